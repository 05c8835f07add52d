"""`forge-load plot` and `ts` against a real filler on the virtual GPU (the real numba-cuda and pynvml path on
driver-free stand-ins; not a GPU measurement): a foreign job arrives and leaves, the log is drawn, and every JSON
line's `ts` is the wall clock of its `t`; an exclusive-mode run with a hold is drawn on its own timeline with the
hold shaded; a GPU in MIG mode is drawn a panel per MIG device."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from forge_load.plot.logs import panels, read_log
from tests.test_real_path import ROOT, finish, foreign_job, forge, wait_for


def test_a_virtual_gpu_run_is_drawn_with_its_yield(vgpu: Any, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    gpu = vgpu()
    run = forge(gpu, "--duration", "10", "--log-interval", "1", "--resume-after", "1")
    wait_for(run, "status")
    with foreign_job(gpu, 2.0):
        wait_for(run, "yield")
    assert finish(run) == 0, run.stderr[-2000:]
    log = tmp_path / "vgpu.log"
    log.write_text(run.stdout)
    start = run.of("start")[0]
    for line in run.events:
        ts_s = datetime.fromisoformat(line["ts"].replace("Z", "+00:00")).timestamp()
        # the wall clock of its t (within the moment between reading the clock and writing the line, on a busy host)
        assert abs(ts_s - (float(start["wall_time"]) + line["t"])) < 0.5, line
    out = tmp_path / "vgpu.svg"
    done = subprocess.run([sys.executable, "-m", "forge_load", "plot", str(log), "-o", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    ids = {element.get("id") for element in ET.parse(out).iter() if element.get("id")}
    assert {"target", "util", "own", "foreign", "span-yielding"} <= ids, ids


def plot(log: Path, out: Path) -> set[str]:
    """`forge-load plot LOG -o OUT.svg`: the series drawn, by SVG id."""
    done = subprocess.run([sys.executable, "-m", "forge_load", "plot", str(log), "-o", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return {element.get("id") or "" for element in ET.parse(out).iter()}


def test_an_exclusive_mode_run_is_drawn_on_its_timeline_with_its_hold(vgpu: Any, tmp_path: Path) -> None:
    """The supervisor's lines and its children's share one timeline: a child's start line is no restart."""
    pytest.importorskip("matplotlib")
    gpu = vgpu(compute_mode="exclusive_process")
    hold_dir = tmp_path / "holds"
    hold_dir.mkdir()
    run = forge(gpu, "--duration", "10", "--log-interval", "1", "--resume-after", "1",
                env={"FORGE_HOLD_DIR": str(hold_dir)})
    wait_for(run, "status")
    command = [sys.executable, "-m", "forge_load", "--hold-dir", str(hold_dir)]
    held = subprocess.run([*command[:3], "hold", "--gpu", "0", "--holder", "job-1", "--wait", "5", *command[3:]],
                          env=gpu.env(dict(os.environ)), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert held.returncode == 0, held.stderr
    time.sleep(2.0)
    released = subprocess.run([*command[:3], "release", "--gpu", "0", "--holder", "job-1", *command[3:]],
                              env=gpu.env(dict(os.environ)), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert released.returncode == 0, released.stderr
    assert finish(run) == 0, run.stderr[-2000:]
    log = tmp_path / "exclusive.log"
    log.write_text(run.stdout)
    assert sum(line.startswith('{"t"') and '"event":"start"' in line for line in run.stdout.splitlines()) == 2
    series = read_log(run.stdout.splitlines()).gpus["0"]
    assert series.restarts_t == [] and 10.0 <= series.end_t < 11.0  # the 10-s run, not its children's added up
    (held_span,) = series.spans
    assert held_span[0] == "held" and 1.9 < held_span[2] - held_span[1] < 4.0
    assert {"span-held", "util", "own", "target"} <= plot(log, tmp_path / "exclusive.svg")


def test_a_mig_gpu_is_drawn_a_panel_per_mig_device(vgpu: Any, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    gpu = vgpu(mig=2)
    run = forge(gpu, "--gpus", "all", "--duration", "4", "--log-interval", "1")
    assert finish(run) == 0, run.stderr[-2000:]
    log = tmp_path / "mig.log"
    log.write_text(run.stdout)
    chosen, left_out = panels(read_log(run.stdout.splitlines()))
    assert [series.key[:4] for series in chosen] == ["MIG-", "MIG-"] and left_out == []
    assert [series.gpu_instance for series in chosen] == sorted(series.gpu_instance for series in chosen)
    assert {"target", "power_w"} <= plot(log, tmp_path / "mig.svg")
    one = subprocess.run([sys.executable, "-m", "forge_load", "plot", str(log), "-o", str(tmp_path / "one.png"),
                          "--gpu", chosen[1].key], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert one.returncode == 0 and f"(GPU {chosen[1].key}:" in one.stdout, one.stderr
