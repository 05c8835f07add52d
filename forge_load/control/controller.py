"""Control laws: (target, samples of the held quantity) -> the next Plan for the Worker.

Pure Python on purpose: no numba, no pynvml, no clock of its own. Time arrives with the samples.

What we steer is our own busy share of time (the duty); the held quantity (quantity.py; today NVML's
utilization, docs/design.md §1) says which duty holds a target before any feedback. The multiplier only sizes
each kernel: the PI law keeps the largest kernel near `slice_s`, and sets the Worker's period to a whole
fraction of the sample window, so that every window holds the same number of bursts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

from forge_load.control.probe import UtilSample
from forge_load.control.quantity import UTILIZATION, Quantity
from forge_load.control.worker import Plan


class Controller(Protocol):
    name: str

    def start(self, now_s: float) -> None:
        """Begin (or resume) filling at `now_s`; samples whose window started earlier are ignored."""

    def update(self, target: float, samples: Sequence[UtilSample], window_s: float,
               launch_s: float | None, max_duty: float = 1.0) -> Plan:
        """Take the samples of the held quantity that arrived since the last call; the plan to follow, its duty
        at most `max_duty` (the power cap's limit, powercap.py)."""


class PiController:
    """Feed-forward on the target plus integral action on the NVML error.

    The feed-forward duty is right from the first launch, so the loop settles within a sample or two;
    the integral only removes the small bias between our event-timed busy share and what NVML counts.
    The integral is clamped to keep the duty in [0, 1] and is neither fed nor reset while yielding, so
    it cannot wind up, and the bias it learned still holds when filling resumes.
    """

    name = "pi"

    def __init__(self, quantity: Quantity = UTILIZATION, slice_s: float = 0.010, burst_s: float = 1.0 / 12.0,
                 max_period_s: float = 1.0 / 6.0, ki_per_s: float = 0.6, max_gain: float = 0.3,
                 max_multiplier: int = 4096, initial_multiplier: int = 8) -> None:
        self.quantity = quantity
        self.slice_s = slice_s
        self.burst_s = burst_s
        self.max_period_s = max_period_s
        self.ki_per_s = ki_per_s
        self.max_gain = max_gain
        self.max_multiplier = max_multiplier
        self.multiplier = initial_multiplier
        self.integral_duty = 0.0
        self._filling_since_s = float("inf")

    def start(self, now_s: float) -> None:
        self._filling_since_s = now_s

    def update(self, target: float, samples: Sequence[UtilSample], window_s: float,
               launch_s: float | None, max_duty: float = 1.0) -> Plan:
        # Per-sample gain grows with the window but stays well below the one-sample-delay limit (0.5).
        gain = min(self.ki_per_s * window_s, self.max_gain)
        feed_forward = self.quantity.duty_for(target)
        for sample in samples:
            if sample.t_s - window_s < self._filling_since_s:
                continue  # the window saw the GPU before we filled it
            step = gain * (target - sample.ratio) / self.quantity.per_duty
            if step > 0 and feed_forward + self.integral_duty >= max_duty:
                continue  # held under the duty limit: growing the integral would only wind it up
            self.integral_duty += step
        self.integral_duty = min(max(self.integral_duty, -feed_forward), 1.0 - feed_forward)
        if launch_s is not None and launch_s > 0:
            scale = self.slice_s / launch_s
            if not 0.7 <= scale <= 1.4:  # dead band: kernel time moves in whole waves
                self.multiplier = min(max(round(self.multiplier * scale), 1), self.max_multiplier)
        return Plan(multiplier=self.multiplier, duty_ratio=max(min(feed_forward + self.integral_duty, max_duty), 0.0),
                    period_s=self.period_for(feed_forward, window_s))

    def period_for(self, duty: float, window_s: float) -> float:
        """How often the Worker queues a burst: the longest period, up to `max_period_s`, whose burst at this
        duty is at most `burst_s` and that divides the sample window, so that each window holds whole
        bursts.

        Halvings of `max_period_s` come first: they divide every window of 1/6, 1/2 and 1 s (and 1/12 s
        divides 1/4 s too), so the period does not change when the window is learned after the first
        samples, which would upset one window. It is chosen by the target's feed-forward duty, not the
        integral's, so that the integral's small steps never change it. The window is learned from sample
        stamps: a hair over a multiple is that multiple."""
        if window_s <= 0:
            return 0.0
        period_s = self.max_period_s
        while duty * period_s > self.burst_s * 1.001 and period_s > self.burst_s / 64:
            period_s /= 2
        parts = window_s / period_s
        if parts >= 0.99 and abs(parts - round(parts)) <= 0.01 * parts:
            return window_s / round(parts)
        parts = max(math.ceil(window_s / self.max_period_s - 0.01),
                    math.ceil(duty * window_s / self.burst_s - 0.01), 1)
        return window_s / parts


class LegacyController:
    """The original tool's law, kept to compare against.

    Runs of `run_s` at a fixed multiplier, a kernel after another with `gap_s` of sleep between them.
    At the end of each run the multiplier grows x1.2 when the run's mean was below 0.9 x target and
    shrinks /1.5 when above 1.2 x target; then, if the peak of the run's last 5 s exceeded 1.1 x target,
    it idles for 5 s before the next run.
    """

    name = "legacy"

    def __init__(self, run_s: float = 10.0, gap_s: float = 0.005, initial_multiplier: float = 32.0,
                 peak_window_s: float = 5.0, idle_s: float = 5.0, max_multiplier: float = 65536.0) -> None:
        self.run_s = run_s
        self.gap_s = gap_s
        self.peak_window_s = peak_window_s
        self.idle_s = idle_s
        self.max_multiplier = max_multiplier
        self.multiplier_f = initial_multiplier
        self._run_start_s: float | None = None
        self._run: list[UtilSample] = []
        self._idle_until_s = float("-inf")
        self._last_s = float("-inf")

    @property
    def multiplier(self) -> int:
        return max(1, round(self.multiplier_f))

    def start(self, now_s: float) -> None:
        self._run_start_s = now_s
        self._run = []
        self._idle_until_s = float("-inf")

    def update(self, target: float, samples: Sequence[UtilSample], window_s: float,
               launch_s: float | None, max_duty: float = 1.0) -> Plan:
        for sample in samples:
            self._last_s = max(self._last_s, sample.t_s)
            self._observe(target, sample)
        duty = 0.0 if self._last_s < self._idle_until_s else 1.0
        if duty > max_duty:  # its gap pacing has no duty to cap: paced by the limit instead
            return Plan(multiplier=self.multiplier, duty_ratio=max(max_duty, 0.0))
        return Plan(multiplier=self.multiplier, duty_ratio=duty, gap_s=self.gap_s)

    def _observe(self, target: float, sample: UtilSample) -> None:
        if sample.t_s < self._idle_until_s:
            return
        if self._run_start_s is None:
            self._run_start_s = sample.t_s
        self._run.append(sample)
        if sample.t_s - self._run_start_s < self.run_s:
            return
        mean_ratio = sum(s.ratio for s in self._run) / len(self._run)
        if mean_ratio < 0.9 * target:
            self.multiplier_f = min(self.multiplier_f * 1.2, self.max_multiplier)
        elif mean_ratio > 1.2 * target:
            self.multiplier_f = max(self.multiplier_f / 1.5, 1.0)
        peak_ratio = max(s.ratio for s in self._run if s.t_s >= sample.t_s - self.peak_window_s)
        self._run_start_s = sample.t_s
        self._run = []
        if peak_ratio > 1.1 * target:
            self._idle_until_s = sample.t_s + self.idle_s
            self._run_start_s = self._idle_until_s


# name -> a fresh controller holding the quantity (the legacy law, the original's, knows utilization only).
CONTROLLERS: dict[str, Callable[[Quantity], Controller]] = {
    PiController.name: PiController,
    LegacyController.name: lambda _quantity: LegacyController(),
}


def make_controller(name: str, quantity: Quantity = UTILIZATION) -> Controller:
    """A fresh controller of that name (config/settings.py accepts exactly these names), holding `quantity`."""
    try:
        return CONTROLLERS[name](quantity)
    except KeyError:
        raise ValueError(f"no controller {name!r}: expected one of {', '.join(CONTROLLERS)}") from None
