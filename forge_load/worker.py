"""Worker: paces our kernel launches to the Plan and records exactly when our kernels ran.

The pacing and the busy log are pure; what touches CUDA is the Launcher: launcher.py on a real GPU, sim.py on
the simulated one. Either way the Worker never blocks on the GPU: it polls events and sleeps until the next
launch is due, so no CPU core spins.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from forge_load.probe import GpuFailedError


@dataclass(frozen=True)
class Plan:
    """What the Worker should do until the next plan.

    multiplier: grid size in blocks per SM.
    duty_ratio: the share of wall time our kernels should be running; 0 launches nothing.
    gap_s: a fixed sleep after each launch completes (the legacy law's pacing); 0 paces by duty alone.
    """

    multiplier: int
    duty_ratio: float
    gap_s: float = 0.0


IDLE_PLAN = Plan(multiplier=1, duty_ratio=0.0)


@dataclass(frozen=True)
class Completed:
    """One of our kernels, as it ran on the GPU (seconds on the Worker's clock)."""

    start_s: float
    end_s: float
    multiplier: int


class Launcher(Protocol):
    sm_count: int

    def launch(self, multiplier: int, now_s: float) -> None:
        """Queue one burn kernel of `multiplier` blocks per SM; returns at once."""

    def poll(self, now_s: float) -> list[Completed]:
        """Kernels finished since the last poll, in launch order."""

    def close(self) -> None: ...

    def describe(self) -> dict[str, object]:
        """Fields for the start line (e.g. the stack limit on a real GPU)."""


class BusyLog:
    """When our kernels ran, shared between the Worker (writer) and the Monitor (reader)."""

    def __init__(self, keep_s: float = 30.0) -> None:
        self._keep_s = keep_s
        self._lock = threading.Lock()
        self._starts: list[float] = []
        self._ends: list[float] = []
        self._complete_until_s = float("-inf")
        self.total_busy_s = 0.0
        self.last_end_s = float("-inf")

    def add(self, start_s: float, end_s: float) -> None:
        with self._lock:
            self._starts.append(start_s)
            self._ends.append(end_s)
            self.total_busy_s += end_s - start_s
            self.last_end_s = max(self.last_end_s, end_s)
            cut = bisect_right(self._ends, end_s - self._keep_s)
            if cut > len(self._ends) // 2:
                del self._starts[:cut], self._ends[:cut]

    def mark_complete_until(self, t_s: float) -> None:
        """Every kernel of ours that ran before `t_s` is in the log."""
        with self._lock:
            self._complete_until_s = max(self._complete_until_s, t_s)

    @property
    def complete_until_s(self) -> float:
        with self._lock:
            return self._complete_until_s

    def busy_s(self, begin_s: float, end_s: float) -> float:
        """Seconds within [begin_s, end_s] during which one of our kernels was running."""
        with self._lock:
            total = 0.0
            for i in range(bisect_right(self._ends, begin_s), len(self._starts)):
                if self._starts[i] >= end_s:
                    break
                total += min(self._ends[i], end_s) - max(self._starts[i], begin_s)
            return total


class Worker:
    """Launches kernels so that our busy share of wall time follows `plan.duty_ratio`.

    Launches come in bursts of about `burst_s` with at most `queue_s` of work queued, so a stop or a
    yield waits for at most `queue_s`, and the CPU wakes a few dozen times per second at most.
    """

    def __init__(self, launcher: Launcher, busy_log: BusyLog, burst_s: float = 0.004,
                 queue_s: float = 0.005, guess_launch_s: float = 0.002, ema_weight: float = 0.2) -> None:
        self.launcher = launcher
        self.busy_log = busy_log
        self.burst_s = burst_s
        self.queue_s = queue_s
        self.plan = IDLE_PLAN
        self.launch_s: float | None = None  # measured duration of one launch at plan.multiplier
        self._guess_launch_s = guess_launch_s
        self._ema_weight = ema_weight
        self._owed_s = 0.0
        self._in_burst = False
        self._last_s: float | None = None
        self._gap_until_s = float("-inf")
        self._queue: deque[tuple[float, float]] = deque()  # (expected end, seconds charged)

    @property
    def in_flight(self) -> int:
        return len(self._queue)

    def set_plan(self, plan: Plan) -> None:
        if plan.multiplier != self.plan.multiplier:
            self.launch_s = None
        if plan.duty_ratio <= 0:
            self._owed_s = 0.0
            self._in_burst = False
        self.plan = plan

    def step(self, now_s: float) -> float:
        """Collect finished kernels, launch what is due; returns when to call again."""
        self._collect(now_s)
        dt_s = 0.0 if self._last_s is None else max(now_s - self._last_s, 0.0)
        self._last_s = now_s
        duty = min(self.plan.duty_ratio, 1.0)
        if duty <= 0:
            return self._next_poll_s(now_s, idle_s=0.05)
        if self.plan.gap_s > 0:
            return self._step_gap(now_s)
        expected_s = self.launch_s or self._guess_launch_s
        self._owed_s = min(self._owed_s + duty * dt_s, self.burst_s + expected_s)
        if not self._in_burst and self._owed_s >= self.burst_s:
            self._in_burst = True
        # Until a launch at this size has been timed, one at a time: it may be longer than the guess.
        while (self._in_burst and self._owed_s > 0 and self._queued_s(now_s) < self.queue_s
               and (self.launch_s is not None or not self._queue)):
            self._launch(now_s, expected_s)
        if self._owed_s <= 0:
            self._in_burst = False
        if self._queue:
            return self._next_poll_s(now_s, idle_s=0.05)
        return now_s + max((self.burst_s - self._owed_s) / duty, 0.0005)

    def drain(self, now_s: float) -> float:
        """Stop launching; returns when to look again (now_s when nothing is left in flight)."""
        self.set_plan(IDLE_PLAN)
        self._collect(now_s)
        return self._next_poll_s(now_s, idle_s=0.0) if self._queue else now_s

    def _step_gap(self, now_s: float) -> float:
        if not self._queue and now_s >= self._gap_until_s:
            self._launch(now_s, self.launch_s or self._guess_launch_s)
        if self._queue:
            return self._next_poll_s(now_s, idle_s=0.05)
        return self._gap_until_s

    def _launch(self, now_s: float, expected_s: float) -> None:
        try:
            self.launcher.launch(self.plan.multiplier, now_s)
        except GpuFailedError:
            raise
        except Exception as error:  # a failed CUDA call: the GPU is gone or broken
            raise GpuFailedError(f"kernel launch failed: {error}") from error
        start_s = max(now_s, self._queue[-1][0]) if self._queue else now_s
        self._queue.append((start_s + expected_s, expected_s))
        self._owed_s -= expected_s

    def _collect(self, now_s: float) -> None:
        try:
            done = self.launcher.poll(now_s)
        except GpuFailedError:
            raise
        except Exception as error:
            raise GpuFailedError(f"waiting for a kernel failed: {error}") from error
        for kernel in done:
            # A launcher's times can cross by a hair (clock anchoring); never log or learn a negative span.
            busy_s = max(kernel.end_s - kernel.start_s, 0.0)
            self.busy_log.add(kernel.end_s - busy_s, kernel.end_s)
            charged_s = self._queue.popleft()[1] if self._queue else busy_s
            if self.plan.gap_s > 0:
                self._gap_until_s = now_s + self.plan.gap_s
            else:
                self._owed_s -= busy_s - charged_s  # pay for what the kernel really took
            if kernel.multiplier == self.plan.multiplier and busy_s > 0:
                w = self._ema_weight
                self.launch_s = busy_s if self.launch_s is None else (1 - w) * self.launch_s + w * busy_s
        if not self._queue:
            self.busy_log.mark_complete_until(now_s)
        elif done:
            self.busy_log.mark_complete_until(done[-1].end_s)

    def _queued_s(self, now_s: float) -> float:
        return max(self._queue[-1][0] - now_s, 0.0) if self._queue else 0.0

    def _next_poll_s(self, now_s: float, idle_s: float) -> float:
        if not self._queue:
            return now_s + idle_s
        # Wake when one kernel is left queued, so the GPU never waits on us inside a burst.
        due_s = self._queue[-2][0] if len(self._queue) >= 2 and self._in_burst else self._queue[0][0]
        return max(due_s, now_s + 0.0002)
