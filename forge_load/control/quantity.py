"""The quantity the filler holds at its target: today NVML's device utilization, a ratio (docs/design.md §1).

The policy, the controller and the status speak of "the target" in this quantity's unit, never of a ratio; the
filler feeds the controller the samples this quantity reads from each Monitor reading. A target in another
quantity (SM activity, board power) is a new Quantity here, with its samples, its feed-forward duty and its
units, plus the setting that chooses it (config/settings.py) and, where NVML offers it, the reading it comes from
(monitor.py, nvml.py, sim.py).
"""

from __future__ import annotations

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
