"""`forge-load status` on the virtual GPU (the unmodified numba-cuda and pynvml path, real time): a filler of two GPUs
is listed as it fills and as one GPU is held, with NVML's utilization and power; at its exit its rows go, and so do
its GPU locks (`gpu-<UUID>.lock`, which once piled up in the user's directory)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.host_paths import settings_free
from tests.test_real_path import ROOT, finish, forge, wait_for
from tests.test_status_cmd import poll, status_rows
from vgpu.pytest_plugin import VgpuFactory


def test_status_follows_a_real_path_filler_and_its_locks_go_at_exit(vgpu: VgpuFactory, tmp_path: Path) -> None:
    gpu = vgpu(gpus=2)
    uuids = gpu.uuids()
    hold_dir = tmp_path / "holds"
    hold_dir.mkdir()
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    run = forge(gpu, "--gpus", "all", "--duration", "60", "--hold-dir", str(hold_dir),
                env={"FORGE_TARGET": "0.5", "TMPDIR": str(tmpdir), "RUNTIME_DIRECTORY": "",  # locks under TMPDIR
                     "FORGE_RUNTIME_DIR": str(tmp_path / "run")})
    try:
        wait_for(run, "start")
        rows = poll(hold_dir, lambda rows: len(rows) == 2 and all(
            r["state"] == "filling" and r["util"] is not None and r["power_w"] is not None for r in rows))
        assert [(r["gpu"], r["uuid"], r["pid"], r["simulated"]) for r in rows] == [
            (0, uuids[0], run.proc.pid, False), (1, uuids[1], run.proc.pid, False)]
        locks = sorted(p.name for p in (tmpdir / f"forge_load-{os.geteuid()}").iterdir() if p.name.startswith("gpu-"))
        assert locks == [f"gpu-{uuid}.lock" for uuid in sorted(uuids)]
        hold = subprocess.run([sys.executable, "-m", "forge_load", "hold", "--gpu", uuids[1], "--holder", "job-1",
                               "--hold-dir", str(hold_dir)], capture_output=True, text=True, check=False, cwd=ROOT,
                              env=gpu.env(settings_free()))
        assert hold.returncode == 0, hold.stderr
        poll(hold_dir, lambda rows: [(r["state"], r["held_by"]) for r in rows] == [
            ("filling", []), ("held", ["job-1"])])
        run.proc.send_signal(signal.SIGTERM)
        assert finish(run) == 0, run.stderr[-3000:]
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.communicate(timeout=30)
    assert status_rows(hold_dir) == []
    assert list((tmpdir / f"forge_load-{os.geteuid()}").iterdir()) == []  # no lock file left behind
