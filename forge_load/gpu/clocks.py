"""The time a GPU's loop runs on, and how it waits: each backend supplies its own (backend.py), so one loop
(service/loop.py) drives a real GPU and the simulated one alike.

A real GPU runs in wall-clock time: the Monitor polls in a thread of its own and wakes the loop through `wake`.
The simulated GPU runs in virtual time in the loop's own thread: waiting steps the Monitor at its due times and
moves the virtual clock, paced against the wall clock at `speed` (0: as fast as it computes).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from forge_load.control.monitor import Monitor
from forge_load.gpu.sim import VirtualClock

MONITOR_JOIN_S = 1.0  # one poll's NVML calls take milliseconds; a hung driver call is not waited out


class LoopClock(Protocol):
    def now(self) -> float:
        """Seconds on the loop's clock (monotonic, or virtual)."""

    def wall_s(self) -> float:
        """The Unix time now: what active hours, the pause file's and the holds' times are read against."""

    def start_monitor(self, monitor: Monitor, stop: threading.Event, wake: threading.Event) -> None:
        """The Monitor polls from now on (it has polled once already) and sets `wake` when a reading matters."""

    def wait(self, until_s: float, stop: threading.Event, wake: threading.Event) -> None:
        """Until `until_s`, or less: a reading that woke the loop, or `stop`."""

    def sleep(self, until_s: float) -> None:
        """Until `until_s`, nothing else to do (the last kernels draining)."""

    def stop_monitor(self) -> None:
        """The Monitor has stopped polling (`stop` is set), or is left behind in a hung driver call."""


class WallLoopClock:
    """A real GPU's: monotonic time, the Monitor in a thread of its own."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def now(self) -> float:
        return time.monotonic()

    def wall_s(self) -> float:
        return time.time()

    def start_monitor(self, monitor: Monitor, stop: threading.Event, wake: threading.Event) -> None:
        monitor.on_reading = wake.set
        self._thread = threading.Thread(target=monitor.run, args=(time.monotonic, stop), name="monitor", daemon=True)
        self._thread.start()

    def wait(self, until_s: float, stop: threading.Event, wake: threading.Event) -> None:
        wake.wait(max(until_s - time.monotonic(), 0.0))
        wake.clear()

    def sleep(self, until_s: float) -> None:
        time.sleep(max(until_s - time.monotonic(), 0.0))

    def stop_monitor(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=MONITOR_JOIN_S)


class VirtualLoopClock:
    """The simulated GPU's: its virtual clock, the Monitor stepped in the loop's thread in the order a real run
    would see it. The Unix time starts at `wall_start_s` and moves with virtual time."""

    def __init__(self, clock: VirtualClock, speed: float, wall_start_s: float | None = None) -> None:
        self.clock = clock
        self.speed = speed
        self.wall_start_s = time.time() if wall_start_s is None else wall_start_s
        self._monitor: Monitor | None = None
        self._monitor_due_s = float("inf")
        self._origin_s = 0.0  # the wall time (monotonic) of virtual time 0, for pacing

    def now(self) -> float:
        return self.clock.now()

    def wall_s(self) -> float:
        return self.wall_start_s + self.clock.now()

    def start_monitor(self, monitor: Monitor, stop: threading.Event, wake: threading.Event) -> None:
        self._monitor = monitor
        self._origin_s = time.monotonic() - self.clock.now() / self.speed if self.speed > 0 else 0.0
        self._monitor_due_s = monitor.step(self.clock.now())

    def wait(self, until_s: float, stop: threading.Event, wake: threading.Event) -> None:
        while True:
            due_s = min(self._monitor_due_s, until_s)
            if self.speed > 0:
                delay_s = self._origin_s + due_s / self.speed - time.monotonic()
                if delay_s > 0:
                    stop.wait(delay_s)
            if stop.is_set():  # every step, also when behind schedule and never waiting
                return
            self.clock.advance_to(due_s)
            if self._monitor is not None and self._monitor_due_s <= due_s:
                self._monitor_due_s = self._monitor.step(due_s)
                if self._monitor.woke:
                    return  # react to the new reading at once
            if due_s >= until_s:
                return

    def sleep(self, until_s: float) -> None:
        self.clock.advance_to(until_s)

    def stop_monitor(self) -> None:
        self._monitor = None
