"""Event log for `docker logs`: one line per event on stdout, as text (logfmt) or JSON with the same fields."""

from __future__ import annotations

import json
import math
import sys
from typing import Callable, TextIO

# The fields every status-like line carries, in this order; anything else follows.
CORE_FIELDS = ("t", "event", "state", "target", "util", "own", "foreign", "multiplier", "gpu_mem_mib", "reason")


class EventLog:
    def __init__(self, fmt: str = "text", stream: TextIO | None = None,
                 clock: Callable[[], float] | None = None, start_s: float = 0.0,
                 static: dict[str, object] | None = None) -> None:
        self.fmt = fmt
        self.stream = stream if stream is not None else sys.stdout
        self.clock = clock
        self.start_s = start_s
        self.static = dict(static or {})

    def emit(self, event: str, **fields: object) -> dict[str, object]:
        t_s = fields.pop("t", None)
        if t_s is None and self.clock is not None:
            t_s = self.clock() - self.start_s
        record: dict[str, object] = {"t": round(float(t_s), 3) if t_s is not None else None, "event": event}
        record.update(self.static)
        record.update(fields)
        ordered = {k: record[k] for k in CORE_FIELDS if k in record}
        ordered.update({k: v for k, v in record.items() if k not in ordered})
        self.stream.write(self.format(ordered) + "\n")
        self.stream.flush()
        return ordered

    def format(self, record: dict[str, object]) -> str:
        if self.fmt == "json":
            return json.dumps({k: _json_value(v) for k, v in record.items()}, separators=(",", ":"))
        return " ".join(f"{k}={_text_value(v, 2 if k == 't' else 3)}" for k, v in record.items())


def _json_value(value: object) -> object:
    if isinstance(value, float):
        return None if not math.isfinite(value) else round(value, 6)
    return value


def _text_value(value: object, decimals: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.{decimals}f}" if abs(value) < 10 or decimals == 2 else f"{value:.1f}"
    text = str(value)
    if not text or any(c.isspace() or c in '"=' for c in text):
        return json.dumps(text)
    return text
