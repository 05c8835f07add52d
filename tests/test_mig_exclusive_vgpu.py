"""A MIG device in EXCLUSIVE_PROCESS compute mode (NVML sets the compute mode per MIG device on a GPU in MIG mode,
docs/design.md §12), filled with its siblings by `forge-load --gpus all`: as a whole GPU in that mode
(docs/exclusive.md), our context on it exists only while it fills, so a job given it, announced by a hold on it or
on its GPU, creates its context; the other MIG device goes on filling. On the virtual GPU, with a real foreign
CUDA job (scripts/foreign_job.py) judged by the virtual GPU's record of contexts and kernels."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.test_mig_all_vgpu import FORGE_LOAD, _lines, _start
from tests.test_real_path import FOREIGN_JOB
from tests.test_vgpu import ROOT
from vgpu import MigDevice, VirtualGpu
from vgpu.pytest_plugin import VgpuFactory


def _hold(gpu: VirtualGpu, tmp_path: Path, name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FORGE_LOAD, "hold", "--gpu", name, "--holder", "job1", "--wait", "10", "--hold-dir",
                           str(tmp_path / "holds")], env=gpu.env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def _job(gpu: VirtualGpu, mig: MigDevice) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """A real job on one MIG device, as a container given it runs: CUDA sees it as device 0."""
    job = subprocess.run([sys.executable, str(FOREIGN_JOB), "--backend", "numba", "--gpu", "0", "--seconds", "1.0",
                          "--size", "256"], env=gpu.env({**os.environ, "CUDA_VISIBLE_DEVICES": mig.uuid}), cwd=ROOT,
                         capture_output=True, text=True, timeout=180)
    return job, [json.loads(line) for line in job.stdout.splitlines() if line.startswith("{")]


@contextlib.contextmanager
def _filled(vgpu: VgpuFactory, tmp_path: Path) -> Iterator[tuple[VirtualGpu, list[MigDevice]]]:
    """Both MIG devices of a GPU in EXCLUSIVE_PROCESS mode filled by `forge-load --gpus all` (a hold directory there,
    so it fills); after the block, it stops cleanly and leaves no context behind."""
    gpu = vgpu(mig=2, compute_mode="exclusive_process")
    migs = gpu.mig_devices()
    (tmp_path / "holds").mkdir()
    proc = _start(gpu, tmp_path, "--duration", "30", "--resume-after", "60")
    try:
        deadline_s = time.monotonic() + 60
        while {k.mig for k in gpu.kernels()} != {m.gi for m in migs} and time.monotonic() < deadline_s:
            time.sleep(0.2)
        assert {k.mig for k in gpu.kernels()} == {m.gi for m in migs}
        yield gpu, migs
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    exclusive = [line for line in _lines(out) if line["event"] == "exclusive"]
    assert {line["uuid"] for line in exclusive} == {m.uuid for m in migs}  # each supervised
    assert [c for c in gpu.contexts() if c.open] == []


def test_a_held_mig_devices_job_creates_its_context_while_its_sibling_fills(vgpu: VgpuFactory,
                                                                             tmp_path: Path) -> None:
    with _filled(vgpu, tmp_path) as (gpu, migs):
        held = _hold(gpu, tmp_path, migs[0].uuid)
        assert held.returncode == 0, held.stderr  # acknowledged: drained, our context on it gone
        held_s = time.time()
        assert {c.mig for c in gpu.contexts() if c.open} == {migs[1].gi}
        job, lines = _job(gpu, migs[0])
        assert job.returncode == 0, job.stderr[-2000:]  # its context, in EXCLUSIVE_PROCESS mode: created
        context = next(line for line in lines if line["event"] == "context")
        sibling = [k for k in gpu.kernels() if k.mig == migs[1].gi and held_s <= k.start <= context["wall_time"]]
        assert sibling, "the other MIG device stopped filling"


def test_a_hold_on_the_gpu_ends_every_mig_devices_context(vgpu: VgpuFactory, tmp_path: Path) -> None:
    with _filled(vgpu, tmp_path) as (gpu, migs):
        held = _hold(gpu, tmp_path, "0")  # the whole GPU, as `docker run --gpus device=0` or a Slurm index gives it
        assert held.returncode == 0, held.stderr
        assert [c for c in gpu.contexts() if c.open] == []
        for mig in migs:
            job, _ = _job(gpu, mig)
            assert job.returncode == 0, job.stderr[-2000:]
