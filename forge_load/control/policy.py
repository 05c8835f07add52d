"""The state machine: filling, yielding, boosted, paused, held, and the lines of its changes. Which reason outranks
which is Reasons' answer (reasons.py); this adds the boost and says when the state changed. Pure: time, verdicts,
pauses and holds are passed in."""

from __future__ import annotations

from dataclasses import dataclass

from forge_load.control.reasons import FILLING_STATES, Reasons, State

__all__ = ["FILLING_STATES", "Policy", "State", "Transition"]


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
    pause is still on). That order is `reasons`' verdict; the filler feeds `reasons` from its sources and tells the
    policy what changed (changed()), tests and tools may tell it directly (pause(), hold(), ...).
    """

    def __init__(self, target: float, boost_target: float, resume_after_s: float,
                 boost_after_s: float, now_s: float, reasons: Reasons | None = None) -> None:
        self.target = target  # in the held quantity's unit (quantity.py)
        self.boost_target = boost_target
        self.reasons = reasons if reasons is not None else Reasons(resume_after_s)
        self.boost_after_s = boost_after_s
        self.state = State.FILLING
        self.last_foreign_s = now_s  # for the boost, the quiet spell counts from the start

    @property
    def resume_after_s(self) -> float:
        return self.reasons.resume_after_s

    @property
    def paused(self) -> bool:
        return self.reasons.paused

    @property
    def held(self) -> bool:
        return self.reasons.held

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
            self.last_foreign_s = now_s
            self.reasons.foreign_seen(now_s)
        verdict = self.reasons.verdict(now_s, foreign_reason)
        if verdict.state in (State.PAUSED, State.HELD):
            return None  # a higher reason stands: no yield or resume line while it does
        if verdict.state is State.YIELDING:
            if foreign_reason is not None and self.state is not State.YIELDING:
                self.state = State.YIELDING
                return Transition("yield", self.state, foreign_reason)
            return None
        quiet_s = now_s - self.last_foreign_s
        if self.state is State.YIELDING:
            self.state = State.FILLING
            return Transition("resume", self.state, f"no foreign activity for {quiet_s:.1f} s")
        if (self.state is State.FILLING and self.boost_after_s > 0
                and self.boost_target > self.target and quiet_s >= self.boost_after_s):
            self.state = State.BOOSTED
            return Transition("boost", self.state, f"no foreign activity for {quiet_s:.0f} s")
        return None

    def changed(self, event: str, now_s: float, reason: str) -> Transition:
        """A pause or a hold began or ended (`reasons` already says so): the state is the verdict's; one that ends
        on yielding says how long the last foreign job is past and how long it waits."""
        verdict = self.reasons.verdict(now_s)
        self.state = verdict.state
        if verdict.state is State.YIELDING:
            reason = (f"{reason}; foreign activity {self.reasons.quiet_s(now_s):.1f} s ago: filling after "
                      f"{self.resume_after_s:.1f} s without any")
        return Transition(event, self.state, reason)

    def pause(self, now_s: float, reason: str) -> Transition:
        """Paused from now on (again, when the reason changed while paused: the line says the new one); while
        held, the state stays held."""
        self.reasons.pause = reason
        return self.changed("pause", now_s, reason)

    def unpause(self, now_s: float, reason: str) -> Transition | None:
        """The pause is over: filling, or yielding while foreign activity is more recent than `resume_after_s`
        (still held while a hold is on)."""
        if not self.paused:
            return None
        self.reasons.pause = None
        return self.changed("unpause", now_s, reason)

    def hold(self, now_s: float, reason: str) -> Transition:
        """Held from now on: nothing runs until release()."""
        self.reasons.holders = self.reasons.holders or ()
        return self.changed("hold", now_s, reason)

    def release(self, now_s: float, reason: str) -> Transition | None:
        """The last hold is gone: paused if a pause is on, else as after a pause."""
        if not self.held:
            return None
        self.reasons.holders = None
        return self.changed("release", now_s, reason)
