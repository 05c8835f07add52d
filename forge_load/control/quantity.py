"""The quantity the filler holds at its target (FORGE_METRIC): NVML's device utilization (docs/design.md §1), or GPM's
SM or graphics activity (§12), each a ratio.

The policy, the controller and the status speak of "the target" in this quantity's unit, never of a ratio; the
filler feeds the controller the samples this quantity reads from each Monitor reading. A target in another
quantity (board power, say) is a new Quantity here, with its samples, its feed-forward duty and its
units, plus the setting that chooses it (config/settings.py) and, where NVML offers it, the reading it comes from
(monitor.py, nvml.py, sim.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from forge_load.control.probe import UtilSample

if TYPE_CHECKING:  # the controller uses this module and must stay clear of the Monitor's imports
    from forge_load.control.monitor import Reading


@dataclass(frozen=True)
class Quantity:
    name: str  # as the log and the docs say it
    unit: str
    samples: Callable[[Reading], list[UtilSample]]  # what one reading adds, oldest first
    duty_for: Callable[[float], float]  # the duty that holds a target, before any feedback (feed-forward)
    per_duty: float  # how much the quantity moves per unit of duty, near the target (scales the feedback)


def _utilization_samples(reading: Reading) -> list[UtilSample]:
    return [UtilSample(s.t_s, s.util_ratio) for s in reading.samples]


# NVML counts a window busy for the time any kernel ran (§1): the duty is the utilization we add.
UTILIZATION = Quantity("utilization", "ratio", _utilization_samples, duty_for=lambda target: target, per_duty=1.0)


def _sm_samples(reading: Reading) -> list[UtilSample]:
    return [UtilSample(a.t_s, a.sm_ratio) for a in reading.activity]


def _gr_samples(reading: Reading) -> list[UtilSample]:
    return [UtilSample(a.t_s, a.gr_ratio) for a in reading.activity]


# GPM's SM_UTIL (docs/design.md §12): with a warp of ours on every SM (the lean shape's layout for it, or the burn
# shape's full waves), SM activity follows our busy share, less the tails of sleeps or last waves; the controller's
# integral learns that bias as it does NVML's. A shape that covers a share of the SMs moves it by that share per unit
# of duty (quantity_for).
SM_ACTIVITY = Quantity("sm_activity", "ratio", _sm_samples, duty_for=lambda target: target, per_duty=1.0)
# GPM's GRAPHICS_UTIL: the time any kernel ran, as NVML's utilization counts it, and there on MIG devices too.
GR_ACTIVITY = Quantity("gr_activity", "ratio", _gr_samples, duty_for=lambda target: target, per_duty=1.0)

# FORGE_METRIC's names (config/settings.py METRIC_NAMES) -> the quantity; the GPM ones need GPM on the device.
QUANTITIES: dict[str, Quantity] = {q.name: q for q in (UTILIZATION, SM_ACTIVITY, GR_ACTIVITY)}
NEEDS_GPM = frozenset({SM_ACTIVITY.name, GR_ACTIVITY.name})


def quantity_for(name: str, sm_ratio: float = 1.0) -> Quantity:
    """The quantity FORGE_METRIC names, for kernels that keep a warp resident on `sm_ratio` of the SMs while they run
    (control/shape.py): SM activity then moves by `sm_ratio` per unit of duty, and its feed-forward asks for the duty
    that gives the target (at most all of the time). The time any kernel runs does not depend on it."""
    quantity = QUANTITIES[name]
    if name != SM_ACTIVITY.name or sm_ratio >= 1.0:
        return quantity
    return dataclasses.replace(quantity, duty_for=lambda target: min(target / sm_ratio, 1.0), per_duty=sm_ratio)
