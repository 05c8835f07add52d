"""FORGE_METRIC on the virtual GPU: the real filler holding GPM's SM_UTIL (cc 9.0) and a MIG device's
GRAPHICS_UTIL, as a second process reads GPM every second; refused in one line where there is no GPM (cc 8.0).
How close it holds is the benchmark's to measure; these check that it holds, with room for a loaded machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_vgpu import DRIVER, ROOT
from vgpu import VirtualGpu
from vgpu.pytest_plugin import VgpuFactory

FORGE_LOAD = ROOT / ".venv" / "bin" / "forge-load"

# Reads GPM every second, for N seconds: {"t": Unix s, "sm", "gr"} per line (GI: that GPU instance's).
OBSERVER = r'''
import json, os, sys, time
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
gi = os.environ.get("GI")

def take():
    s = n.nvmlGpmSampleAlloc()
    if gi is None:
        n.nvmlGpmSampleGet(h, s)
    else:
        n.nvmlGpmMigSampleGet(h, int(gi), s)
    return s

prev = take()
for _ in range(int(sys.argv[1])):
    time.sleep(1.0)
    cur = take()
    g = n.c_nvmlGpmMetricsGet_t()
    g.version, g.numMetrics, g.sample1, g.sample2 = n.NVML_GPM_METRICS_GET_VERSION, 2, prev, cur
    g.metrics[0].metricId, g.metrics[1].metricId = n.NVML_GPM_METRIC_SM_UTIL, n.NVML_GPM_METRIC_GRAPHICS_UTIL
    n.nvmlGpmMetricsGet(g)
    n.nvmlGpmSampleFree(prev)
    prev = cur
    print(json.dumps({"t": time.time(), "sm": g.metrics[0].value / 100, "gr": g.metrics[1].value / 100}), flush=True)
'''


def fill_and_observe(gpu: VirtualGpu, tmp_path: Path, args: list[str], seconds: int,
                     gi: int | None = None) -> tuple[dict[str, object], list[dict[str, float]]]:
    env = gpu.env({**os.environ, "TMPDIR": str(tmp_path)})
    env.pop("CUDA_VISIBLE_DEVICES", None)
    obs_env = dict(env) if gi is None else {**env, "GI": str(gi)}
    observer = subprocess.Popen([sys.executable, "-c", OBSERVER, str(seconds + 2)], env=obs_env,
                                stdout=subprocess.PIPE, text=True, cwd=ROOT)
    proc = subprocess.run([str(FORGE_LOAD), *args, "--duration", str(seconds), "--log-format", "json",
                           "--hold-dir", str(tmp_path / "holds")], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    out, _ = observer.communicate(timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    start = json.loads(proc.stdout.splitlines()[0])
    return start, [json.loads(line) for line in out.splitlines()]


def held(readings: list[dict[str, float]], key: str, start_unix_s: float, settle_s: float,
         seconds: int) -> list[float]:
    """The readings of the filler's run after `settle_s`."""
    return [r[key] for r in readings if start_unix_s + settle_s + 1.0 <= r["t"] <= start_unix_s + seconds]


def test_sm_activity_is_held_at_the_target_by_gpm(vgpu: VgpuFactory, tmp_path: Path) -> None:
    gpu = vgpu()
    start, readings = fill_and_observe(gpu, tmp_path, ["--metric", "sm_activity", "--target", "0.5"], 12)
    assert start["metric"] == "sm_activity"
    values = held(readings, "sm", float(start["wall_time"]), 3.0, 12)  # type: ignore[arg-type]
    assert len(values) >= 6
    assert abs(sum(values) / len(values) - 0.5) <= 0.03
    assert max(abs(v - 0.5) for v in values) <= 0.08


def test_gr_activity_is_held_on_a_mig_device_where_nvml_has_no_utilization(vgpu: VgpuFactory,
                                                                           tmp_path: Path) -> None:
    gpu = vgpu(mig=3)
    target = gpu.mig_devices()[0]
    start, readings = fill_and_observe(gpu, tmp_path, ["--gpu", target.uuid, "--metric", "gr_activity"], 12,
                                       gi=target.gi)
    assert start["signals"] == "process,memory,utilization,sm_activity"  # GPM gives utilization back, and SM activity
    values = held(readings, "gr", float(start["wall_time"]), 3.0, 12)  # type: ignore[arg-type]
    assert len(values) >= 6 and abs(sum(values) / len(values) - 0.5) <= 0.03
    assert {k.mig for k in gpu.kernels()} == {target.gi}


def test_sm_activity_is_refused_in_one_line_before_any_kernel_where_there_is_no_gpm(vgpu: VgpuFactory,
                                                                                    tmp_path: Path) -> None:
    gpu = vgpu(cc="8.0")
    env = gpu.env({**os.environ, "TMPDIR": str(tmp_path)})
    proc = subprocess.run([str(FORGE_LOAD), "--metric", "sm_activity", "--duration", "5", "--hold-dir",
                           str(tmp_path / "holds")], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert (proc.returncode, proc.stderr) == (3, "")
    assert proc.stdout.count("\n") == 1 and "FORGE_METRIC=sm_activity needs NVML's GPM" in proc.stdout
    assert gpu.kernels() == []


def run_filler(gpu: VirtualGpu, tmp_path: Path, args: list[str], timeout_s: float = 120) -> subprocess.Popen[str]:
    env = gpu.env({**os.environ, "TMPDIR": str(tmp_path)})
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.Popen([str(FORGE_LOAD), *args, "--log-format", "json", "--hold-dir", str(tmp_path / "holds")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def lines_of(out: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("target", [0.5, 0.9])
def test_our_own_load_alone_never_fires_the_sm_activity_signal(vgpu: VgpuFactory, tmp_path: Path,
                                                                target: float) -> None:
    gpu = vgpu(cc="9.0")
    proc = run_filler(gpu, tmp_path, ["--target", str(target), "--duration", "20"])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    lines = lines_of(out)
    assert lines[0]["signals"] == "process,memory,utilization,sm_activity"  # GPM is there: it can see
    assert [line for line in lines if line["event"] == "yield"] == []


# A job hidden from the process list that runs full waves for HOLD_S seconds, back to back.
FOREIGN_BUSY = DRIVER + r'''
say(pid=os.getpid())
until = time.monotonic() + float(os.environ["HOLD_S"])
while time.monotonic() < until:
    busy(0.05)
'''


def test_a_hidden_foreign_job_with_the_memory_signal_off_is_seen_by_sm_activity(vgpu: VgpuFactory,
                                                                                 tmp_path: Path) -> None:
    # 1-s NVML windows: the utilization signal needs two of them, GPM's readings come every 0.19 s, so SM activity
    # is the signal that sees the job first (on a MIG device GPM is the only rate signal's input)
    gpu = vgpu(cc="9.0", hide_processes=True, window_s=1.0)
    proc = run_filler(gpu, tmp_path, ["--duration", "14", "--foreign-mem-mib", "1000000"])
    deadline_s = time.monotonic() + 60
    while not gpu.kernels() and time.monotonic() < deadline_s:
        time.sleep(0.2)
    time.sleep(4.0)
    job = subprocess.run([sys.executable, "-c", FOREIGN_BUSY], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env=gpu.env({**os.environ, "HOLD_S": "3"}))
    assert job.returncode == 0, job.stderr[-2000:]
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    lines = lines_of(out)
    assert lines[0]["signals"] == "process,memory,utilization,sm_activity"
    yields = [line for line in lines if line["event"] == "yield"]
    assert len(yields) == 1 and "SM activity" in str(yields[0]["reason"]), yields
