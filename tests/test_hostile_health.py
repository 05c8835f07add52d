"""The heartbeat file and the health command against a hostile host: no link followed, nothing but a regular
file of ours in a directory only we own, the command reading the filler's own settings, its help.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from forge_load.config.settings import Config
from forge_load.service import health
from tests.hostile_support import ROOT, run_health

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
