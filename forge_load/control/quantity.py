"""The quantity the filler holds at its target (FORGE_METRIC): NVML's device utilization (docs/design.md §1), or GPM's
SM or graphics activity (§12), each a ratio.

The policy, the controller and the status speak of "the target" in this quantity's unit, never of a ratio; the
filler feeds the controller the samples this quantity reads from each Monitor reading, and shows the operator its
readings (`held`: with our own share of each, under the quantity's own field names) on its status lines, its status
file and its metrics. A target in another
quantity (board power, say) is a new Quantity here, with its samples, its feed-forward duty and its
units, plus the setting that chooses it (config/settings.py) and, where NVML offers it, the reading it comes from
(monitor.py, nvml.py, sim.py).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from forge_load.control.probe import UtilSample

if TYPE_CHECKING:  # the controller uses this module and must stay clear of the Monitor's imports
    from forge_load.control.monitor import Reading


@dataclass(frozen=True)
class Held:
    """One reading of a quantity as shown: over the `span_s` seconds that ended at `t_s`, the device's value and our
    own share of it (our kernels' busy share of the span, timed with CUDA events)."""

    t_s: float
    span_s: float
    ratio: float
    own_ratio: float


@dataclass(frozen=True)
class Quantity:
    name: str  # as the log and the docs say it
    unit: str
    samples: Callable[[Reading], list[UtilSample]]  # what one reading adds, oldest first
    duty_for: Callable[[float], float]  # the duty that holds a target, before any feedback (feed-forward)
    per_duty: float  # how much the quantity moves per unit of duty, near the target (scales the feedback)
    held: Callable[[Reading], list[Held]]  # what one reading adds as shown, oldest first
    field: str  # its reading's field on the status lines (utilization's is the line's own `util`)
    own_field: str  # ... and our own share's


def utilization_held(reading: Reading) -> list[Held]:
    """NVML's sample windows split into ours and the rest; where NVML reports no utilization (a MIG device) and GPM is
    there, GPM's GRAPHICS_UTIL stands in for it (the time any kernel ran, as NVML counts it), as it does for the
    utilization signal (monitor.py)."""
    if reading.utilization_by_gpm:
        return [Held(a.t_s, a.span_s, a.gr_ratio, a.own_ratio) for a in reading.activity]
    return [Held(s.t_s, reading.window_s, s.util_ratio, s.own_ratio) for s in reading.samples]


def _utilization_samples(reading: Reading) -> list[UtilSample]:
    return [UtilSample(s.t_s, s.util_ratio) for s in reading.samples]


# NVML counts a window busy for the time any kernel ran (§1): the duty is the utilization we add.
UTILIZATION = Quantity("utilization", "ratio", _utilization_samples, duty_for=lambda target: target, per_duty=1.0,
                       held=utilization_held, field="util", own_field="own")


def _sm_samples(reading: Reading) -> list[UtilSample]:
    return [UtilSample(a.t_s, a.sm_ratio) for a in reading.activity]


def _gr_samples(reading: Reading) -> list[UtilSample]:
    return [UtilSample(a.t_s, a.gr_ratio) for a in reading.activity]


def _sm_held(reading: Reading) -> list[Held]:
    return [Held(a.t_s, a.span_s, a.sm_ratio, a.own_ratio) for a in reading.activity]


def _gr_held(reading: Reading) -> list[Held]:
    return [Held(a.t_s, a.span_s, a.gr_ratio, a.own_ratio) for a in reading.activity]


# GPM's SM_UTIL (docs/design.md §12): with a warp of ours on every SM (the lean shape's layout for it, or the burn
# shape's full waves), SM activity follows our busy share, less the tails of sleeps or last waves; the controller's
# integral learns that bias as it does NVML's. A shape that covers a share of the SMs moves it by that share per unit
# of duty (quantity_for). Our own share of it is taken as our busy share: held, it has a warp on every SM.
SM_ACTIVITY = Quantity("sm_activity", "ratio", _sm_samples, duty_for=lambda target: target, per_duty=1.0,
                       held=_sm_held, field="sm_activity", own_field="sm_activity_own")
# GPM's GRAPHICS_UTIL: the time any kernel ran, as NVML's utilization counts it, and there on MIG devices too.
GR_ACTIVITY = Quantity("gr_activity", "ratio", _gr_samples, duty_for=lambda target: target, per_duty=1.0,
                       held=_gr_held, field="gr_activity", own_field="gr_activity_own")

# FORGE_METRIC's names (config/settings.py METRIC_NAMES) -> the quantity; the GPM ones need GPM on the device.
QUANTITIES: dict[str, Quantity] = {q.name: q for q in (UTILIZATION, SM_ACTIVITY, GR_ACTIVITY)}
NEEDS_GPM = frozenset({SM_ACTIVITY.name, GR_ACTIVITY.name})


HELD_OVER_S = 2.0  # the held metric as shown now: its readings of the latest two seconds


def held_mean(readings: Sequence[Held]) -> tuple[float, float] | None:
    """(the quantity, our own share) over the readings, each weighted by its span; None without any."""
    total_s = sum(r.span_s for r in readings)
    if not readings or total_s <= 0:
        return None
    return (sum(r.ratio * r.span_s for r in readings) / total_s,
            sum(r.own_ratio * r.span_s for r in readings) / total_s)


class HeldNow:
    """A quantity's latest readings, the fewest that cover HELD_OVER_S: what the status file and the metrics show of
    it. A single GPM reading (about 0.2 s) holds one period of our bursts (1/6 s or less) and part of the next, so it
    swings with where it falls, by 0.08 at a 0.5 target; over a stretch of W seconds the part-period is off by at
    most a quarter of a period, 0.04 / W at most (NVML's sample windows hold whole periods: it is exact there)."""

    def __init__(self) -> None:
        self._recent: deque[Held] = deque()
        self._span_s = 0.0

    def add(self, readings: Sequence[Held]) -> None:
        for reading in readings:
            self._recent.append(reading)
            self._span_s += reading.span_s
        while len(self._recent) > 1 and self._span_s - self._recent[0].span_s >= HELD_OVER_S - 1e-9:
            self._span_s -= self._recent.popleft().span_s

    def mean(self) -> tuple[float, float] | None:
        return held_mean(self._recent)


def quantity_for(name: str, sm_ratio: float = 1.0) -> Quantity:
    """The quantity FORGE_METRIC names, for kernels that keep a warp resident on `sm_ratio` of the SMs while they run
    (control/shape.py): SM activity then moves by `sm_ratio` per unit of duty, and its feed-forward asks for the duty
    that gives the target (at most all of the time). The time any kernel runs does not depend on it."""
    quantity = QUANTITIES[name]
    if name != SM_ACTIVITY.name or sm_ratio >= 1.0:
        return quantity
    return dataclasses.replace(quantity, duty_for=lambda target: min(target / sm_ratio, 1.0), per_duty=sm_ratio)
