"""The log under abuse: a closed or full stdout stops the filler cleanly (its kernels drained, the GPU closed),
no value can forge a line or put a raw control character in one, and the stop line's counters agree with the
lines before it.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import threading
import unicodedata
from typing import Any

import pytest

from forge_load.config.load import load_config
from forge_load.control.status import GpuSlots
from forge_load.log import EventLog
from tests.host_paths import settings_free
from tests.hostile_support import ENTRY, ROOT

# --- stdout closed or full ----------------------------------------------------------------------------------------

EXIT_LOG = 5


def _closed_after_two_lines(*options: str) -> subprocess.CompletedProcess[str]:
    env = settings_free()
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
    env = settings_free()
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
        assert re.match(r'^t=1\.00 event=error time=\S+ gpu=0 reason="a\\u001b\[31mred\\u0000nul', line), line


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
    from forge_load.control.filler import Controls
    from forge_load.steering.pause import PauseSwitch
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
