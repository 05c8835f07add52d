"""What the Monitor reads from a GPU: the Probe protocol and its value types.

nvml.py implements it on a real GPU, sim.py on the simulated one. Every query returns None where the
GPU or the driver does not support it, so the Monitor degrades to the signals that remain.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol


class NoGpuError(Exception):
    """No usable GPU or NVML: the process exits 3 with this message as the hint."""


class MigModeError(NoGpuError):
    """The GPU named is in MIG mode, where CUDA runs only on its MIG devices (docs/design.md §12): the filler fills
    each of `mig_uuids` instead (service/gpu_threads.py); with none made yet, the GPU is refused as any other."""

    def __init__(self, message: str, gpu_index: int, gpu_uuid: str, mig_uuids: list[str]) -> None:
        super().__init__(message)
        self.gpu_index = gpu_index
        self.gpu_uuid = gpu_uuid
        self.mig_uuids = mig_uuids


class GpuFailedError(Exception):
    """The GPU was lost or a driver call failed while running: the process exits 4."""


class ComputeMode(str, Enum):
    """Who may create a CUDA context on the GPU (`nvidia-smi -c`; docs/exclusive.md says what the filler does)."""

    DEFAULT = "default"  # any number of processes' contexts at once
    EXCLUSIVE_THREAD = "exclusive_thread"  # NVML still names it ("Support Removed"); treated as exclusive_process
    PROHIBITED = "prohibited"  # no context at all
    EXCLUSIVE_PROCESS = "exclusive_process"  # one process's context at a time, idle or not
    UNKNOWN = "unknown"  # NVML does not say (not supported, or a value it did not know when this was written)

    @property
    def exclusive(self) -> bool:
        return self in (ComputeMode.EXCLUSIVE_PROCESS, ComputeMode.EXCLUSIVE_THREAD)


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    uuid: str
    name: str
    memory_total_mib: float
    driver_version: str
    mig_enabled: bool
    compute_mode: ComputeMode = ComputeMode.DEFAULT  # read once, when the GPU is opened
    gpm: bool = False  # NVML's GPM is there (Hopper and newer): activity() answers (docs/design.md §12)
    # A MIG device's GPU instance ID, its profile ("2g.20gb") and its GPU's UUID: dcgm-exporter's GPU_I_ID,
    # GPU_I_PROFILE and UUID for it. None / "" for a whole GPU.
    gpu_instance: int | None = None
    mig_profile: str = ""
    gpu_uuid: str = ""


@dataclass(frozen=True)
class UtilSample:
    """Device utilization over the sample window that ended at `t_s` (seconds on the probe's clock)."""

    t_s: float
    ratio: float


@dataclass(frozen=True)
class Activity:
    """GPM's readings over the `span_s` seconds that ended at `t_s` (the probe's clock): the share of the SMs
    with a warp on them (SM_UTIL), and of the time any kernel ran (GRAPHICS_UTIL), as ratios."""

    t_s: float
    span_s: float
    sm_ratio: float
    gr_ratio: float


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_mib: float | None


class Probe(Protocol):
    info: DeviceInfo

    @property
    def sample_clock(self) -> str:
        """The clock sample stamps were found on (unix, boot, ...; "pending" until a sample is seen), for the log."""

    def utilization_samples(self, since_s: float) -> list[UtilSample] | None:
        """Buffered samples newer than `since_s`, oldest first; None where not supported."""

    def utilization_ratio(self) -> float | None:
        """The latest window's utilization, for when no buffered samples are offered."""

    def memory_used_mib(self) -> float | None: ...

    def processes(self) -> list[GpuProcess] | None:
        """Compute and graphics processes on the GPU, as far as this PID namespace shows them."""

    def power_w(self) -> float | None:
        """Board power: NVML's reading (a 1-s mean on Ampere and newer, docs/design.md §9)."""

    def energy_j(self) -> float | None:
        """The board's energy counter (since the driver loaded; it only grows), in joules."""

    def power_limit_w(self) -> float | None:
        """The board's enforced power limit."""

    def temperature_c(self) -> float | None: ...

    def activity(self) -> Activity | None:
        """GPM since the previous call (the first call only starts it: None); None where info.gpm is False."""

    def close(self) -> None: ...
