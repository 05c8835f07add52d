"""forge_load.steering.pause: the reasons to pause (signal switch, pause file, active hours) on a fake clock."""

from __future__ import annotations

import errno
import os
from datetime import datetime, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from forge_load.steering.pause import (
    PAUSE_FILE_MAX_BYTES,
    FileState,
    Pauses,
    PauseSwitch,
    parse_until,
    read_pause_file,
    shown_time,
)
from forge_load.steering.schedule import parse_active_hours

BERLIN = ZoneInfo("Europe/Berlin")
NOON_UTC = datetime(2026, 11, 18, 12, 0, tzinfo=timezone.utc).timestamp()  # a Wednesday, 13:00 in Berlin


class Clock:
    def __init__(self, t_s: float) -> None:
        self.t_s = t_s

    def __call__(self) -> float:
        return self.t_s


@pytest.mark.parametrize(("text", "expected"), [
    ("", None), ("  \n", None),
    ("1763640000", 1763640000.0), (" 1763640000.5\n", 1763640000.5),
    ("2026-11-18T12:00:00Z", NOON_UTC), ("2026-11-18T12:00:00+00:00", NOON_UTC),
    ("2026-11-18T13:00:00+01:00", NOON_UTC),
    ("2026-11-18T13:00", NOON_UTC),  # no offset: local time, Berlin here
    ("2026-11-18 13:00:00", NOON_UTC),
])
def test_parse_until(text: str, expected: float | None) -> None:
    assert parse_until(text, BERLIN) == expected


@pytest.mark.parametrize("text", ["tomorrow", "-5", "12:00", "2026-13-01T00:00", "1e9", "nan", "0x10",
                                  "2026-11-18T25:00"])
def test_parse_until_refuses_what_is_not_a_time(text: str) -> None:
    with pytest.raises(ValueError):
        parse_until(text, BERLIN)


def test_read_pause_file(tmp_path: Path) -> None:
    path = tmp_path / "pause"
    assert read_pause_file(str(path)) == FileState(False)
    assert read_pause_file(str(tmp_path / "no-dir" / "pause")) == FileState(False)
    path.write_text("")
    assert (read_pause_file(str(path)).exists, read_pause_file(str(path)).text) == (True, "")
    path.write_text("1763640000\n")
    assert (read_pause_file(str(path)).exists, read_pause_file(str(path)).text) == (True, "1763640000\n")
    path.write_bytes(b"x" * (PAUSE_FILE_MAX_BYTES + 1))
    assert read_pause_file(str(path)).problem == f"holds more than {PAUSE_FILE_MAX_BYTES} bytes"
    path.write_bytes(b"\xff\xfe")
    assert read_pause_file(str(path)).problem == "is not UTF-8 text"


def test_a_fifo_or_a_directory_at_the_path_counts_as_there_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert read_pause_file(str(fifo)) == FileState(True, problem="is not a regular file")
    assert read_pause_file(str(tmp_path)) == FileState(True, problem="is not a regular file")


def test_an_unreadable_file_counts_as_there(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    path = tmp_path / "pause"
    path.write_text("")
    path.chmod(0)
    state = read_pause_file(str(path))
    assert state.exists and state.problem and "cannot be read" in state.problem


def test_the_file_pauses_while_it_exists_and_until_its_time(tmp_path: Path) -> None:
    path = tmp_path / "pause"
    clock = Clock(NOON_UTC)
    pauses = Pauses(pause_file=str(path), wall_clock=clock, tz=BERLIN)
    assert pauses.check().reason is None
    path.write_text("")
    assert pauses.check().reason == f"pause file {path}: paused until it is removed"
    path.write_text("2026-11-18T13:30:00+01:00\n")  # half an hour from now
    assert pauses.check().reason == f"pause file {path}: paused until 2026-11-18T13:30:00+01:00"
    clock.t_s += 29 * 60
    assert pauses.check().reason is not None
    clock.t_s += 60
    verdict = pauses.check()
    assert verdict.reason is None and verdict.ended == "pause file's time 2026-11-18T13:30:00+01:00 reached"
    path.write_text(str(int(clock.t_s) + 60))  # a Unix time
    assert pauses.check().reason is not None
    path.unlink()
    verdict = pauses.check()
    assert verdict.reason is None and verdict.ended == "pause file removed"


def test_a_file_that_holds_no_time_pauses_with_no_end_and_says_why(tmp_path: Path) -> None:
    path = tmp_path / "pause"
    path.write_text("until the job is done\n")
    clock = Clock(NOON_UTC)
    pauses = Pauses(pause_file=str(path), wall_clock=clock, tz=BERLIN)
    reason = pauses.check().reason
    assert reason == (f"pause file {path} holds 'until the job is done', neither an ISO 8601 time nor a Unix time: "
                      "paused until it is removed")
    clock.t_s += 10 * 86400
    assert pauses.check().reason == reason  # the same line: the filler logs a reason once, when it changes


def test_the_schedule_pauses_outside_its_hours() -> None:
    clock = Clock(NOON_UTC)  # Wednesday 13:00 in Berlin
    pauses = Pauses(active_hours=parse_active_hours("Mon-Fri 20:00-08:00, Sat-Sun"), wall_clock=clock, tz=BERLIN)
    assert pauses.check().reason == "outside FORGE_ACTIVE_HOURS (Mon-Fri 20:00-08:00, Sat-Sun)"
    clock.t_s += 7 * 3600  # 20:00
    verdict = pauses.check()
    assert verdict.reason is None and verdict.ended == "inside FORGE_ACTIVE_HOURS (Mon-Fri 20:00-08:00, Sat-Sun)"


def test_sigusr2_lifts_only_the_signals_pause(tmp_path: Path) -> None:
    switch = PauseSwitch()
    told: list[int] = []
    switch.listeners.add(lambda: told.append(switch.generation))
    path = tmp_path / "pause"
    pauses = Pauses(switch, pause_file=str(path), wall_clock=Clock(NOON_UTC), tz=BERLIN)
    switch.set(True, "SIGUSR1")
    assert told == [1] and pauses.generation == 1
    assert pauses.check().reason == "SIGUSR1 (SIGUSR2 resumes)"
    path.write_text("")
    assert pauses.check().reason == f"SIGUSR1 (SIGUSR2 resumes); pause file {path}: paused until it is removed"
    switch.set(False, "SIGUSR2")
    verdict = pauses.check()
    assert verdict.reason == f"pause file {path}: paused until it is removed" and verdict.ended == "SIGUSR2"
    path.unlink()
    assert pauses.check().reason is None


# --- times at and beyond the ends of the calendar: never a crash -----------------------------------------------

KIRITIMATI, MINUS_12 = ZoneInfo("Pacific/Kiritimati"), ZoneInfo("Etc/GMT+12")  # UTC+14 and UTC-12
ZONES = [BERLIN, KIRITIMATI, MINUS_12, None]  # None: the C library's local time (TZ)
FAR_PAST = ["0", "0001-01-01T00:00:00+14:00", "0001-01-01T00:00:00", "0001-01-01", "0000-01-01T00:00:00Z",
            "0000-02-29", "-0044-03-15T12:00:00+01:00", "1." + "9" * 200, "0." + "0" * 250]
# Beyond what Python's datetime can hold (the year 9999) in every zone above.
FAR_FUTURE = ["999999999999", "9" * 12 + "." + "9" * 242, "1763640000000", "9" * 255, "10000-01-01",
              "9999-12-31T23:59:59-14:00", "33658-09-27T01:46:39+00:00", "+33658-09-27T01:46:39Z",
              "1" + "0" * 200 + "-01-01T00:00:00Z"]


@pytest.mark.parametrize(("text", "expected"), [
    ("0000-01-01T00:00:00Z", datetime(1, 1, 1, tzinfo=timezone.utc).timestamp() - 366 * 86400),  # 0 is leap
    ("33658-09-27T01:46:39+00:00", 999999999999.0),  # as GNU date writes @999999999999
    ("+33658-09-27T03:46:39+02:00", 999999999999.0),
    ("1763640000000", 1763640000000.0),  # milliseconds by mistake: a time in the year 57857
    ("0001-01-01T00:00:00+14:00", datetime(1, 1, 1, tzinfo=timezone.utc).timestamp() - 14 * 3600),
])
def test_parse_until_beyond_the_calendar(text: str, expected: float) -> None:
    assert parse_until(text, BERLIN) == expected


@pytest.mark.parametrize("tz", ZONES, ids=str)
@pytest.mark.parametrize("text", FAR_PAST)
def test_a_far_past_time_pauses_nothing(tmp_path: Path, text: str, tz: ZoneInfo | None) -> None:
    path = tmp_path / "pause"
    path.write_text(text)
    pauses = Pauses(pause_file=str(path), wall_clock=Clock(NOON_UTC), tz=tz)
    assert pauses.check().reason is None


@pytest.mark.parametrize("tz", ZONES, ids=str)
@pytest.mark.parametrize("text", FAR_FUTURE)
def test_a_time_beyond_the_calendar_pauses_until_removed_and_says_what_was_read(tmp_path: Path, text: str,
                                                                               tz: ZoneInfo | None) -> None:
    path = tmp_path / "pause"
    path.write_text(text + "\n")
    clock = Clock(NOON_UTC)
    pauses = Pauses(pause_file=str(path), wall_clock=clock, tz=tz)
    shown = text if len(text) <= 40 else text[:40] + "..."
    reason = pauses.check().reason
    assert reason == f"pause file {path} holds {shown!r}, a time after the year 9999: paused until it is removed"
    clock.t_s += 1e9  # thirty years on, still paused
    assert pauses.check().reason == reason
    path.unlink()
    verdict = pauses.check()
    assert verdict.reason is None and verdict.ended == "pause file removed"


@pytest.mark.parametrize("tz", ZONES, ids=str)
def test_far_times_written_mid_pause_neither_crash_nor_lose_the_end(tmp_path: Path, tz: ZoneInfo | None) -> None:
    path = tmp_path / "pause"
    clock = Clock(NOON_UTC)
    pauses = Pauses(pause_file=str(path), wall_clock=clock, tz=tz)
    assert pauses.check().reason is None
    path.write_text("9999-12-31T23:59:59-12:00")
    assert pauses.check().reason is not None
    path.write_text("0001-01-01T00:00:00+14:00")  # rewritten with a time long gone: the pause ends
    verdict = pauses.check()
    assert verdict.reason is None and verdict.ended == "pause file's time 0001-01-01T00:00:00+14:00 reached"


def test_a_time_at_the_end_of_the_calendar_is_shown_where_it_can_be() -> None:
    assert shown_time(parse_until("9999-12-31T00:00:00Z"), BERLIN) == "9999-12-31T01:00:00+01:00"
    assert shown_time(parse_until("0001-01-02T00:00:00Z"), BERLIN) == "0001-01-02T00:53:28+00:53:28"  # Berlin's LMT
    for tz in ZONES:
        assert shown_time(parse_until("9999-12-31T23:59:59-12:00"), tz) is None
    assert shown_time(float("inf")) is None and shown_time(float("nan")) is None


# --- the host out of descriptors or memory: not "the pause file says pause" --------------------------------------

class ShortHost:
    """read_pause_file, until `short` is set: then every open() fails as on a host out of descriptors."""

    def __init__(self) -> None:
        self.short = False

    def __call__(self, path: str) -> FileState:
        if not self.short:
            return read_pause_file(path)
        real_open = os.open

        def no_descriptor(*args: object, **kwargs: object) -> int:
            raise OSError(errno.EMFILE, "Too many open files")

        os.open = no_descriptor  # type: ignore[assignment]
        try:
            return read_pause_file(path)
        finally:
            os.open = real_open


def test_out_of_descriptors_a_missing_file_pauses_nothing_and_is_said_once(tmp_path: Path) -> None:
    path = tmp_path / "pause"
    host, said = ShortHost(), []
    pauses = Pauses(pause_file=str(path), wall_clock=Clock(NOON_UTC), tz=BERLIN, read=host, on_host_error=said.append)
    host.short = True
    for _ in range(5):
        assert pauses.check().reason is None
    assert len(said) == 1 and "Too many open files" in said[0] and str(path) in said[0]


@pytest.mark.parametrize(("content", "paused"), [("", True), ("2026-11-18T13:30:00+01:00", True),
                                                 ("2020-01-01T00:00:00Z", False)])
def test_out_of_descriptors_the_same_file_means_what_it_meant(tmp_path: Path, content: str, paused: bool) -> None:
    path = tmp_path / "pause"
    path.write_text(content)
    host = ShortHost()
    pauses = Pauses(pause_file=str(path), wall_clock=Clock(NOON_UTC), tz=BERLIN, read=host, on_host_error=print)
    before = pauses.check().reason
    assert (before is not None) == paused
    host.short = True
    assert pauses.check().reason == before
    path.unlink()
    assert pauses.check().reason is None  # its removal is seen without a descriptor


def test_out_of_descriptors_a_new_file_pauses_until_it_can_be_read(tmp_path: Path) -> None:
    path = tmp_path / "pause"
    host, said = ShortHost(), []
    pauses = Pauses(pause_file=str(path), wall_clock=Clock(NOON_UTC), tz=BERLIN, read=host, on_host_error=said.append)
    assert pauses.check().reason is None
    host.short = True
    path.write_text("2020-01-01T00:00:00Z")  # a time long past, which cannot be read yet
    assert pauses.check().reason == (f"pause file {path} is there but cannot be read now (Too many open files): "
                                     "paused until it can be read")
    host.short = False
    verdict = pauses.check()
    assert verdict.reason is None
    host.short = True
    pauses.check()
    assert len(said) == 2  # once per spell without descriptors
