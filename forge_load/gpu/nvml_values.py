"""NVML's answers made into forge_load's values: numbers out of NVML's value unions, memory in MiB, the process
lists merged, and the sample stamps put on the monotonic clock. No pynvml here: nvml.py asks, this module reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

from forge_load.clock import boot_time_s, clock_minus_monotonic_s
from forge_load.control.probe import GpuProcess

MIB: int = 1024 * 1024


@dataclass(frozen=True)
class GpuInstance:
    """A MIG device by where it sits (docs/design.md §13): its GPU instance's profile ID and placement (start and size,
    in memory slices), and its UUID."""

    profile_id: int
    start: int
    size: int
    uuid: str


@dataclass(frozen=True)
class MinorGpu:
    """A GPU by its minor number (the N of /dev/nvidiaN, not its NVML index), its UUID, and its MIG devices."""

    minor: int
    uuid: str
    migs: tuple[GpuInstance, ...] = ()

# NVML's "not available" value for 64-bit fields (e.g. usedGpuMemory under WDDM or without permission).
# Current pynvml already turns it into None; older ones pass it through.
NVML_VALUE_NOT_AVAILABLE_ULL: int = 2**64 - 1

# A sample stamp is on a clock when it is at most this far behind it (an idle GPU may add no samples for a
# long while) and at most this far ahead of it (clock reads race the driver).
STAMP_MAX_AGE_S: float = 7 * 86400.0
STAMP_AHEAD_S: float = 1.0


# sampleValType -> the field of the c_nvmlValue_t union that holds the value (nvmlValueType_t).
_UNION_FIELD_BY_VALUE_TYPE: dict[int, str] = {
    0: "dVal",
    1: "uiVal",
    2: "ulVal",
    3: "ullVal",
    4: "sllVal",
    5: "siVal",
    6: "usVal",
}


def boot_clock() -> float:
    """Seconds since boot, suspend included (Linux); elsewhere the monotonic clock stands in."""
    boot_s = boot_time_s()
    return time.monotonic() if boot_s is None else boot_s


class StampClock:
    """Which CPU clock NVML stamps one GPU's samples with, and the offset that puts a stamp on the monotonic clock.
    The clocks are arguments so tests can fix them: NVML stamps samples with the CPU wall clock (or the boot
    clock), while the rest of forge_load runs on time.monotonic()."""

    def __init__(self, wall_clock: Callable[[], float], mono_clock: Callable[[], float],
                 boot_clock: Callable[[], float]) -> None:
        self._mono_clock = mono_clock
        # The clocks NVML may stamp samples with, in the order preferred when two fit equally well.
        self._clocks: dict[str, Callable[[], float]] = {"unix": wall_clock, "boot": boot_clock, "monotonic": mono_clock}
        self._clock: Callable[[], float] | None = None
        self._relative_offset_s = 0.0
        # unix, boot, monotonic, relative (none fits: anchored on the newest sample), or pending (no sample yet).
        self.name = "pending"

    def offset_s(self) -> float:
        """Seconds to subtract from a sample stamp to land on the monotonic clock.

        Recomputed per call: the wall clock can be stepped (NTP) while monotonic time cannot.
        """
        if self._clock is None:
            return self._relative_offset_s
        return clock_minus_monotonic_s(self._clock, self._mono_clock)

    def calibrate(self, stamps_us: Iterable[int]) -> None:
        """Find which CPU clock NVML stamps its samples with (docs/design.md §2): the one the newest stamp is
        a little behind of. Where none fits, anchor the newest sample at now."""
        newest_s = max(stamps_us) / 1e6
        ages = {name: clock() - newest_s for name, clock in self._clocks.items()}
        fitting = [(age_s, name) for name, age_s in ages.items() if -STAMP_AHEAD_S <= age_s <= STAMP_MAX_AGE_S]
        if fitting:
            self.name = min(fitting)[1]
            self._clock = self._clocks[self.name]
        else:
            self.name = "relative"
            self._relative_offset_s = newest_s - self._mono_clock()


def sample_value(value: Any, value_type: int) -> float:
    """The number in a c_nvmlValue_t union, read through the field that sampleValType names."""
    if isinstance(value, (int, float)):
        return float(value)
    field = _UNION_FIELD_BY_VALUE_TYPE.get(int(value_type), "uiVal")
    number = getattr(value, field, None)
    if number is None:
        number = getattr(value, "uiVal", 0)  # utilization samples are unsigned ints on every driver seen
    return float(cast(float, number))


def used_mib(used_bytes: int | None) -> float | None:
    if used_bytes is None or int(used_bytes) == NVML_VALUE_NOT_AVAILABLE_ULL:
        return None
    return int(used_bytes) / MIB


def merge_processes(*lists: Iterable[Any]) -> list[GpuProcess]:
    """One entry per pid; a process in both lists (compute + graphics) keeps the larger known memory."""
    by_pid: dict[int, float | None] = {}
    for processes in lists:
        for process in processes:
            pid = int(process.pid)
            used = used_mib(getattr(process, "usedGpuMemory", None))
            if pid not in by_pid:
                by_pid[pid] = used
            elif used is not None:
                known = by_pid[pid]
                by_pid[pid] = used if known is None else max(known, used)
    return [GpuProcess(pid=pid, used_mib=used) for pid, used in sorted(by_pid.items())]
