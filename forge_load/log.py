"""Event log for `docker logs`: one line per event on stdout, as text (logfmt) or JSON with the same fields.

No value can forge a line: control characters (C0, DEL, C1, line and paragraph separators, bidi and other
format characters) never reach the output raw. Text values holding anything but plain printable ASCII are
quoted and escaped JSON-style (\\u001b); JSON lines escape everything beyond ASCII.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import TextIO

# The fields every status-like line carries, in this order; anything else follows. `time` is key=value lines' (a
# person's), `ts` JSON lines' (a machine's); `t` and `event` stay first in both (forge-load plot finds a line by them).
CORE_FIELDS = ("t", "ts", "event", "time", "gpu", "state", "target", "util", "own", "foreign", "multiplier",
               "gpu_mem_mib", "reason")
# Last on every line, after whatever a line adds: the GPU's UUID, the longest value, which a person reads least.
LAST_FIELDS = ("uuid",)
# In JSON lines only: what a machine counts and a person reading the log does not (key=value lines stay short).
JSON_ONLY_FIELDS = ("samples",)


def local_time(unix_s: float, with_date: bool) -> str:
    """`unix_s` as the local wall-clock time, as `date +%T` shows it (10:42:07), or, `with_date`, with its date and
    UTC offset (2026-11-28T10:42:07+01:00): a key=value line's `time`."""
    stamp = time.localtime(math.floor(unix_s))
    if not with_date:
        return time.strftime("%H:%M:%S", stamp)
    offset = time.strftime("%z", stamp)  # +0100
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S', stamp)}{offset[:3]}:{offset[3:]}"


def rfc3339_utc(unix_s: float) -> str:
    """`unix_s` as RFC 3339 in UTC with milliseconds: 2026-11-27T03:41:07.123Z (truncated, never rounded up into
    the next second)."""
    whole_s = math.floor(unix_s)
    stamp = datetime.fromtimestamp(whole_s, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{stamp}.{min(int((unix_s - whole_s) * 1000), 999):03d}Z"


class EventLog:
    """`clock` gives `t` (seconds since `start_s` on the loop's clock, virtual on the simulated GPU); `wall_clock`
    gives JSON lines' `ts`, the Unix time on the same timeline (the wall clock on a real GPU; on the simulated GPU
    the start's wall time plus the virtual seconds, so that `ts - t` is the same on every line)."""

    def __init__(self, fmt: str = "text", stream: TextIO | None = None,
                 clock: Callable[[], float] | None = None, start_s: float = 0.0,
                 static: dict[str, object] | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.fmt = fmt
        self.stream = stream if stream is not None else sys.stdout
        self.clock = clock
        self.wall_clock = wall_clock
        self.start_s = start_s
        self.static = dict(static or {})
        # Added to every `t`: a child process logs on its parent's timeline (exclusive compute mode).
        self.t_offset_s = 0.0
        self._day: tuple[int, int, int] | None = None  # the local date of the last key=value line's `time`

    def emit(self, event: str, **fields: object) -> dict[str, object]:
        t_s = fields.pop("t", None)
        if t_s is None and self.clock is not None:
            t_s = self.clock() - self.start_s
        if isinstance(t_s, (int, float)):
            t_s = float(t_s) + self.t_offset_s
        record: dict[str, object] = {"t": round(t_s, 3) if isinstance(t_s, float) else None}
        wall_s = self.wall_clock()
        if self.fmt == "json":
            # JSON lines are the ones shipped to Loki or Elasticsearch: a machine's time, UTC (docs/operating.md).
            record["ts"] = rfc3339_utc(wall_s)
        else:
            # A person's: the local time of day, and the date on the first line and the first of each new day, so
            # that a bare file places every line without `docker logs -t` or journald (docs/operating.md).
            day = time.localtime(math.floor(wall_s))[:3]
            record["time"] = local_time(wall_s, with_date=day != self._day)
            self._day = day
        record["event"] = event
        record.update(self.static)
        record.update(fields)
        ordered = {k: record[k] for k in CORE_FIELDS if k in record}
        ordered.update({k: v for k, v in record.items() if k not in ordered and k not in LAST_FIELDS})
        ordered.update({k: record[k] for k in LAST_FIELDS if k in record})
        self.stream.write(self.format(ordered) + "\n")
        self.stream.flush()
        return ordered

    def format(self, record: dict[str, object]) -> str:
        if self.fmt == "json":
            # ensure_ascii escapes C0, C1 and every non-ASCII character; DEL is ASCII and is left raw.
            text = json.dumps({k: _json_value(v) for k, v in record.items()}, separators=(",", ":"))
            return text.replace("\x7f", "\\u007f")
        return " ".join(f"{k}={_text_value(v, 2 if k == 't' else 3)}" for k, v in record.items()
                        if k not in JSON_ONLY_FIELDS)


# A text value is written bare only when it is plain printable ASCII with nothing logfmt gives a meaning to.
_BARE_RE = re.compile(r'[!#-<>-\[\]-~]+')


def internal_error(error: BaseException) -> str:
    """The line for a bug caught where it must not escape (a traceback would fill the log): what to report."""
    return f"internal error, please report: {type(error).__name__}: {error}"


def escape_controls(text: str) -> str:
    """`text` with every character that is not printable (controls, line breaks, format and bidi characters,
    unassigned code points) written as \\uXXXX: safe to print as one line on a terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == " " else
                   f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}" for c in text)


def say(text: str) -> None:
    """One line on stderr, escaped (no value can forge a line there either): every command's and the filler's
    messages outside the event log. A closed or broken stderr is no reason to fail: it is pointed at /dev/null."""
    try:
        print(escape_controls(text), file=sys.stderr, flush=True)
    except (OSError, ValueError):
        to_devnull(sys.stderr)


def to_devnull(stream: TextIO) -> None:
    """Point a broken standard stream at /dev/null, so that the interpreter's last flush cannot fail."""
    with contextlib.suppress(Exception):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


class OutputLost(BaseException):
    """A write to stdout failed (`error`): the end of a command, raised by forge_load/cli.py's stdout past whatever
    the command catches (a BaseException, as KeyboardInterrupt is: no `except Exception` or `except OSError` of a
    command's own mistakes it for one of them) to the dispatcher, which says it in one line, or in none for a reader
    that stopped reading."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error)
        self.error = error


class LogStream:
    """stdout for the event log, shared by every GPU thread: one whole line per write, never two interleaved.

    A write that fails (the reader closed the pipe, the disk is full, the terminal hung up) is not raised into
    the run loops: `on_failure` is told once, and every later line is dropped, so the fillers stop the way
    they stop for a signal (their kernels drained), and main() reports it in one line.
    """

    def __init__(self, stream: TextIO, on_failure: Callable[[OSError], None]) -> None:
        self._stream = stream
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self.failure: OSError | None = None

    def write(self, text: str) -> int:
        with self._lock:
            if self.failure is None:
                try:
                    return self._stream.write(text)
                except (OSError, ValueError, OutputLost) as error:  # ValueError: the stream was closed under us
                    self._failed(error)
            return len(text)

    def flush(self) -> None:
        with self._lock:
            if self.failure is None:
                try:
                    self._stream.flush()
                except (OSError, ValueError, OutputLost) as error:
                    self._failed(error)

    def _failed(self, error: OSError | ValueError | OutputLost) -> None:
        if isinstance(error, OutputLost):
            error = error.error
        self.failure = error if isinstance(error, OSError) else OSError(f"stdout is closed ({error})")
        self._on_failure(self.failure)


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
    if _BARE_RE.fullmatch(text):
        return text
    return json.dumps(text).replace("\x7f", "\\u007f")
