"""forge_load.steering.schedule: FORGE_ACTIVE_HOURS parsed and judged in local wall-clock time, DST and midnight."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from forge_load.steering.schedule import ActiveHours, ScheduleError, from_unix, parse_active_hours, to_unix

BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")


def at(text: str) -> datetime:
    """A naive local time: 'Mon 20:00' in the week of Monday 2026-11-16."""
    day, clock = text.split()
    hour, minute = map(int, clock.split(":"))
    offset = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun").index(day)
    return datetime(2026, 11, 16 + offset, hour, minute)


OFFICE_NIGHTS = "Mon-Fri 20:00-08:00, Sat-Sun"


@pytest.mark.parametrize(("when", "active"), [
    ("Mon 19:59", False), ("Mon 20:00", True), ("Mon 23:59", True), ("Tue 00:00", True), ("Tue 07:59", True),
    ("Tue 08:00", False), ("Wed 12:00", False),
    ("Fri 20:00", True), ("Sat 07:00", True), ("Sat 12:00", True), ("Sun 23:59", True),
    ("Mon 00:00", False), ("Mon 07:59", False),  # Sunday is a whole day, and no span starts on Sunday night
])
def test_office_nights_and_weekends(when: str, active: bool) -> None:
    assert parse_active_hours(OFFICE_NIGHTS).active(at(when)) is active


def test_a_span_over_midnight_belongs_to_the_day_it_starts() -> None:
    hours = parse_active_hours("Fri 22:00-02:00")
    assert hours.active(at("Fri 23:00")) and hours.active(at("Sat 01:59"))
    assert not hours.active(at("Sat 02:00")) and not hours.active(at("Fri 01:00"))


def test_day_ranges_wrap_and_times_without_days_are_every_day() -> None:
    weekend = parse_active_hours("Fri-Mon")
    assert [weekend.active(at(f"{d} 12:00")) for d in ("Tue", "Thu", "Fri", "Sat", "Sun", "Mon")] == [
        False, False, True, True, True, True]
    every_night = parse_active_hours("01:00-05:00 13:00-13:30")
    assert all(every_night.active(at(f"{d} 01:00")) for d in ("Mon", "Wed", "Sun"))
    assert every_night.active(at("Tue 13:15")) and not every_night.active(at("Tue 13:30"))


def test_24_00_ends_a_day_and_the_text_is_tidied() -> None:
    hours = parse_active_hours("  sat   00:00-24:00 ,SUN")
    assert hours.text == "sat 00:00-24:00, SUN"
    assert hours.active(at("Sat 00:00")) and hours.active(at("Sat 23:59")) and not hours.active(at("Fri 23:59"))


@pytest.mark.parametrize(("text", "needle"), [
    ("", "empty entry"), ("Mon,", "empty entry"), ("Monday", "neither days"), ("Mon-Funday", "neither days"),
    ("Mon-Fry", "'Fry' is not a day"), ("Mon 8-17", "not a time range"), ("Mon 25:00-26:00", "starts at no time"),
    ("Mon 08:60-09:00", "starts at no time"), ("Mon 08:00-24:01", "ends at no time"),
    ("Mon 08:00-08:00", "ambiguous"), ("20:00-08:00 Mon", "days come first"), ("1", "neither days"),
    (",".join(["Mon"] * 65), "at most 64"),
])
def test_bad_schedules_say_what_is_wrong(text: str, needle: str) -> None:
    with pytest.raises(ScheduleError, match=needle):
        parse_active_hours(text)


def minutes_active(hours: ActiveHours, start: datetime, minutes: int) -> int:
    """Real minutes from `start` (aware) during which the schedule says active, stepping in Unix time."""
    t0 = start.timestamp()
    return sum(hours.active(from_unix(t0 + 60 * k, start.tzinfo)) for k in range(minutes))


def test_dst_spring_forward_skips_the_hour_that_does_not_exist() -> None:
    # Europe/Berlin, 2026-03-29: 02:00 CET becomes 03:00 CEST; 02:00-03:00 never happens that night.
    night = datetime(2026, 3, 29, 0, 0, tzinfo=BERLIN)
    assert minutes_active(parse_active_hours("02:00-03:00"), night, 6 * 60) == 0
    assert minutes_active(parse_active_hours("01:00-04:00"), night, 6 * 60) == 120  # 01-02 and 03-04 only
    assert minutes_active(parse_active_hours("02:00-03:00"), datetime(2026, 3, 30, tzinfo=BERLIN), 6 * 60) == 60


def test_dst_fall_back_runs_the_repeated_hour_twice() -> None:
    # America/New_York, 2026-11-01: 02:00 EDT becomes 01:00 EST; 01:00-02:00 happens twice.
    night = datetime(2026, 11, 1, 0, 0, tzinfo=NEW_YORK)
    assert minutes_active(parse_active_hours("01:00-02:00"), night, 6 * 60) == 120
    assert minutes_active(parse_active_hours("Sat 23:00-03:00"), datetime(2026, 10, 31, 22, tzinfo=NEW_YORK),
                          8 * 60) == 5 * 60  # a 4-hour wall-clock span lasting 5 real hours


def test_midnight_in_another_zone_is_local_midnight() -> None:
    hours = parse_active_hours("Mon-Fri 20:00-08:00")
    utc_evening = datetime(2026, 11, 16, 19, 30, tzinfo=timezone.utc).timestamp()  # Monday 20:30 in Berlin
    assert hours.active(from_unix(utc_evening, BERLIN))
    assert not hours.active(from_unix(utc_evening, NEW_YORK))  # 14:30 there


def test_to_unix_reads_a_naive_time_in_the_zone_given() -> None:
    naive = datetime(2026, 7, 1, 12, 0)
    assert to_unix(naive, BERLIN) == datetime(2026, 7, 1, 10, 0, tzinfo=timezone.utc).timestamp()
    aware = datetime(2026, 7, 1, 12, 0, tzinfo=timezone(timedelta(hours=-4)))
    assert to_unix(aware, BERLIN) == aware.timestamp()  # a time with its own offset keeps it
