"""FORGE_ACTIVE_HOURS: the hours the filler may run, in the local wall-clock time of its host or container.

Pure: the moment is passed in as a local datetime (from_unix turns a Unix time into one, in the zone given or,
with none, in the C library's local time, which honours TZ). A schedule is a list of entries separated by
commas: `DAYS`, `DAYS HH:MM-HH:MM ...` or `HH:MM-HH:MM ...` (every day). DAYS is a day (`Mon`) or a range of
days (`Mon-Fri`, `Fri-Mon` wraps); a time range whose end is not after its start runs over midnight into the
next day and belongs to the day it starts on (`Fri 20:00-08:00` ends Saturday 08:00); `24:00` ends a day.
Times are wall-clock times: on the night clocks go forward, an hour that does not exist is never active; on
the night they go back, an hour that occurs twice is active both times.
"""

from __future__ import annotations

import io
import os
import re
import stat
from dataclasses import dataclass
from datetime import datetime, timezone, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

DAY_NAMES = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")  # datetime.weekday() order
MINUTES_PER_DAY = 24 * 60
_TIME_RANGE_RE = re.compile(r"([0-9]{1,2}):([0-9]{2})-([0-9]{1,2}):([0-9]{2})", re.ASCII)
_DAYS_RE = re.compile(r"([A-Za-z]{3})(?:-([A-Za-z]{3}))?", re.ASCII)
MAX_ENTRIES = 64
MAX_ZONE_FILE_BYTES = 1 << 20
# A POSIX TZ rule (std offset [dst [offset] [,start,end]]), which the C library reads without any zone file.
_ABBREVIATION = r"(?:[A-Za-z]{3,}|<[A-Za-z0-9+-]{3,}>)"
_OFFSET = r"[+-]?[0-9]{1,2}(?::[0-9]{2}){0,2}"
_POSIX_TZ_RE = re.compile(rf"{_ABBREVIATION}{_OFFSET}(?:{_ABBREVIATION}(?:{_OFFSET})?(?:,[^,\s]+,[^,\s]+)?)?", re.ASCII)

ACCEPTED = ("days and times such as 'Mon-Fri 20:00-08:00, Sat-Sun': comma-separated entries of days (Mon..Sun, "
            "or a range Mon-Fri) and/or HH:MM-HH:MM ranges (over midnight allowed, 24:00 ends a day), in local "
            "time (TZ)")


class ScheduleError(ValueError):
    """What is wrong with a schedule's text, for the config's one-line message."""


@dataclass(frozen=True)
class Span:
    days: frozenset[int]  # the weekdays (Monday 0) the span starts on
    start_min: int  # minutes after midnight, 0..1439
    end_min: int  # 1..1440; not after start_min: the span ends on the next day

    def covers(self, weekday: int, minute: float) -> bool:
        if self.start_min < self.end_min:
            return weekday in self.days and self.start_min <= minute < self.end_min
        return ((weekday in self.days and minute >= self.start_min)
                or ((weekday - 1) % 7 in self.days and minute < self.end_min))


@dataclass(frozen=True)
class ActiveHours:
    spans: tuple[Span, ...]
    text: str  # as given, spaces tidied: what the log and the pause reasons quote

    def active(self, local: datetime) -> bool:
        """Whether the filler may run at this local wall-clock time."""
        minute = local.hour * 60 + local.minute + local.second / 60 + local.microsecond / 60e6
        return any(span.covers(local.weekday(), minute) for span in self.spans)


def parse_active_hours(text: str) -> ActiveHours:
    """The schedule `text` describes; ScheduleError saying what is wrong."""
    entries = [entry.strip() for entry in text.split(",")]
    if len(entries) > MAX_ENTRIES:
        raise ScheduleError(f"{len(entries)} entries, at most {MAX_ENTRIES}")
    spans: list[Span] = []
    for entry in entries:
        if not entry:
            raise ScheduleError("an empty entry")
        tokens = entry.split()
        days = frozenset(range(7))
        if not _TIME_RANGE_RE.fullmatch(tokens[0]):
            days = _days(tokens[0])
            tokens = tokens[1:]
        if not tokens:
            spans.append(Span(days, 0, MINUTES_PER_DAY))
        for token in tokens:
            spans.append(Span(days, *_time_range(token)))
    return ActiveHours(tuple(spans), ", ".join(" ".join(entry.split()) for entry in entries))


def _quoted(token: str) -> str:
    """A piece of the schedule for a message: repr, cut short."""
    return repr(token) if len(token) <= 24 else repr(token[:20]) + "..."


def _days(token: str) -> frozenset[int]:
    match = _DAYS_RE.fullmatch(token)
    if match is None:
        raise ScheduleError(f"{_quoted(token)} is neither days (Mon, Mon-Fri) nor a time range (HH:MM-HH:MM)")
    first, last = (_day(name) for name in (match[1], match[2] or match[1]))
    return frozenset((first + i) % 7 for i in range((last - first) % 7 + 1))


def _day(name: str) -> int:
    try:
        return DAY_NAMES.index(name.lower())
    except ValueError:
        raise ScheduleError(f"{_quoted(name)} is not a day (Mon, Tue, Wed, Thu, Fri, Sat, Sun)") from None


def _time_range(token: str) -> tuple[int, int]:
    match = _TIME_RANGE_RE.fullmatch(token)
    if match is None:
        raise ScheduleError(f"{_quoted(token)} is not a time range HH:MM-HH:MM (days come first in an entry)")
    start_h, start_m, end_h, end_m = (int(g) for g in match.groups())
    if start_h > 23 or start_m > 59:
        raise ScheduleError(f"{_quoted(token)} starts at no time of day (00:00 to 23:59)")
    if end_m > 59 or end_h > 24 or (end_h == 24 and end_m):
        raise ScheduleError(f"{_quoted(token)} ends at no time of day (00:00 to 24:00)")
    start, end = start_h * 60 + start_m, end_h * 60 + end_m
    if start == end:
        raise ScheduleError(f"{_quoted(token)} is empty or ambiguous: for a whole day write 00:00-24:00, or the "
                            "day alone")
    return start, end


def from_unix(t_s: float, tz: tzinfo | None = None) -> datetime:
    """The local wall-clock time of a Unix time: in `tz`, or with None in the C library's local time (TZ)."""
    return datetime.fromtimestamp(t_s, tz) if tz is not None else datetime.fromtimestamp(t_s)


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def to_unix(local: datetime, tz: tzinfo | None = None) -> float:
    """A datetime's Unix time; one without a zone is read as local time (`tz`, or the C library's). Any datetime
    has one: at the ends of the calendar (the years 1 and 9999), where the C library cannot say its offset, a
    naive time is read as UTC, within a day of the truth."""
    if local.tzinfo is None and tz is not None:
        local = local.replace(tzinfo=tz)
    if local.tzinfo is None:
        try:
            return local.timestamp()
        except (OverflowError, ValueError, OSError):
            local = local.replace(tzinfo=timezone.utc)
    return (local - _EPOCH).total_seconds()  # what timestamp() does, without a datetime beyond the calendar


def local_zone(tz_value: str | None) -> tzinfo | None:
    """The zone the TZ variable names, for the active hours and the pause file's times: a ZoneInfo for a zone
    name (the system's zone files, or the tzdata package); None when TZ is unset, empty or a POSIX rule, for the
    C library's local time. A name no zone file knows is a ScheduleError: the C library would quietly read it as
    UTC, and the filler would run in the wrong hours."""
    if tz_value is None:
        return None
    name = tz_value[1:] if tz_value.startswith(":") else tz_value
    if not name or _POSIX_TZ_RE.fullmatch(name):
        return None
    try:
        if os.path.isabs(name):
            return ZoneInfo.from_file(io.BytesIO(_zone_file(name)), key=name)
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ScheduleError(f"{_quoted(name)} is no time zone this system knows") from None


def _zone_file(path: str) -> bytes:
    """A zone file's bytes, read without waiting on a FIFO or a device and at most MAX_ZONE_FILE_BYTES of it
    (the largest zone files are a few KiB); ValueError for anything else."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        data = os.read(fd, MAX_ZONE_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_ZONE_FILE_BYTES:
        raise ValueError("too large for a zone file")
    return data
