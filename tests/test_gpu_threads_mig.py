"""Which GPUs `--gpus all` fills on a host with GPUs in MIG mode, and which filler runs in a child process: a GPU
in MIG mode beside a whole one, which the virtual GPU cannot make (its `mig=N` splits every GPU alike)."""

from __future__ import annotations

from dataclasses import replace

from forge_load.config.settings import Config
from forge_load.control.probe import ComputeMode, DeviceInfo
from forge_load.service.gpu_threads import gpu_selectors, in_child

WHOLE = DeviceInfo(0, "GPU-00000000-0000-0000-0000-000000000000", "Whole", 81559.0, "fake", False,
                   ComputeMode.DEFAULT)
SPLIT = replace(WHOLE, index=1, uuid="GPU-11111111-1111-1111-1111-111111111111", mig_enabled=True)
EMPTY = replace(WHOLE, index=2, uuid="GPU-22222222-2222-2222-2222-222222222222", mig_enabled=True)
MIGS = ["MIG-11111111-1111-1111-1111-aaaaaaaaaaaa", "MIG-11111111-1111-1111-1111-bbbbbbbbbbbb"]


class Mixed:
    """NVML's view: GPU 0 whole, GPU 1 in MIG mode with two MIG devices, GPU 2 in MIG mode with none made yet."""

    def devices(self) -> list[DeviceInfo]:
        return [WHOLE, SPLIT, EMPTY]

    def mig_devices(self, gpu_uuid: str) -> list[str]:
        return MIGS if gpu_uuid == SPLIT.uuid else []


def test_all_is_each_whole_gpu_and_each_mig_device_of_a_gpu_in_mig_mode() -> None:
    selectors = gpu_selectors(Config(gpus="all"), Mixed())  # type: ignore[arg-type]  # only what it reads
    # GPU 2 has no MIG device yet: named as a whole, its filler refuses it in one line (that GPU's exit 3 alone)
    assert selectors == ["0", *MIGS, "2"]
    assert [in_child(s, selectors) for s in selectors] == [False, True, True, False]


def test_a_mig_device_alone_is_filled_in_process_as_before() -> None:
    assert not in_child(MIGS[0], [MIGS[0]])
    assert in_child(MIGS[0], [MIGS[0], "0"])  # CUDA in this process would then see that MIG device only
