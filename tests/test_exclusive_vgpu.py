"""Exclusive compute mode on the virtual GPU (`scripts/vgpu run --exclusive`): the unmodified numba-cuda and pynvml
path, a real foreign CUDA job (scripts/foreign_job.py), judged by the virtual GPU's own record of contexts and
kernels. In EXCLUSIVE_PROCESS mode a context of ours, idle or not, would make the job's context creation fail."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.test_real_path import FOREIGN_JOB, ROOT, Run, finish, forge, wait_for
from tests.test_status_cmd import poll
from vgpu import Kernel, VirtualGpu
from vgpu.pytest_plugin import VgpuFactory


def wait_until(run: Run, event: str, gpu: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """The next line of this event for this GPU (lines of the other GPU are kept on the way)."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        line = wait_for(run, event, max(deadline_s - time.monotonic(), 0.1))
        if line["gpu"] == gpu:
            return line


def wait_each(run: Run, event: str, gpus: tuple[int, ...], timeout_s: float = 60.0) -> dict[int, dict[str, Any]]:
    """The next line of this event for each of these GPUs, in whatever order they come."""
    deadline_s = time.monotonic() + timeout_s
    seen: dict[int, dict[str, Any]] = {}
    while set(seen) != set(gpus):
        line = wait_for(run, event, max(deadline_s - time.monotonic(), 0.1))
        if line["gpu"] in gpus:
            seen.setdefault(int(line["gpu"]), line)
    return seen


def ours(gpu: VirtualGpu, pids: set[int], device: int) -> list[Kernel]:
    return [k for k in gpu.kernels() if k.pid in pids and k.device == device]


def command(gpu: VirtualGpu, *args: str) -> subprocess.CompletedProcess[str]:
    """`forge-load hold|release ...` on the virtual GPU (its NVML resolves the index)."""
    return subprocess.run([sys.executable, "-m", "forge_load", *args], env=gpu.env(dict(os.environ)), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def foreign(gpu: VirtualGpu, index: int, seconds: float) -> tuple[int, list[dict[str, Any]], str]:
    proc = subprocess.run([sys.executable, str(FOREIGN_JOB), "--backend", "numba", "--gpu", str(index),
                           "--seconds", str(seconds), "--size", "256"], env=gpu.env(dict(os.environ)), cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, lines, proc.stderr


def test_a_held_gpus_job_creates_its_context_while_the_other_gpu_fills(vgpu: VgpuFactory, tmp_path: Path) -> None:
    gpu = vgpu(gpus=2, compute_mode="exclusive_process")
    hold_dir = tmp_path / "holds"
    hold_dir.mkdir()
    run = forge(gpu, "--gpus", "all", "--duration", "120", "--resume-after", "2", "--log-interval", "1",
                env={"FORGE_HOLD_DIR": str(hold_dir)})
    try:
        children = {int(line["child_pid"]) for line in wait_each(run, "child_start", (0, 1)).values()}
        wait_each(run, "status", (0, 1))  # each child filled for a second
        assert {c.device for c in gpu.contexts()} == {0, 1}
        assert run.proc.pid not in {c.pid for c in gpu.contexts()}  # the supervisor itself holds none
        # The supervisors' rows show what their children report: the target, utilization, our share and power.
        rows = poll(hold_dir, lambda rows: len(rows) == 2 and all(
            r["own"] is not None and r["util"] is not None and r["power_w"] is not None for r in rows))
        assert [(r["gpu"], r["state"], r["target"], r["pid"]) for r in rows] == [
            (0, "filling", 0.5, run.proc.pid), (1, "filling", 0.5, run.proc.pid)]

        held = command(gpu, "hold", "--gpu", "1", "--holder", "job-1", "--reason", "a job", "--wait", "5",
                       "--hold-dir", str(hold_dir))
        assert held.returncode == 0, held.stderr  # not 1: the filler acknowledged the drain within the 5 s
        held_s = time.time()
        assert [c.device for c in gpu.contexts()] == [0]  # the acknowledgement came once the context was gone
        code, lines, stderr = foreign(gpu, 1, seconds=2.0)
        assert code == 0, stderr[-2000:]  # a context on GPU 1 in EXCLUSIVE_PROCESS mode: created without error
        context = next(line for line in lines if line["event"] == "context")
        job_pid = int(context["pid"])
        job_kernels = [k for k in gpu.kernels() if k.pid == job_pid]
        assert job_kernels and {k.device for k in job_kernels} == {1}
        assert max(k.end for k in ours(gpu, children, 1)) < context["wall_time_begin"]  # drained before it began
        during = [k for k in ours(gpu, children, 0) if held_s <= k.start <= float(context["wall_time"]) + 2.0]
        assert during, "GPU 0 stopped filling while GPU 1 was held"

        released = command(gpu, "release", "--gpu", "1", "--holder", "job-1", "--hold-dir", str(hold_dir))
        assert released.returncode == 0, released.stderr
        restarted = wait_until(run, "child_start", 1)
        wait_until(run, "status", 1)
        again = ours(gpu, {int(restarted["child_pid"])}, 1)
        assert again and min(k.start for k in again) > max(k.end for k in job_kernels)  # GPU 1 fills again
    finally:
        run.proc.send_signal(signal.SIGTERM)
        code = finish(run)
    assert code == 0, run.stderr[-3000:]
    assert gpu.contexts() == []  # every child gone, its context with it
    assert not (hold_dir / f"filler.{os.geteuid()}").exists()  # a clean stop leaves nothing of its own behind
    events = [(e["event"], e["gpu"]) for e in run.events if e["event"] in ("hold", "child_end", "drained", "release")]
    assert events[:4] == [("hold", 1), ("child_end", 1), ("drained", 1), ("release", 1)]


def test_without_a_hold_dir_exclusive_mode_creates_no_context(vgpu: VgpuFactory, tmp_path: Path) -> None:
    gpu = vgpu(compute_mode="exclusive_process")
    run = forge(gpu, "--duration", "60", env={"FORGE_HOLD_DIR": str(tmp_path / "absent")})
    try:
        line = wait_for(run, "exclusive")
        assert (line["holds"], line["filling"], line["compute_mode"]) == (False, False, "exclusive_process")
        code, lines, stderr = foreign(gpu, 0, seconds=1.0)  # the GPU is free for a job all along
        assert code == 0, stderr[-2000:]
        assert gpu.contexts() == []
    finally:
        run.proc.send_signal(signal.SIGTERM)
        code = finish(run)
    assert code == 0, run.stderr[-3000:]
    job_pid = next(line["pid"] for line in lines if line["event"] == "context")
    assert gpu.kernels() and {k.pid for k in gpu.kernels()} == {job_pid}  # only the job's kernels ran
    assert [e["event"] for e in run.events] == ["exclusive", "stop"]


def test_prohibited_mode_exits_3_with_one_line(vgpu: VgpuFactory) -> None:
    gpu = vgpu(compute_mode="prohibited")
    run = forge(gpu, "--duration", "5")
    code = finish(run)
    assert code == 3
    errors = run.of("error")
    assert len(errors) == 1 and "PROHIBITED compute mode" in errors[0]["reason"]
    assert gpu.contexts() == [] and gpu.kernels() == []


def test_a_neighbour_squatting_the_next_slurm_holds_names_harms_no_job(vgpu: VgpuFactory) -> None:
    """A directory anyone may write (1777), a root filler: a neighbour makes directories with the names the Slurm
    prolog's holds will have (its holder names are predictable). The prolog's hold is placed all the same, its
    `--wait` returns 0 once our context is gone, and the job creates its context."""
    from tests.neighbours import NEIGHBOUR, as_user, hold_dir_for_all, local_user, shared_dir

    neighbour = local_user(NEIGHBOUR)
    gpu = vgpu(gpus=1, compute_mode="exclusive_process")
    uuid = gpu.uuids()[0]
    with shared_dir() as parent:
        hold_dir = hold_dir_for_all(parent)

        def squat(_channel: object) -> None:
            for job in range(100, 356):
                (hold_dir / f"hold.{uuid}.slurm-{job}.json").mkdir()

        as_user(neighbour, squat)
        run = forge(gpu, "--duration", "120", "--resume-after", "2", "--log-interval", "1",
                    env={"FORGE_HOLD_DIR": str(hold_dir)})
        try:
            child = int(wait_until(run, "child_start", 0)["child_pid"])
            wait_until(run, "status", 0)  # the child fills
            held = command(gpu, "hold", "--gpu", "0", "--holder", "slurm-200", "--reason", "Slurm job 200",
                           "--wait", "5", "--hold-dir", str(hold_dir))
            assert held.returncode == 0, held.stderr
            held_s = time.time()
            assert gpu.contexts() == []
            code, lines, stderr = foreign(gpu, 0, seconds=1.0)
            assert code == 0, stderr[-2000:]  # the job's context: created, in EXCLUSIVE_PROCESS mode
            assert [k for k in ours(gpu, {child}, 0) if k.end > held_s] == []
        finally:
            run.proc.send_signal(signal.SIGTERM)
            code = finish(run)
    assert code == 0, run.stderr[-3000:]
    warnings = [e for e in run.events if e["event"] == "hold_warning"]
    assert len(warnings) <= 2, warnings  # the 256 names: one line, not one each
