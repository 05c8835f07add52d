"""Every reason not to fill one GPU, judged in one place and in one order: held, then paused, then yielding.

Reasons is fed by the holds (on disk and the kubelet's, through FillerHolds), the pause switch, the pause file and
the active hours (through Pauses), the foreign-job verdict, and carries the power cap; `verdict(now_s)` says whether
the GPU may be filled at that moment and, if not, why. The filler's Policy takes that answer and turns each change
into a line (policy.py); exclusive mode's supervisor acts on it with its child process (service/exclusive.py). The
state names, the hold lines and the order of the reasons are defined here and nowhere else. Pure: the time is passed
in, the sources are read only when asked."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from forge_load.control.powercap import PowerCap
from forge_load.steering.hold_watch import FillerHolds, HoldChange, coalesce
from forge_load.steering.pause import Pauses, shown_time


class State(str, Enum):
    FILLING = "filling"
    YIELDING = "yielding"  # a foreign job, or the quiet time after one
    BOOSTED = "boosted"  # filling at the boost target after a long quiet spell
    PAUSED = "paused"  # outside the active hours, a pause file, or SIGUSR1: nothing runs, whatever the GPU does
    HELD = "held"  # a hold names this GPU (holds.py): nothing runs; it outranks a pause


FILLING_STATES = (State.FILLING, State.BOOSTED)  # our kernels run


@dataclass(frozen=True)
class Verdict:
    """Whether the GPU may be filled at a moment (state FILLING), or the highest-ranked reason not to."""

    state: State  # FILLING, or HELD, PAUSED or YIELDING: the reason that decides
    reason: str | None  # why not, in words (the supervisor's child_end line); None when it may be filled

    @property
    def may_fill(self) -> bool:
        return self.state is State.FILLING


@dataclass(frozen=True)
class HoldLine:
    """One `hold` or `release` line of a look at the holds: many holders at once are one line with their count."""

    event: str  # "hold" or "release"
    holder: str  # the first holder by name, or FAIL_SAFE_HOLDER
    reason: str  # the hold's reason (held by HOLDER where it gave none), or why it ended
    more: dict[str, object] = field(default_factory=dict)  # count (more than one holder), until (a hold that ends)
    turns: bool = False  # the line at which the GPU becomes held, or is held no longer: a change of state


@dataclass(frozen=True)
class HoldLook:
    """What one look at the holds found: problems not said before, and the lines to write, in order."""

    problems: list[str]
    lines: list[HoldLine]


@dataclass(frozen=True)
class PauseChange:
    """The pause began, its reasons changed ("pause", every reason now), or it ended ("unpause", what ended)."""

    event: str
    reason: str


def hold_lines(changes: list[HoldChange], held_before: bool, held_after: bool) -> list[HoldLine]:
    """The lines of one look's changes: coalesced, each with its reason, count and end; the first hold of a GPU not
    held before and the last release of one no longer held are marked as the lines where its state turns."""
    lines: list[HoldLine] = []
    coalesced = coalesce(changes)
    last_release = max((i for i, c in enumerate(coalesced) if c.event == "release"), default=-1)
    turned = False
    for i, change in enumerate(coalesced):
        more: dict[str, object] = {}
        if change.count > 1:
            more["count"] = change.count
        if change.until_unix_s is not None:
            more["until"] = shown_time(change.until_unix_s)
        if change.event == "hold":
            reason = change.reason or f"held by {change.holder}"
            turns = not held_before and not turned
            turned = turned or turns
        else:
            reason = change.reason
            turns = held_before and not held_after and i == last_release
        lines.append(HoldLine(change.event, change.holder, reason, more, turns))
    return lines


class Reasons:
    """One GPU's reasons not to run: the sources (pauses, holds, power cap), what they said at their last look, and
    when the last foreign job was seen. `resume_after_s`: the quiet time a foreign job leaves behind it."""

    def __init__(self, resume_after_s: float, pauses: Pauses | None = None, holds: FillerHolds | None = None,
                 power_cap: PowerCap | None = None) -> None:
        self.resume_after_s = resume_after_s
        self.pauses = pauses
        self.holds = holds
        self.power_cap = power_cap
        self.pause: str | None = None  # every reason to pause now, joined; None: not paused
        self.holders: tuple[str, ...] | None = None  # who holds the GPU (() for the fail-safe); None: not held
        self.foreign_seen_s: float | None = None  # the last foreign verdict (or wait: see wait_quiet); None: never
        self.holds_begun = 0  # holders honoured since the start
        self._pause_generation = -1  # the pauses are asked at the first look, before anything is launched
        self._holds_checked = False  # asked at the first look, before anything is launched
        self._holds_generation = 0  # and at once when the in-process holds change (HoldBoard)

    @property
    def held(self) -> bool:
        return self.holders is not None

    @property
    def paused(self) -> bool:
        return self.pause is not None

    @property
    def duty_limit(self) -> float:
        """The most of the time our kernels may run, under the power cap (1 without one)."""
        return self.power_cap.duty_limit if self.power_cap is not None else 1.0

    # --- what the sources say --------------------------------------------------------------------------------

    def holds_due(self, fresh: bool) -> bool:
        """Whether to look at the holds now: at a fresh reading, at the first look, and when the in-process holds
        changed (the kubelet's, between readings)."""
        return self.holds is not None and (fresh or not self._holds_checked
                                           or self.holds.generation != self._holds_generation)

    def look_holds(self, now_s: float) -> HoldLook:
        """Read the holds; `holders` follows what they say, and the look says what began and ended."""
        assert self.holds is not None
        self._holds_checked = True
        self._holds_generation = self.holds.generation
        changes, problems = self.holds.check(now_s)
        held_before = self.held
        self.holders = self.holds.watch.holders if self.holds.held else None
        self.holds_begun += sum(c.count for c in changes if c.event == "hold")
        return HoldLook(problems, hold_lines(changes, held_before, self.held))

    def pauses_due(self, fresh: bool) -> bool:
        """Whether to ask the pauses now: at a fresh reading, and when a signal changed the switch."""
        return self.pauses is not None and (fresh or self.pauses.generation != self._pause_generation)

    def look_pauses(self) -> PauseChange | None:
        """Ask every reason to pause; `pause` follows, and a change is returned (None when nothing changed)."""
        assert self.pauses is not None
        self._pause_generation = self.pauses.generation
        asked = self.pauses.check()
        if asked.reason is not None and asked.reason != self.pause:
            self.pause = asked.reason
            return PauseChange("pause", asked.reason)
        if asked.reason is None and self.pause is not None:
            self.pause = None
            return PauseChange("unpause", asked.ended or "no reason to pause left")
        return None

    def foreign_seen(self, now_s: float) -> None:
        """A foreign job (or no reading at all) now: the quiet time starts again."""
        self.foreign_seen_s = now_s

    def wait_quiet(self, now_s: float) -> None:
        """Wait the quiet time from now, as after a foreign job (exclusive mode: the child yielded by itself)."""
        self.foreign_seen_s = now_s

    def quiet_s(self, now_s: float) -> float:
        """How long since the last foreign job (infinite when there was none)."""
        return now_s - self.foreign_seen_s if self.foreign_seen_s is not None else float("inf")

    # --- the answer --------------------------------------------------------------------------------------------

    def verdict(self, now_s: float, foreign: str | None = None) -> Verdict:
        """May the GPU be filled now, and if not, why: a hold outranks a pause, a pause outranks a foreign job (seen
        now: `foreign`, what the latest look at the GPU saw) and the quiet time after one."""
        if self.holders is not None:
            return Verdict(State.HELD, f"held by {','.join(self.holders) or 'the fail-safe'}")
        if self.pause is not None:
            return Verdict(State.PAUSED, f"paused: {self.pause}")
        if foreign is not None:
            return Verdict(State.YIELDING, f"foreign job: {foreign}")
        if self.quiet_s(now_s) < self.resume_after_s:
            return Verdict(State.YIELDING, f"no foreign job for {self.resume_after_s:g} s first")
        return Verdict(State.FILLING, None)
