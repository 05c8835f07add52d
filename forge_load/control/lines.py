"""One GPU's log lines, through one gate (LineGate): most are written at once; those a storm can repeat are coalesced.

A signal storm (SIGUSR1/SIGUSR2 by turns: each change of the pause's reasons) would write a line per change. Each
kind in COALESCED_KINDS is written at most once per LINES_EVERY_S: a line that comes sooner is held, the latest
replacing the one held, and written when its second is up (or before any other line, so the log stays in order)
with `coalesced`: how many changes it stands for that have no line. Only the lines wait: what they say has
already happened."""

from __future__ import annotations

from dataclasses import dataclass

from forge_load.log import EventLog

COALESCED_KINDS = {"pause": "pause", "unpause": "pause", "drained": "drained", "power_capped": "power_capped"}
LINES_EVERY_S = 1.0


@dataclass(frozen=True)
class _Held:
    """A line held back (COALESCED_KINDS): the latest of its kind, and how many changes before it had no line."""

    event: str
    t_s: float
    fields: dict[str, object]
    coalesced: int


class LineGate:
    """Writes the lines of a filler that started at `start_s` (their `t` counts from it) to `log`."""

    def __init__(self, log: EventLog, start_s: float) -> None:
        self.log = log
        self.start_s = start_s
        self._held: dict[str, _Held] = {}  # by kind: the latest line not yet written
        self._written_s: dict[str, float] = {}  # kind -> when its last line was written

    @property
    def due_s(self) -> float:
        """When the first held line is due to be written (inf when none is held)."""
        return min((self._written_s[kind] + LINES_EVERY_S for kind in self._held), default=float("inf"))

    def emit(self, now_s: float, event: str, fields: dict[str, object]) -> None:
        """Write a line at `now_s`, or hold it (COALESCED_KINDS); every held line goes first, in order."""
        kind = COALESCED_KINDS.get(event)
        if kind is not None and (kind in self._held
                                 or now_s - self._written_s.get(kind, float("-inf")) < LINES_EVERY_S):
            held = self._held.get(kind)
            self._held[kind] = _Held(event, now_s, fields, 0 if held is None else held.coalesced + 1)
            return
        self.flush(now_s)
        self.log.emit(event, t=now_s - self.start_s, **fields)
        if kind is not None:
            self._written_s[kind] = now_s

    def flush(self, now_s: float) -> None:
        """Write the held lines now (before a line that must follow them, when due, and before the stop line)."""
        held, self._held = self._held, {}
        for kind, line in sorted(held.items(), key=lambda item: item[1].t_s):
            extra: dict[str, object] = {"coalesced": line.coalesced} if line.coalesced else {}
            self.log.emit(line.event, t=line.t_s - self.start_s, **line.fields, **extra)
            self._written_s[kind] = now_s
