"""The fake NVML's shared fixtures (tests/fake_pynvml.py): a fake pynvml with two GPUs, and the clocks a probe on it
reads, which the tests set. Import `clocks` and `fake` into a test module for pytest to find them."""

from __future__ import annotations

import pytest
from fake_pynvml import MIB, FakeDevice, FakeNvml

from forge_load.gpu.nvml import NvmlProbe

UUID_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
UUID_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
WALL_MINUS_MONO_S = 1_700_000_000.0  # wall clock = monotonic clock + this, in the default test clocks
BOOT_MINUS_MONO_S = 12.5  # the boot clock also counts time suspended


class Clocks:
    """A monotonic clock the test sets, a wall clock `offset_s` ahead of it (steppable like NTP), and a
    boot clock `boot_offset_s` ahead of it."""

    def __init__(self, mono_s: float = 1000.0, offset_s: float = WALL_MINUS_MONO_S,
                 boot_offset_s: float = BOOT_MINUS_MONO_S) -> None:
        self.mono_s = mono_s
        self.offset_s = offset_s
        self.boot_offset_s = boot_offset_s

    def mono(self) -> float:
        return self.mono_s

    def wall(self) -> float:
        return self.mono_s + self.offset_s

    def boot(self) -> float:
        return self.mono_s + self.boot_offset_s

    def probe(self, fake: FakeNvml, gpu: str = "0") -> NvmlProbe:
        return NvmlProbe(gpu, nvml=fake.module, wall_clock=self.wall, mono_clock=self.mono, boot_clock=self.boot)


def two_devices() -> list[FakeDevice]:
    return [
        FakeDevice(name="NVIDIA H100 80GB HBM3", uuid=UUID_A, memory_total_bytes=81559 * MIB),
        FakeDevice(name="NVIDIA A100-SXM4-40GB", uuid=UUID_B, memory_total_bytes=40960 * MIB),
    ]


@pytest.fixture
def clocks() -> Clocks:
    return Clocks()


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml(two_devices())
