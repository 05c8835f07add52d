"""A hold on a GPU in MIG mode, by its index as Slurm and Docker name it, drains every MIG device's filler before
`hold --wait` returns 0 (docs/holds.md, MIG), on the virtual GPU with the real commands."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.test_mig_all_vgpu import FORGE_LOAD, _lines, _start
from tests.test_vgpu import ROOT
from vgpu.pytest_plugin import VgpuFactory


def test_a_hold_on_the_gpu_by_index_drains_every_mig_device(vgpu: VgpuFactory, tmp_path: Path) -> None:
    gpu = vgpu(mig=2)
    migs = gpu.mig_devices()
    proc = _start(gpu, tmp_path, "--duration", "14")
    try:
        deadline_s = time.monotonic() + 60
        while {k.mig for k in gpu.kernels()} != {m.gi for m in migs} and time.monotonic() < deadline_s:
            time.sleep(0.2)
        time.sleep(1.5)  # both fillers have acknowledged at least once
        hold = subprocess.run([FORGE_LOAD, "hold", "--gpu", "0", "--holder", "job1", "--wait", "10", "--hold-dir",
                               str(tmp_path / "holds")], env=gpu.env(), cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        returned_s = time.time()
        assert hold.returncode == 0, hold.stderr
        time.sleep(2.0)
        late = [k for k in gpu.kernels() if k.end > returned_s]
        assert late == [], late[:3]  # every MIG device drained before the hold returned, and stays so
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    held = {line["uuid"] for line in _lines(out) if line["event"] == "hold"}
    assert held == {m.uuid for m in migs}, out[-2000:] + err[-2000:]
