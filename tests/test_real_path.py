"""The filler in real mode on the virtual GPU: the unmodified cuda-bindings and pynvml path, end to end.

Judged by the virtual GPU's own record of every kernel that ran (`gpu.kernels()`), never by what the filler logs
about itself. Each run is a subprocess; runs that do not depend on each other start together to save time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from forge_load.control.probe import UtilSample
from forge_load.control.scoring import busy_samples, tracking
from vgpu import Kernel, VirtualGpu
from vgpu.pytest_plugin import VgpuFactory

ROOT = Path(__file__).resolve().parent.parent
FOREIGN_JOB = ROOT / "scripts" / "foreign_job.py"


@dataclass
class Run:
    """A forge-load process on a virtual GPU."""

    gpu: VirtualGpu
    proc: subprocess.Popen[str]
    started_wall_s: float
    stdout: str = ""
    stderr: str = ""

    def wait(self, timeout_s: float = 120.0) -> int:
        self.stdout, self.stderr = self.proc.communicate(timeout=timeout_s)
        return self.proc.returncode

    @property
    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stdout.splitlines() if line.startswith("{")]

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]

    def kernels(self, device: int | None = None) -> list[Kernel]:
        return [k for k in self.gpu.kernels() if k.pid == self.proc.pid and (device is None or k.device == device)]

    def wall(self, t_s: float) -> float:
        """The Unix time of a log line's `t`."""
        return float(self.of("start")[0]["wall_time"]) + t_s


def forge(gpu: VirtualGpu, *args: str, env: dict[str, str] | None = None) -> Run:
    command = [sys.executable, "-m", "forge_load", "--log-format", "json", *args]
    # Runs on several virtual GPUs at once all fill "GPU 0": each keeps a heartbeat of its own (one heartbeat,
    # one filler: a second filler of the same GPUs and user is refused).
    own = {"FORGE_HEARTBEAT_FILE": str(gpu.state_dir / f"heartbeat-{time.monotonic_ns()}")}
    proc = subprocess.Popen(command, env=gpu.env({**os.environ, **own, **(env or {})}), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return Run(gpu, proc, time.time())


def wait_for(run: Run, event: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """Read the run's stdout until a line with this event (the run keeps going)."""
    assert run.proc.stdout is not None
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        line = run.proc.stdout.readline()
        if not line:
            break
        run.stdout += line
        if line.startswith("{") and json.loads(line)["event"] == event:
            return dict(json.loads(line))
    raise AssertionError(f"no {event!r} line: {run.stdout[-3000:]}")


def finish(run: Run, timeout_s: float = 120.0) -> int:
    """Wait for the run's end, keeping what it already printed."""
    before = run.stdout
    code = run.wait(timeout_s)
    run.stdout = before + run.stdout
    return code


def samples_from(kernels: Iterable[Kernel], begin_s: float, end_s: float, window_s: float = 1 / 6) -> list[UtilSample]:
    """What NVML would report from these kernels alone: the busy share of each window."""
    return busy_samples(((k.start, k.end) for k in kernels), begin_s, end_s, window_s)


@contextmanager
def foreign_job(gpu: VirtualGpu, seconds: float, gpu_index: int = 0) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, str(FOREIGN_JOB), "--backend", "numba", "--gpu", str(gpu_index),
                             "--seconds", str(seconds), "--size", "256"],
                            env=gpu.env(dict(os.environ)), cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def job_lines(proc: subprocess.Popen[str]) -> dict[str, dict[str, Any]]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    return {e["event"]: e for e in map(json.loads, out.splitlines())}


# --- holding the target ----------------------------------------------------------------------------------------


TARGETS = (0.3, 0.5, 0.8)


@pytest.fixture(scope="module")
def holding(tmp_path_factory: pytest.TempPathFactory, vgpu_lib_dir: Path) -> dict[float, Run]:
    """forge-load at each target, 16 s, on three virtual GPUs at once."""
    runs = {}
    for target in TARGETS:
        gpu = VirtualGpu(tmp_path_factory.mktemp(f"hold{target}"), lib_dir=vgpu_lib_dir)
        runs[target] = forge(gpu, "--target", str(target), "--duration", "16", "--log-interval", "2")
    for run in runs.values():
        assert run.wait() == 0, run.stderr[-3000:]
    return runs


@pytest.mark.parametrize("target", TARGETS)
def test_real_mode_holds_the_target_by_the_virtual_gpus_own_record(holding: dict[float, Run], target: float) -> None:
    run = holding[target]
    start = run.of("start")[0]
    assert start["gpu_name"] == "Virtual GPU (H100-like)" and start["driver"].endswith("-virtual")
    assert start["uuid"] == run.gpu.uuids()[0] and start["nvml_clock"] == "unix"
    assert start["stack_bytes"] == 1024  # read back from the driver
    assert "NumbaPerformanceWarning" not in run.stderr, run.stderr[-2000:]
    begin_s = run.wall(0.0)
    result = tracking(samples_from(run.kernels(), begin_s, begin_s + 16.0), target, begin_s, begin_s + 16.0)
    # The simulated GPU's acceptance numbers (tests/test_sim_loop.py).
    assert result.settle_s is not None and result.settle_s <= 5.0, result
    assert result.mae_ratio <= 0.02 and result.within_005_ratio >= 0.95, result
    assert run.of("yield") == [], run.of("yield")
    assert run.gpu.unimplemented() == []


@pytest.mark.parametrize("target", TARGETS)
def test_our_own_busy_time_matches_the_gpus_record(holding: dict[float, Run], target: float) -> None:
    # Timing a kernel from a start event on an idle stream read our busy time ~5 % high.
    run = holding[target]
    truth_s = sum(k.end - k.start for k in run.kernels()[1:])  # the warm-up launch is not the Worker's
    assert run.of("stop")[0]["own_busy_s"] == pytest.approx(truth_s, rel=0.01)


# --- foreign jobs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hide", [False, True], ids=["visible", "hidden"])
def test_a_real_foreign_job_makes_it_yield_at_once_and_resume_after_the_wait(vgpu: VgpuFactory, hide: bool) -> None:
    gpu = vgpu(hide_processes=hide)
    run = forge(gpu, "--target", "0.5", "--duration", "22", "--resume-after", "3", "--log-interval", "5")
    wait_for(run, "start")
    time.sleep(3.0)
    with foreign_job(gpu, seconds=5.0) as job:
        lines = job_lines(job)
    assert finish(run) == 0, run.stderr[-3000:]
    context_s, job_end_s = lines["context"]["wall_time"], lines["done"]["wall_time"]
    late = [k for k in run.kernels() if context_s + 0.2 < k.start < job_end_s]
    assert late == [], f"{len(late)} kernels of ours ran beside the job, the first {late[0].start - context_s:.3f} s in"
    yielded = run.of("yield")
    assert len(yielded) == 1 and ("process" in yielded[0]["signals"]) is not hide
    resumed = run.of("resume")
    assert len(resumed) == 1 and run.wall(resumed[0]["t"]) >= job_end_s + 3.0
    assert any(k.start > run.wall(resumed[0]["t"]) for k in run.kernels())  # filling again


# --- several GPUs ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lost", [0, 2])
def test_one_lost_gpu_of_four_stops_only_its_own_filler(vgpu: VgpuFactory, lost: int) -> None:
    # Closing the lost GPU's launcher must not touch the other GPUs' contexts. numba's cuda.close() resets
    # every device when called from the thread that first imported numba.cuda (usually GPU 0's).
    gpu = vgpu(gpus=4, fail_gpu=[(lost, 8.0)])  # 8 s after the virtual GPU was made: a few s of filling
    run = forge(gpu, "--gpus", "all", "--duration", "16", "--log-interval", "5")
    assert run.wait() == 4, run.stderr[-3000:]  # a GPU failed while running
    assert [e["gpu"] for e in run.of("error")] == [lost]
    others = [d for d in range(4) if d != lost]
    assert sorted(e["gpu"] for e in run.of("stop")) == others
    end_s = max(k.end for k in run.kernels())
    for device in others:
        assert any(k.start > end_s - 1.0 for k in run.kernels(device)), f"GPU {device} stopped filling"
    assert run.kernels(lost) and max(k.start for k in run.kernels(lost)) < end_s - 3.0


@pytest.mark.parametrize("state", ["filling", "yielding", "boosted"])
def test_sigterm_in_every_state_exits_0_within_a_second(vgpu: VgpuFactory, state: str) -> None:
    gpu = vgpu()
    run = forge(gpu, "--target", "0.5", "--boost-after", "2" if state == "boosted" else "0",
                "--boost-target", "0.7", "--resume-after", "30")
    wait_for(run, "start")
    job = None
    if state == "yielding":
        job = subprocess.Popen([sys.executable, str(FOREIGN_JOB), "--backend", "numba", "--seconds", "60",
                                "--size", "256"], env=gpu.env(dict(os.environ)), cwd=ROOT, text=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(run, "yield")
    elif state == "boosted":
        wait_for(run, "boost")
    else:
        time.sleep(1.0)
    try:
        sent_s = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        code = finish(run, timeout_s=10)
        took_s = time.monotonic() - sent_s
    finally:
        if job is not None:
            job.kill()
            job.wait()
    assert code == 0, run.stderr[-2000:]
    assert took_s <= 1.0
    stop = run.of("stop")[-1]
    assert stop["reason"] == "signal SIGTERM" and stop["state"] == state


# --- the defects of the real path, each pinned on the virtual GPU -------------------------------------------


def test_a_restart_beside_its_predecessors_history_does_not_yield(vgpu: VgpuFactory) -> None:
    # NVML's buffer at start holds ~15 s from before our context existed, here a predecessor's filling. (Our
    # own start-up puts idle samples after it, so judging the history did no harm here: tests/test_monitor.py
    # pins the rule itself.)
    gpu = vgpu()
    first = forge(gpu, "--target", "0.8", "--duration", "6")
    assert first.wait() == 0, first.stderr[-2000:]
    second = forge(gpu, "--target", "0.8", "--duration", "6")
    assert second.wait() == 0, second.stderr[-2000:]
    assert second.of("yield") == [], second.of("yield")


def test_boot_relative_sample_stamps_are_found_and_the_target_held(vgpu: VgpuFactory) -> None:
    gpu = vgpu(timestamps="boot")
    run = forge(gpu, "--target", "0.5", "--duration", "10", "--log-interval", "2")
    assert run.wait() == 0, run.stderr[-2000:]
    assert run.of("start")[0]["nvml_clock"] == "boot"
    assert run.of("yield") == [], run.of("yield")
    statuses = [e for e in run.of("status") if e["t"] >= 4]
    assert statuses and all(abs(e["util"] - 0.5) <= 0.05 and e["foreign"] <= 0.05 for e in statuses), statuses


@pytest.mark.parametrize(("env", "fastest_first", "gpu_flag", "device"), [
    ({"CUDA_VISIBLE_DEVICES": "1"}, None, "1", 1),  # CUDA sees one device and calls it 0
    ({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, [1, 0], "0", 0),  # CUDA's 0 is the fastest, NVML's 1
], ids=["visible-devices", "fastest-first"])
def test_the_cuda_device_is_the_one_nvml_names(vgpu: VgpuFactory, env: dict[str, str],
                                               fastest_first: list[int] | None, gpu_flag: str, device: int) -> None:
    gpu = vgpu(gpus=2, **({"fastest_first": fastest_first} if fastest_first else {}))
    run = forge(gpu, "--gpu", gpu_flag, "--duration", "3", env=env)
    assert run.wait() == 0, run.stderr[-2000:]
    assert run.of("start")[0]["uuid"] == gpu.uuids()[device]
    assert {k.device for k in run.kernels()} == {device}


def test_a_gpu_cuda_cannot_see_is_no_usable_gpu_with_what_cuda_sees(vgpu: VgpuFactory) -> None:
    gpu = vgpu(gpus=2)
    run = forge(gpu, "--gpu", "0", "--duration", "3", env={"CUDA_VISIBLE_DEVICES": "1"})
    assert (run.wait(), run.stderr) == (3, "")
    (error,) = run.of("error")
    assert f"CUDA does not see the GPU NVML calls {gpu.uuids()[0]}" in error["reason"]
    assert f"CUDA sees: 0 {gpu.uuids()[1]}" in error["reason"]
    assert gpu.kernels() == []


NVML_POLL = r'''
import json, time
from forge_load.gpu.nvml import NvmlProbe
probe = NvmlProbe("0")
stamps, since = [], float("-inf")
end = time.monotonic() + 3.0
while time.monotonic() < end:
    for s in probe.utilization_samples(since) or []:
        stamps.append(s.t_s)
        since = s.t_s
    time.sleep(0.02)
print(json.dumps({"stamps": stamps, "clock": probe.sample_clock}))
'''


def test_no_nvml_sample_is_returned_twice_on_real_clocks(vgpu: VgpuFactory) -> None:
    gpu = vgpu()
    proc = gpu.run([sys.executable, "-c", NVML_POLL], cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    stamps = result["stamps"]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert len(stamps) > 15 * 6  # the 15 s of history, then what came while polling
    assert min(gaps) > 0.1, sorted(gaps)[:5]  # 1/6-s windows: a repeat shows as a gap of ~0


# --- the kernel image: loaded, never compiled ------------------------------------------------------------------

COMPILERS = ("libnvvm", "libnvrtc", "libnvJitLink", "llvmlite")

# Where the `jit` extra is not installed: a numba that cannot be imported, first on the path.
NO_NUMBA = 'raise ImportError("numba is not installed (the test hides it: no jit extra)")\n'


@pytest.fixture
def without_numba(tmp_path: Path) -> dict[str, str]:
    hidden = tmp_path / "no_numba"
    (hidden / "numba").mkdir(parents=True)
    (hidden / "numba" / "__init__.py").write_text(NO_NUMBA)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(hidden), str(ROOT), os.environ.get("PYTHONPATH")]))}


def compilers_mapped(pid: int) -> list[str]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return [name for name in COMPILERS if name in maps]


@pytest.mark.parametrize(("cc", "cuda_version", "image", "shape"), [
    ("9.0", 12090, "sm_90", "lean"), ("8.6", 12090, "sm_86", "lean"), ("8.7", 12090, "sm_86", "lean"),
    ("7.5", 12020, "sm_75", "lean"), ("12.0", 12090, "sm_120", "lean"), ("10.3", 12080, "sm_100", "lean"),
    ("9.0", 12090, "sm_90", "burn"), ("7.0", 12020, "sm_70", "burn"),
], ids=lambda v: str(v))
def test_the_filler_loads_a_fitting_cubin_and_no_compiler(vgpu: VgpuFactory, cc: str, cuda_version: int,
                                                            image: str, shape: str) -> None:
    gpu = vgpu(cc=cc, cuda_version=cuda_version)
    run = forge(gpu, "--duration", "30", "--log-interval", "1", "--shape", shape)
    try:
        start = wait_for(run, "status")
        assert compilers_mapped(run.proc.pid) == []
    finally:
        run.proc.send_signal(signal.SIGTERM)
        assert finish(run) == 0, run.stderr[-2000:]
    modules = [m for m in gpu.modules() if m["pid"] == run.proc.pid]
    assert modules == [{"pid": run.proc.pid, "kind": "cubin", "arch": image, "result": "CUDA_SUCCESS"}]
    assert run.of("start")[0]["kernel_image"] == f"{shape}.{image}.cubin"
    assert start and {k.kind for k in run.kernels()} == {"lean" if shape == "lean" else "other"}


def test_a_gpu_no_cubin_fits_fills_from_the_ptx_on_a_new_enough_driver(vgpu: VgpuFactory) -> None:
    gpu = vgpu(cc="11.0", cuda_version=12090)
    run = forge(gpu, "--duration", "3")
    assert run.wait() == 0, run.stderr[-2000:]
    modules = [m for m in gpu.modules() if m["pid"] == run.proc.pid]
    assert [(m["kind"], m.get("ptx_version"), m["result"]) for m in modules] == [("ptx", "8.8", "CUDA_SUCCESS")]
    assert run.of("start")[0]["kernel_image"] == "lean.ptx"
    assert run.kernels()


@pytest.mark.parametrize(("cc", "cuda_version", "answers", "to_do"), [
    ("11.0", 12080, "lean.ptx CUDA_ERROR_UNSUPPORTED_PTX_VERSION",  # PTX 8.8 needs CUDA 12.9
     "its PTX 8.8 needs a driver of CUDA 12.9 or newer: update the driver, or install forge-load[jit]"),
    ("6.1", 12090, "burn.ptx CUDA_ERROR_INVALID_PTX",  # PTX for sm_70 does not compile for sm_61
     "this GPU is older than every image (sm_70 and newer): install forge-load[jit]"),
], ids=["driver-too-old-for-the-ptx", "below-every-image"])
def test_where_no_image_loads_one_line_says_why_and_what_to_do(vgpu: VgpuFactory, without_numba: dict[str, str],
                                                               cc: str, cuda_version: int, answers: str,
                                                               to_do: str) -> None:
    gpu = vgpu(cc=cc, cuda_version=cuda_version)
    shape = answers.split(".", 1)[0]
    run = forge(gpu, "--duration", "3", "--shape", shape, env=without_numba)
    assert (run.wait(), run.stderr) == (3, "")
    arch = "sm_" + cc.replace(".", "")
    version = f"{cuda_version // 1000}.{cuda_version % 1000 // 10}"
    lines = [e["reason"] for e in run.of("error") if "no kernel image loads" in e["reason"]]
    assert len(lines) == 1, run.stdout[-2000:]
    assert f"({arch}, driver CUDA {version}): {answers}" in lines[0]
    assert to_do in lines[0]
    assert gpu.kernels() == []


def test_the_lean_kernel_needs_volta_and_a_gpu_before_it_is_told_to_use_burn(vgpu: VgpuFactory) -> None:
    # nanosleep is sm_70's: no image, and no compiler, can make the lean kernel for a Pascal GPU. Before any module
    # load or launch, one line says so, and what to do; not "install the jit extra", which cannot help.
    gpu = vgpu(cc="6.1", cuda_version=12090)
    run = forge(gpu, "--duration", "3")
    assert run.wait() == 3
    lines = [e["reason"] for e in run.of("error") if "FORGE_SHAPE" in e["reason"]]  # the log's one error line
    assert len(lines) == 1 and "FORGE_SHAPE" not in run.stderr, (run.stdout[-2000:], run.stderr[-2000:])
    assert "the lean kernel sleeps with nanosleep, which needs compute capability 7.0 (Volta) or newer" in lines[0]
    assert "(sm_61)" in lines[0] and "FORGE_SHAPE=burn" in lines[0] and "jit" not in lines[0].split("FORGE_SHAPE")[0]
    assert gpu.modules() == [] and gpu.kernels() == []


def test_with_the_jit_extra_numba_compiles_the_kernel_for_a_gpu_no_image_fits(vgpu: VgpuFactory) -> None:
    gpu = vgpu(cc="6.1", cuda_version=12090)
    run = forge(gpu, "--duration", "3", "--shape", "burn")
    assert run.wait() == 0, run.stderr[-2000:]
    modules = [m for m in gpu.modules() if m["pid"] == run.proc.pid]
    assert [(m["kind"], m["arch"], m["result"]) for m in modules] == [
        ("ptx", "sm_70", "CUDA_ERROR_INVALID_PTX"), ("cubin", "sm_61", "CUDA_SUCCESS")]
    assert run.of("start")[0]["kernel_image"] == "jit sm_61"
    assert run.kernels()


def test_the_real_start_path_imports_no_server_client_or_other_command_it_is_not_asked_for(vgpu: VgpuFactory,
                                                                                            tmp_path: Path) -> None:
    """As tests/test_app.py checks the simulated filler's: pynvml and cuda-bindings pull in none of them either."""
    from tests.test_app import NOT_ON_THE_START_PATH, filler_modules

    modules = filler_modules({}, tmp_path, args=(), wrap=vgpu().env)
    assert {"pynvml", "cuda.bindings.driver"} <= modules  # the real path it is
    loaded = [name for name in NOT_ON_THE_START_PATH if name in modules]
    assert loaded == [], f"imported on the filler's start path without their settings: {loaded}"
