"""The state machine: filling, yielding, boosted. Pure: time and verdicts are passed in."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class State(str, Enum):
    FILLING = "filling"
    YIELDING = "yielding"
    BOOSTED = "boosted"


@dataclass(frozen=True)
class Transition:
    event: str  # "yield", "resume" or "boost"
    state: State
    reason: str


class Policy:
    """Yield the moment any foreign signal fires; resume after `resume_after_s` with every signal clear;
    boost after `boost_after_s` without foreign activity (0 disables the boost)."""

    def __init__(self, target: float, boost_target: float, resume_after_s: float,
                 boost_after_s: float, now_s: float) -> None:
        self.target = target  # in the held quantity's unit (quantity.py)
        self.boost_target = boost_target
        self.resume_after_s = resume_after_s
        self.boost_after_s = boost_after_s
        self.state = State.FILLING
        self.last_foreign_s = now_s

    @property
    def current_target(self) -> float:
        if self.state is State.BOOSTED:
            return self.boost_target
        if self.state is State.YIELDING:
            return 0.0
        return self.target

    def update(self, now_s: float, foreign_reason: str | None) -> Transition | None:
        """`foreign_reason` is None when every signal is clear, else what fired."""
        if foreign_reason is not None:
            self.last_foreign_s = now_s
            if self.state is not State.YIELDING:
                self.state = State.YIELDING
                return Transition("yield", self.state, foreign_reason)
            return None
        quiet_s = now_s - self.last_foreign_s
        if self.state is State.YIELDING and quiet_s >= self.resume_after_s:
            self.state = State.FILLING
            return Transition("resume", self.state, f"no foreign activity for {quiet_s:.1f} s")
        if (self.state is State.FILLING and self.boost_after_s > 0
                and self.boost_target > self.target and quiet_s >= self.boost_after_s):
            self.state = State.BOOSTED
            return Transition("boost", self.state, f"no foreign activity for {quiet_s:.0f} s")
        return None
