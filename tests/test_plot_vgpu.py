"""`forge-load plot` and `ts` against a real filler on the virtual GPU (the real numba-cuda and pynvml path on
driver-free stand-ins; not a GPU measurement): a foreign job arrives and leaves, the log is drawn, and every JSON
line's `ts` is the wall clock of its `t`."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

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
