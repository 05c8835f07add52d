"""The forge-load process as an operator meets it: its name in ps, SIGUSR1 and SIGUSR2, and bad operator settings.

Each test runs the console entry point (tests/hostile_entry.py) on the simulated GPU in real time.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.host_paths import settings_free

ROOT = Path(__file__).resolve().parent.parent
ENTRY = ROOT / "tests" / "hostile_entry.py"


class Process:
    def __init__(self, *args: str, options: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        full = settings_free()
        full.update(env or {}, PYTHONPATH=str(ROOT), FORGE_LOG_FORMAT="json")
        self.proc = subprocess.Popen([sys.executable, str(ENTRY), *options, "--", "--simulate", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full, cwd=ROOT)
        self.events: list[dict[str, Any]] = []

    def until(self, event: str, timeout_s: float = 60.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.events.append(json.loads(line))
            if self.events[-1]["event"] == event:
                return self.events[-1]
        raise AssertionError(f"no {event!r} line in {[e['event'] for e in self.events]}")

    def cmdline(self) -> str:
        return Path(f"/proc/{self.proc.pid}/cmdline").read_bytes().rstrip(b"\0").decode()

    def comm(self) -> str:
        return Path(f"/proc/{self.proc.pid}/comm").read_text().strip()

    def title_becomes(self, expected: str, timeout_s: float = 10.0) -> str:
        deadline_s = time.monotonic() + timeout_s
        while self.cmdline() != expected and time.monotonic() < deadline_s:
            time.sleep(0.01)
        return self.cmdline()

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        out, err = self.proc.communicate(timeout=30)
        self.events += [json.loads(line) for line in out.splitlines() if line.strip()]
        return self.proc.returncode, err


def test_sigusr1_pauses_and_sigusr2_resumes() -> None:
    run = Process("--log-interval", "0.2")
    try:
        run.until("status")
        run.proc.send_signal(signal.SIGUSR1)
        paused = run.until("pause")
        assert paused["state"] == "paused" and paused["reason"] == "SIGUSR1 (SIGUSR2 resumes)"
        run.until("drained")
        run.until("status")
        status = run.until("status")
        assert status["state"] == "paused" and status["own"] == 0.0
        run.proc.send_signal(signal.SIGUSR2)
        unpaused = run.until("unpause")
        assert unpaused["state"] == "filling" and unpaused["reason"] == "SIGUSR2"
    finally:
        code, err = run.stop()
    assert code == 0 and err == "", err
    assert run.events[-1]["event"] == "stop" and run.events[-1]["reason"] == "signal SIGTERM"


def test_sigusr1_at_start_up_is_not_lost_and_kills_nothing() -> None:
    # SIGUSR1's default action would end the process: it is caught from the first moment, like SIGTERM.
    run = Process("--log-interval", "0.2", options=("--signal-on-import", "SIGUSR1:forge_load.service.app"))
    try:
        start = run.until("start")
        paused = run.until("pause")
        assert paused["t"] == 0.0 and start["state"] == "filling"  # paused before the first launch
    finally:
        code, err = run.stop()
    assert code == 0 and err == "", err
    assert not any(e["event"] == "drained" for e in run.events)  # nothing ever ran
    assert run.events[-1]["own_busy_s"] == 0.0


def test_the_process_is_named_after_its_gpu_and_state() -> None:
    run = Process("--log-interval", "0.2")
    try:
        run.until("status")
        assert run.title_becomes("forge-load: gpu 0 filling") == "forge-load: gpu 0 filling"
        assert run.comm() == "forge-load"
        ps = subprocess.run(["ps", "-o", "comm=,args=", "-p", str(run.proc.pid)], capture_output=True, text=True)
        if ps.returncode == 0:  # procps, where installed
            assert ps.stdout.split() == ["forge-load", "forge-load:", "gpu", "0", "filling"], ps.stdout
        run.proc.send_signal(signal.SIGUSR1)
        run.until("pause")
        assert run.title_becomes("forge-load: gpu 0 paused") == "forge-load: gpu 0 paused"
    finally:
        run.stop()


def test_several_gpus_are_all_in_the_title() -> None:
    run = Process("--log-interval", "0.2", "--sim-gpus", "2", "--gpus", "all", "--sim-foreign", "0-3600",
                  "--sim-foreign-gpus", "1")
    try:
        run.until("yield")
        expected = "forge-load: gpu 0 filling, gpu 1 yielding"
        assert run.title_becomes(expected) == expected
    finally:
        run.stop()


def test_without_setproctitle_only_the_short_name_is_set() -> None:
    run = Process("--log-interval", "0.2", options=("--without", "setproctitle"))
    try:
        run.until("status")
        assert run.comm() == "forge-load"
        assert "forge-load:" not in run.cmdline()  # the interpreter's command line, untouched
    finally:
        code, err = run.stop()
    assert code == 0 and err == "", err


@pytest.mark.parametrize(("env", "name"), [
    ({"FORGE_ACTIVE_HOURS": "weekdays"}, "FORGE_ACTIVE_HOURS"),
    ({"FORGE_ACTIVE_HOURS": "Mon-Fri 20:00-08:00", "TZ": "Europe/Berln"}, "TZ"),
    ({"FORGE_MAX_POWER_W": "5"}, "FORGE_MAX_POWER_W"),
    ({"FORGE_PAUSE_FILE": "pause"}, "FORGE_PAUSE_FILE"),
])
def test_bad_operator_settings_exit_2_with_one_line(env: dict[str, str], name: str) -> None:
    proc = subprocess.run([sys.executable, str(ENTRY), "--", "--simulate"], capture_output=True, text=True,
                          env={**settings_free(), **env,
                               "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"forge-load: {name}="), proc.stderr


def test_a_pause_file_in_a_missing_directory_is_warned_about(tmp_path: Path) -> None:
    run = Process("--duration", "0.5", env={"FORGE_PAUSE_FILE": str(tmp_path / "not-mounted" / "pause")})
    out, err = run.proc.communicate(timeout=60)
    assert run.proc.returncode == 0
    assert err.splitlines() == [f"forge-load: warning: FORGE_PAUSE_FILE={tmp_path}/not-mounted/pause: its directory "
                                "does not exist (yet), so the file cannot appear: is the directory mounted?"]
