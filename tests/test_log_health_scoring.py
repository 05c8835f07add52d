"""forge_load.log (text and JSON lines), service.health (heartbeat and its check), control.scoring."""

from __future__ import annotations

import functools
import io
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forge_load.config.load import load_config
from forge_load.control.probe import UtilSample
from forge_load.control.scoring import one_second_readings, percentile, settle_time_s, tracking
from forge_load.log import CORE_FIELDS, EventLog
from forge_load.service import health

REPO = Path(__file__).resolve().parents[1]

# --- log ----------------------------------------------------------------------------------------------


def emit_both(event: str, static: dict[str, object] | None = None, **fields: object) -> tuple[str, str]:
    """The same event as a text line and as a JSON line."""
    lines = []
    for fmt in ("text", "json"):
        out = io.StringIO()
        EventLog(fmt, out, static=static).emit(event, **dict(fields))
        lines.append(out.getvalue())
    return lines[0], lines[1]


def parse_text(line: str) -> dict[str, str]:
    """logfmt as written: key=value, values with spaces in double quotes."""
    assert line.endswith("\n") and line.count("\n") == 1
    pairs = [token.split("=", 1) for token in shlex.split(line)]
    return {k: v for k, v in pairs}


STATUS = dict(t=12.3456, state="filling", target=0.5, util=0.4987, own=0.4912, foreign=0.0075,
              multiplier=20, gpu_mem_mib=512.25, reason=None, power_w=312.5, extra_flag=True)


def test_text_and_json_have_the_same_fields_in_the_same_order() -> None:
    # Given in a scrambled order, with static fields: both come out core fields first, then the rest.
    scrambled = dict(reversed(list(STATUS.items())))
    text, js = emit_both("status", static={"gpu": 0, "uuid": "GPU-abc"}, **scrambled)
    record = json.loads(js)
    text_fields = parse_text(text)
    assert list(text_fields) == [k for k in record if k != "ts"]  # ts: JSON lines only
    core = [k for k in CORE_FIELDS if k in record]
    assert list(record)[:len(core)] == core == list(CORE_FIELDS)
    assert set(record) == set(STATUS) | {"event", "gpu", "uuid", "ts"}


def test_json_values() -> None:
    _, js = emit_both("status", **STATUS)
    assert js.count("\n") == 1 and js.endswith("\n")
    record = json.loads(js)
    assert record["t"] == 12.346
    assert record["event"] == "status"
    assert record["state"] == "filling"
    assert record["target"] == 0.5
    assert record["util"] == 0.4987
    assert record["multiplier"] == 20
    assert record["reason"] is None
    assert record["extra_flag"] is True


def test_text_values() -> None:
    text, _ = emit_both("status", **STATUS)
    f = parse_text(text)
    assert f["t"] == "12.35"
    assert f["event"] == "status"
    assert f["util"] == "0.499"
    assert f["multiplier"] == "20"
    assert f["gpu_mem_mib"] == "512.2"  # >= 10: one decimal
    assert f["reason"] == "-"
    assert f["extra_flag"] == "true"
    assert text.startswith("t=12.35 event=status state=filling target=0.500 ")


def test_text_quotes_values_with_spaces_quotes_or_equals() -> None:
    reason = 'process 4242 on the GPU; util="0.9"'
    text, js = emit_both("yield", reason=reason, note="a=b", empty="")
    assert ' reason="process 4242 on the GPU; util=\\"0.9\\""' in text
    f = parse_text(text)
    assert f["reason"] == reason
    assert f["note"] == "a=b"
    assert f["empty"] == ""
    assert json.loads(js)["reason"] == reason


def test_text_value_with_spaces_and_a_newline_stays_on_one_line() -> None:
    text, js = emit_both("error", reason="CUDA_ERROR_ILLEGAL_ADDRESS\nan illegal memory access")
    assert js.count("\n") == 1
    assert text.count("\n") == 1
    assert parse_text(text)["reason"] == "CUDA_ERROR_ILLEGAL_ADDRESS\\nan illegal memory access"


@pytest.mark.parametrize("value", ["first\nsecond", "a\tb\r\nc"])
def test_text_value_with_a_bare_newline_stays_on_one_line(value: str) -> None:
    text, _ = emit_both("error", reason=value)
    assert text.count("\n") == 1 and "\r" not in text and "\t" not in text


def test_none_and_non_finite() -> None:
    text, js = emit_both("status", reason=None, util=float("nan"), own=float("inf"))
    record = json.loads(js)
    assert record["reason"] is None
    assert record["util"] is None and record["own"] is None  # strict JSON: no NaN, no Infinity
    assert "NaN" not in js and "Infinity" not in js
    assert parse_text(text)["reason"] == "-"


def test_time_from_the_clock_relative_to_start() -> None:
    out = io.StringIO()
    now = [105.25]
    log = EventLog("json", out, clock=lambda: now[0], start_s=100.0)
    log.emit("resume")
    now[0] = 107.5
    record = log.emit("status", util=0.5)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["t"] for line in lines] == [5.25, 7.5]
    assert record["t"] == 7.5
    out2 = io.StringIO()
    EventLog("json", out2, clock=lambda: 1e9, start_s=0.0).emit("x", t=3.0)  # an explicit t wins
    assert json.loads(out2.getvalue())["t"] == 3.0


def test_no_clock_no_time() -> None:
    text, js = emit_both("start")
    assert json.loads(js)["t"] is None
    assert parse_text(text)["t"] == "-"


def test_every_json_line_parses() -> None:
    out = io.StringIO()
    log = EventLog("json", out, static={"gpu": 1})
    for k, event in enumerate(["start", "status", "yield", "resume", "boost", "stop"]):
        log.emit(event, t=float(k), reason=f"reason {k} with \"quotes\" and = signs", util=k / 7)
    lines = out.getvalue().splitlines()
    assert len(lines) == 6
    records = [json.loads(line) for line in lines]
    assert [r["event"] for r in records] == ["start", "status", "yield", "resume", "boost", "stop"]
    assert all(r["gpu"] == 1 for r in records)


# --- health -------------------------------------------------------------------------------------------


def test_heartbeat_writes_and_throttles(tmp_path: Path) -> None:
    path = tmp_path / "hb"
    beat = health.Heartbeat(path, every_s=3600.0)
    beat()
    assert path.exists()
    assert abs(float(path.read_text()) - time.time()) < 60
    path.unlink()
    beat()  # within every_s: no write
    assert not path.exists()


def test_heartbeat_every_call_when_not_throttled(tmp_path: Path) -> None:
    path = tmp_path / "hb"
    beat = health.Heartbeat(path, every_s=0.0)
    beat()
    path.unlink()
    beat()
    assert path.exists()


def test_heartbeat_survives_an_unwritable_path(tmp_path: Path) -> None:
    beat = health.Heartbeat(tmp_path / "missing-dir" / "hb")
    beat()  # no exception
    assert not (tmp_path / "missing-dir").exists()


def test_heartbeat_clear(tmp_path: Path) -> None:
    path = tmp_path / "hb"
    beat = health.Heartbeat(path)
    beat()
    beat.clear()
    assert not path.exists()
    beat.clear()  # already gone: fine


def make_stale(path: Path, age_s: float) -> None:
    old = time.time() - age_s
    os.utime(path, (old, old))


def test_check_fresh_stale_missing(tmp_path: Path) -> None:
    path = tmp_path / "hb"
    ok, message = health.check(path, 30.0)
    assert not ok and str(path) in message
    health.Heartbeat(path)()
    ok, message = health.check(path, 30.0)
    assert ok, message
    make_stale(path, 120.0)
    ok, message = health.check(path, 30.0)
    assert not ok
    assert "120 s old" in message and "30 s" in message
    assert health.check(path, 300.0)[0]


def test_heartbeat_path_from_the_settings(tmp_path: Path) -> None:
    config = load_config([], {"FORGE_HEARTBEAT_FILE": str(tmp_path / "x")})
    assert health.heartbeat_location(config) == (tmp_path / "x", False)
    assert health.heartbeat_location(load_config([], {})) == (health.default_heartbeat_path(), True)


# The health check's two addresses: `forge-load health` (here through `python -m forge_load`, what the console
# script runs) and `python -m forge_load.health`, the Dockerfile's HEALTHCHECK.
HEALTH_COMMANDS = [("forge_load", "health"), ("forge_load.health",)]


def run_health(path: Path, max_age: str | None = None,
               command: tuple[str, ...] = ("forge_load.health",)) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env["FORGE_HEARTBEAT_FILE"] = str(path)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if max_age is not None:
        env["FORGE_HEALTH_MAX_AGE"] = max_age
    return subprocess.run([sys.executable, "-m", *command], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("command", HEALTH_COMMANDS)
def test_health_command_exit_codes(tmp_path: Path, command: tuple[str, ...]) -> None:
    path = tmp_path / "hb"
    run_health = functools.partial(globals()["run_health"], command=command)
    missing = run_health(path)
    assert missing.returncode == 1
    assert "no heartbeat" in missing.stdout
    health.Heartbeat(path)()
    fresh = run_health(path)
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert fresh.stderr == ""
    make_stale(path, 100.0)
    stale = run_health(path)
    assert stale.returncode == 1
    assert "old" in stale.stdout
    assert run_health(path, max_age="600").returncode == 0


@pytest.mark.parametrize("command", HEALTH_COMMANDS)
def test_health_command_bad_max_age(tmp_path: Path, command: tuple[str, ...]) -> None:
    result = run_health(tmp_path / "hb", max_age="soon", command=command)
    assert result.returncode == 1  # unhealthy: Docker reserves 2
    assert "FORGE_HEALTH_MAX_AGE" in result.stderr and "soon" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("max_age", ["nan", "0", "-5"])
def test_health_command_rejects_out_of_range_max_age(tmp_path: Path, max_age: str) -> None:
    path = tmp_path / "hb"
    health.Heartbeat(path)()
    make_stale(path, 100.0)
    assert run_health(path, max_age=max_age).returncode == 1


# --- scoring ------------------------------------------------------------------------------------------


def test_one_second_readings_bins() -> None:
    samples = [
        UtilSample(9.99, 1.0),   # before start: out
        UtilSample(10.0, 0.4), UtilSample(10.5, 0.6), UtilSample(10.999, 0.5),  # second 0
        UtilSample(11.2, 0.3),   # second 1
        # second 2: no samples, no reading
        UtilSample(13.0, 0.8), UtilSample(13.9, 0.6),  # second 3
        UtilSample(14.0, 1.0),   # at end: out
    ]
    readings = one_second_readings(samples, 10.0, 14.0)
    assert [t for t, _ in readings] == [10.0, 11.0, 13.0]
    assert [u for _, u in readings] == pytest.approx([0.5, 0.3, 0.7])


def test_one_second_readings_unsorted_input() -> None:
    samples = [UtilSample(1.5, 0.2), UtilSample(0.5, 0.4), UtilSample(1.2, 0.4)]
    assert one_second_readings(samples, 0.0, 2.0) == [(0.0, 0.4), (1.0, pytest.approx(0.3))]


def series(values: list[float], start_s: float = 0.0) -> list[tuple[float, float]]:
    return [(start_s + k, v) for k, v in enumerate(values)]


def test_settle_never() -> None:
    assert settle_time_s(series([0.3] * 20), 0.5, 0.0) is None
    assert settle_time_s([], 0.5, 0.0) is None


def test_settle_then_hold() -> None:
    readings = series([0.2, 0.35, 0.45, 0.49, 0.5, 0.51, 0.5, 0.49, 0.5, 0.5, 0.51, 0.5])
    assert settle_time_s(readings, 0.5, 0.0) == 4.0  # the reading of second 3 is the first that holds


def test_settle_ignores_a_pass_through_that_does_not_hold() -> None:
    # Within tolerance at second 1, out again at 3: settling is the reading of second 4.
    readings = series([0.3, 0.5, 0.51, 0.6, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    assert settle_time_s(readings, 0.5, 0.0) == 5.0


def test_settle_relative_to_start_and_hold_window() -> None:
    readings = series([0.1, 0.5, 0.5, 0.1, 0.5, 0.5, 0.5], start_s=100.0)
    assert settle_time_s(readings, 0.5, 100.0, hold_s=2.0) == 2.0   # 101 and 102 hold for 2 s
    assert settle_time_s(readings, 0.5, 100.0, hold_s=5.0) == 5.0   # only from 104 on (to the end)
    assert settle_time_s(readings, 0.5, 99.0, hold_s=5.0) == 6.0


def test_settle_tolerance() -> None:
    readings = series([0.53] * 10)
    assert settle_time_s(readings, 0.5, 0.0, tolerance_ratio=0.02) is None
    assert settle_time_s(readings, 0.5, 0.0, tolerance_ratio=0.05) == 1.0


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
    ([4.0, 1.0, 3.0, 2.0], 0, 1.0),
    ([4.0, 1.0, 3.0, 2.0], 100, 4.0),
    ([0.0, 10.0], 95, 9.5),
    ([float(k) for k in range(101)], 95, 95.0),
    ([7.0], 95, 7.0),
    ([0.06, 0.0, 0.01, 0.0, 0.015, 0.01], 95, 0.015 + 0.75 * (0.06 - 0.015)),  # rank 4.75
])
def test_percentile(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_empty_is_nan() -> None:
    assert math.isnan(percentile([], 95))


def test_tracking_numbers_on_a_hand_built_series() -> None:
    # One sample per second, in the middle of the second; target 0.5.
    values = [0.2, 0.5, 0.51, 0.49, 0.5, 0.515, 0.44, 0.5]
    samples = [UtilSample(k + 0.5, v) for k, v in enumerate(values)]
    result = tracking(samples, 0.5, 0.0, 8.0)
    assert result.settle_s == 2.0  # second 1 is followed by 5 s within 0.02
    # Judged: seconds 2..7, errors 0.01 0.01 0 0.015 0.06 0.
    assert result.seconds == 6
    assert result.mae_ratio == pytest.approx((0.01 + 0.01 + 0.0 + 0.015 + 0.06 + 0.0) / 6)
    assert result.p95_error_ratio == pytest.approx(0.015 + 0.75 * (0.06 - 0.015))
    assert result.within_005_ratio == pytest.approx(5 / 6)


def test_tracking_never_settled() -> None:
    samples = [UtilSample(k + 0.5, 0.3) for k in range(10)]
    result = tracking(samples, 0.5, 0.0, 10.0)
    assert result.settle_s is None
    assert result.seconds == 0
    assert math.isnan(result.mae_ratio) and math.isnan(result.p95_error_ratio)
    assert math.isnan(result.within_005_ratio)


def test_tracking_with_several_samples_per_second() -> None:
    # 1/6-s windows alternating 0.48 / 0.52: each 1-s reading is exactly on target.
    samples = [UtilSample(k / 6 + 0.01, 0.48 if k % 2 else 0.52) for k in range(60)]
    result = tracking(samples, 0.5, 0.0, 10.0)
    assert result.settle_s == 1.0
    assert result.seconds == 9
    assert result.mae_ratio == pytest.approx(0.0, abs=1e-9)
    assert result.within_005_ratio == 1.0


def test_health_command_asks_the_metrics_server_when_one_is_configured(tmp_path: Path) -> None:
    import http.server
    import threading

    codes = {"/health": 503}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(codes.get(self.path, 404))
            self.end_headers()
            self.wfile.write(b"unhealthy: 1 of 2 GPUs\n")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        beat = tmp_path / "beat"
        beat.write_text("fresh\n")  # a fresh file must not hide an unhealthy server
        env = {**os.environ, "FORGE_HEARTBEAT_FILE": str(beat), "FORGE_METRICS_PORT": str(server.server_port),
               "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        result = subprocess.run([sys.executable, "-m", "forge_load.health"], env=env, capture_output=True,
                                text=True, timeout=30)
        assert result.returncode == 1 and "unhealthy: 1 of 2 GPUs" in result.stdout
        codes["/health"] = 200
        result = subprocess.run([sys.executable, "-m", "forge_load.health"], env=env, capture_output=True,
                                text=True, timeout=30)
        assert result.returncode == 0
    finally:
        server.shutdown()
