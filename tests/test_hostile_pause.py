"""Pauses that must hold from the first moment: no kernel of ours runs at start while a pause file, a SIGUSR1
at any moment of start-up or a foreign job says none may (the simulated and the virtual GPU), and no time
written in the pause file, however far, crashes anything.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from forge_load.config.load import load_config
from forge_load.service.loop import run_simulated
from tests.hostile_support import ENTRY, ROOT, forge

# --- no kernel of ours before the filler may fill ---------------------------------------------------------------

# Moments of start-up a SIGUSR1 can come at: before the settings are read, before NVML opens, before CUDA starts,
# and with our context made but the kernel not yet loaded.
START_UP_MOMENTS = ("forge_load.service.app", "pynvml", "numba", "forge_load.gpu.kernels")


def test_no_kernel_runs_at_start_when_none_may_on_the_virtual_gpu(vgpu: Any, tmp_path: Path) -> None:
    """The virtual GPU's own record: not one kernel of ours with the pause file there at start, after a SIGUSR1
    at any moment of start-up, or with a foreign job on the GPU at start (the unmodified numba-cuda path)."""
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
    from forge_load.control.filler import Controls
    from forge_load.steering.pause import PauseSwitch
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


# --- the pause file: no content crashes anything -----------------------------------------------------------------

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
