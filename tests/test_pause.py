"""forge_load.operators.pause: the reasons to pause (signal switch, pause file, active hours) on a fake clock."""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from forge_load.operators.pause import (
    PAUSE_FILE_MAX_BYTES,
    FileState,
    Pauses,
    PauseSwitch,
    parse_until,
    read_pause_file,
)
from forge_load.operators.schedule import parse_active_hours

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
    assert read_pause_file(str(path)) == FileState(True, "")
    path.write_text("1763640000\n")
    assert read_pause_file(str(path)) == FileState(True, "1763640000\n")
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
    switch.add_listener(lambda: told.append(switch.generation))
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
