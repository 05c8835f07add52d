"""Every JSON line's `ts`: RFC 3339 in UTC with milliseconds, from the wall clock the log is given (docs/operating.md,
Reading the log); `t` stays. Key=value lines carry no `ts` (people read them through `docker logs -t` or journald,
which stamp each line)."""

from __future__ import annotations

import io
import json
import re
from datetime import datetime

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
    assert out.getvalue() == "t=1.00 event=status\n"


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
