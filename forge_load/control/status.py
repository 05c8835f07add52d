"""Each GPU's filler as the rest of the process sees it: a frozen status snapshot; the process's GPU slots, health.

The filler makes a GpuStatus when asked (filler.py); its log lines and the Prometheus metrics both read that
one snapshot. A GpuSlot is one GPU's place in the process (starting, running, stopped or failed, with its
loop's heartbeat); the GpuSlots holds them and answers /health.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from forge_load.control.probe import DeviceInfo
from forge_load.control.reasons import State

# Every state a GPU's slot can report; exactly one holds at a time: a filler's (reasons.State) while it runs.
STARTING, STOPPED, FAILED = "starting", "stopped", "failed"
STATES = (STARTING, *(state.value for state in State), STOPPED, FAILED)


@dataclass(frozen=True)
class GpuStatus:
    """One GPU's filler at one moment."""

    state: str  # filling, yielding, boosted, paused or held
    target: float  # the target (the boost target when boosted); while yielding or paused, the one to return to
    holding: float  # what the filler holds now: the target, or 0 while yielding or paused (both in the held
    # quantity's unit: quantity.py)
    util_ratio: float | None  # the latest NVML sample window (GPM's GRAPHICS_UTIL span where NVML has none): the
    own_ratio: float | None  # device's utilization, our own share of it,
    foreign_ratio: float | None  # and the rest
    multiplier: int  # blocks per SM in each launch; 0 while not launching
    own_mem_mib: float | None  # device memory our process holds
    power_w: float | None
    temperature_c: float | None
    yields: int
    yielding_s: float
    own_busy_s: float
    energy_j: float = 0.0  # the device's energy while we were filling (filler.py says how it is counted)
    power_cap_w: float | None = None  # FORGE_MAX_POWER_W; None: no cap
    power_capped: bool = False  # the cap sets our duty now, below what the target asks
    holds: int = 0  # holds honoured now (holds.py)
    holds_begun: int = 0  # holds honoured since the start
    metric: str = "utilization"  # what the target is a target of (FORGE_METRIC: quantity.py)
    metric_ratio: float | None = None  # its readings of the latest 2 s (quantity.HeldNow), the device's,
    metric_own_ratio: float | None = None  # and our own share of them; None before the first, and for a supervisor


class GpuSlot:
    """One GPU's filler as seen from outside its thread."""

    def __init__(self, requested: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.requested = requested  # the index or UUID asked for, until the GPU is open
        self.clock = clock
        self.index: int | None = int(requested) if requested.isdigit() else None
        self.uuid = "" if requested.isdigit() else requested
        self.model = ""
        self.info: DeviceInfo | None = None  # once the GPU is open
        self.status = "starting"  # starting -> running -> stopped | failed
        self.reason: str | None = None
        self.exit_code = 0
        self.last_beat_s: float | None = None
        self._snapshot: Callable[[], GpuStatus] | None = None

    def attach(self, info: DeviceInfo, snapshot: Callable[[], GpuStatus]) -> None:
        """The GPU is open and its filler built (gpu_threads.gpu_selectors named each GPU once)."""
        self._snapshot = snapshot
        self.index, self.uuid, self.model = info.index, info.uuid, info.name
        self.info = info
        self.status = "running"

    def snapshot(self) -> GpuStatus | None:
        """The filler's status now; None before it started."""
        return None if self._snapshot is None else self._snapshot()

    def beat(self) -> None:
        """Called by the filler's loop (at most once per loop second): the loop is alive."""
        self.last_beat_s = self.clock()

    def stopped(self) -> None:
        self.status = "stopped"

    def failed(self, reason: str, exit_code: int) -> None:
        self.reason, self.exit_code, self.status = reason, exit_code, "failed"

    @property
    def state(self) -> str:
        """One of STATES."""
        snapshot = self.snapshot() if self.status == "running" else None
        return snapshot.state if snapshot is not None else self.status

    @property
    def name(self) -> str:
        index = "?" if self.index is None else str(self.index)
        return f"gpu {index} {self.uuid or '(' + self.requested + ')'}"

    def health(self, max_age_s: float) -> tuple[bool, str]:
        """(alive and fresh, one line for /health)."""
        if self.status == "failed":
            return False, f"{self.name}: failed: {self.reason}"
        if self.status == "stopped":
            return False, f"{self.name}: stopped"
        if self.last_beat_s is None:
            return False, f"{self.name}: starting, no loop heartbeat yet"
        age_s = self.clock() - self.last_beat_s
        if age_s > max_age_s:
            return False, (f"{self.name}: {self.state}, loop stalled: last heartbeat {age_s:.0f} s ago "
                           f"(limit {max_age_s:g} s)")
        return True, f"{self.name}: {self.state}, loop heartbeat {age_s:.1f} s ago"


class GpuSlots:
    """The process's GPU slots; a process with one GPU has one."""

    def __init__(self, max_age_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 simulated: bool = False) -> None:
        self.max_age_s = max_age_s
        self.clock = clock
        self.simulated = simulated
        self.slots: list[GpuSlot] = []

    def add(self, requested: str) -> GpuSlot:
        slot = GpuSlot(requested, self.clock)
        self.slots = [*self.slots, slot]  # replaced, not appended, so readers iterate a stable list
        return slot

    def remove(self, slot: GpuSlot) -> None:
        """A slot that gave way to others (a GPU in MIG mode named as a whole: one slot per MIG device)."""
        self.slots = [s for s in self.slots if s is not slot]

    def health(self) -> tuple[bool, str]:
        """(every filler alive and fresh, the /health body: a verdict line, then one line per GPU)."""
        slots = self.slots
        if not slots:
            return False, "unhealthy: no GPU started yet\n"
        results = [slot.health(self.max_age_s) for slot in slots]
        bad = sum(not ok for ok, _ in results)
        verdict = "ok" if not bad else f"unhealthy: {bad} of {len(results)} GPUs"
        return not bad, "\n".join([verdict, *(line for _, line in results)]) + "\n"
