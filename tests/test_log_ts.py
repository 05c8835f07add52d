"""Every JSON line's `ts`: RFC 3339 in UTC with milliseconds, from the wall clock the log is given (docs/operating.md,
Reading the log); `t` stays. Key=value lines carry `time` instead, the local wall-clock time a person reads, with
its date where the day is new, and put what a person reads first."""

from __future__ import annotations

import io
import json
import re
import time
from collections.abc import Iterator
from datetime import datetime

import pytest

from forge_load.config.load import load_config
from forge_load.log import EventLog, rfc3339_utc
from forge_load.service.loop import run_simulated

TS_RE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def test_rfc3339_utc_with_milliseconds_never_rounded_into_the_next_second() -> None:
    assert rfc3339_utc(0.0) == "1970-01-01T00:00:00.000Z"
    assert rfc3339_utc(1795750867.1234) == "2026-11-27T03:41:07.123Z"
    assert rfc3339_utc(1795750867.9999) == "2026-11-27T03:41:07.999Z"


def test_every_json_line_has_ts_after_t_from_the_wall_clock_given() -> None:
    out = io.StringIO()
    now_s = [10.0]
    wall_s = [1795750867.5]
    log = EventLog("json", out, clock=lambda: now_s[0], start_s=10.0, wall_clock=lambda: wall_s[0])
    log.emit("start")
    now_s[0], wall_s[0] = 12.25, 1795750869.75
    log.emit("status", util=0.5)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [list(line)[:3] for line in lines] == [["t", "ts", "event"]] * 2
    assert [(line["t"], line["ts"]) for line in lines] == [(0.0, "2026-11-27T03:41:07.500Z"),
                                                           (2.25, "2026-11-27T03:41:09.750Z")]


def test_key_value_lines_carry_no_ts() -> None:
    out = io.StringIO()
    EventLog("text", out, clock=lambda: 1.0, wall_clock=lambda: 1795750867.5).emit("status")
    assert "ts=" not in out.getvalue() and out.getvalue().startswith("t=1.00 event=status time=")


@pytest.fixture
def berlin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_every_key_value_line_has_the_local_time_after_its_event_and_its_date_where_the_day_is_new(
        berlin: None) -> None:
    # A bare log file had no time a person can place: `t` counts from the start, `wall_time` is Unix seconds.
    out = io.StringIO()
    wall_s = [1795820400.0 - 2.5]  # 2026-11-27 23:59:57.5 in Berlin (UTC+1)
    log = EventLog("text", out, clock=lambda: wall_s[0], start_s=wall_s[0], wall_clock=lambda: wall_s[0])
    log.emit("start")
    wall_s[0] += 1.0
    log.emit("status")
    wall_s[0] += 2.0
    log.emit("status")
    wall_s[0] += 3600.0
    log.emit("status")
    fields = [line.split()[:3] for line in out.getvalue().splitlines()]
    assert fields == [["t=0.00", "event=start", "time=2026-11-27T23:59:57+01:00"],  # the first line: the day
                      ["t=1.00", "event=status", "time=23:59:58"],
                      ["t=3.00", "event=status", "time=2026-11-28T00:00:00+01:00"],  # a new day: its date
                      ["t=3603.00", "event=status", "time=01:00:00"]]


def test_a_key_value_line_puts_what_a_person_reads_first_and_the_uuid_last() -> None:
    # Status lines ran to 210 characters with the GPU's 40-character UUID in the middle.
    out = io.StringIO()
    log = EventLog("text", out, clock=lambda: 10.0, wall_clock=lambda: 1795750867.5,
                   static={"gpu": 0, "uuid": "GPU-51a00000-0000-4000-8000-000000000000"})
    log.emit("status", state="filling", target=0.5, util=0.5, own=0.5, foreign=0.0, multiplier=742,
             gpu_mem_mib=512.0, samples=58, power_w=385.5, energy_j=3846.4, new_reading=0.25)
    keys = [pair.split("=", 1)[0] for pair in out.getvalue().split()]
    assert keys[:9] == ["t", "event", "time", "gpu", "state", "target", "util", "own", "foreign"]
    assert keys[-1] == "uuid" and "new_reading" in keys
    assert "samples" not in keys  # a count for machines: JSON lines keep it
    out = io.StringIO()
    EventLog("json", out, static={"gpu": 0, "uuid": "GPU-x"}).emit("status", samples=58, state="filling")
    assert list(json.loads(out.getvalue())) == ["t", "ts", "event", "gpu", "state", "samples", "uuid"]


def test_a_simulated_run_stamps_every_json_line_on_its_virtual_timeline() -> None:
    # On the simulated GPU, ts is the start's wall time plus the virtual seconds: ts - t is the same on every line.
    config = load_config(["--simulate", "--sim-speed", "0", "--duration", "30", "--sim-foreign", "10-15",
                          "--log-interval", "5", "--resume-after", "3"], env={"FORGE_LOG_FORMAT": "json"})
    out = io.StringIO()
    run_simulated(config, out)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) > 5 and all(TS_RE.fullmatch(line["ts"]) for line in lines)
    offsets_s = [datetime.fromisoformat(line["ts"].replace("Z", "+00:00")).timestamp() - line["t"] for line in lines]
    assert max(offsets_s) - min(offsets_s) < 0.01, offsets_s
