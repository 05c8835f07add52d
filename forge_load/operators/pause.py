"""Reasons to pause: SIGUSR1 (until SIGUSR2), the pause file (FORGE_PAUSE_FILE), and the hours outside
FORGE_ACTIVE_HOURS. The filler is paused while any one of them holds; SIGUSR2 lifts only the signal's pause.

The clock and the time zone are passed in; the filler asks check() on every Monitor reading and whenever the
switch changes. The pause file is read without following it into a FIFO or a device (a non-regular file counts
as there, with no end time), and at most PAUSE_FILE_MAX_BYTES of it.

What the file holds decides when the pause ends: nothing (or only spaces) means until the file is removed; a
time means until then (ISO 8601, such as 2026-11-20T08:00:00+01:00, where one without an offset is local time,
or a Unix time in seconds), and a file whose time has passed pauses nothing. Anything else is a mistake the
filler cannot read as an end: it stays paused until the file is removed, the safe side for the real work that
the file was written for, and its pause line says why.
"""

from __future__ import annotations

import math
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, tzinfo

from forge_load.operators.schedule import ActiveHours, from_unix, to_unix

PAUSE_FILE_MAX_BYTES = 256
_UNIX_TIME_RE = re.compile(r"[0-9]{1,12}(?:\.[0-9]*)?", re.ASCII)
SIGNAL_SOURCE, FILE_SOURCE, HOURS_SOURCE = "signal", "file", "hours"


class PauseSwitch:
    """The signals' pause: SIGUSR1 sets it, SIGUSR2 clears it. Thread-safe; `generation` moves on every change,
    and listeners (the run loops' wake-ups) are told."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: str | None = None
        self.generation = 0
        self._listeners: list[Callable[[], None]] = []

    def set(self, paused: bool, signal_name: str) -> None:
        with self._lock:
            self._by = signal_name if paused else None
            self.generation += 1
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def add_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    @property
    def by(self) -> str | None:
        """The signal that paused, while paused."""
        with self._lock:
            return self._by


@dataclass(frozen=True)
class FileState:
    exists: bool
    text: str | None = None  # the content, when it could be read
    problem: str | None = None  # why it could not


def read_pause_file(path: str) -> FileState:
    """Whether the file is there and what it holds; never blocks, never raises."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return FileState(False)
    except OSError as error:  # there (or its directory cannot be searched): paused, to be safe
        return FileState(True, problem=f"cannot be read ({error.strerror or error})")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return FileState(True, problem="is not a regular file")
        data = os.read(fd, PAUSE_FILE_MAX_BYTES + 1)
    except OSError as error:
        return FileState(True, problem=f"cannot be read ({error.strerror or error})")
    finally:
        os.close(fd)
    if len(data) > PAUSE_FILE_MAX_BYTES:
        return FileState(True, problem=f"holds more than {PAUSE_FILE_MAX_BYTES} bytes")
    try:
        return FileState(True, text=data.decode("utf-8"))
    except UnicodeDecodeError:
        return FileState(True, problem="is not UTF-8 text")


def parse_until(text: str, tz: tzinfo | None = None) -> float | None:
    """The Unix time a pause file's content names; None for no time at all; ValueError for anything else."""
    stripped = text.strip()
    if not stripped:
        return None
    if _UNIX_TIME_RE.fullmatch(stripped):
        return float(stripped)
    iso = stripped[:-1] + "+00:00" if stripped[-1:] in ("Z", "z") else stripped
    try:
        when = datetime.fromisoformat(iso)
    except ValueError:
        raise ValueError("neither an ISO 8601 time nor a Unix time") from None
    until_s = to_unix(when, tz)
    if not math.isfinite(until_s):
        raise ValueError("not a time")
    return until_s


def shown_time(t_s: float, tz: tzinfo | None = None) -> str:
    """A Unix time as local ISO 8601 with its offset, to the second."""
    local = from_unix(t_s, tz)
    return (local if local.tzinfo is not None else local.astimezone()).isoformat(timespec="seconds")


@dataclass(frozen=True)
class PauseVerdict:
    reason: str | None  # every reason to be paused now, joined; None when there is none
    ended: str  # what stopped holding since the previous check, for the unpause line


class Pauses:
    """Every reason to be paused, asked together."""

    def __init__(self, switch: PauseSwitch | None = None, pause_file: str | None = None,
                 active_hours: ActiveHours | None = None, wall_clock: Callable[[], float] | None = None,
                 tz: tzinfo | None = None, read: Callable[[str], FileState] = read_pause_file) -> None:
        self.switch = switch
        self.pause_file = pause_file
        self.active_hours = active_hours
        self.wall_clock = wall_clock or time.time
        self.tz = tz
        self.read = read
        self._held: dict[str, str] = {}  # source -> its reason, at the previous check
        self._file_ended = "pause file removed"

    @property
    def generation(self) -> int:
        """Moves whenever a signal changed the switch: check() then, not only on the next reading."""
        return self.switch.generation if self.switch is not None else 0

    def check(self) -> PauseVerdict:
        now_s = self.wall_clock()
        held: dict[str, str] = {}
        ends: dict[str, str] = {}
        if self.switch is not None:
            by = self.switch.by
            if by is not None:
                held[SIGNAL_SOURCE] = f"{by} (SIGUSR2 resumes)"
            ends[SIGNAL_SOURCE] = "SIGUSR2"
        if self.pause_file is not None:
            file_reason = self._file_reason(now_s)
            if file_reason is not None:
                held[FILE_SOURCE] = file_reason
            ends[FILE_SOURCE] = self._file_ended
        if self.active_hours is not None:
            text = self.active_hours.text
            if not self.active_hours.active(from_unix(now_s, self.tz)):
                held[HOURS_SOURCE] = f"outside FORGE_ACTIVE_HOURS ({text})"
            ends[HOURS_SOURCE] = f"inside FORGE_ACTIVE_HOURS ({text})"
        ended = [ends[source] for source in self._held if source not in held]
        self._held = held
        return PauseVerdict("; ".join(held.values()) or None, "; ".join(ended))

    def _file_reason(self, now_s: float) -> str | None:
        path = self.pause_file
        state = self.read(path or "")
        if not state.exists:
            self._file_ended = "pause file removed"
            return None
        if state.text is None:
            return f"pause file {path} {state.problem}: paused until it is removed"
        try:
            until_s = parse_until(state.text, self.tz)
        except ValueError as error:
            content = state.text.strip()
            content = content if len(content) <= 40 else content[:40] + "..."
            return f"pause file {path} holds {content!r}, {error}: paused until it is removed"
        if until_s is None:
            return f"pause file {path}: paused until it is removed"
        if until_s <= now_s:
            self._file_ended = f"pause file's time {shown_time(until_s, self.tz)} reached"
            return None
        return f"pause file {path}: paused until {shown_time(until_s, self.tz)}"
