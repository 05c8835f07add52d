"""One line of a filler's log as its fields, for plot/logs.py: JSON or key=value, behind whatever a log collector
put before it. Pure: no matplotlib, no GPU library.

A line is found by its own start (`{"t":` for JSON, `t=... event=` for key=value, other fields allowed between the
two), so `docker logs -t`'s timestamp, `docker compose logs`' `name  | `, `kubectl logs --prefix`'s `[pod/...]` and
journald's `host forge-load[pid]: ` are skipped. Anything else is not the filler's.

A log is a million lines shaped alike (the status lines of a filler carry the same fields in the same order), so
LineReader learns each shape it has read in full: a regular expression of exactly those fields, anchored at both
ends, that captures only the fields the plot reads. A line of a known shape is matched in one call, in C; any other
line is read in full (json.loads, or every key=value pair), and teaches its shape. Both ways read a line the same.
"""

from __future__ import annotations

import json
import re
from typing import Any

# A key=value line: `t=` at the start of the line or after a space, `|`, `]` or `:`, then the event (other fields,
# such as a time a person reads, may stand between them).
_TEXT_START_RE = re.compile(r'(?:^|(?<=[\s|\]:]))t=[^\s="]+(?: [A-Za-z_][A-Za-z0-9_]*=(?:"(?:[^"\\]|\\.)*"|[^\s"]*))*?'
                            r" event=")
_PAIR_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)=("(?:[^"\\]|\\.)*"|\S*)')
_JSON_START = '{"t":'
_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# A value as the line that taught the shape had it: quoted (a string, for JSON one without escapes) or bare (as
# _PAIR_RE reads one, short of a `"` inside it; for JSON a number, null, true or false). Possessive: no way back.
_TEXT_QUOTED, _TEXT_BARE = r'"(?:[^"\\]|\\.)*+"', r'[^\s"]*+'
_JSON_QUOTED, _JSON_BARE = r'"[^"\\]*+"', r"[-+.\w]*+"
_END = r"[ \t]*\r?(?:\n|\Z)"
MAX_SHAPES = 32  # a log of the filler's has a dozen; a hostile one teaches no more than this


def parse_line(line: str) -> dict[str, object] | None:
    """One log line as its fields (key=value values as text, "-" as None), or None when it is not the filler's."""
    fields = _read(line)
    if fields is None or line.find(_JSON_START) >= 0:
        return fields
    return {key: None if raw == "-" else text(raw) for key, raw in fields.items()}


def text(value: object) -> object:
    """A key=value field's text: a quoted value decoded (as JSON, which the log writer escapes as); others as read."""
    if isinstance(value, str) and value.startswith('"'):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _text_start(line: str) -> int:
    """Where a key=value line of the filler's begins in `line`, or -1."""
    match = _TEXT_START_RE.search(line)
    return match.start() if match is not None else -1


def _read(line: str) -> dict[str, object] | None:
    """Every field of a line: JSON's values as json.loads gives them, key=value's as written (a quoted value with
    its quotes, `-` as is); None when the line is not the filler's."""
    at = line.find(_JSON_START)
    if at >= 0:
        try:
            record = json.loads(line[at:])
        except (ValueError, RecursionError):  # RecursionError: nested deeper than any line of ours
            return None
        return record if isinstance(record, dict) and "event" in record else None
    start = _text_start(line)
    return dict(_PAIR_RE.findall(line, start)) if start >= 0 else None


class Shape:
    """The fields of one shape of line, in order: its expression (which ends with the line, its newline included),
    the names of the groups it captures, and where each is. `plan` is the caller's, for its own use of the shape.
    A JSON shape's groups are as written: a string in its quotes."""

    def __init__(self, fields: dict[str, object], wanted: frozenset[str], is_json: bool) -> None:
        keys = list(fields)
        parts = []
        for key, value in fields.items():
            quoted = isinstance(value, str) and (is_json or value.startswith('"'))
            pattern = (_JSON_QUOTED if quoted else _JSON_BARE) if is_json else (_TEXT_QUOTED if quoted else _TEXT_BARE)
            parts.append((f'"{key}":' if is_json else f"{key}=") + (f"({pattern})" if key in wanted else pattern))
        body = ",".join(parts) if is_json else " ".join(parts)
        self.pattern = re.compile(r"\{" + body + r"\}" + _END if is_json else body + _END)
        self.names = [key for key in keys if key in wanted]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.is_json = is_json
        self.plan: object = None


class LineReader:
    """Reads lines into the fields the caller wants (`wanted`): values as key=value writes them (text, a quoted
    value with its quotes), or for JSON as text too (a string without its quotes, null as None) where the line
    has a known shape, else as json.loads gives them. None for a line that is not the filler's."""

    def __init__(self, wanted: frozenset[str]) -> None:
        self.wanted = wanted
        self._shapes: list[Shape] = []  # the last one matched first
        self._learned = 0
        self.matched: tuple[Shape, tuple[str, ...]] | None = None  # the last line's shape and groups, if known

    @property
    def shape(self) -> Shape | None:
        """The shape matched last: the likeliest for the next line."""
        return self._shapes[0] if self._shapes else None

    def fields(self, line: str) -> dict[str, Any] | None:
        self.matched = None
        at = line.find(_JSON_START)
        is_json = at >= 0
        start = at if is_json else 0 if line.startswith("t=") else _text_start(line)  # a shape checks the rest
        if start < 0:
            return None
        for index, shape in enumerate(self._shapes):
            if shape.is_json != is_json:
                continue
            match = shape.pattern.match(line, start)
            if match is not None:
                if index:
                    self._shapes.insert(0, self._shapes.pop(index))
                groups = match.groups()
                self.matched = shape, groups
                if is_json:
                    return {name: None if raw == "null" else raw[1:-1] if raw[:1] == '"' else raw
                            for name, raw in zip(shape.names, groups)}
                return dict(zip(shape.names, groups))
        fields = _read(line)
        if fields is not None:
            self._learn(line, start, fields, is_json)
        return fields

    def _learn(self, line: str, start: int, fields: dict[str, object], is_json: bool) -> None:
        if self._learned >= MAX_SHAPES or not all(_KEY_RE.match(key) for key in fields):
            return
        self._learned += 1
        shape = Shape(fields, self.wanted, is_json)
        if shape.pattern.match(line, start) is not None:  # it reads this line as it was read: worth keeping
            self._shapes.insert(0, shape)
