"""The shape of our kernels (FORGE_SHAPE): what one launch of ours puts on the GPU, and so what it can move.

- `lean` (the default): the least each metric counts, resident and idle. NVML's utilization and GPM's graphics
  activity count the time any kernel runs, so one warp (one block of 32 threads) on one SM; GPM's SM activity counts
  the SMs with a warp resident, so one warp on every SM. Each warp sleeps (nanosleep) for the launch's length: the
  multiplier is that length in sleep quanta.
- `burn`: register-only FMA loops in full waves over every SM (the original filler's load): the multiplier is the
  grid in blocks per SM. Only it moves what needs arithmetic: SM occupancy, pipe activity, board power.

Pure: the launchers (gpu/launcher.py, gpu/sim.py) lay kernels out by it, the Monitor and the held quantity read how
much of the GPU our kernels cover (docs/design.md, "How it holds the target").
"""

from __future__ import annotations

from dataclasses import dataclass

from forge_load.config.settings import SHAPE_NAMES

LEAN, BURN = SHAPE_NAMES  # FORGE_SHAPE's names, as config/settings.py accepts them


@dataclass(frozen=True)
class Shape:
    """A kernel shape on a device of `sm_count` SMs (a MIG device: its own)."""

    name: str
    sm_count: int
    per_sm: bool = False  # lean: one warp on every SM (SM activity) rather than a single warp

    @classmethod
    def for_metric(cls, name: str, metric: str, sm_count: int) -> Shape:
        """The shape `name` for holding `metric`: lean puts a warp on every SM only where SM activity is held."""
        if name not in SHAPE_NAMES:
            raise ValueError(f"no kernel shape {name!r}: expected one of {', '.join(SHAPE_NAMES)}")
        return cls(name, max(sm_count, 1), per_sm=name == LEAN and metric == "sm_activity")

    @property
    def lean(self) -> bool:
        return self.name == LEAN

    def blocks(self, multiplier: int) -> int:
        """The grid of a kernel of `multiplier`: lean's is fixed (its length is in its arguments), burn's grows."""
        if self.lean:
            return self.sm_count if self.per_sm else 1
        return multiplier * self.sm_count

    @property
    def sm_ratio(self) -> float:
        """The share of the SMs with a warp of ours resident while one of our kernels runs: what our busy share is
        worth in GPM's SM activity. Burn's kernels are full waves over every SM (less the tails of last waves)."""
        return 1.0 if not self.lean or self.per_sm else 1.0 / self.sm_count

    def describe(self) -> str:
        """For the start line (`shape_layout`): what one kernel puts on the GPU, in a few words."""
        if not self.lean:
            return "full waves of FMA blocks on every SM"
        return f"one sleeping warp on each of {self.sm_count} SMs" if self.per_sm else "one sleeping warp"
