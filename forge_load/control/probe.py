"""What the Monitor reads from a GPU: the Probe protocol and its value types.

nvml.py implements it on a real GPU, sim.py on the simulated one. Every query returns None where the
GPU or the driver does not support it, so the Monitor degrades to the signals that remain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class NoGpuError(Exception):
    """No usable GPU or NVML: the process exits 3 with this message as the hint."""


class GpuFailedError(Exception):
    """The GPU was lost or a driver call failed while running: the process exits 4."""


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    uuid: str
    name: str
    memory_total_mib: float
    driver_version: str
    mig_enabled: bool


@dataclass(frozen=True)
class UtilSample:
    """Device utilization over the sample window that ended at `t_s` (seconds on the probe's clock)."""

    t_s: float
    ratio: float


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

    def close(self) -> None: ...
