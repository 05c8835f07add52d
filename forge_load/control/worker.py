"""Worker: paces our kernel launches to the Plan and records exactly when our kernels ran.

The pacing and the busy log are pure; what touches CUDA is the Launcher: launcher.py on a real GPU, sim.py on
the simulated one. Either way the Worker never blocks on the GPU: it polls events and sleeps until the next
launch is due, so no CPU core spins.

The CPU cost of the loop is per wake-up and per launch call, so the Worker wakes once per period: it queues
the period's whole busy share as one burst of a few back-to-back kernels (a single launch call, timed by the
launcher as one span) and sleeps until the next period (docs/design.md §6, §7).
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from forge_load.control.probe import GpuFailedError
from forge_load.control.shape import Shape

DEFAULT_PERIOD_S = 1.0 / 12.0  # divides every NVML sample window of 1/6 s, 1/4 s, 1/2 s and 1 s
QUEUE_S = 0.09  # the most work queued at once: a yield's last kernel ends at most this after the yield
MAX_KERNELS = 16  # per launch call: more would cost CPU; kernels then grow past the plan's size
RETARGET_RATIO = 0.05  # a duty change this large applies at once, not from the next period
IDLE_WAKE_S = 1.0  # nothing to launch: a new plan comes with a reading, which steps the Worker anyway


@dataclass(frozen=True)
class Plan:
    """What the Worker should do until the next plan.

    multiplier: the size of the largest kernel the Worker launches, in the shape's unit (control/shape.py): sleep
        quanta of the lean kernel, blocks per SM of the burn kernel.
    duty_ratio: the share of wall time our kernels should be running; 0 launches nothing.
    gap_s: a fixed sleep after each launch completes (the legacy law's pacing); 0 paces by duty alone.
    period_s: how often the Worker queues a burst; 0 leaves it to the Worker. One that divides NVML's
        sample window gives every window the same busy share.
    """

    multiplier: int
    duty_ratio: float
    gap_s: float = 0.0
    period_s: float = 0.0


IDLE_PLAN = Plan(multiplier=1, duty_ratio=0.0)


@dataclass(frozen=True)
class Completed:
    """`count` kernels of ours that ran back to back from `start_s` to `end_s` (seconds on the Worker's clock)."""

    start_s: float
    end_s: float
    multiplier: int
    count: int = 1
    kernel_s: float | None = None  # one kernel's length, measured exactly (a burst of two or more), else None


class Launcher(Protocol):
    sm_count: int
    shape: Shape  # what its kernels are

    def launch(self, multiplier: int, now_s: float, count: int = 1) -> None:
        """Queue `count` kernels of the shape, each of `multiplier` (its unit), back to back; returns at once."""

    def poll(self, now_s: float) -> list[Completed]:
        """Launches finished since the last poll, in launch order (one Completed per launch call)."""

    def close(self) -> None: ...

    def describe(self) -> dict[str, object]:
        """Fields for the start line (e.g. the stack limit on a real GPU)."""


class BlockRate:
    """Seconds of kernel per unit of the multiplier (a block per SM of the burn kernel, a sleep quantum of the lean
    one), measured: a moving average of timed kernels' lengths over their sizes (the Worker's, from what it was told;
    the CUDA launcher's, from its events). A lean kernel's length is what its sleeps really last, which nanosleep
    does not promise (0 to 2x the request): learnt here, like a burn kernel's wave time, never assumed."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self.rate_s: float | None = None  # None until a kernel was timed

    def add(self, kernel_s: float, multiplier: int) -> None:
        rate_s = kernel_s / multiplier
        self.rate_s = rate_s if self.rate_s is None else (1 - self.weight) * self.rate_s + self.weight * rate_s


class BusyLog:
    """When our kernels ran, shared between the Worker (writer) and the Monitor (reader)."""

    def __init__(self, keep_s: float = 30.0) -> None:
        self._keep_s = keep_s
        self._lock = threading.Lock()
        self._starts: list[float] = []
        self._ends: list[float] = []
        self._complete_until_s = float("-inf")
        self._idle = False  # nothing of ours in flight since mark_idle
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

    def mark_idle(self, t_s: float) -> None:
        """Every kernel of ours is in the log and none is in flight: the log is complete up to whenever the
        next launch begins (`launching`), so the Monitor need not wait for the Worker's next wake-up."""
        with self._lock:
            self._complete_until_s = max(self._complete_until_s, t_s)
            self._idle = True

    def launching(self, t_s: float) -> None:
        """A launch begins at `t_s` (called before the launch call): complete up to here, no further."""
        with self._lock:
            if self._idle:
                self._complete_until_s = max(self._complete_until_s, t_s)
                self._idle = False

    @property
    def complete_until_s(self) -> float:
        with self._lock:
            return float("inf") if self._idle else self._complete_until_s

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

    Once per period (`plan.period_s`, else DEFAULT_PERIOD_S) it queues one burst of back-to-back kernels
    worth the busy time owed (duty x period, plus what earlier bursts ran short or long), sized so that no
    kernel is longer than one at `plan.multiplier` (unless that would take more than MAX_KERNELS), and
    sleeps until the next period. A period that divides NVML's sample window gives every window the same
    busy share. At most `queue_s` of work is queued at once (a longer burst is queued in parts), so a stop
    or a yield takes effect within `queue_s`. A new target applies at once; the integral's small steps
    wait for the next period. Filling again after a stop waits for the grid's next burst (at once if the stop
    outlasted it): a burst at every start would pile up under a storm of pauses, since what is queued outlasts
    a short one.

    `launch_s` is the measured length of one kernel at `plan.multiplier` (what the controller sizes it by):
    the Worker learns the seconds per unit of the multiplier (BlockRate), which holds whatever the multiplier, for a
    kernel whose length is its waves (burn) as for one whose length is its sleep loop (lean).
    """

    def __init__(self, launcher: Launcher, busy_log: BusyLog, queue_s: float = QUEUE_S,
                 guess_launch_s: float = 0.002, ema_weight: float = 0.2) -> None:
        self.launcher = launcher
        self.busy_log = busy_log
        busy_log.mark_idle(float("-inf"))  # nothing launched yet: the log is complete until the first launch
        self.queue_s = queue_s
        self.plan = IDLE_PLAN
        self._multiplier = IDLE_PLAN.multiplier  # the latest filling plan's
        self._rate = BlockRate(ema_weight)
        self._guess_launch_s = guess_launch_s
        self._owed_s = 0.0
        self._next_burst_s = float("-inf")
        self._stopped = False  # a stop since the last burst: the next one starts the grid afresh
        self._in_burst = False  # the period's burst is still being queued (it was longer than queue_s)
        self._retarget_from: float | None = None  # the duty before a new target, until the next step
        self._gap_until_s = float("-inf")
        self._queue: deque[tuple[float, float]] = deque()  # per launch call: (expected end, seconds charged)

    @property
    def in_flight(self) -> int:
        return len(self._queue)

    @property
    def launch_s(self) -> float | None:
        """Measured length of one kernel at the multiplier of the latest plan that fills (not a stop's, whose
        multiplier of 1 would tell the controller to grow the kernels on the next start); None until timed."""
        return None if self._rate.rate_s is None else self._rate.rate_s * self._multiplier

    @property
    def period_s(self) -> float:
        return self.plan.period_s if self.plan.period_s > 0 else DEFAULT_PERIOD_S

    def set_plan(self, plan: Plan) -> None:
        if plan.duty_ratio <= 0:
            self._owed_s = 0.0
            self._in_burst = False
            self._stopped = True
        elif abs(plan.duty_ratio - self.plan.duty_ratio) >= RETARGET_RATIO and self.plan.duty_ratio > 0:
            # A new target (not the integral's small steps): the rest of this period follows it at once.
            self._retarget_from = self.plan.duty_ratio if self._retarget_from is None else self._retarget_from
        if plan.duty_ratio > 0:
            self._multiplier = plan.multiplier
        self.plan = plan

    def step(self, now_s: float) -> float:
        """Collect finished kernels, launch what is due; returns when to call again."""
        duty = min(self.plan.duty_ratio, 1.0)
        if (duty > 0 and self.plan.gap_s <= 0 and not self._in_burst and now_s < self._next_burst_s
                and self._retarget_from is None and not (self._queue and self._queue[0][0] <= now_s)):
            # Woken early (by a reading) with nothing due and nothing finished: not even a query.
            return self._next_burst_s
        self._collect(now_s)
        if duty <= 0:
            return self._next_poll_s(now_s, idle_s=IDLE_WAKE_S)
        if self.plan.gap_s > 0:
            return self._step_gap(now_s)
        period_s = self.period_s
        if self._retarget_from is not None:
            if self._next_burst_s > now_s:
                self._owed_s += (duty - min(self._retarget_from, 1.0)) * (self._next_burst_s - now_s)
                self._in_burst = self._owed_s > 0
            self._retarget_from = None
        if now_s >= self._next_burst_s:
            # Each period is owed its share; what earlier bursts ran short or long is settled in `_owed_s`.
            # A wake-up a whole period late starts a fresh grid: a stall is not caught up in one flood.
            self._owed_s = min(self._owed_s + duty * period_s, 2.0 * duty * period_s)
            # The first burst after a stop starts the grid afresh too: no two bursts then begin less than a period
            # apart, so a storm of stops and starts cannot fit more than the duty into any stretch of periods.
            late = self._stopped or now_s - self._next_burst_s >= period_s
            self._next_burst_s = now_s + period_s if late else self._next_burst_s + period_s
            self._stopped = False
            self._in_burst = True
        if self._in_burst:
            self._launch_owed(now_s)
        if not self._in_burst:
            return self._next_burst_s
        if self._rate.rate_s is None:  # the first kernel is being timed
            return max(self._queue[0][0], now_s + 0.001)
        # The queue is full: wake while its last kernel runs, to queue the rest behind it.
        return max(self._queue[-1][0] - self._tail_kernel_s(), now_s + 0.0002)

    def drain(self, now_s: float) -> float:
        """Stop launching; returns when to look again (now_s when nothing is left in flight)."""
        self.set_plan(IDLE_PLAN)
        self._collect(now_s)
        return self._next_poll_s(now_s, idle_s=0.0) if self._queue else now_s

    def _launch_owed(self, now_s: float) -> None:
        """Queue the owed busy time, up to `queue_s` queued; `_in_burst` stays set while some is left."""
        multiplier = self.plan.multiplier
        if self._rate.rate_s is None:
            # Until kernels have been timed, two at the plan's size alone (they may be longer than the guess):
            # the second, queued behind the first, is timed exactly. The burst's rest follows at once.
            if not self._queue:
                self._launch(now_s, multiplier, 2, 2 * self._guess_launch_s)
            self._in_burst = True
            return
        room_s = self.queue_s - self._queued_s(now_s)
        burst_s = min(self._owed_s, room_s)
        self._in_burst = room_s < self._owed_s
        if burst_s < 0.5 * self._rate.rate_s:  # less than half a unit of the multiplier: not worth a launch
            return
        nominal_s = self._rate.rate_s * multiplier
        count = min(max(1, math.ceil(burst_s / nominal_s - 1e-9)), MAX_KERNELS)
        size = max(1, round(burst_s / (count * self._rate.rate_s)))
        self._launch(now_s, size, count, count * size * self._rate.rate_s)

    def _tail_kernel_s(self) -> float:
        return self._rate.rate_s * self.plan.multiplier if self._rate.rate_s is not None else self._guess_launch_s

    def _step_gap(self, now_s: float) -> float:
        if not self._queue and now_s >= self._gap_until_s:
            expected_s = self.launch_s or self._guess_launch_s
            self._launch(now_s, self.plan.multiplier, 1, expected_s)
        if self._queue:
            return self._next_poll_s(now_s, idle_s=0.05)
        return self._gap_until_s

    def _launch(self, now_s: float, multiplier: int, count: int, expected_s: float) -> None:
        self.busy_log.launching(now_s)
        try:
            self.launcher.launch(multiplier, now_s, count)
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
                self._owed_s -= busy_s - charged_s  # pay for what the kernels really took
            # Learn from what was timed exactly: the launcher's two events around the kernels after a burst's
            # first. A span's start is inferred from host clocks, which a busy process reads late or early.
            # (The legacy law's gap pacing launches lone kernels only, and learns from their spans.)
            kernel_s = kernel.kernel_s
            if kernel_s is None and self.plan.gap_s > 0:
                kernel_s = busy_s / kernel.count
            if kernel_s is not None and kernel_s > 0:
                self._rate.add(kernel_s, kernel.multiplier)
        if not self._queue:
            self.busy_log.mark_idle(now_s)
        elif done:
            self.busy_log.mark_complete_until(done[-1].end_s)

    def _queued_s(self, now_s: float) -> float:
        return max(self._queue[-1][0] - now_s, 0.0) if self._queue else 0.0

    def _next_poll_s(self, now_s: float, idle_s: float) -> float:
        if not self._queue:
            return now_s + idle_s
        return max(self._queue[0][0], now_s + 0.0002)
