"""Hostile and careless input, as a lasting family: every setting against a table of bad values (generated from
forge_load.config.settings.SETTINGS, so a new setting inherits the checks), every timing setting at its extremes,
signals at several moments (as PID 1 too), a closed or full stdout, hostile heartbeat paths, log lines that cannot be
forged, unknown variables, and the fleet script's input. In-process where it can be, subprocesses where the
process itself is what is tested.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import unicodedata
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from forge_load.config import values as config_values
from forge_load.config.load import load_config
from forge_load.config.settings import SETTINGS, Config
from forge_load.config.values import ConfigError
from forge_load.control.status import GpuSlots
from forge_load.gpu.backend import backend_for
from forge_load.log import EventLog
from forge_load.service import health
from forge_load.service.loop import run_simulated

ROOT = Path(__file__).resolve().parent.parent
ENTRY = ROOT / "tests" / "hostile_entry.py"
EVENT_RE = re.compile(r"(^|\s)event=|\"event\"\s*:")

# --- the table of hostile values ------------------------------------------------------------------------------

# Every one of these must be refused by every setting: one line naming the variable, exit 2.
HOSTILE: dict[str, str] = {
    "empty": "",
    "spaces": "   ",
    "tab": "\t",
    "huge int": "9" * 4000,
    "huge negative int": "-" + "9" * 4000,
    "over the int digit limit": "9" * 5000,
    "leading zeros": "0" * 5000 + "1",
    "1e999": "1e999",
    "-1e999": "-1e999",
    "nan": "nan",
    "NaN%": "NaN%",
    "inf": "inf",
    "-inf": "-inf",
    "Infinity": "Infinity",
    "negative": "-1",
    "newline after": "0.5\n",
    "newline before": "\n1",
    "forged line": "1\nt=9.00 event=stop reason=forged",
    "carriage return": "1\r",
    "escape sequence": "0.5\x1b[31m",
    "bel": "\x07",
    "del": "1\x7f",
    "C1 next line": "0.5\x85",
    "line separator": "0.5\u2028",
    "bidi override": "\u202e0.5",
    "arabic-indic digit": "\u0661",
    "arabic-indic percent": "\u0665\u0660%",
    "fullwidth digit": "\uff11",
    "very long": "1" * 100_000,  # an environment string may hold 128 KiB
    "very long spaces": "1" + " " * 100_000 + "x",
}
IN_PROCESS_ONLY = {"nul": "0.5\x00"}  # the environment cannot carry NUL


def assert_one_clean_line(message: str, *names: str) -> None:
    assert message and "\n" not in message, repr(message)
    bad = [c for c in message if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")]
    assert not bad, f"raw control characters {bad!r} in {message!r}"
    assert len(message) < 600, f"{len(message)} characters: the value must be shown shortened"
    for name in names:
        assert name in message, f"{name!r} not in {message!r}"


CASES = [(s.env, label, raw) for s in SETTINGS for label, raw in {**HOSTILE, **IN_PROCESS_ONLY}.items()]


@pytest.mark.parametrize(("env", "label", "raw"), CASES, ids=[f"{e}-{label}" for e, label, _ in CASES])
def test_every_setting_refuses_every_hostile_value(env: str, label: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([], {env: raw})
    assert_one_clean_line(str(info.value), env)


FLAG_CASES = [(s.flag, s.env, label, raw) for s in SETTINGS if not s.boolean
              for label, raw in {**HOSTILE, **IN_PROCESS_ONLY}.items()]


@pytest.mark.parametrize(("flag", "env", "label", "raw"), FLAG_CASES,
                         ids=[f"{f}-{label}" for f, _, label, _ in FLAG_CASES])
def test_every_flag_refuses_every_hostile_value(flag: str, env: str, label: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([f"{flag}={raw}"], {})
    assert_one_clean_line(str(info.value), flag)


def forge(*args: str, env: dict[str, str] | None = None, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_") and k != "TARGET"}
    full_env.update(env or {}, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "forge_load", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout_s, cwd=ROOT)


def assert_config_exit(result: subprocess.CompletedProcess[str], name: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    assert_one_clean_line(lines[0], name)
    assert not EVENT_RE.search(result.stdout or ""), result.stdout


# The whole process for a sample of the values on one setting; app.main() in this process for the rest.
SAMPLE = ["empty", "over the int digit limit", "1e999", "NaN%", "forged line", "escape sequence",
          "arabic-indic digit", "very long"]


@pytest.mark.parametrize("label", SAMPLE)
def test_process_exits_2_with_one_line(label: str) -> None:
    assert_config_exit(forge("--simulate", env={"FORGE_SIM_SEED": HOSTILE[label]}), "FORGE_SIM_SEED")


def run_main(env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess[str]:
    """app.main() in this process, with `env` over a simulated one-second run as the whole environment."""
    from forge_load.service.app import main

    for name in [k for k in os.environ if k.upper().startswith("FORGE_") or k == "TARGET"]:
        monkeypatch.delenv(name)
    for name, value in {"FORGE_SIMULATE": "1", "FORGE_SIM_SPEED": "0", "FORGE_DURATION": "1", **env}.items():
        monkeypatch.setenv(name, value)
    code = main([])
    captured = capsys.readouterr()
    return subprocess.CompletedProcess([], code, captured.out, captured.err)


@pytest.mark.parametrize("env", [s.env for s in SETTINGS])
def test_main_exits_2_for_a_forged_line_in_every_setting(env: str, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert_config_exit(run_main({env: HOSTILE["forged line"]}, monkeypatch, capsys), env)


@pytest.mark.parametrize("env", ["FORGE_SIM_SEED", "FORGE_GPU", "FORGE_METRICS_PORT", "FORGE_SIM_SMS",
                                 "FORGE_FOREIGN_SAMPLES", "FORGE_SIM_GPUS", "FORGE_SIM_FAIL_GPU",
                                 "FORGE_SIM_FOREIGN_GPUS", "FORGE_GPUS"])
@pytest.mark.parametrize("digits", [4000, 4301, 5000])
def test_integers_over_the_digit_limit_exit_2(env: str, digits: int, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    raw = "9" * digits + ("@1" if env == "FORGE_SIM_FAIL_GPU" else "")
    assert_config_exit(run_main({env: raw}, monkeypatch, capsys), env)


# --- addresses (no forged lines through FORGE_METRICS_ADDR) ------------------------------------------------------

@pytest.mark.parametrize("raw", [
    "fe80::1%eth0\nt=1.00 event=stop", "fe80::1%\x1b[2J", "fe80::1%", "fe80::1%" + "x" * 40, "::1%lo%lo",
    "localhost", "example.com", "127.0.0.1:9400", "[::1]:9400", "127.1", "0x7f.0.0.1", "1.2.3.4/24",
])
def test_metrics_addr_is_an_ip_literal_only(raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([], {"FORGE_METRICS_ADDR": raw})
    assert_one_clean_line(str(info.value), "FORGE_METRICS_ADDR")


@pytest.mark.parametrize(("raw", "expected"), [
    ("::1", "::1"), ("[::1]", "::1"), ("127.0.0.2", "127.0.0.2"), ("0.0.0.0", "0.0.0.0"), ("::", "::"),
    ("fe80::1%eth0", "fe80::1%eth0"), ("fe80::1%2", "fe80::1%2"),
])
def test_metrics_addr_good_values(raw: str, expected: str) -> None:
    assert load_config([], {"FORGE_METRICS_ADDR": raw}).metrics_addr == expected


def test_a_zone_id_with_a_newline_forges_no_line() -> None:
    result = forge("--simulate", "--duration", "1", env={"FORGE_METRICS_PORT": "0",
                                                          "FORGE_METRICS_ADDR": "fe80::1%x\nt=1.00 event=stop"})
    assert_config_exit(result, "FORGE_METRICS_ADDR")


# --- floors: no setting can make the loop spin or starve -------------------------------------------------------

@pytest.mark.parametrize(("env", "raw", "accepted"), [
    ("FORGE_LOG_INTERVAL", "1e-20", "0.1"),
    ("FORGE_LOG_INTERVAL", "0.05", "0.1"),
    ("FORGE_LOG_INTERVAL", "0", "0.1"),
    ("FORGE_LOG_INTERVAL", "90000", "86400"),
    ("FORGE_HEALTH_MAX_AGE", "0.5", "2"),
    ("FORGE_HEALTH_MAX_AGE", "1e-9", "2"),
    ("FORGE_SIM_SPEED", "1e-20", "0.1"),
    ("FORGE_SIM_SPEED", "0.05", "0.1"),
    ("FORGE_POLL_INTERVAL", "1e-20", "0.01"),
    ("FORGE_SIM_SEED", "1000000", "999999"),
    ("FORGE_SIM_FOREIGN", ",".join(f"{k}-{k + 0.5}" for k in range(1001)), "1000"),
    ("FORGE_GPU", "100000", "1023"),
])
def test_below_the_floor_is_refused_with_the_range(env: str, raw: str, accepted: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([], {env: raw})
    assert_one_clean_line(str(info.value), env, accepted)


def test_tiny_log_interval_exits_2() -> None:
    assert_config_exit(forge("--simulate", "--duration", "5", env={"FORGE_LOG_INTERVAL": "1e-20"}),
                       "FORGE_LOG_INTERVAL")


def test_health_max_age_covers_the_heartbeat_of_a_slow_simulation() -> None:
    # At 0.1 virtual seconds per second the loop beats every ~10 s of wall time: 5 s would flap.
    with pytest.raises(ConfigError) as info:
        load_config([], {"FORGE_SIMULATE": "1", "FORGE_SIM_SPEED": "0.1", "FORGE_HEALTH_MAX_AGE": "5"})
    assert_one_clean_line(str(info.value), "FORGE_HEALTH_MAX_AGE", "FORGE_SIM_SPEED")
    assert load_config([], {"FORGE_SIMULATE": "1", "FORGE_SIM_SPEED": "0.1"}).health_max_age_s == 30


# The extremes each timing-related setting accepts; every setting must be listed (a new one must be thought
# about): () for a setting that does not pace the loop.
EXTREMES: dict[str, tuple[str, ...]] = {
    "FORGE_TARGET": ("1e-9", "1"),
    "FORGE_GPU": (),
    "FORGE_GPUS": (),
    "FORGE_BOOST_TARGET": ("1",),
    "FORGE_BOOST_AFTER": ("0", "1e-9", "1e300"),
    "FORGE_RESUME_AFTER": ("0", "1e-9", "1e300"),
    "FORGE_LOG_INTERVAL": ("0.1", "86400"),
    "FORGE_LOG_FORMAT": (),
    "FORGE_DURATION": ("1e-9", "1e300"),
    "FORGE_CONTROLLER": ("legacy",),
    "FORGE_POLL_INTERVAL": ("0.01", "1"),
    "FORGE_FOREIGN_MEM_MIB": ("1e-9", "1e300"),
    "FORGE_FOREIGN_UTIL": ("1e-9", "0.999999"),
    "FORGE_FOREIGN_SAMPLES": ("1", "100"),
    "FORGE_USE_PROCESS_LIST": ("0",),
    "FORGE_SIMULATE": (),
    "FORGE_METRICS_PORT": (),
    "FORGE_METRICS_ADDR": (),
    "FORGE_HEALTH_MAX_AGE": (),  # read by /health and the health command, not by the loop
    "FORGE_HEARTBEAT_FILE": (),
    "FORGE_SIM_SPEED": (),  # paced against the wall clock; its floor is what the health max age is checked against
    "FORGE_SIM_WINDOW": ("0.1657", "1"),
    "FORGE_SIM_SMS": ("1", "1024"),
    "FORGE_SIM_FOREIGN": (",".join(f"{k / 100:g}-{k / 100 + 1e-9:.9f}" for k in range(100)), "0-1e300"),
    "FORGE_SIM_FOREIGN_HIDDEN": ("4-1e300",),  # after the base run's visible job (1-3)
    "FORGE_SIM_FOREIGN_LOAD": ("1e-9", "1"),
    "FORGE_SIM_FOREIGN_MEM": ("0", "1e300"),
    "FORGE_SIM_HIDE_FOREIGN": ("1",),
    "FORGE_SIM_SEED": ("0", "999999"),
    "FORGE_SIM_GPUS": ("64",),
    "FORGE_SIM_FOREIGN_GPUS": ("0",),
    "FORGE_SIM_FAIL_GPU": ("0@1e300",),
    "FORGE_MAX_POWER_W": ("10", "10000"),  # below idle power: launches nothing; above the board: never binds
    "FORGE_ACTIVE_HOURS": ("Mon-Sun", "Mon 00:00-00:01"),  # always, and (nearly) never: paused the whole run
    "FORGE_PAUSE_FILE": ("/",),  # a directory: there, and unreadable as a time: paused the whole run
    "FORGE_HOLD_DIR": (),  # a directory the filler writes its acknowledgement into: tests/test_filler_holds.py
    "FORGE_HOLD_IDLE_AGE_OUT": ("0", "1e-9", "1e300"),
    "FORGE_KUBELET_SOCKET": (),  # a socket the filler connects to: tests/test_kubelet.py
}


def test_every_setting_has_its_extremes_listed() -> None:
    assert set(EXTREMES) == {s.env for s in SETTINGS}


class _CappedStream(io.StringIO):
    """Stops the run after `cap` lines, so that a setting that makes the loop spin fails instead of hanging."""

    def __init__(self, stop: threading.Event, cap: int) -> None:
        super().__init__()
        self.stop, self.cap, self.lines = stop, cap, 0

    def write(self, text: str) -> int:
        self.lines += text.count("\n")
        if self.lines >= self.cap:
            self.stop.set()
        return super().write(text)


EXTREME_CASES = [(env, raw) for env, values in EXTREMES.items() for raw in values]


@pytest.mark.parametrize(("env", "raw"), EXTREME_CASES, ids=[f"{e}={r[:20]}" for e, r in EXTREME_CASES])
def test_extreme_settings_neither_spin_nor_starve_the_loop(env: str, raw: str) -> None:
    """Five virtual seconds (a foreign job from 1 to 3 s): the loop keeps beating and writes a bounded log."""
    flags = {"FORGE_SIMULATE": "1", "FORGE_SIM_SPEED": "0", "FORGE_LOG_FORMAT": "json", "FORGE_LOG_INTERVAL": "1",
             "FORGE_SIM_FOREIGN": "1-3", "FORGE_RESUME_AFTER": "1", env: raw}
    config = load_config([], flags)
    stop = threading.Event()
    out = _CappedStream(stop, cap=200)
    beats: list[float] = []

    def beat() -> None:
        beats.append(0.0)
        if len(beats) >= 5:
            stop.set()

    run = run_simulated(config, out, stop, heartbeat=beat)
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    ended_early = config.duration_s and config.duration_s < 5
    assert len(beats) >= (1 if ended_early else 5), "the loop did not advance in virtual time"
    assert out.lines < 100, f"{out.lines} lines in 5 virtual seconds: the loop spins"
    assert events[-1]["event"] == "stop"
    assert not run.runtime.worker.in_flight


# --- the heartbeat: no links followed, nothing but a regular file of ours ---------------------------------------

def test_heartbeat_does_not_follow_a_symlink(tmp_path: Path) -> None:
    secret = tmp_path / "root-only"
    secret.write_text("precious\n")
    secret.chmod(0o600)
    link = tmp_path / "heartbeat"
    link.symlink_to(secret)
    health.Heartbeat(link)()
    assert secret.read_text() == "precious\n"
    assert link.is_symlink()
    ok, message = health.check(link, 30.0)
    assert not ok and "link" in message


def test_heartbeat_does_not_write_through_a_hard_link(tmp_path: Path) -> None:
    secret = tmp_path / "other"
    secret.write_text("precious\n")
    os.link(secret, tmp_path / "heartbeat")
    health.Heartbeat(tmp_path / "heartbeat")()
    assert secret.read_text() == "precious\n"


def test_a_directory_at_the_heartbeat_path_is_unhealthy(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat"
    path.mkdir()
    health.Heartbeat(path)()
    ok, message = health.check(path, 30.0)
    assert not ok and "directory" in message
    result = run_health({"FORGE_HEARTBEAT_FILE": str(path)})
    assert result.returncode == 1 and "directory" in result.stdout


def test_a_fifo_at_the_heartbeat_path_neither_blocks_nor_counts(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat"
    os.mkfifo(path)
    writer = threading.Thread(target=health.Heartbeat(path), daemon=True)
    writer.start()
    writer.join(timeout=5.0)
    assert not writer.is_alive(), "the heartbeat write blocked on a FIFO"
    ok, message = health.check(path, 30.0)
    assert not ok and "not a regular file" in message


def test_a_heartbeat_file_of_another_user_is_neither_written_nor_trusted(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    path = tmp_path / "heartbeat"
    path.write_text("theirs\n")
    os.chown(path, 12345, 12345)
    health.Heartbeat(path)()
    assert path.read_text() == "theirs\n"
    ok, message = health.check(path, 30.0)
    assert not ok and "12345" in message


def test_the_default_heartbeat_is_in_a_directory_only_we_own(tmp_path: Path) -> None:
    path = health.default_heartbeat_path(base=tmp_path)
    assert path.parent.name == f"forge_load-{os.geteuid()}"
    assert health.heartbeat_location(Config()) == (health.default_heartbeat_path(), True)
    health.Heartbeat(path, private_dir=True)()
    mode = path.parent.lstat().st_mode
    assert stat.S_ISDIR(mode) and stat.S_IMODE(mode) == 0o700
    assert stat.S_IMODE(path.lstat().st_mode) == 0o600
    assert health.check(path, 30.0, private_dir=True)[0]


@pytest.mark.parametrize("planted", ["symlink", "open directory", "other owner"])
def test_a_planted_default_directory_is_refused(tmp_path: Path, planted: str) -> None:
    path = health.default_heartbeat_path(base=tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if planted == "symlink":
        path.parent.symlink_to(elsewhere)
    elif planted == "open directory":
        path.parent.mkdir()
        path.parent.chmod(0o777)
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to give a directory to another user")
        path.parent.mkdir(mode=0o700)
        os.chown(path.parent, 12345, 12345)
    refused: list[str] = []
    health.Heartbeat(path, private_dir=True, on_refused=refused.append)()
    assert not (elsewhere / path.name).exists()
    assert not path.exists()
    assert len(refused) == 1 and str(path.parent) in refused[0]
    ok, message = health.check(path, 30.0, private_dir=True)
    assert not ok and str(path.parent) in message


# --- the health command reads the filler's settings -------------------------------------------------------------

def run_health(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    full.update(env, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "forge_load.health"], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def health_server() -> Iterator[Any]:
    servers: list[HTTPServer] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok\n")

        def log_message(self, *args: object) -> None:
            pass

    class Server6(HTTPServer):
        address_family = socket.AF_INET6

    def start(addr: str) -> int:
        server = (Server6 if ":" in addr else HTTPServer)((addr, 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return int(server.server_address[1])

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("listen", "setting"), [("::1", "::1"), ("127.0.0.2", "127.0.0.2"),
                                                 ("127.0.0.1", "0.0.0.0"), ("::1", "::")])
def test_health_asks_where_the_filler_listens(health_server: Any, tmp_path: Path, listen: str,
                                              setting: str) -> None:
    port = health_server(listen)
    result = run_health({"FORGE_METRICS_PORT": str(port), "FORGE_METRICS_ADDR": setting,
                         "FORGE_HEARTBEAT_FILE": str(tmp_path / "none")})
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("env", "name"), [
    ({"FORGE_METRICS_PORT": "http"}, "FORGE_METRICS_PORT"),
    ({"FORGE_METRICS_ADDR": "localhost"}, "FORGE_METRICS_ADDR"),
    ({"FORGE_HEALTH_MAX_AGE": "soon"}, "FORGE_HEALTH_MAX_AGE"),
    ({"FORGE_HEALTH_MAX_AGE": "0.5"}, "FORGE_HEALTH_MAX_AGE"),
    ({"FORGE_TARGET": "1.5"}, "FORGE_TARGET"),
    ({"FORGE_HEARTBEAT_FILE": "relative/path"}, "FORGE_HEARTBEAT_FILE"),
])
def test_health_refuses_what_the_filler_refuses_with_exit_1(env: dict[str, str], name: str) -> None:
    result = run_health(env)
    assert result.returncode == 1, result
    output = (result.stdout + result.stderr).strip().splitlines()
    assert len(output) == 1 and name in output[0] and "Traceback" not in result.stderr


# --- stdout closed or full ----------------------------------------------------------------------------------------

EXIT_LOG = 5


def _closed_after_two_lines(*options: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen([sys.executable, str(ENTRY), *options], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    lines = [proc.stdout.readline(), proc.stdout.readline()]  # `| head -2`
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=30)
    assert all("event=" in line for line in lines), lines
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", err)


def _into_dev_full(*options: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env["PYTHONPATH"] = str(ROOT)
    with open("/dev/full", "w") as full:
        return subprocess.run([sys.executable, str(ENTRY), *options], stdout=full, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=ROOT, timeout=30)


def assert_log_lost_exit(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == EXIT_LOG, (result.returncode, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "stdout" in lines[0], result.stderr
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr


SIM_RUN = ("--", "--simulate", "--sim-speed", "0", "--log-interval", "0.1")
REAL_RUN = ("--wall-clock-sim", "--", "--log-interval", "0.1", "--duration", "60")


@pytest.mark.parametrize("loop", ["simulated", "real"])
def test_a_closed_stdout_stops_cleanly(loop: str) -> None:
    assert_log_lost_exit(_closed_after_two_lines(*(SIM_RUN if loop == "simulated" else REAL_RUN)))


@pytest.mark.parametrize("loop", ["simulated", "real"])
def test_a_full_stdout_stops_cleanly(loop: str) -> None:
    assert_log_lost_exit(_into_dev_full(*(SIM_RUN if loop == "simulated" else REAL_RUN)))


def test_a_closed_stdout_drains_the_kernels_and_closes_the_gpu() -> None:
    from forge_load.log import LogStream
    from forge_load.service import gpu_threads, runtime

    class Broken(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.writes = 0

        def write(self, text: str) -> int:
            self.writes += 1
            if self.writes > 3:
                raise BrokenPipeError(32, "Broken pipe")
            return super().write(text)

    config = load_config("--simulate --sim-speed 0 --log-interval 0.1".split(), {})
    stop, wake = threading.Event(), threading.Event()
    failures: list[OSError] = []

    def lost(error: OSError) -> None:
        failures.append(error)
        stop.set()
        wake.set()

    gpu_slots = GpuSlots(30.0, simulated=True)
    runtimes: list[runtime.Runtime] = []
    code = gpu_threads.run_gpus(config, LogStream(Broken(), lost), stop, wake, gpu_slots,
                                on_start=lambda _slot, rt: runtimes.append(rt))
    assert code == 0 and len(failures) == 1
    [slot] = gpu_slots.slots
    assert slot.status == "stopped"
    [rt] = runtimes
    assert not rt.worker.in_flight
    assert not rt.launcher.gpu.context_open  # type: ignore[attr-defined]


# --- signals at every moment --------------------------------------------------------------------------------------

def _spawn(*options: str, pid1: bool = False, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    full.update(env or {}, PYTHONPATH=str(ROOT), FORGE_LOG_FORMAT="json")
    command = [sys.executable, str(ENTRY), *options]
    if pid1:
        command = ["unshare", "--pid", "--fork", "--mount-proc", *command]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full, cwd=ROOT)


def _finish(proc: subprocess.Popen[str], first: list[str] | None = None) -> tuple[int, list[dict[str, Any]], str]:
    out, err = proc.communicate(timeout=30)
    lines = [line for line in (first or []) + out.splitlines() if line.strip()]
    return proc.returncode, [json.loads(line) for line in lines], err


def assert_stopped_by(code: int, events: list[dict[str, Any]], err: str, signum: int) -> None:
    assert code == 0, (code, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err == "", err
    assert events and events[-1]["event"] == "stop", events
    assert events[-1]["reason"] == f"signal {signal.Signals(signum).name}", events[-1]


def pid1_possible() -> str | None:
    try:
        probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                               timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"no unshare: {error}"
    return None if probe.returncode == 0 else f"unshare --pid fails here: {probe.stderr.decode().strip()}"


STARTUP_SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]


@pytest.mark.parametrize("signum", STARTUP_SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_signal_during_start_up_imports_stops_it(signum: int) -> None:
    name = signal.Signals(signum).name
    proc = _spawn("--signal-on-import", f"{name}:forge_load.service.app", "--", "--simulate", "--duration", "30")
    assert_stopped_by(*_finish(proc), signum)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: signal.Signals(s).name)
def test_a_signal_during_start_up_is_not_lost_as_pid_1(signum: int) -> None:
    if (why := pid1_possible()) is not None:
        pytest.skip(why)
    name = signal.Signals(signum).name
    proc = _spawn("--signal-on-import", f"{name}:forge_load.service.app", "--", "--simulate", "--duration", "30",
                  pid1=True)
    assert_stopped_by(*_finish(proc), signum)


def _host_pid_of_pid1(unshare_pid: int) -> int:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            children = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text().split()
        except OSError:
            children = []
        if children:
            return int(children[0])
        time.sleep(0.001)
    raise AssertionError("unshare started no child")


def _catches(pid: int, signum: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.MULTILINE)[1], 16)  # type: ignore[index]
    return bool(caught >> (signum - 1) & 1)


def test_sigterm_the_moment_pid_1_can_catch_it() -> None:
    """As `docker stop` right after `docker run`: sent as soon as the handler exists, long before the start line."""
    if (why := pid1_possible()) is not None:
        pytest.skip(why)
    proc = _spawn("--", "--simulate", "--duration", "30", pid1=True)
    pid = _host_pid_of_pid1(proc.pid)
    deadline = time.monotonic() + 20
    while not _catches(pid, signal.SIGTERM) and time.monotonic() < deadline:
        time.sleep(0.0005)
    os.kill(pid, signal.SIGTERM)
    assert_stopped_by(*_finish(proc), signal.SIGTERM)


@pytest.mark.parametrize("signum", [signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
def test_a_signal_while_running_stops_it(signum: int) -> None:
    proc = _spawn("--", "--simulate", "--log-interval", "0.1")
    assert proc.stdout is not None
    first = [proc.stdout.readline(), proc.stdout.readline()]  # start, then a status: running
    proc.send_signal(signum)
    assert_stopped_by(*_finish(proc, first), signum)


def _pending(pid: int, signum: int) -> bool:
    """Whether `signum` is still pending for the process (not yet delivered to a handler)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    masks = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask >> (signum - 1) & 1 for mask in masks)


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM], ids=lambda s: signal.Signals(s).name)
def test_more_signals_during_shutdown_change_nothing(second: int) -> None:
    proc = _spawn("--", "--simulate", "--log-interval", "0.1")
    assert proc.stdout is not None
    first = [proc.stdout.readline(), proc.stdout.readline()]
    proc.send_signal(signal.SIGTERM)
    # Two signals pending at once are delivered lowest number first (SIGINT before SIGTERM): the operator's
    # SIGTERM is the first only once the kernel has delivered it, so the flood waits for that.
    while _pending(proc.pid, signal.SIGTERM):
        time.sleep(0.001)
    while proc.poll() is None:  # as an impatient operator would, until it has exited
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(second)
        time.sleep(0.002)
    assert_stopped_by(*_finish(proc, first), signal.SIGTERM)


def test_sigint_before_the_gpus_open_prints_no_traceback() -> None:
    proc = _spawn("--signal-on-import", "SIGINT:forge_load.gpu.sim", "--", "--simulate", "--duration", "30")
    code, events, err = _finish(proc)
    assert "KeyboardInterrupt" not in err and "Traceback" not in err
    assert code == 0 and events[-1]["event"] == "stop"


# --- log lines cannot be forged -------------------------------------------------------------------------------------

NASTY = "a\x1b[31mred\x00nul\x07bel\x7fdel\rcr\nt=9.00 event=stop\x85nel\u2028ls\u202ebidi"


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_no_raw_control_characters_in_the_log(fmt: str) -> None:
    out = io.StringIO()
    EventLog(fmt, out, static={"gpu": 0}).emit("error", t=1.0, reason=NASTY, gpu_name=NASTY)
    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1
    line = text[:-1]
    bad = [c for c in line if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")]
    assert not bad, bad
    if fmt == "json":
        assert json.loads(line)["reason"] == NASTY
    else:
        assert re.match(r'^t=1\.00 event=error reason="a\\u001b\[31mred\\u0000nul', line), line


# --- unknown variables, the fleet script ----------------------------------------------------------------------------

def test_a_typo_is_warned_about_with_the_closest_name() -> None:
    result = forge("--simulate", "--sim-speed", "0", "--duration", "1", env={"FORGE_TARGE": "0.9"})
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "FORGE_TARGE" in lines[0] and "FORGE_TARGET" in lines[0], result.stderr


def test_unknown_variables_are_warned_about_in_one_clean_line_each() -> None:
    from forge_load.config.load import unknown_variables

    warnings = unknown_variables({"FORGE_LOG_INTERVALS": "1", "forge_target": "0.5", "FORGE_X\x1b[2J": "1",
                                  "FORGE_TARGET": "0.5", "PATH": "/bin", "FORGE_IMAGE": "forge-load:latest"})
    assert len(warnings) == 3, warnings
    for warning in warnings:
        assert_one_clean_line(warning)
    assert any("FORGE_LOG_INTERVAL" in w and "FORGE_LOG_INTERVALS" in w for w in warnings)
    assert any("forge_target" in w and "FORGE_TARGET" in w for w in warnings)


@pytest.mark.parametrize(("args", "name"), [
    (["--target", "1.5"], "FORGE_TARGET"),
    (["-e", "FORGE_LOG_INTERVAL=1e-20"], "FORGE_LOG_INTERVAL"),
    (["-e", "FORGE_SIM_SEED=" + "9" * 5000], "FORGE_SIM_SEED"),
    (["-e", "FORGE_METRICS_ADDR=fe80::1%x\nevent=stop"], "FORGE_METRICS_ADDR"),
])
def test_fleet_validates_settings_before_touching_the_engine(args: list[str], name: str,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from forge_load.fleet import command, engine

    def no_engine() -> None:
        raise AssertionError("the engine was contacted before the settings were checked")

    monkeypatch.setattr(engine, "connect", no_engine)
    assert command.main(["up", "--simulate", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert_one_clean_line(err.splitlines()[0], name)


def test_fleet_warns_about_an_unknown_variable(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from forge_load.fleet import command, engine

    def no_engine() -> None:
        raise engine.FleetError("no engine here")

    monkeypatch.setattr(engine, "connect", no_engine)
    assert command.main(["up", "--simulate", "-e", "FORGE_TARGE=0.9"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "FORGE_TARGET" in err[0] and "no engine here" in err[1], err


@pytest.mark.parametrize("docker_host", ["tcp://[::1", "tcp://:::", "tcp://host:notaport", "foo://bar"])
def test_fleet_malformed_docker_host_is_one_line(docker_host: str) -> None:
    result = subprocess.run([sys.executable, "-m", "forge_load", "fleet", "status"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "DOCKER_HOST": docker_host})
    assert result.returncode == 1, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and docker_host in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_fleet_ctrl_c_is_one_line_and_exit_130(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from forge_load.fleet import command, engine

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "connect", interrupted)
    assert command.main(["status"]) == 130
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "interrupted" in err[0], err


# --- one GPU named twice (tests/test_metrics.py runs it on simulated GPUs) -------------------------------------------

def test_real_gpus_named_twice_are_resolved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import forge_load.gpu.nvml
    from forge_load.control.probe import DeviceInfo
    from forge_load.service import gpu_threads

    infos = [DeviceInfo(index=i, uuid=f"GPU-{i}0000000-0000-4000-8000-000000000000", name="x",
                        memory_total_mib=1.0, driver_version="1", mig_enabled=False) for i in range(2)]
    monkeypatch.setattr(forge_load.gpu.nvml, "list_devices", lambda *a, **k: infos)
    config = load_config(["--gpus", f"1,{infos[1].uuid},0,{infos[0].uuid}"], {})
    assert gpu_threads.gpu_selectors(config, backend_for(config)) == ["1", "0"]


# --- the health command's own help, and the floor its help names ------------------------------------------------

def test_health_help_says_what_it_checks_and_its_exit_codes() -> None:
    result = subprocess.run([sys.executable, "-m", "forge_load.health", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result
    text = result.stdout
    assert len(text.splitlines()) < 30, "the filler's help, not the health command's"
    assert "--sim-" not in text and "forge_load.health" in text.splitlines()[0]
    assert re.search(r"\b0 healthy\b", text) and re.search(r"\b1 unhealthy\b", text)
    assert "Never 2" in text


def test_the_health_max_age_floor_in_the_help_is_accepted() -> None:
    [setting] = [s for s in SETTINGS if s.env == "FORGE_HEALTH_MAX_AGE"]
    match = re.search(r">= ([0-9.]+)", setting.help)
    assert match, setting.help
    floor = match[1]
    assert load_config([], {"FORGE_HEALTH_MAX_AGE": floor}).health_max_age_s == float(floor)
    assert load_config(["--health-max-age", floor], {}).health_max_age_s == float(floor)
    with pytest.raises(ConfigError) as info:
        load_config([], {"FORGE_HEALTH_MAX_AGE": f"{float(floor) - 0.01:g}"})
    assert_one_clean_line(str(info.value), "FORGE_HEALTH_MAX_AGE", floor)


# --- the counters agree with the lines before them ---------------------------------------------------------------

def _yield_spells(events: list[dict[str, Any]]) -> tuple[int, float]:
    """(times the lines went into `yielding`, seconds they spent there) up to the stop line."""
    count, spent_s, since_s, state = 0, 0.0, None, "filling"
    for event in events:
        t_s, new = float(event["t"]), event["state"]
        if event["event"] == "stop":
            break
        if new == "yielding" and state != "yielding":
            count, since_s = count + 1, t_s
        elif new != "yielding" and state == "yielding" and since_s is not None:
            spent_s, since_s = spent_s + t_s - since_s, None
        state = new
    if since_s is not None:
        spent_s += float(events[-1]["t"]) - since_s
    return count, spent_s


def test_a_job_seen_while_paused_counts_as_a_yield_in_the_stop_line() -> None:
    """Paused from the start, a job at 2-4 s, SIGUSR2 at 6 s: the unpause goes to `yielding` until 9 s."""
    from forge_load.operators.pause import PauseSwitch
    from forge_load.service.runtime import Controls
    from tests.test_operators import simulate

    switch = PauseSwitch()
    switch.set(True, "SIGUSR1")
    run = simulate("--duration 12 --sim-foreign 2-4 --resume-after 5", controls=Controls(switch),
                   at={6.0: lambda: switch.set(False, "SIGUSR2")})
    unpause = run.of("unpause")[0]
    assert unpause["state"] == "yielding", unpause
    stop = run.of("stop")[0]
    count, spent_s = _yield_spells(run.events)
    assert count == 1 and spent_s > 2.0
    assert stop["yields"] == count, stop
    assert float(stop["yielding_s"]) == pytest.approx(spent_s, abs=0.01)


# --- a signal storm: the pause acts at once, the log stays readable -----------------------------------------------

@pytest.mark.parametrize("pause_file", [True, False], ids=["pause file there", "no pause file"])
def test_a_signal_storm_pauses_at_once_and_coalesces_its_lines(tmp_path: Path, pause_file: bool) -> None:
    """SIGUSR1 and SIGUSR2 by turns every 10 ms for 20 virtual seconds (as a `while true; do docker kill -s USR1
    ...; docker kill -s USR2 ...; done` would): every pause takes effect at the step it is seen, the log holds about
    a pause line a second, and its last pause line says the state the storm left."""
    from forge_load.operators.pause import PauseSwitch
    from forge_load.service.loop import open_simulated
    from forge_load.service.runtime import Controls, log_start, log_stop

    path = tmp_path / "pause"
    if pause_file:
        path.touch()
    config = load_config(["--simulate", "--log-format", "json", "--log-interval", "5", "--pause-file", str(path)], {})
    switch = PauseSwitch()
    out = io.StringIO()
    run = open_simulated(config, out, controls=Controls(switch))
    rt, clock = run.runtime, run.clock
    log_start(rt, {})
    monitor_due_s = rt.monitor.step(0.0)
    storm_s, step_s = 20.0, 0.01
    for i in range(1, int(storm_s / step_s) + 1):
        now_s = i * step_s
        clock.advance_to(now_s)
        if monitor_due_s <= now_s:
            monitor_due_s = rt.monitor.step(now_s)
        switch.set(i % 2 == 1, "SIGUSR1" if i % 2 == 1 else "SIGUSR2")
        rt.filler.step(now_s)
        paused = pause_file or switch.by is not None
        assert (rt.filler.state.value == "paused") == paused, (now_s, rt.filler.state)
        if paused:
            assert rt.worker.plan.duty_ratio == 0, f"still launching at {now_s:.2f} s while paused"
    switch.set(True, "SIGUSR1")  # the storm ends paused by the signal (and the file, where there is one)
    end_s = storm_s + 0.05
    clock.advance_to(end_s)
    rt.filler.step(end_s)
    assert rt.worker.plan.duty_ratio == 0
    while rt.worker.in_flight:
        clock.advance_to(rt.worker.drain(clock.now()))
    log_stop(rt, clock.now(), "signal SIGTERM")
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    changes = [e for e in events if e["event"] in ("pause", "unpause")]
    assert len(changes) <= storm_s + 3, f"{len(changes)} pause lines in {storm_s:g} s"
    assert len(events) <= 2 * storm_s + 10, f"{len(events)} lines in {storm_s:g} s"
    assert sum(int(e.get("coalesced", 0)) for e in changes) > 1000  # the lines say how many changes they stand for
    last = changes[-1]
    assert last["event"] == "pause" and last["state"] == "paused", last
    assert last["reason"].startswith("SIGUSR1 (SIGUSR2 resumes)"), last
    assert ("pause file" in last["reason"]) == pause_file, last
    assert events[-1]["event"] == "stop" and events[-1]["state"] == "paused"


# --- no kernel of ours before the filler may fill ---------------------------------------------------------------

# Moments of start-up a SIGUSR1 can come at: before the settings are read, before NVML opens, as the launcher is
# imported, and just before CUDA starts (cuda-bindings' driver module is imported right before cuInit).
START_UP_MOMENTS = ("forge_load.service.app", "pynvml", "forge_load.gpu.launcher", "cuda.bindings.driver")


def test_no_kernel_runs_at_start_when_none_may_on_the_virtual_gpu(vgpu: Any, tmp_path: Path) -> None:
    """The virtual GPU's own record: not one kernel of ours with the pause file there at start, after a SIGUSR1
    at any moment of start-up, or with a foreign job on the GPU at start (the unmodified cuda-bindings path)."""
    from tests.test_real_path import Run, finish, foreign_job, forge

    pause = tmp_path / "pause"
    pause.touch()
    runs: dict[str, Run] = {"pause file": forge(vgpu(), "--pause-file", str(pause), "--duration", "2")}
    for module in START_UP_MOMENTS:
        gpu = vgpu()
        command = [sys.executable, str(ENTRY), "--signal-on-import", f"SIGUSR1:{module}", "--", "--log-format",
                   "json", "--duration", "2"]
        own = {"PYTHONPATH": str(ROOT), "FORGE_HEARTBEAT_FILE": str(gpu.state_dir / "heartbeat")}
        proc = subprocess.Popen(command, env=gpu.env({**os.environ, **own}), cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        runs[f"SIGUSR1 at import of {module}"] = Run(gpu, proc, time.time())
    busy = vgpu()
    with foreign_job(busy, seconds=60.0) as job:
        assert job.stdout is not None
        while json.loads(job.stdout.readline())["event"] != "context":
            pass
        runs["a foreign job at start"] = forge(busy, "--duration", "2")
        assert finish(runs["a foreign job at start"]) == 0, runs["a foreign job at start"].stderr[-2000:]
    for case, run in runs.items():
        assert finish(run) == 0, (case, run.stderr[-2000:])
        ours = run.kernels()
        assert ours == [], f"{case}: {len(ours)} kernels of ours ran, the first {ours[0].start - run.wall(0):.3f} s in"
        first = run.events[1]  # the line after the start line says why nothing ran
        if case == "a foreign job at start":
            assert first["event"] == "yield" and "process" in first["signals"], (case, first)
        else:
            assert first["event"] == "pause", (case, first)
            assert first["reason"].startswith("SIGUSR1" if "SIGUSR1" in case else "pause file"), (case, first)


@pytest.mark.parametrize("case", ["pause file", "SIGUSR1 before start", "a foreign job at start"])
def test_no_kernel_runs_at_start_when_none_may_on_the_simulated_gpu(tmp_path: Path, case: str) -> None:
    from forge_load.operators.pause import PauseSwitch
    from forge_load.service.runtime import Controls
    from tests.test_operators import simulate

    pause, switch = tmp_path / "pause", PauseSwitch()
    flags = "--duration 3"
    if case == "pause file":
        pause.touch()
        flags += f" --pause-file {pause}"
    elif case == "SIGUSR1 before start":
        switch.set(True, "SIGUSR1")
    else:
        flags += " --sim-foreign 0-10"
    run = simulate(flags, controls=Controls(switch))
    assert run.kernel_starts(0.0, 3.0) == []
    assert run.events[1]["event"] == ("yield" if case == "a foreign job at start" else "pause")


# --- a blind foreign-job signal is said -------------------------------------------------------------------------

ALL_BLIND = ("processes", "memory_used_mib", "utilization_samples", "utilization_ratio")
PROCESS_QUERIES = [f"nvmlDevice{kind}RunningProcesses{version}" for kind in ("GetCompute", "GetGraphics")
                   for version in ("_v3", "_v2", "")]


def test_a_blind_process_signal_is_said_on_the_virtual_gpu(vgpu: Any) -> None:
    from tests.test_real_path import finish, forge

    run = forge(vgpu(not_supported=PROCESS_QUERIES), "--duration", "1")
    assert finish(run) == 0, run.stderr[-2000:]
    start = run.of("start")[0]
    assert start["signals"] == "memory,utilization", start
    [warning] = run.of("warning")
    assert warning["blind"] == "process", warning
    assert "process" in warning["reason"] and "not supported" in warning["reason"], warning
    assert "memory,utilization" in warning["reason"], warning


@pytest.mark.parametrize(("blind", "seen"), [
    ((), "process,memory,utilization"),
    (("processes",), "memory,utilization"),
    (("memory_used_mib",), "process,utilization"),
    (("utilization_samples", "utilization_ratio"), "process,memory"),
    (("utilization_samples",), "process,memory,utilization"),  # the latest window's ratio stands in
    (ALL_BLIND, ""),  # fills only because holds announce jobs (the hold directory exists)
])
def test_the_start_line_names_the_signals_that_work_and_a_warning_the_blind_ones(
        blind: tuple[str, ...], seen: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from forge_load.gpu.sim import SimProbe

    for query in blind:
        monkeypatch.setattr(SimProbe, query, lambda self, *args: None)
    out = io.StringIO()
    run_simulated(load_config(f"--simulate --sim-speed 0 --duration 1 --log-format json --hold-dir {tmp_path}".split(),
                              {}), out)
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert events[0]["event"] == "start" and events[0]["signals"] == seen, events[0]
    warnings = [e for e in events if e["event"] == "warning"]
    if seen == "process,memory,utilization":
        assert warnings == []
        return
    [warning] = warnings
    named = {"processes": "process", "memory_used_mib": "memory", "utilization_ratio": "utilization"}
    assert warning["blind"] == ",".join(named[q] for q in blind if q in named), warning
    assert_one_clean_line(warning["reason"], *warning["blind"].split(","))
    if not seen:
        assert "no foreign job" in warning["reason"], warning


def test_a_gpu_where_no_foreign_job_can_be_seen_or_announced_is_not_filled(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    """Every signal blind and no hold directory: nothing could ever make the filler step aside for a job, so the
    GPU is left alone (exit 3 for it, one line) rather than filled beside jobs it cannot see."""
    from forge_load.control.probe import NoGpuError
    from forge_load.gpu.sim import SimProbe

    for query in ALL_BLIND:
        monkeypatch.setattr(SimProbe, query, lambda self, *args: None)
    out = io.StringIO()
    flags = f"--simulate --sim-speed 0 --duration 1 --log-format json --hold-dir {tmp_path / 'none'}"
    with pytest.raises(NoGpuError) as caught:
        run_simulated(load_config(flags.split(), {}), out)
    assert_one_clean_line(str(caught.value), "no foreign job", "FORGE_HOLD_DIR")
    assert [json.loads(line)["event"] for line in out.getvalue().splitlines()] == []  # not even a start line


def test_a_process_list_switched_off_is_not_named_but_not_warned_about() -> None:
    out = io.StringIO()
    run_simulated(load_config("--simulate --sim-speed 0 --duration 1 --log-format json --no-process-list".split(),
                              {}), out)
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert events[0]["signals"] == "memory,utilization"
    assert not [e for e in events if e["event"] == "warning"]


# --- one heartbeat, one filler ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("one", "other"), [
    (["--gpu", "0"], ["--gpu", "1"]),
    (["--gpus", "0,1"], ["--gpu", "0"]),
    (["--gpus", "all"], ["--gpus", "0,1"]),
    (["--simulate"], []),
    (["--gpu", "GPU-00000000-0000-4000-8000-000000000000"], ["--gpu", "0"]),
])
def test_fillers_of_other_gpus_have_other_default_heartbeats(one: list[str], other: list[str]) -> None:
    first, second = (health.heartbeat_location(load_config(args, {})) for args in (one, other))
    assert first != second and first[1] and second[1]
    assert first[0].parent == second[0].parent == health.default_heartbeat_path().parent
    assert health.heartbeat_location(load_config(["--gpus", "1,0"], {})) == \
        health.heartbeat_location(load_config(["--gpus", "0,1"], {}))


def _started(proc: subprocess.Popen[str]) -> list[str]:
    """Read the process's stdout up to its start line (it runs on)."""
    assert proc.stdout is not None
    lines = [proc.stdout.readline()]
    assert '"start"' in lines[0], lines[0] + (proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
    return lines


def test_the_health_check_judges_the_filler_its_settings_name() -> None:
    """Two simulated GPUs of one user's: the health check of GPU 6 does not read GPU 7's filler's heartbeat."""
    sim = {"FORGE_SIMULATE": "1", "FORGE_SIM_GPUS": "8"}
    proc = _spawn("--", "--simulate", "--sim-gpus", "8", "--gpu", "7", "--duration", "60")
    try:
        first = _started(proc)
        deadline_s = time.monotonic() + 20
        while (ours := run_health({**sim, "FORGE_GPU": "7"})).returncode != 0 and time.monotonic() < deadline_s:
            time.sleep(0.2)
        assert ours.returncode == 0, ours
        other = run_health({**sim, "FORGE_GPU": "6"})
        assert other.returncode == 1 and "no heartbeat" in other.stdout and "gpu6" in other.stdout, other
    finally:
        proc.send_signal(signal.SIGTERM)
    code, events, err = _finish(proc, first)
    assert code == 0 and events[-1]["event"] == "stop", err


def test_a_second_filler_of_the_same_gpus_is_refused() -> None:
    """As a second `forge-load --gpu 3` beside a running one (a unit, or a test run): exit 2, one line, before it
    opens the GPU; the first runs on."""
    proc = _spawn("--wall-clock-sim", "--", "--gpu", "3", "--duration", "60")
    try:
        first = _started(proc)
        second = subprocess.Popen([sys.executable, str(ENTRY), "--wall-clock-sim", "--", "--gpu", "3", "--duration",
                                   "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                  env={**{k: v for k, v in os.environ.items() if not k.startswith("FORGE_")},
                                       "PYTHONPATH": str(ROOT)})
        out, err = second.communicate(timeout=60)
        assert second.returncode == 2, (second.returncode, out[-1000:], err[-1000:])
        assert out == "" and len(err.splitlines()) == 1, err
        assert_one_clean_line(err.strip(), f"pid {proc.pid}", "heartbeat-gpu3", "FORGE_GPU")
        assert proc.poll() is None, "the first filler stopped"
    finally:
        proc.send_signal(signal.SIGTERM)
    code, events, err = _finish(proc, first)
    assert code == 0 and events[-1]["event"] == "stop" and err == "", err


def test_a_shared_heartbeat_file_is_refused_for_other_gpus_too(tmp_path: Path) -> None:
    beat = str(tmp_path / "heartbeat")
    proc = _spawn("--wall-clock-sim", "--", "--gpu", "3", "--duration", "60", "--heartbeat-file", beat)
    try:
        first = _started(proc)
        second = forge("--gpu", "4", "--duration", "2", "--heartbeat-file", beat)
        assert second.returncode == 2, second
        assert_one_clean_line(second.stderr.strip(), f"pid {proc.pid}", f"FORGE_HEARTBEAT_FILE={beat}")
    finally:
        proc.send_signal(signal.SIGTERM)
    code, events, err = _finish(proc, first)
    assert code == 0 and err == "", err


def test_a_second_simulation_of_the_same_gpus_warns_and_leaves_the_heartbeat_alone() -> None:
    proc = _spawn("--", "--simulate", "--sim-gpus", "8", "--gpu", "5", "--duration", "60")
    try:
        first = _started(proc)
        second = forge("--simulate", "--sim-gpus", "8", "--gpu", "5", "--sim-speed", "0", "--duration", "5")
        assert second.returncode == 0, second
        assert len(second.stderr.splitlines()) == 1, second.stderr
        assert_one_clean_line(second.stderr.strip(), "warning", f"pid {proc.pid}", "heartbeat-sim-gpu5")
    finally:
        proc.send_signal(signal.SIGTERM)
    code, events, err = _finish(proc, first)
    assert code == 0 and err == "", err


def test_a_second_filler_of_one_gpu_by_another_name_is_refused_on_the_virtual_gpu(vgpu: Any) -> None:
    """`--gpu 0` runs; `--gpu GPU-...` (the same GPU by its UUID, another heartbeat) exits 2 before it makes a
    context, without a kernel, saying which filler has the GPU."""
    from tests.test_real_path import finish, forge, wait_for

    gpu = vgpu()
    first = forge(gpu, "--duration", "30")
    try:
        wait_for(first, "start")
        second = forge(gpu, "--gpu", gpu.uuids()[0], "--duration", "2")
        assert second.wait() == 2, (second.stdout[-2000:], second.stderr[-2000:])
        [error] = second.of("error")
        assert error["exit_code"] == 2 and f"pid {first.proc.pid}" in error["reason"], error
        assert len(second.stderr.splitlines()) == 1, second.stderr
        assert_one_clean_line(second.stderr.strip(), f"pid {first.proc.pid}", gpu.uuids()[0])
        assert second.kernels() == []
        assert first.proc.poll() is None and first.of("yield") == [], "the first filler took the second for a job"
    finally:
        first.proc.send_signal(signal.SIGTERM)
    assert finish(first) == 0, first.stderr[-2000:]
    assert first.of("yield") == []


def test_a_fleet_leaves_out_a_gpu_another_filler_fills_and_fills_the_rest() -> None:
    """`--gpu 1` runs; `--gpus 0,1` fills GPU 0, and GPU 1's filler ends at once with an error line (exit 2)."""
    proc = _spawn("--wall-clock-sim", "--", "--gpu", "1", "--duration", "60")
    try:
        first = _started(proc)
        second = _spawn("--wall-clock-sim", "--", "--gpus", "0,1", "--duration", "2")
        code, events, err = _finish(second)
        assert code == 2, (code, err)
        [error] = [e for e in events if e["event"] == "error"]
        assert error["gpu"] == 1 and error["exit_code"] == 2 and f"pid {proc.pid}" in error["reason"], error
        assert [e["gpu"] for e in events if e["event"] == "stop"] == [0]  # GPU 0 was filled to the end
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
    code, events, err = _finish(proc, first)
    assert code == 0 and err == "", err


# --- the pause file: no content crashes anything (issue 17) ------------------------------------------------------

FAR_PAUSE_TIMES = {  # content -> whether it pauses (until the file is removed), or is a time long past
    "999999999999": True,  # a Unix time in the year 33658
    "0001-01-01T00:00:00+14:00": False,  # before the year 1 in UTC
    "9999-12-31T23:59:59-12:00": True,  # the year 10000 in UTC
    "0000-01-01T00:00:00Z": False,
    "1763640000000": True,  # milliseconds by mistake
    "33658-09-27T01:46:39+00:00": True,  # `date -d @999999999999 -Iseconds`
    "1." + "9" * 240: False,
}


@pytest.mark.parametrize("content", list(FAR_PAUSE_TIMES))
def test_a_far_time_in_the_pause_file_at_start_crashes_nothing(tmp_path: Path, content: str) -> None:
    pause = tmp_path / "pause"
    pause.write_text(content + "\n")
    result = forge("--simulate", "--sim-speed", "0", "--duration", "2", "--log-format", "json",
                   "--pause-file", str(pause))
    assert result.returncode == 0 and result.stderr == "", (result.returncode, result.stderr, result.stdout[-2000:])
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert [e["event"] for e in events if e["event"] in ("error", "stop")] == ["stop"]
    pauses = [e for e in events if e["event"] == "pause"]
    if FAR_PAUSE_TIMES[content]:
        [line] = pauses
        assert "a time after the year 9999: paused until it is removed" in line["reason"], line
        assert events[-1]["state"] == "paused"
    else:
        assert pauses == [] and events[-1]["state"] == "filling"


@pytest.mark.parametrize("content", list(FAR_PAUSE_TIMES))
def test_a_far_time_written_mid_run_crashes_nothing(tmp_path: Path, content: str) -> None:
    pause = tmp_path / "pause"
    config = load_config(["--simulate", "--sim-speed", "0", "--duration", "5", "--log-format", "json",
                          "--pause-file", str(pause)], {})
    beats: list[int] = []

    def beat() -> None:  # once a virtual second: the file appears after two
        beats.append(1)
        if len(beats) == 2:
            pause.write_text(content)

    out = io.StringIO()
    run_simulated(config, out, heartbeat=beat)
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["event"] for e in events if e["event"] in ("error", "stop")] == ["stop"], events[-1]
    assert len(beats) >= 4, "the loop stopped beating"
    assert [e["event"] == "pause" for e in events].count(True) == int(FAR_PAUSE_TIMES[content])


# --- the host's limit on open files (issue 17) ---------------------------------------------------------------------

def test_too_low_an_open_files_limit_is_one_line_naming_it_not_a_gpu_failure() -> None:
    import resource

    from forge_load.service.app import MIN_OPEN_FILES

    def low_limit() -> None:
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (12, hard))

    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, "-m", "forge_load", "--simulate", "--duration", "1"], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=60, preexec_fn=low_limit)
    assert result.returncode == 2, (result.returncode, result.stderr, result.stdout[-500:])
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert_one_clean_line(lines[0], "ulimit -n", "12", str(MIN_OPEN_FILES))
    assert "CUDA" not in lines[0] and not EVENT_RE.search(result.stdout)


# --- a ratio above 1: the percent it suggests is one the setting takes, and only for a whole number (issue 17) ----

RATIO_SETTINGS = [s for s in SETTINGS if getattr(s.parse, "func", None) is config_values.ratio_value]


@pytest.mark.parametrize("env", [s.env for s in RATIO_SETTINGS])
@pytest.mark.parametrize("raw", ["1.5", "2", "10", "50", "99.5", "100", "150", "1e2"])
def test_a_ratio_above_1_suggests_only_a_percent_that_is_meant_and_taken(env: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([], {env: raw})
    message = str(info.value)
    assert_one_clean_line(message, env)
    suggested = re.search(r"did you mean (\S+)\?", message)
    if not raw.isdigit():  # 1.5 is not how a percent is written: 1.5 % is no likelier than 15 % or 0.15
        assert suggested is None, message
        return
    [setting] = [s for s in RATIO_SETTINGS if s.env == env]
    if suggested is not None:
        assert suggested[1] == f"{raw}%"
        setting.parse(suggested[1])  # the setting takes it (another setting may still disagree: a boost below target)
    else:
        with pytest.raises(config_values.Rejected):
            setting.parse(raw + "%")


def test_there_are_ratio_settings_to_check() -> None:
    assert {"FORGE_TARGET", "FORGE_BOOST_TARGET", "FORGE_FOREIGN_UTIL"} <= {s.env for s in RATIO_SETTINGS}


# --- TZ naming what the C library would wait on (issue 17) ---------------------------------------------------------

@pytest.fixture
def launcher(tmp_path: Path) -> Path:
    """bin/forge-load as installed: beside a forge-load-python that runs this checkout's forge_load."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    command = bin_dir / "forge-load"
    command.write_bytes((ROOT / "bin" / "forge-load").read_bytes())
    python = bin_dir / "forge-load-python"
    python.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                      "from forge_load.cli import entry\nentry()\n")
    for path in (command, python):
        path.chmod(0o755)
    return command


def _through_launcher(command: Path, tz: str, extra_env: dict[str, str] | None = None,
                      stdin: int | None = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_") and k not in ("TZ", "TZDIR")}
    env.update(extra_env or {}, TZ=tz)
    with subprocess.Popen([str(command), "--simulate", "--sim-speed", "0", "--duration", "1", "--active-hours",
                           "Mon-Sun"], stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env) as proc:
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"TZ={tz!r}: start-up hangs") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("kind", ["fifo", "colon fifo", "relative fifo", "TZDIR fifo", "/dev/zero", "/dev/stdin"])
def test_tz_naming_a_fifo_or_a_device_exits_2_at_once(launcher: Path, tmp_path: Path, kind: str) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    extra: dict[str, str] = {}
    tz = {"fifo": str(fifo), "colon fifo": f":{fifo}", "relative fifo": "../../../../../../../.." + str(fifo),
          "/dev/zero": "/dev/zero", "/dev/stdin": "/dev/stdin", "TZDIR fifo": "fifo"}[kind]
    if kind == "TZDIR fifo":
        extra["TZDIR"] = str(tmp_path)
    result = _through_launcher(launcher, tz, extra, stdin=subprocess.PIPE if kind == "/dev/stdin" else None)
    assert_config_exit(result, "TZ=")


def test_forge_load_health_through_the_launcher_is_unhealthy_never_2(launcher: Path, tmp_path: Path) -> None:
    """`forge-load health` keeps the health check's exit codes: a TZ the launcher refuses is 1, as Docker reserves 2;
    a good TZ and a fresh heartbeat are 0."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    beat = tmp_path / "hb"
    health.Heartbeat(beat)()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_") and k not in ("TZ", "TZDIR")}
    env["FORGE_HEARTBEAT_FILE"] = str(beat)
    refused = subprocess.run([str(launcher), "health"], env={**env, "TZ": str(fifo)}, capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 1 and "TZ=" in refused.stderr, refused.stderr
    fine = subprocess.run([str(launcher), "health"], env={**env, "TZ": "UTC"}, capture_output=True, text=True,
                          timeout=60)
    assert fine.returncode == 0, fine.stdout + fine.stderr


@pytest.mark.parametrize("tz", ["Europe/Berlin", "", "CET-1CEST,M3.5.0,M10.5.0/3", "UTC"])
def test_the_launcher_runs_the_filler_for_a_good_tz(launcher: Path, tz: str) -> None:
    result = _through_launcher(launcher, tz)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert "event=stop" in result.stdout.splitlines()[-1]


@pytest.mark.parametrize("kind", ["directory", "large file", "fifo"])
def test_tz_naming_what_is_no_zone_file_is_refused_without_reading_it_all(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "zone"
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        with path.open("wb") as big:
            big.truncate(1 << 34)  # 16 GiB, sparse
    with pytest.raises(ConfigError) as info:
        load_config(["--active-hours", "Mon-Sun"], {"TZ": str(path)})
    assert_one_clean_line(str(info.value), "TZ=")


def test_out_of_descriptors_the_heartbeat_warns_once_and_raises_nothing(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A guard (this held before issue 17): the loop's heartbeat, on a host out of descriptors."""
    import errno

    def no_descriptor(*args: object, **kwargs: object) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    refused: list[str] = []
    beat = health.Heartbeat(tmp_path / "heartbeat", every_s=0.0, on_refused=refused.append)
    monkeypatch.setattr(os, "open", no_descriptor)
    for _ in range(3):
        beat()
    monkeypatch.undo()
    assert len(refused) == 1 and "Too many open files" in refused[0]
    beat()
    assert health.check(tmp_path / "heartbeat", 30.0)[0]  # written again once descriptors are there
