"""The state machine: filling, yielding, boosted, paused, held. Pure: time, verdicts, pauses and holds are passed
in."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class State(str, Enum):
    FILLING = "filling"
    YIELDING = "yielding"
    BOOSTED = "boosted"
    PAUSED = "paused"  # outside the active hours, a pause file, or SIGUSR1: nothing runs, whatever the GPU does
    HELD = "held"  # a hold names this GPU (holds.py): nothing runs; it outranks a pause


FILLING_STATES = (State.FILLING, State.BOOSTED)  # our kernels run


@dataclass(frozen=True)
class Transition:
    event: str  # "yield", "resume", "boost", "pause", "unpause", "hold" or "release"
    state: State
    reason: str


class Policy:
    """Yield the moment any foreign signal fires; resume after `resume_after_s` with every signal clear;
    boost after `boost_after_s` without foreign activity (0 disables the boost).

    A pause overrides all of it until unpause(); foreign activity seen meanwhile still counts, so a job that
    ran during the pause keeps the filler yielding afterwards until `resume_after_s` have passed without one.
    A hold overrides a pause the same way (state held while both apply; paused again after the release when the
    pause is still on).
    """

    def __init__(self, target: float, boost_target: float, resume_after_s: float,
                 boost_after_s: float, now_s: float) -> None:
        self.target = target  # in the held quantity's unit (quantity.py)
        self.boost_target = boost_target
        self.resume_after_s = resume_after_s
        self.boost_after_s = boost_after_s
        self.state = State.FILLING
        self.last_foreign_s = now_s  # for the boost, the quiet spell counts from the start
        self.foreign_seen_s: float | None = None  # the last foreign verdict, if there was any
        self.paused = False
        self.held = False

    @property
    def current_target(self) -> float:
        if self.state is State.BOOSTED:
            return self.boost_target
        if self.state in FILLING_STATES:
            return self.target
        return 0.0

    def update(self, now_s: float, foreign_reason: str | None) -> Transition | None:
        """`foreign_reason` is None when every signal is clear, else what fired."""
        if foreign_reason is not None:
            self.last_foreign_s = self.foreign_seen_s = now_s
            if self.state in (State.PAUSED, State.HELD):
                return None
            if self.state is not State.YIELDING:
                self.state = State.YIELDING
                return Transition("yield", self.state, foreign_reason)
            return None
        if self.state in (State.PAUSED, State.HELD):
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

    def pause(self, now_s: float, reason: str) -> Transition:
        """Paused from now on (again, when the reason changed while paused: the line says the new one); while
        held, the state stays held."""
        self.paused = True
        if not self.held:
            self.state = State.PAUSED
        return Transition("pause", self.state, reason)

    def unpause(self, now_s: float, reason: str) -> Transition | None:
        """The pause is over: filling, or yielding while foreign activity is more recent than `resume_after_s`
        (still held while a hold is on)."""
        if not self.paused:
            return None
        self.paused = False
        if self.held:
            return Transition("unpause", self.state, reason)
        return self._wake("unpause", now_s, reason)

    def hold(self, now_s: float, reason: str) -> Transition:
        """Held from now on: nothing runs until release()."""
        self.held = True
        self.state = State.HELD
        return Transition("hold", self.state, reason)

    def release(self, now_s: float, reason: str) -> Transition | None:
        """The last hold is gone: paused if a pause is on, else as after a pause."""
        if not self.held:
            return None
        self.held = False
        if self.paused:
            self.state = State.PAUSED
            return Transition("release", self.state, reason)
        return self._wake("release", now_s, reason)

    def _wake(self, event: str, now_s: float, reason: str) -> Transition:
        quiet_s = now_s - (self.foreign_seen_s if self.foreign_seen_s is not None else float("-inf"))
        if quiet_s >= self.resume_after_s:
            self.state = State.FILLING
            return Transition(event, self.state, reason)
        self.state = State.YIELDING
        return Transition(event, self.state, f"{reason}; foreign activity {quiet_s:.1f} s ago: filling after "
                                                 f"{self.resume_after_s:.1f} s without any")
