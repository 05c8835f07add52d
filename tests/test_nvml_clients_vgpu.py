"""NVML clients written elsewhere on the virtual GPU beside a running filler: gpustat and nvitop (pinned in
requirements-dev.txt) show both GPUs and the filler's process, with no traceback. They call NVML functions the
virtual GPU does not model (fan speed, encoder and decoder utilization, ECC counts, ...), which answer
NOT_SUPPORTED as on a GPU without the feature (vgpu/gen_nvml_stubs.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_real_path import Run, finish, forge, wait_for
from vgpu import VirtualGpu
from vgpu.pytest_plugin import VgpuFactory

Filling = tuple[VirtualGpu, Run]


@pytest.fixture
def filling(vgpu: VgpuFactory, tmp_path: Path) -> Iterator[Filling]:
    gpu = vgpu(gpus=2)
    run = forge(gpu, "--gpus", "all", "--duration", "30", "--hold-dir", str(tmp_path / "holds"),
                env={"FORGE_TARGET": "0.5"})
    try:
        for _ in range(2):
            wait_for(run, "status")
        yield gpu, run
    finally:
        run.proc.terminate()
        assert finish(run) == 0, run.stderr[-3000:]


def client(gpu: VirtualGpu, *argv: str) -> subprocess.CompletedProcess[str]:
    proc = gpu.run([sys.executable, *argv], timeout=120, env=gpu.env({"COLUMNS": "120", "TERM": "dumb"}))
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_gpustat_shows_both_gpus_and_the_filler(filling: Filling) -> None:
    pytest.importorskip("gpustat")
    gpu, run = filling
    assert gpu.nvml_unmodelled() == []  # the filler itself asks only what the virtual GPU models
    shown = json.loads(client(gpu, "-m", "gpustat", "--json").stdout)
    assert [g["uuid"] for g in shown["gpus"]] == gpu.uuids()
    for g in shown["gpus"]:
        assert [p["pid"] for p in g["processes"]] == [run.proc.pid]
        assert g["memory.used"] >= 512 and g["utilization.gpu"] is not None
    assert gpu.nvml_unmodelled()  # it asked for what the virtual GPU does not model, and went on


def test_nvitop_shows_both_gpus_and_the_filler(filling: Filling) -> None:
    pytest.importorskip("nvitop")
    gpu, run = filling
    out = client(gpu, "-m", "nvitop", "-1").stdout
    assert "No running processes found" not in out
    assert sum(f" {run.proc.pid} " in line for line in out.splitlines()) == 2, out  # one row per GPU
    assert "00000000:18:00.0" in out and "00000000:2A:00.0" in out
    assert {"nvmlDeviceGetFanSpeed", "nvmlDeviceGetEncoderUtilization",
            "nvmlDeviceGetDecoderUtilization"} <= set(gpu.nvml_unmodelled())
