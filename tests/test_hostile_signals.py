"""Signals at every moment of the filler's life, as PID 1 too: during start-up's imports, the moment the handler
exists, while running, and more of them during shutdown.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.hostile_support import finish_entry, spawn_entry


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
    proc = spawn_entry("--signal-on-import", f"{name}:forge_load.service.app", "--", "--simulate", "--duration", "30")
    assert_stopped_by(*finish_entry(proc), signum)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: signal.Signals(s).name)
def test_a_signal_during_start_up_is_not_lost_as_pid_1(signum: int) -> None:
    if (why := pid1_possible()) is not None:
        pytest.skip(why)
    name = signal.Signals(signum).name
    proc = spawn_entry("--signal-on-import", f"{name}:forge_load.service.app", "--", "--simulate", "--duration", "30",
                  pid1=True)
    assert_stopped_by(*finish_entry(proc), signum)


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
    proc = spawn_entry("--", "--simulate", "--duration", "30", pid1=True)
    pid = _host_pid_of_pid1(proc.pid)
    deadline = time.monotonic() + 20
    while not _catches(pid, signal.SIGTERM) and time.monotonic() < deadline:
        time.sleep(0.0005)
    os.kill(pid, signal.SIGTERM)
    assert_stopped_by(*finish_entry(proc), signal.SIGTERM)


@pytest.mark.parametrize("signum", [signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
def test_a_signal_while_running_stops_it(signum: int) -> None:
    proc = spawn_entry("--", "--simulate", "--log-interval", "0.1")
    assert proc.stdout is not None
    first = [proc.stdout.readline(), proc.stdout.readline()]  # start, then a status: running
    proc.send_signal(signum)
    assert_stopped_by(*finish_entry(proc, first), signum)


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
    proc = spawn_entry("--", "--simulate", "--log-interval", "0.1")
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
    assert_stopped_by(*finish_entry(proc, first), signal.SIGTERM)


def test_sigint_before_the_gpus_open_prints_no_traceback() -> None:
    proc = spawn_entry("--signal-on-import", "SIGINT:forge_load.gpu.sim", "--", "--simulate", "--duration", "30")
    code, events, err = finish_entry(proc)
    assert "KeyboardInterrupt" not in err and "Traceback" not in err
    assert code == 0 and events[-1]["event"] == "stop"
