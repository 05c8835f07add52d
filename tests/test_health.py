"""forge_load/service/health.py: the heartbeat (written, throttled, cleared) and its check; and
forge_load/commands/health.py, the health command's exit codes (`forge-load health`, `python -m forge_load.health`)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forge_load.config.load import load_config
from forge_load.service import health
from tests.host_paths import settings_free

REPO = Path(__file__).resolve().parents[1]


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


def test_every_verdict_names_the_file_it_judged(tmp_path: Path) -> None:
    # An operator who gave the wrong settings must see which heartbeat was read, healthy or not.
    path = tmp_path / "heartbeat-gpu0"
    assert str(path) in health.check(path, 30.0)[1]  # missing
    health.Heartbeat(path)()
    ok, message = health.check(path, 30.0)
    assert ok and message.startswith(f"heartbeat {path} ") and message.endswith(" s old"), message
    make_stale(path, 120.0)
    ok, message = health.check(path, 30.0)
    assert not ok and str(path) in message and "120 s old" in message


def test_heartbeat_path_from_the_settings(tmp_path: Path) -> None:
    config = load_config([], {"FORGE_HEARTBEAT_FILE": str(tmp_path / "x")})
    assert health.heartbeat_location(config) == (tmp_path / "x", False)
    assert health.heartbeat_location(load_config([], {})) == (health.default_heartbeat_path(), True)


# The health check's two addresses: `forge-load health` (here through `python -m forge_load`, what the console
# script runs) and `python -m forge_load.health`, the Dockerfile's HEALTHCHECK.
HEALTH_COMMANDS = [("forge_load", "health"), ("forge_load.health",)]


def run_health(path: Path, max_age: str | None = None,
               command: tuple[str, ...] = ("forge_load.health",)) -> subprocess.CompletedProcess[str]:
    env = settings_free()
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
