"""Reasons to pause: SIGUSR1 (until SIGUSR2), the pause file (FORGE_PAUSE_FILE), and the hours outside
FORGE_ACTIVE_HOURS. The filler is paused while any one of them holds; SIGUSR2 lifts only the signal's pause.

The clock and the time zone are passed in; the filler asks check() on every Monitor reading and whenever the
switch changes. The pause file is read without following it into a FIFO or a device (a non-regular file counts
as there, with no end time), and at most PAUSE_FILE_MAX_BYTES of it.

What the file holds decides when the pause ends: nothing (or only spaces) means until the file is removed; a
time means until then (ISO 8601, such as 2026-11-20T08:00:00+01:00, where one without an offset is local time,
or a Unix time in seconds), and a file whose time has passed pauses nothing, however long ago (the year 1, the
year 0). A time after the year 9999, which Python's datetime cannot hold (a Unix time in milliseconds by
mistake, `date -d @999999999999 -Iseconds`), pauses until the file is removed, and its pause line quotes it.
Anything else is a mistake the filler cannot read as an end: it stays paused until the file is removed, the safe
side for the real work that the file was written for, and its pause line says why. No content raises.

A host short of descriptors or memory (EMFILE, ENFILE, ENOMEM) says nothing about the file, so it is not read as
"pause": whether the file is there is asked without a descriptor (stat), a file that is gone pauses nothing, the
same file unchanged since its last reading means what it meant then, and only a new or changed one that cannot
be read pauses, until it can be. The host's error is said once (on_host_error).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, tzinfo

from forge_load.steering.listeners import Listeners
from forge_load.steering.schedule import ActiveHours, from_unix, to_unix

PAUSE_FILE_MAX_BYTES = 256
_UNIX_TIME_RE = re.compile(r"[0-9]+(?:\.[0-9]*)?", re.ASCII)
# An ISO 8601 date whose year datetime cannot hold: 0000, a sign, or more than four digits (GNU date's way).
_YEAR_RE = re.compile(r"([+-]?)([0-9]+)(-.*)", re.ASCII | re.DOTALL)
_DAYS_PER_400_YEARS = 146097  # the Gregorian calendar repeats every 400 years, leap days included
SIGNAL_SOURCE, FILE_SOURCE, HOURS_SOURCE = "signal", "file", "hours"
# The host's errors, which say nothing about the file: out of descriptors or kernel memory.
HOST_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


class PauseSwitch:
    """The signals' pause: SIGUSR1 sets it, SIGUSR2 clears it. Thread-safe; `generation` moves on every change,
    and listeners (the run loops' wake-ups) are told."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: str | None = None
        self.generation = 0
        self.listeners = Listeners()  # told after every change

    def set(self, paused: bool, signal_name: str) -> None:
        with self._lock:
            self._by = signal_name if paused else None
            self.generation += 1
        self.listeners.tell()

    @property
    def by(self) -> str | None:
        """The signal that paused, while paused."""
        with self._lock:
            return self._by


@dataclass(frozen=True)
class FileState:
    exists: bool | None  # None: the host could not even say (see host_error)
    text: str | None = None  # the content, when it could be read
    problem: str | None = None  # why it could not
    host_error: str | None = None  # the host's error (out of descriptors or memory) that kept it from being read
    version: tuple[int, ...] | None = None  # device, inode, size, change time: the same file, unchanged


def _version(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def read_pause_file(path: str) -> FileState:
    """Whether the file is there and what it holds; never blocks, never raises. Out of descriptors or memory,
    whether it is there is asked without opening it (host_error says why it was not read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return FileState(False)
    except OSError as error:
        if error.errno in HOST_ERRNOS:
            return _state_without_opening(path, error.strerror or str(error))
        return FileState(True, problem=f"cannot be read ({error.strerror or error})")  # there: paused, to be safe
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return FileState(True, problem="is not a regular file")
        data = os.read(fd, PAUSE_FILE_MAX_BYTES + 1)
    except OSError as error:
        if error.errno in HOST_ERRNOS:
            return _state_without_opening(path, error.strerror or str(error))
        return FileState(True, problem=f"cannot be read ({error.strerror or error})")
    finally:
        os.close(fd)
    if len(data) > PAUSE_FILE_MAX_BYTES:
        return FileState(True, problem=f"holds more than {PAUSE_FILE_MAX_BYTES} bytes", version=_version(st))
    try:
        return FileState(True, text=data.decode("utf-8"), version=_version(st))
    except UnicodeDecodeError:
        return FileState(True, problem="is not UTF-8 text", version=_version(st))


def _state_without_opening(path: str, why: str) -> FileState:
    """stat() takes no descriptor: whether the file is there (and which version of it), without its content."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return FileState(False, host_error=why)
    except OSError:
        return FileState(None, host_error=why)
    return FileState(True, host_error=why, version=_version(st))


def parse_until(text: str, tz: tzinfo | None = None) -> float | None:
    """The Unix time a pause file's content names; None for no time at all; ValueError for anything else."""
    stripped = text.strip()
    if not stripped:
        return None
    if _UNIX_TIME_RE.fullmatch(stripped):
        return float(stripped)  # 256 bytes of digits stay finite
    iso = stripped[:-1] + "+00:00" if stripped[-1:] in ("Z", "z") else stripped
    shift_s = 0.0
    match = _YEAR_RE.fullmatch(iso)
    if match is not None and (match[1] or len(match[2]) > 4 or int(match[2]) == 0):
        # Read as the year in the same place of the 400-year cycle (the same leap days), then moved by the cycles.
        year = int(match[1] + match[2])
        stand_in = 2000 + year % 400
        iso = f"{stand_in}{match[3]}"
        cycles = (year - stand_in) // 400
        shift_s = cycles * _DAYS_PER_400_YEARS * 86400.0 if abs(cycles) < 10**290 else cycles * float("inf")
    try:
        when = datetime.fromisoformat(iso)
    except ValueError:
        raise ValueError("neither an ISO 8601 time nor a Unix time") from None
    return to_unix(when, tz) + shift_s


def shown_time(t_s: float, tz: tzinfo | None = None) -> str | None:
    """A Unix time as local ISO 8601 with its offset, to the second; None beyond what datetime holds (the years 1
    to 9999 in that zone)."""
    try:
        local = from_unix(t_s, tz)
        return (local if local.tzinfo is not None else local.astimezone()).isoformat(timespec="seconds")
    except (OverflowError, ValueError, OSError):
        return None


@dataclass(frozen=True)
class PauseVerdict:
    reason: str | None  # every reason to be paused now, joined; None when there is none
    ended: str  # what stopped holding since the previous check, for the unpause line


class Pauses:
    """Every reason to be paused, asked together."""

    def __init__(self, switch: PauseSwitch | None = None, pause_file: str | None = None,
                 active_hours: ActiveHours | None = None, wall_clock: Callable[[], float] | None = None,
                 tz: tzinfo | None = None, read: Callable[[str], FileState] = read_pause_file,
                 on_host_error: Callable[[str], None] | None = None) -> None:
        """`on_host_error` hears, once until the file can be read again, that the host kept it from being read."""
        self.switch = switch
        self.pause_file = pause_file
        self.active_hours = active_hours
        self.wall_clock = wall_clock or time.time
        self.tz = tz
        self.read = read
        self.on_host_error = on_host_error
        self._held: dict[str, str] = {}  # source -> its reason, at the previous check
        self._file_ended = "pause file removed"
        self._last_read: FileState | None = None  # the last reading with the file's content, or its absence
        self._host_error_said = False

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
        try:
            return self._judge_file(now_s)
        except Exception as error:  # noqa: BLE001 - a bug must not stop every filler of the node: paused, and said
            return (f"pause file {self.pause_file} could not be judged ({type(error).__name__}: {error}, please "
                    "report): paused until it is removed")

    def _judge_file(self, now_s: float) -> str | None:
        path = self.pause_file
        state = self._with_host_errors_judged(self.read(path or ""))
        if state is None:  # nothing new could be learnt: the last verdict stands
            return self._held.get(FILE_SOURCE)
        if not state.exists:
            self._file_ended = "pause file removed"
            return None
        if state.text is None and state.host_error is not None:
            return (f"pause file {path} is there but cannot be read now ({state.host_error}): paused until it can "
                    "be read")
        if state.text is None:
            return f"pause file {path} {state.problem}: paused until it is removed"
        content = state.text.strip()
        content = content if len(content) <= 40 else content[:40] + "..."
        try:
            until_s = parse_until(state.text, self.tz)
        except ValueError as error:
            return f"pause file {path} holds {content!r}, {error}: paused until it is removed"
        if until_s is None:
            return f"pause file {path}: paused until it is removed"
        shown = shown_time(until_s, self.tz)
        if until_s <= now_s:
            self._file_ended = f"pause file's time {shown or content} reached"
            return None
        if shown is None:
            return f"pause file {path} holds {content!r}, a time after the year 9999: paused until it is removed"
        return f"pause file {path}: paused until {shown}"

    def _with_host_errors_judged(self, state: FileState) -> FileState | None:
        """A host error (out of descriptors or memory) says nothing about the file: the same file, unchanged,
        means what it meant at its last reading; a file gone pauses nothing; a new or changed one that cannot be
        read pauses until it can be; None when not even its presence is known (the last verdict stands)."""
        if state.host_error is None:
            self._last_read = state
            self._host_error_said = False
            return state
        if not self._host_error_said:
            self._host_error_said = True
            if self.on_host_error is not None:
                self.on_host_error(f"pause file {self.pause_file} cannot be read now ({state.host_error}): the "
                                   "host is short of descriptors or memory; judged by what it held when last read")
        if state.exists is None:
            return None
        if not state.exists:
            return state
        last = self._last_read
        if last is not None and last.exists and last.version == state.version:
            return last
        return state  # there, unread: paused until it can be read
