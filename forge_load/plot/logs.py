"""A filler's log read back into series: JSON or key=value lines, from a file, stdin or `docker logs` output.

Each line is found by its own start (`{"t":` for JSON, `t=... event=` for key=value), so whatever a log collector
put before it is skipped: `docker logs -t`'s timestamp, `docker compose logs`' `name  | `, `kubectl logs --prefix`'s
`[pod/...]`, journald's `host forge-load[pid]: `. Lines that are not the filler's (its stderr, a shell's) are
counted and left out. Pure: no matplotlib, no GPU library, so that reading 30 minutes of log costs milliseconds.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

# A key=value line: `t=` at the start of the line or after a space, `|`, `]` or `:`, then the event.
_TEXT_START_RE = re.compile(r"(?:^|(?<=[\s|\]:]))t=\S+ event=")
_PAIR_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)=("(?:[^"\\]|\\.)*"|\S*)')
_JSON_START = '{"t":'

# The states in which the filler runs nothing of its own, each drawn as a span (control/policy.py's names).
SPAN_STATES = ("yielding", "paused", "held")


def parse_line(line: str) -> dict[str, object] | None:
    """One log line as its fields (key=value values as text, "-" as None), or None when it is not the filler's."""
    at = line.find(_JSON_START)
    if at >= 0:
        try:
            record = json.loads(line[at:])
        except ValueError:
            return None
        return record if isinstance(record, dict) and "event" in record else None
    match = _TEXT_START_RE.search(line)
    if match is None:
        return None
    record_text: dict[str, object] = {}
    for key, raw in _PAIR_RE.findall(line[match.start():]):
        if raw.startswith('"'):
            try:
                record_text[key] = json.loads(raw)
            except ValueError:
                record_text[key] = raw
        else:
            record_text[key] = None if raw == "-" else raw
    return record_text


def _number(value: object) -> float | None:
    """A field as a float: JSON gives numbers, key=value text; `-`, null, NaN and words are None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        try:
            number = float(str(value))
        except ValueError:
            return None
    return number if math.isfinite(number) else None


@dataclass
class Series:
    """One GPU's run: every series as (t seconds, value) points; runs after a restart follow on, offset."""

    gpu: str
    target: list[tuple[float, float]] = field(default_factory=list)
    util: list[tuple[float, float]] = field(default_factory=list)
    own: list[tuple[float, float]] = field(default_factory=list)
    foreign: list[tuple[float, float]] = field(default_factory=list)
    power_w: list[tuple[float, float]] = field(default_factory=list)
    # (state, begin t, end t) for every span in SPAN_STATES
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    restarts_t: list[float] = field(default_factory=list)  # where a later run's start line continues the plot
    end_t: float = 0.0
    _offset_s: float = 0.0
    _last_t: float = -math.inf
    _state: str | None = None
    _state_since_t: float = 0.0

    def add(self, record: dict[str, object]) -> None:
        t = _number(record.get("t"))
        if t is None:
            return
        event = record.get("event")
        if event == "start" and self._last_t > -math.inf:
            # A restarted filler (docker logs keeps every run): its t begins at 0 again; draw it after the last.
            self._close_state(self._last_t)
            self._offset_s = self._last_t
            self.restarts_t.append(self._offset_s)
        t += self._offset_s
        t = max(t, self._last_t)  # lines of one run are in order; a clock step back is not drawn as a loop
        self._last_t = self.end_t = t
        state = record.get("state")
        if isinstance(state, str) and state != self._state:
            self._close_state(t)
            self._state, self._state_since_t = state, t
        target = _number(record.get("target"))
        if target is not None:
            self.target.append((t, target))
        if event == "status":
            for name in ("util", "own", "foreign"):
                value = _number(record.get(name))
                if value is not None:
                    getattr(self, name).append((t, value))
        power = _number(record.get("power_w"))
        if power is not None:
            self.power_w.append((t, power))

    def finish(self) -> None:
        self._close_state(self.end_t)
        self._state = None

    def _close_state(self, t: float) -> None:
        if self._state in SPAN_STATES and t > self._state_since_t:
            self.spans.append((self._state, self._state_since_t, t))
        self._state_since_t = t


@dataclass
class Run:
    """A log read: one Series per GPU, in the order they first appear, and how many lines were not the filler's."""

    gpus: dict[str, Series]
    lines: int
    skipped: int


def read_log(lines: Iterable[str]) -> Run:
    gpus: dict[str, Series] = {}
    count = skipped = 0
    for line in lines:
        if not line.strip():
            continue
        count += 1
        record = parse_line(line)
        if record is None:
            skipped += 1
            continue
        gpu = str(record.get("gpu", "-"))
        series = gpus.get(gpu)
        if series is None:
            series = gpus[gpu] = Series(gpu)
        series.add(record)
    for series in gpus.values():
        series.finish()
    return Run(gpus, count, skipped)
