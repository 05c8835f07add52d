"""The power cap (FORGE_MAX_POWER_W): a second loop that limits the controller's duty so that board power stays
at or under the cap while the filler fills. Pure: each reading's board power and our busy share are passed in.

Board power is NVML's reading, which NVIDIA documents as a 1-s mean on Ampere (except A100) and newer GPUs and
as instantaneous before; the simulated and the virtual GPU model the 1-s mean. Our busy share is taken over
the same last second (CUDA events), so the two describe the same time.

The model is a line: power = idle + slope x our busy share. `idle` is the lowest power read while nothing of
ours ran and no foreign job was seen. `slope` starts at what the board's power limit allows (limit - idle:
our kernels at full duty cannot draw more than the board may), never below the truth, so the first duty errs
low; readings while filling steadily then teach it. A reading above the line raises the slope at once, one
below lowers it by a step per reading, so a mistake errs toward less power. The duty limit is where the line
meets the cap less a margin: each reading aims from the operating point at the cap, which on a board whose power
grows with duty converges from below, as a secant step would.

Which readings it learns from, and when, is PowerWatch's: each power reading once, once our busy log covers it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from forge_load.control.monitor import Reading

DEFAULT_BOARD_LIMIT_W = 1500.0  # when NVML names no limit: above any single GPU's, so the first duty errs low
MARGIN_RATIO = 0.05  # aim this far under the cap: NVML's readings wobble by a percent, our bursts' 1-s share by more
MIN_LEARN_RATIO = 0.05  # below this busy share our power cannot be told from the readings' noise: never raised from
LOWER_WEIGHT = 0.2  # how far one reading below the line moves the slope toward it
RELEASE_BAND = 0.01  # binding ends once the controller wants this much less duty than the limit
# Our share of the second before a reading and of the one before that differ by at most this much of the larger,
# plus the slack, when we were not mid-ramp ("steady").
STEADY_RATIO = 0.1
STEADY_SLACK_RATIO = 0.01
BEFORE_SLACK_S = 0.05  # a power reading's second may begin this much before our context: a poll grid's rounding


@dataclass(frozen=True)
class CapChange:
    """The cap started (binding=True) or stopped binding, for the `power_capped` line."""

    binding: bool
    power_w: float | None
    cap_w: float
    duty_limit: float

    def fields(self) -> dict[str, object]:
        """The `power_capped` line's own fields."""
        return {"capped": self.binding, "power_w": None if self.power_w is None else round(self.power_w, 1),
                "max_power_w": self.cap_w, "duty_limit": round(self.duty_limit, 4)}


class PowerCap:
    def __init__(self, cap_w: float, board_limit_w: float | None = None, margin_ratio: float = MARGIN_RATIO,
                 lower_weight: float = LOWER_WEIGHT) -> None:
        self.cap_w = cap_w
        self.board_limit_w = board_limit_w if board_limit_w is not None and board_limit_w > 0 else None
        self.margin_ratio = margin_ratio
        self.lower_weight = lower_weight
        self.idle_w: float | None = None
        self.learned_slope_w: float | None = None  # watts our busy share adds per unit, from the readings
        self.power_w: float | None = None  # the latest reading
        self.binding = False

    @property
    def slope_w(self) -> float | None:
        """Watts per unit of our busy share: learned, or until then what the board's limit allows."""
        if self.learned_slope_w is not None:
            return self.learned_slope_w
        if self.idle_w is None:
            return None
        limit_w = self.board_limit_w if self.board_limit_w is not None else DEFAULT_BOARD_LIMIT_W
        return max(limit_w - self.idle_w, 1.0)

    def observe(self, power_w: float | None, own_ratio: float, quiet: bool, steady: bool = True) -> None:
        """One reading: board power, our busy share of the same second, whether nothing foreign was seen, and
        whether our share was about the same the second before (a reading mid-ramp teaches nothing)."""
        if power_w is None:
            return
        self.power_w = power_w
        if not quiet:
            return  # a foreign job's power is not ours to learn from
        if own_ratio <= 0.0:
            self.idle_w = power_w if self.idle_w is None else min(self.idle_w, power_w)
            return
        slope_w = self.slope_w
        if not steady or slope_w is None or self.idle_w is None:
            return
        seen_w = (power_w - self.idle_w) / own_ratio
        if seen_w >= slope_w:
            if own_ratio >= MIN_LEARN_RATIO:  # below it, a reading's noise over our share is no slope to believe
                self.learned_slope_w = seen_w
        elif seen_w > 0:
            # Lowered a step even from a small share: a kernel that draws little (the lean shape) leaves the board's
            # limit as the slope, and a cap near idle power as a duty too small to learn from, for good; a step too
            # far is raised back at the next reading that shows it.
            self.learned_slope_w = slope_w + self.lower_weight * (seen_w - slope_w)

    @property
    def duty_limit(self) -> float:
        """The most duty that keeps the line under the cap; 0 until an idle reading anchors it."""
        slope_w = self.slope_w
        if self.idle_w is None or slope_w is None:
            return 0.0
        budget_w = self.cap_w * (1.0 - self.margin_ratio) - self.idle_w
        return min(max(budget_w / slope_w, 0.0), 1.0)

    def after_plan(self, duty: float, limit: float) -> CapChange | None:
        """The controller planned `duty` under `limit`: the change in binding, if any. It binds once the limit
        sets the duty, and stops once the controller wants RELEASE_BAND less, so it does not flap at the edge. Before
        an idle reading the limit is 0 because nothing is known yet, not because the cap binds: no line says so."""
        if not self.binding and self.idle_w is not None and limit < 1.0 and duty >= limit - 1e-12:
            self.binding = True
            return CapChange(True, self.power_w, self.cap_w, limit)
        if self.binding and duty < limit - RELEASE_BAND:
            self.binding = False
            return CapChange(False, self.power_w, self.cap_w, limit)
        return None

    def stop_binding(self) -> CapChange | None:
        """The filler stopped filling (yield, pause): the cap no longer binds."""
        if not self.binding:
            return None
        self.binding = False
        return CapChange(False, self.power_w, self.cap_w, self.duty_limit)


class BusyShares(Protocol):
    """Our own busy time (worker.py's BusyLog): timed completely up to a time, and summed over a span."""

    @property
    def complete_until_s(self) -> float: ...

    def busy_s(self, begin_s: float, end_s: float) -> float: ...


class PowerWatch:
    """What the cap learns from: every Monitor reading is handed to observe(), which teaches the cap board power
    against our busy share of the same second.

    Power is read about once a second (monitor.py): each reading of it is learnt from once. It waits until every
    kernel of ours that ran before it is timed: a burst still in flight would read our share low and the watts it
    costs high (bursts last up to a twelfth of a second). A reading whose second began before `since_s` (when our
    context was made) describes the board without it, tens of watts lower (docs/design.md §15): shown, never
    learnt from, or the line's idle would sit below what our context alone draws."""

    def __init__(self, cap: PowerCap, busy: BusyShares, since_s: float = float("-inf")) -> None:
        self.cap = cap
        self.busy = busy
        self.since_s = since_s
        self._pending: tuple[float, Reading] | None = None  # a reading our busy log does not yet cover, and when
        self._seen_t_s: float | None = None  # when the power reading last learnt from was read

    def observe(self, now_s: float, reading: Reading) -> None:
        """A new reading at `now_s`. A power reading not learnt from yet waits (one at a time) until the busy log
        covers the time it came at; then the cap learns from it, with our share of the second before that time."""
        if self._pending is None and reading.power_w is not None and reading.power_t_s != self._seen_t_s:
            self._seen_t_s = reading.power_t_s
            if reading.power_t_s is not None and reading.power_t_s - 1.0 < self.since_s - BEFORE_SLACK_S:
                self.cap.power_w = reading.power_w  # NVML's 1-s mean of a board without our context yet
                return
            self._pending = (now_s, reading)
        if self._pending is None or self.busy.complete_until_s < self._pending[0]:
            return
        at_s, pending = self._pending
        self._pending = None
        own_ratio = min(self.busy.busy_s(at_s - 1.0, at_s), 1.0)
        before_ratio = min(self.busy.busy_s(at_s - 2.0, at_s - 1.0), 1.0)
        steady = abs(own_ratio - before_ratio) <= STEADY_RATIO * max(own_ratio, before_ratio) + STEADY_SLACK_RATIO
        self.cap.observe(pending.power_w, own_ratio, quiet=pending.reason is None, steady=steady)
