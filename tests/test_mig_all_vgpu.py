"""`--gpus all` on GPUs in MIG mode (docs/operating.md, MIG): every MIG device filled, each in a child process of
its own (CUDA shows a process one MIG device only), on the virtual GPU (`mig=N` splits every GPU alike, so a GPU in
MIG mode beside a whole one cannot be made there: tests/test_gpu_threads_mig.py covers the mix with stand-ins)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.test_vgpu import DRIVER, ROOT
from vgpu import VirtualGpu
from vgpu.pytest_plugin import VgpuFactory

FORGE_LOAD = str(ROOT / ".venv" / "bin" / "forge-load")


def _start(gpu: VirtualGpu, tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    env = gpu.env({**os.environ, "TMPDIR": str(tmp_path)})
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.Popen([FORGE_LOAD, "--gpus", "all", "--log-format", "json", "--hold-dir",
                             str(tmp_path / "holds"), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _lines(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _busy_share(gpu: VirtualGpu, gi: int, begin: float, end: float) -> float:
    kernels = [k for k in gpu.kernels() if k.mig == gi]
    return sum(max(0.0, min(k.end, end) - max(k.start, begin)) for k in kernels) / (end - begin)


def test_gpus_all_fills_every_mig_device_each_at_its_target(vgpu: VgpuFactory, tmp_path: Path) -> None:
    gpu = vgpu(mig=3)
    migs = gpu.mig_devices()
    proc = _start(gpu, tmp_path, "--duration", "12")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    lines = _lines(out)
    starts = {line["uuid"]: line for line in lines if line["event"] == "start"}
    assert set(starts) == {m.uuid for m in migs}  # each line names its MIG device, as a FORGE_GPU=MIG-... filler's
    assert all(starts[m.uuid]["gpu_instance"] == m.gi and starts[m.uuid]["gpu"] == 0 for m in migs)
    assert {line["uuid"] for line in lines if line["event"] == "stop"} >= {m.uuid for m in migs}
    kernels = gpu.kernels()
    assert {k.mig for k in kernels} == {m.gi for m in migs}
    for m in migs:
        mine = [k for k in kernels if k.mig == m.gi]
        begin, end = mine[0].start + 2.0, mine[-1].end  # after the first seconds' learning
        assert abs(_busy_share(gpu, m.gi, begin, end) - 0.5) <= 0.05, m


FOREIGN = DRIVER + r'''
ok(launch(100))
ok(d.cuStreamSynchronize(stream))
say(pid=os.getpid())
time.sleep(float(os.environ["HOLD_S"]))
'''


def test_a_foreign_job_on_one_mig_device_yields_that_one_only(vgpu: VgpuFactory, tmp_path: Path) -> None:
    gpu = vgpu(mig=3)
    migs = gpu.mig_devices()
    proc = _start(gpu, tmp_path, "--duration", "16")
    deadline_s = time.monotonic() + 60
    while {k.mig for k in gpu.kernels()} != {m.gi for m in migs} and time.monotonic() < deadline_s:
        time.sleep(0.2)
    time.sleep(3.0)
    job = subprocess.run([sys.executable, "-c", FOREIGN], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env=gpu.env({**os.environ, "CUDA_VISIBLE_DEVICES": migs[0].uuid, "HOLD_S": "4"}))
    assert job.returncode == 0, job.stderr[-2000:]
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    lines = _lines(out)
    yielded = {line["uuid"] for line in lines if line["event"] == "yield"}
    assert yielded == {migs[0].uuid}
    job_pid = {json.loads(job.stdout.splitlines()[-1])["pid"]}
    kernels = [k for k in gpu.kernels() if k.pid not in job_pid]
    job = [k for k in gpu.kernels() if k.pid in job_pid]
    assert job  # the job's own kernel, on the first MIG device
    during = (job[0].end + 0.5, job[0].end + 3.0)  # the job holds its context this long after its kernel
    assert not [k for k in kernels if k.mig == migs[0].gi and k.end > during[0] and k.start < during[1]]
    for m in migs[1:]:
        assert _busy_share(gpu, m.gi, *during) >= 0.3, m  # the others went on filling meanwhile


def test_sigterm_ends_every_child_and_sigusr1_pauses_every_one(vgpu: VgpuFactory, tmp_path: Path) -> None:
    gpu = vgpu(gpus=2, mig=2)
    migs = gpu.mig_devices()
    proc = _start(gpu, tmp_path)
    deadline_s = time.monotonic() + 60
    while len({(k.device, k.mig) for k in gpu.kernels()}) < len(migs) and time.monotonic() < deadline_s:
        time.sleep(0.2)
    assert len({(k.device, k.mig) for k in gpu.kernels()}) == len(migs)
    proc.send_signal(signal.SIGUSR1)
    time.sleep(1.5)
    proc.send_signal(signal.SIGUSR2)
    time.sleep(1.0)
    sent_s = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - sent_s <= 3.0
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    lines = _lines(out)
    for event in ("pause", "unpause", "stop"):
        assert {line["uuid"] for line in lines if line["event"] == event} == {m.uuid for m in migs}, event
    assert [c for c in gpu.contexts() if c.open] == []  # every child has ended, its context with it


def test_a_failing_child_is_its_mig_devices_failure_only(vgpu: VgpuFactory, tmp_path: Path) -> None:
    gpu = vgpu(mig=3)
    migs = gpu.mig_devices()
    env = gpu.env({**os.environ, "TMPDIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": migs[0].uuid})
    other = subprocess.Popen([FORGE_LOAD, "--gpu", migs[0].uuid, "--duration", "20", "--hold-dir",
                              str(tmp_path / "holds")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=ROOT)
    try:
        deadline_s = time.monotonic() + 60
        while not gpu.kernels() and time.monotonic() < deadline_s:
            time.sleep(0.2)
        proc = _start(gpu, tmp_path, "--duration", "6")
        out, err = proc.communicate(timeout=120)
    finally:
        other.send_signal(signal.SIGTERM)
        other.communicate(timeout=30)
    # Another filler fills the first MIG device: its child says so and ends (exit 2, as for a whole GPU), the others
    # fill to the end
    assert proc.returncode == 2, out[-2000:] + err[-2000:]
    lines = _lines(out)
    assert [line["uuid"] for line in lines if line["event"] == "error"] == [migs[0].uuid]
    assert {line["uuid"] for line in lines if line["event"] == "stop"} == {m.uuid for m in migs[1:]}
    assert {k.mig for k in gpu.kernels() if k.pid != other.pid} == {m.gi for m in migs[1:]}


def test_a_gpu_in_mig_mode_named_as_a_whole_fills_each_of_its_mig_devices(vgpu: VgpuFactory, tmp_path: Path) -> None:
    # The default FORGE_GPU=0, as in a container given the whole GPU (`docker run --gpus device=0`)
    gpu = vgpu(mig=2)
    migs = gpu.mig_devices()
    env = gpu.env({**os.environ, "TMPDIR": str(tmp_path)})
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([FORGE_LOAD, "--log-format", "json", "--duration", "5", "--metrics-port", "0"], env=env,
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = _lines(proc.stdout)
    expanded = [line for line in lines if line["event"] == "mig"]
    assert len(expanded) == 1 and expanded[0]["gpu"] == 0 and expanded[0]["mig_devices"] == 2, expanded
    assert {line["uuid"] for line in lines if line["event"] == "start"} == {m.uuid for m in migs}
    assert not [line for line in lines if line["event"] == "error"]
    assert {k.mig for k in gpu.kernels()} == {m.gi for m in migs}
