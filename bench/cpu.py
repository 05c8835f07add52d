"""The cpu scenario: what the filler costs the host's CPU per GPU, in steady state and at start-up, and how well
it holds its target meanwhile; for one GPU and for several GPUs in one process (`--gpus all`), at each target.

The filler runs in real mode as users run it (`python -m forge_load`, no --simulate), one run at a time.
CPU is the filler process's utime + stime (/proc/<pid>/stat, every thread) over wall time, from STEADY_FROM_S
after its (last) start line to the end of its run: start-up excluded. Start-up is measured separately: from
the process's start to its first kernel, and the CPU time it had used by then.

On the virtual GPU (`--vgpu`, or under scripts/vgpu) each run gets a fresh virtual GPU of its own with as many
devices as it fills (vgpu.VirtualGpu), and that GPU's record of every kernel is the ground truth: the first
kernel, the launches, and the busy share of each 1/6-s window, which is what the tracking numbers are scored
on. Its results say "virtual GPU" and are never a GPU measurement; the CPU time is this machine's.
On a real GPU, NVML's samples of `--gpu` (read by the Sampler, as the Monitor reads them) stand in for the
record, and start-up is measured to the filler's start line, just before its first launch.

Besides CPU, each run reports the NVML calls per second per GPU by function (the virtual GPU counts every call
of every process), the wake-ups per second of each of the process's threads (voluntary context switches,
/proc/<pid>/task/*/status) and the resident memory. On the virtual GPU every (GPUs, target) runs once as the
stand-in is and once with each process-list query costing `--cpu-nvml-costs` ms of CPU (a slow driver);
`--cpu-repeats N` runs each N times, and the tables and goals take the median of the repeats.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from bench import REPO, BenchError, NoGpu, log
from bench.analysis import count, tracking_metrics
from bench.results import SCHEMA, Goal, Json, Quantity, judge, mean, measured, q, to_json, worst
from bench.runner import CHILDREN, CLK_TCK, Child, CpuWatch, cpu_s_at
from bench.sampler import Sampler
from forge_load.control.probe import UtilSample
from forge_load.control.scoring import busy_samples

if TYPE_CHECKING:
    from vgpu import VirtualGpu

STEADY_FROM_S = 5.0  # after the last start line: start-up (imports, contexts, compiling) is over by then
END_MARGIN_S = 0.2  # before the earliest filler's end: its stop and the process's exit are not steady state
GPU_COUNTS = (1, 8)
RUN_S = 20.0
VIRTUAL_WINDOW_S = 1 / 6  # the virtual GPU's NVML sample window (its default), for the tracking numbers
OVERHEAD_S = 10.0  # a run's length beyond its own (start-up, exit), for --budget-s
IDLE_WAIT_S = 20.0  # how long a real GPU may take to be free of the previous run's process
NVML_COSTS_MS = (0.0, 4.5)  # what each process-list query costs on the virtual GPU: as it is, a slow driver
# pynvml's process lists: the C functions each refresh calls (a count call, then a fill call when there is one)
PROCESS_LIST_FUNCTIONS = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3",
                          "nvmlDeviceGetComputeRunningProcesses_v2", "nvmlDeviceGetGraphicsRunningProcesses_v2",
                          "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses")
TASKS_EVERY_S = 0.5  # how often the threads' context switches, the RSS and the NVML counts are read

# The CPU goals: CPU per GPU at 0.5 and 0.8 on one GPU, the whole process with 8 GPUs at 0.5, and the tracking
# that must hold meanwhile (the worst run and GPU).
CPU_GOALS = (
    Goal("cpu_1gpu_0.5", "filler CPU per GPU at 0.5, one GPU, steady state", "<=", 1.0, "% of one core"),
    Goal("cpu_1gpu_0.8", "filler CPU per GPU at 0.8, one GPU, steady state", "<=", 1.5, "% of one core"),
    Goal("cpu_8gpus_0.5", "filler CPU, 8 GPUs in one process, at 0.5, steady state", "<=", 8.0, "% of one core"),
    Goal("settle", "settle time (worst run and GPU)", "<=", 2.0, "s"),
    Goal("mae", "mean abs error after settling (worst run and GPU)", "<=", 0.01, "ratio"),
    Goal("p95", "p95 abs error after settling (worst run and GPU)", "<=", 0.03, "ratio"),
    # With NVML asked by need (only what can have changed): the CPU, also with process lists that cost what a
    # recent driver's do, and how often those lists are asked for. The keys keep the names committed results use.
    Goal("cpu20_1gpu_0.5", "filler CPU, one GPU at 0.5, steady state (NVML asked by need)", "<=", 0.5,
         "% of one core"),
    Goal("cpu20_8gpus_0.5", "filler CPU, 8 GPUs in one process at 0.5, steady state (NVML asked by need)", "<=",
         3.0, "% of one core"),
    Goal("cpu20_1gpu_0.5_slow", "filler CPU, one GPU at 0.5, process-list queries at 4.5 ms each", "<=", 1.0,
         "% of one core"),
    Goal("proc_lists", "process-list C calls per s per GPU, nothing changing (one refresh is three), one GPU at 0.5",
         "<=", 3.3, "calls/s"),
    # The compiled kernel's: the filler loads its kernel compiled, with no compiler in the process.
    Goal("startup_1gpu", "start to the first kernel, one GPU at 0.5", "<=", 0.25, "s"),
    Goal("rss_1gpu", "filler resident memory, one GPU at 0.5", "<=", 64.0, "MiB"),
)

@dataclass
class CpuRun:
    """One filler process: N GPUs at one target."""

    label: str
    gpus: Quantity
    target: Quantity
    duration_s: Quantity
    cpu_pct_one_core: Quantity  # the whole process, steady state
    cpu_pct_per_gpu: Quantity
    steady_s: Quantity  # the wall time the steady numbers cover
    launches_per_s_per_gpu: Quantity
    cpu_us_per_launch: Quantity
    startup_s: Quantity  # process start to the first kernel (on each of its GPUs)
    startup_to_start_line_s: Quantity
    startup_cpu_s: Quantity  # CPU time used by then
    settle_s: Quantity  # tracking: the worst of its GPUs
    mae: Quantity
    p95_error: Quantity
    mae_from_5s: Quantity
    p95_error_from_5s: Quantity
    mean_util: Quantity  # the mean of its GPUs' mean readings from 5 s on
    yields: Quantity  # no foreign job here: anything above 0 is a false alarm
    tracking_from: str
    nvml_cost_ms: Quantity  # what each process-list query cost (the virtual GPU's --nvml-cost)
    repeat: Quantity  # which repeat of this (GPUs, target, cost)
    nvml_calls_per_s_per_gpu: dict[str, Quantity]  # by function, steady state
    process_list_calls_per_s_per_gpu: Quantity
    wakeups_per_s: Quantity  # the whole process: voluntary context switches of every thread
    wakeups_per_s_by_thread: list[Quantity]  # each thread's, the busiest first
    threads: Quantity
    rss_mib: Quantity  # at the end of the steady state


class Platform(Protocol):
    """Where the runs go: fresh virtual GPUs, or the real GPUs of this machine."""

    virtual: bool
    device_count: int

    def prepare(self, gpus: int, nvml_cost_ms: float = 0.0) -> tuple[dict[str, str], list[str]]:
        """The environment and the GPU flags for a filler on `gpus` GPUs (process lists costing that much)."""

    def nvml_calls(self, pid: int) -> tuple[float, dict[str, int]] | None:
        """(Unix time, the process's NVML calls so far by function); None where they are not counted."""

    def started(self, child: Child) -> bool:
        """Whether the filler has launched its first kernel (where that cannot be seen: logged its start)."""

    def kernel_spans(self, pid: int) -> dict[int, list[tuple[float, float]]] | None:
        """Per device, its kernels' (start, end) in Unix seconds; None where there is no record."""

    def samples(self, device: int, a: float, b: float) -> list[UtilSample] | None:
        """NVML's samples of `device` between wall times a and b; None where it is not sampled."""

    def check(self) -> None:
        """After a run: BenchError if the GPU saw something that makes the run's numbers wrong."""


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_") and k != "TARGET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env.update(PYTHONUNBUFFERED="1", CUDA_DEVICE_ORDER="PCI_BUS_ID")
    env.setdefault("CUDA_MODULE_LOADING", "LAZY")
    return env


class VirtualGpus:
    """Each run on a fresh virtual GPU with exactly the devices it fills; its kernel record is the truth."""

    virtual = True

    def __init__(self, tmp: Path) -> None:
        from vgpu import MAX_GPUS

        self.tmp = tmp
        self.device_count = MAX_GPUS
        self._gpu: VirtualGpu | None = None  # the current run's
        self.runs = 0

    def prepare(self, gpus: int, nvml_cost_ms: float = 0.0) -> tuple[dict[str, str], list[str]]:
        from vgpu import VgpuError, VirtualGpu

        self.runs += 1
        cost = {name: nvml_cost_ms for name in PROCESS_LIST_FUNCTIONS[:2]} if nvml_cost_ms else None
        try:
            self._gpu = VirtualGpu(self.tmp / f"run{self.runs}", gpus=gpus, nvml_cost=cost)
        except VgpuError as error:
            raise BenchError(f"cannot create a virtual GPU: {error}") from error
        env = self._gpu.env(base_env())
        env["FORGE_HEARTBEAT_FILE"] = str(self.tmp / f"heartbeat{self.runs}")
        return env, ["--gpus", "all"] if gpus > 1 else ["--gpu", "0"]

    @property
    def gpu(self) -> VirtualGpu:
        assert self._gpu is not None, "prepare() first"
        return self._gpu

    def started(self, child: Child) -> bool:
        try:
            return (self.gpu.state_dir / "kernels.jsonl").stat().st_size > 0
        except OSError:
            return False

    def nvml_calls(self, pid: int) -> tuple[float, dict[str, int]] | None:
        from vgpu import VgpuError

        try:
            data = self.gpu.nvml_calls()
        except VgpuError:
            return None
        rows = [p["calls"] for p in data["processes"] if p["pid"] == pid]
        return (float(data["now"]), dict(rows[0])) if rows else None

    def kernel_spans(self, pid: int) -> dict[int, list[tuple[float, float]]] | None:
        spans: dict[int, list[tuple[float, float]]] = {}
        for k in self.gpu.kernels():
            if k.pid == pid:
                spans.setdefault(k.device, []).append((k.start, k.end))
        return spans

    def samples(self, device: int, a: float, b: float) -> list[UtilSample] | None:
        return None

    def check(self) -> None:
        missing = self.gpu.unimplemented()
        if missing:  # the filler took a path the stand-ins do not model: its numbers are not the real path's
            raise BenchError(f"the filler called driver entry points the virtual GPU does not implement: {missing}")


class RealGpus:
    """The machine's GPUs; NVML's samples of `--gpu` for tracking (there is no kernel record)."""

    virtual = False

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        from forge_load.control.probe import NoGpuError
        from forge_load.gpu import nvml

        try:
            self.device_count = len(nvml.list_devices())
            self.probe = nvml.NvmlProbe(str(args.gpu))
        except NoGpuError as error:
            raise NoGpu(str(error)) from error
        self.index = args.gpu
        self.tmp = tmp
        self.sampler = Sampler(self.probe)
        self.sampler.start()

    def close(self) -> None:
        self.sampler.stop_event.set()
        self.sampler.join(timeout=2.0)
        self.probe.close()

    def prepare(self, gpus: int, nvml_cost_ms: float = 0.0) -> tuple[dict[str, str], list[str]]:
        deadline = time.monotonic() + IDLE_WAIT_S  # the previous run's process may still be listed
        while procs := self.probe.processes():
            if time.monotonic() > deadline:
                raise BenchError(f"GPU {self.index} is not idle: process(es) {', '.join(str(p.pid) for p in procs)}"
                                 " on it; the benchmark needs the GPU to itself")
            time.sleep(0.25)
        env = base_env()
        env["FORGE_HEARTBEAT_FILE"] = str(self.tmp / "heartbeat")
        if gpus == 1:
            return env, ["--gpu", str(self.index)]
        return env, ["--gpus", "all" if gpus == self.device_count else ",".join(map(str, range(gpus)))]

    def started(self, child: Child) -> bool:
        return any(e.get("event") == "start" for e in list(child.events))

    def kernel_spans(self, pid: int) -> dict[int, list[tuple[float, float]]] | None:
        return None

    def nvml_calls(self, pid: int) -> tuple[float, dict[str, int]] | None:
        return None  # a real driver does not count them

    def samples(self, device: int, a: float, b: float) -> list[UtilSample] | None:
        return self.sampler.between("util", a, b) if device == self.index else None

    def check(self) -> None:
        time.sleep(3 * self.sampler.interval_s)  # NVML's last samples of the run
        if self.sampler.failure:
            raise BenchError(f"reading NVML failed: {self.sampler.failure}")


@dataclass
class TaskReading:
    """One look at a process: every thread's voluntary context switches, its RSS, its NVML calls so far."""

    wall: float
    switches: dict[int, int]  # thread id -> voluntary context switches so far
    rss_mib: float | None
    nvml: tuple[float, dict[str, int]] | None


def read_tasks(pid: int) -> tuple[dict[int, int], float | None]:
    """Each thread's voluntary context switches (a thread's sleeps that ended: its wake-ups) and the RSS."""
    switches: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return switches, None
    for tid in tids:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        for line in text.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                switches[int(tid)] = int(line.split()[1])
    rss = None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return switches, rss


class TaskWatch(threading.Thread):
    """Reads the filler's threads, RSS and NVML calls every TASKS_EVERY_S until stopped."""

    def __init__(self, pid: int, gpus: Platform) -> None:
        super().__init__(daemon=True, name=f"tasks-{pid}")
        self.pid, self.gpus = pid, gpus
        self.readings: list[TaskReading] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(TASKS_EVERY_S):
            switches, rss = read_tasks(self.pid)
            if not switches:
                return
            self.readings.append(TaskReading(time.time(), switches, rss, self.gpus.nvml_calls(self.pid)))


def load_average() -> float | None:
    """How many processes were running or waiting for a CPU, over the last minute (other work on the machine)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def machine() -> Json:
    """The CPU the numbers were taken on: its model and core count, and how busy it was at the start."""
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_model": model, "logical_cpus": q(os.cpu_count(), "count"), "usable_cpus": q(usable, "count"),
            "load_average_1m_at_start": q(load_average(), "count"), "platform": platform.platform(),
            "clock_ticks_per_s": q(CLK_TCK, "count")}


def new_results(args: argparse.Namespace, argv: list[str], today: str, virtual: bool, software: Json) -> Json:
    return {
        "schema": SCHEMA,
        "scenario": "cpu",
        "mode": "real",
        "virtual_gpu": virtual,
        "date": today,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "scripts/gpu_bench.py", *argv]),
        "complete": False,
        "software": dict(software),
        "machine": machine(),
        "settings": {"run_s": q(args.cpu_s, "s"), "steady_from_s": q(STEADY_FROM_S, "s"),
                     "targets": [q(t, "ratio") for t in args.targets], "gpu_counts": [q(n, "count") for n in
                                                                                       args.cpu_gpus],
                     "filler_args": args.filler_args,
                     "budget_s": q(args.budget_s or None, "s", None if args.budget_s else "no limit")},
        "gpu": {"name": "unknown", "driver": "unknown"},
        "runs": [], "goals": [], "notes": [], "failures": [], "skipped": [],
    }


def plan(args: argparse.Namespace, virtual: bool = True) -> list[tuple[int, float, float, int]]:
    """(GPUs, target, process-list cost in ms, repeat) in the order they run: each repeat whole before the next,
    and within it the goals' runs first (1 GPU at 0.5 and 0.8, 8 GPUs at 0.5), so that a --budget-s cut leaves
    out the least telling. A real GPU's driver costs what it costs: only 0 there."""
    costs = list(getattr(args, "cpu_nvml_costs", [0.0])) if virtual else [0.0]
    runs = [(n, t) for n in args.cpu_gpus for t in args.targets]
    key_runs = [(1, 0.5), (max(args.cpu_gpus), 0.5), (1, 0.8)]
    order = sorted(runs, key=lambda r: (key_runs.index(r) if r in key_runs else len(key_runs), r))
    return [(n, t, c, k) for k in range(getattr(args, "cpu_repeats", 1)) for c in costs for n, t in order]


def estimate_s(args: argparse.Namespace) -> float:
    return float(len(plan(args, bool(getattr(args, "vgpu", True)))) * (args.cpu_s + OVERHEAD_S))


class CpuBench:
    def __init__(self, args: argparse.Namespace, gpus: Platform, results: Json) -> None:
        self.args = args
        self.gpus = gpus
        self.results = results
        self.start_event: Json | None = None  # the first run's, for the GPU's name and driver

    def run(self, n: int, target: float, nvml_cost_ms: float = 0.0, repeat: int = 0) -> CpuRun:
        args = self.args
        env, flags = self.gpus.prepare(n, nvml_cost_ms)
        label = "1 GPU" if n == 1 else f"{n} GPUs in one process"
        argv = [sys.executable, "-m", "forge_load", "--target", f"{target:g}", "--duration", f"{args.cpu_s:g}",
                "--log-format", "json", *flags, *args.filler_args]
        child = Child(f"filler ({label} at {target:g})", argv, env)
        watch = CpuWatch(child.pid, fast=lambda: not self.gpus.started(child))
        watch.start()
        tasks = TaskWatch(child.pid, self.gpus)
        tasks.start()
        try:
            code = child.wait_exit(args.start_timeout + args.cpu_s + 60.0)
        finally:
            for thread in (watch, tasks):
                thread.stop_event.set()
                thread.join(timeout=2.0)
        errors = [e for e in child.events if e.get("event") == "error"]
        starts = {int(e["gpu"]): float(e["wall_time"]) for e in child.events if e.get("event") == "start"}
        if code != 0 or errors or len(starts) != n:
            reason = f": {errors[0].get('reason')}" if errors else child.tail()
            raise BenchError(f"{child.name} exited with code {code} after {len(starts)} of {n} start lines{reason}")
        self.gpus.check()
        if self.start_event is None:
            self.start_event = next(e for e in child.events if e.get("event") == "start")
        return self.measure(child, watch.readings, starts, n, target, label, tasks.readings, nvml_cost_ms, repeat)

    def measure(self, child: Child, readings: list[tuple[float, int]], starts: dict[int, float], n: int,
                target: float, label: str, tasks: list[TaskReading] | None = None, nvml_cost_ms: float = 0.0,
                repeat: int = 0) -> CpuRun:
        args = self.args
        a = max(starts.values()) + STEADY_FROM_S
        b = min(starts.values()) + args.cpu_s - END_MARGIN_S
        inside = [(t, ticks) for t, ticks in readings if a <= t <= b]
        if len(inside) < 2 or inside[-1][0] - inside[0][0] < 1.0:
            raise BenchError(f"{child.name}: too few CPU readings in its steady state ({a:.1f} to {b:.1f})")
        (t0, ticks0), (t1, ticks1) = inside[0], inside[-1]
        cpu_s, wall_s = (ticks1 - ticks0) / CLK_TCK, t1 - t0
        cpu_pct = 100.0 * cpu_s / wall_s
        spans = self.gpus.kernel_spans(child.pid)
        line_s = min(starts.values()) - child.started_wall
        if spans is not None:
            if set(spans) != set(starts):
                raise BenchError(f"{child.name}: kernels on GPUs {sorted(spans)}, start lines for {sorted(starts)}")
            launches = sum(1 for device in spans.values() for s, _ in device if t0 <= s <= t1)
            first_kernel = max(min(s for s, _ in device) for device in spans.values())
            startup = Quantity.of(first_kernel - child.started_wall, "s")
            startup_cpu = measured(cpu_s_at(readings, first_kernel), "s",
                                   "the first kernel came before the first CPU reading")
            launches_q = Quantity.of(launches / wall_s / n, "launches/s")
            per_launch = measured(cpu_s / launches * 1e6 if launches else None, "us", "no launches")
            tracking_from = "the virtual GPU's kernel record, 1/6-s windows"
            tracked = [tracking_metrics(busy_samples(spans[d], s, s + args.cpu_s, VIRTUAL_WINDOW_S), target, s,
                                        s + args.cpu_s) for d, s in sorted(starts.items())]
        else:
            no_record = "n/a (real GPU): no record of kernels; see startup_to_start_line_s"
            startup = Quantity.of(None, "s", no_record)
            startup_cpu = measured(cpu_s_at(readings, min(starts.values())), "s",
                                   "the start line came before the first CPU reading")
            launches_q = Quantity.of(None, "launches/s", "n/a (real GPU): launches are not counted")
            per_launch = Quantity.of(None, "us", "n/a (real GPU): launches are not counted")
            tracked = []
            for d, s in sorted(starts.items()):
                samples = self.gpus.samples(d, s, s + args.cpu_s)
                if samples:
                    tracked.append(tracking_metrics(samples, target, s, s + args.cpu_s))
            tracking_from = f"NVML's samples of GPU {self.args.gpu}"
        if not tracked:
            raise BenchError(f"{child.name}: no utilization samples to judge its tracking by")
        never = "never settled on at least one GPU"
        steady = [r for r in tasks or [] if a <= r.wall <= b]
        first, last = (steady[0], steady[-1]) if len(steady) >= 2 else (None, None)
        by_thread: list[float] = []
        calls: dict[str, Quantity] = {}
        lists_q = Quantity.of(None, "calls/s", "n/a (real GPU): NVML calls are not counted")
        if first is not None and last is not None:
            dt = last.wall - first.wall
            by_thread = sorted(((last.switches[t] - first.switches[t]) / dt for t in last.switches
                                if t in first.switches), reverse=True)
            if first.nvml is not None and last.nvml is not None:
                (ta, ca), (tb, cb) = first.nvml, last.nvml
                rates = {f: (cb.get(f, 0) - ca.get(f, 0)) / (tb - ta) / n for f in sorted(cb)}
                calls = {f: Quantity.of(r, "calls/s") for f, r in rates.items() if r > 0}
                lists_q = Quantity.of(sum(rates.get(f, 0.0) for f in PROCESS_LIST_FUNCTIONS), "calls/s")
        no_tasks = "fewer than two readings of the threads in the steady state"
        return CpuRun(
            label=label, gpus=Quantity.of(n, "count"), target=Quantity.of(target, "ratio"),
            duration_s=Quantity.of(args.cpu_s, "s"),
            cpu_pct_one_core=Quantity.of(cpu_pct, "% of one core"),
            cpu_pct_per_gpu=Quantity.of(cpu_pct / n, "% of one core"),
            steady_s=Quantity.of(wall_s, "s"),
            launches_per_s_per_gpu=launches_q, cpu_us_per_launch=per_launch,
            startup_s=startup, startup_to_start_line_s=Quantity.of(line_s, "s"), startup_cpu_s=startup_cpu,
            settle_s=measured(worst([m.settle_s.value for m in tracked], True), "s", never),
            mae=measured(worst([m.mae.value for m in tracked], True), "ratio", never),
            p95_error=measured(worst([m.p95_error.value for m in tracked], True), "ratio", never),
            mae_from_5s=Quantity.of(worst([m.mae_from_5s.value for m in tracked], True), "ratio"),
            p95_error_from_5s=Quantity.of(worst([m.p95_error_from_5s.value for m in tracked], True), "ratio"),
            mean_util=Quantity.of(mean([m.mean_util.value for m in tracked if m.mean_util.value is not None]),
                                  "ratio"),
            yields=Quantity.of(count(child.events, "yield"), "count"),
            tracking_from=tracking_from,
            nvml_cost_ms=Quantity.of(nvml_cost_ms, "ms"),
            repeat=Quantity.of(repeat + 1, "count"),
            nvml_calls_per_s_per_gpu=calls,
            process_list_calls_per_s_per_gpu=lists_q,
            wakeups_per_s=measured(sum(by_thread) if by_thread else None, "wake-ups/s", no_tasks),
            wakeups_per_s_by_thread=[Quantity.of(w, "wake-ups/s") for w in by_thread],
            threads=measured(len(last.switches) if last is not None else None, "count", no_tasks),
            rss_mib=measured(last.rss_mib if last is not None else None, "MiB", no_tasks),
        )


def _value(x: Json) -> float | None:
    v = x.get("value") if isinstance(x, dict) else None
    return float(v) if isinstance(v, (int, float)) else None


def _median_quantity(items: list[Json]) -> Json:
    values = [v for v in map(_value, items) if v is not None]
    if not values:
        return dict(items[0])
    middle = statistics.median(values)
    whole = all(isinstance(x.get("value"), int) for x in items) and middle == int(middle)
    out: Json = {"value": int(middle) if whole else round(middle, 6), "unit": items[0]["unit"]}
    if len(items) > 1:
        out["note"] = f"median of {len(items)} runs: " + ", ".join(f"{v:.4g}" for v in values)
    return out


def summaries(results: Json) -> list[Json]:
    """One row per (GPUs, target, process-list cost): each number the median of its repeats (a run's tracking
    and yields too); sorted by cost, then GPUs, then target."""
    groups: dict[tuple[int, float, float], list[Json]] = {}
    for r in results["runs"]:
        cost = _value(r.get("nvml_cost_ms", {})) or 0.0
        groups.setdefault((r["gpus"]["value"], r["target"]["value"], cost), []).append(r)
    rows = []
    for (_n, _t, cost), runs in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        row: Json = {"label": runs[0]["label"], "tracking_from": runs[0]["tracking_from"], "repeats": len(runs)}
        by_cpu = sorted(runs, key=lambda r: _value(r["cpu_pct_one_core"]) or 0.0)
        middle = by_cpu[(len(by_cpu) - 1) // 2]  # the median run, for what has no median (each thread's)
        for key, first in runs[0].items():
            if isinstance(first, list):
                row[key] = middle[key]
            elif isinstance(first, dict) and "unit" in first:
                row[key] = _median_quantity([r[key] for r in runs if key in r])
            elif isinstance(first, dict) and "unit" not in first:  # by function
                names = sorted({f for r in runs for f in r.get(key, {})})
                row[key] = {f: _median_quantity([r[key].get(f, {"value": 0.0, "unit": "calls/s"}) for r in runs])
                            for f in names}
        if "nvml_cost_ms" not in row:
            row["nvml_cost_ms"] = {"value": cost, "unit": "ms"}
        rows.append(row)
    return rows


def judge_cpu_goals(results: Json) -> list[Json]:
    """CPU_GOALS against the runs: CPU per GPU (one GPU) at 0.5 and 0.8, the whole process with 8 GPUs at 0.5,
    and tracking (the worst run and GPU); with NVML asked by need, CPU at 0.5 for one and eight GPUs, one GPU with
    4.5-ms process lists, and the process-list calls; the compiled kernel's start-up and resident memory. A (GPUs,
    target, cost) run several times counts by its median."""
    runs = summaries(results)

    def run(gpus: int, target: float, cost: float = 0.0) -> Json | None:
        return next((r for r in runs if r["gpus"]["value"] == gpus and r["target"]["value"] == target
                     and (_value(r["nvml_cost_ms"]) or 0.0) == cost), None)

    def cpu(gpus: int, target: float, key: str, cost: float = 0.0) -> tuple[float | None, str, str | None]:
        found = run(gpus, target, cost)
        over = f"{gpus} GPU{'s' if gpus > 1 else ''} at {target:g}" + (f", {cost:g}-ms process lists" if cost
                                                                        else "")
        if found is None:
            devices = (results["gpu"].get("devices") or {}).get("value")
            if devices is not None and gpus > devices:
                return None, over, f"n/a: this machine has {devices} GPU(s)"
            if cost and not results.get("virtual_gpu"):
                return None, over, "n/a (real GPU): its driver costs what it costs"
            return None, over, f"no run of {over}"
        if found[key]["value"] is None and "n/a" in str(found[key].get("note", "")):
            return None, over, found[key]["note"]
        return found[key]["value"], over, None

    def name(r: Json) -> str:
        return f"{r['label']} at {r['target']['value']:g}"

    def tracked(key: str) -> tuple[float | None, str, str | None]:
        plain = [r for r in runs if not _value(r["nvml_cost_ms"])]
        unsettled = [name(r) for r in plain if r[key]["value"] is None]
        why = f"never settled: {'; '.join(unsettled)}" if unsettled else None if plain else "no run"
        return worst([r[key]["value"] for r in plain], True), ", ".join(map(name, plain)), why

    slow = max(NVML_COSTS_MS)

    measured = {
        "cpu_1gpu_0.5": cpu(1, 0.5, "cpu_pct_per_gpu"),
        "cpu_1gpu_0.8": cpu(1, 0.8, "cpu_pct_per_gpu"),
        "cpu_8gpus_0.5": cpu(8, 0.5, "cpu_pct_one_core"),
        "settle": tracked("settle_s"),
        "mae": tracked("mae"),
        "p95": tracked("p95_error"),
        "cpu20_1gpu_0.5": cpu(1, 0.5, "cpu_pct_per_gpu"),
        "cpu20_8gpus_0.5": cpu(8, 0.5, "cpu_pct_one_core"),
        "cpu20_1gpu_0.5_slow": cpu(1, 0.5, "cpu_pct_per_gpu", slow),
        "proc_lists": cpu(1, 0.5, "process_list_calls_per_s_per_gpu"),
        "startup_1gpu": cpu(1, 0.5, "startup_s"),
        "rss_1gpu": cpu(1, 0.5, "rss_mib"),
    }
    return [judge(goal, *measured[goal.key]) for goal in CPU_GOALS]


def run_cpu_bench(args: argparse.Namespace, results: Json, save: Callable[[], None], virtual: bool) -> None:
    """Every (GPUs, target) run, one at a time; a failed run is listed under failures and the others still run."""
    tmp = Path(tempfile.mkdtemp(prefix="forge_bench_cpu_"))
    gpus: VirtualGpus | RealGpus = VirtualGpus(tmp) if virtual else RealGpus(args, tmp)
    if not virtual:
        results["gpu"]["devices"] = q(gpus.device_count, "count")
    bench = CpuBench(args, gpus, results)
    began = time.monotonic()
    try:
        for n, target, cost, repeat in plan(args, gpus.virtual):
            what = (f"cpu: {'1 GPU' if n == 1 else f'{n} GPUs in one process'} at {target:g} ({args.cpu_s:g} s)"
                    + (f", process lists at {cost:g} ms" if cost else "")
                    + (f", repeat {repeat + 1}" if getattr(args, "cpu_repeats", 1) > 1 else ""))
            elapsed = time.monotonic() - began
            if n > gpus.device_count:
                results["skipped"].append(f"{what}: this machine has {gpus.device_count} GPU(s)")
                continue
            if args.budget_s and elapsed + args.cpu_s + OVERHEAD_S > args.budget_s:
                results["skipped"].append(f"{what}: left out of the --budget-s {args.budget_s:g} s "
                                          f"({elapsed:.0f} s used)")
                log(f"skipped {what} (time budget)")
                continue
            log(f"{what} [{elapsed:.0f} s in]")
            try:
                record = bench.run(n, target, cost, repeat)
            except BenchError as error:
                results["failures"].append(f"{what}: {error}")
                log(f"FAILED {what}: {error}")
                continue
            finally:
                CHILDREN.kill_all()
            results["runs"].append(to_json(record))
            if results["gpu"]["name"] == "unknown":
                devices = results["gpu"].get("devices")
                results["gpu"] = gpu_info(gpus, bench) | ({"devices": devices} if devices else {})
            save()
    finally:
        results["machine"]["load_average_1m_at_end"] = q(load_average(), "count")
        if isinstance(gpus, RealGpus):
            gpus.close()


def gpu_info(gpus: VirtualGpus | RealGpus, bench: CpuBench) -> Json:
    start = bench.start_event or {}
    info: Json = {"name": start.get("gpu_name", "unknown"), "driver": start.get("driver", "unknown")}
    if isinstance(gpus, RealGpus):  # NVML, read here, names the GPU of --gpu
        device = gpus.probe.info
        info = {"name": device.name, "uuid": device.uuid, "driver": device.driver_version, "index": device.index,
                "memory_total_mib": q(device.memory_total_mib, "MiB"), "mig": device.mig_enabled}
    info["sm_count"] = q(start.get("sm_count"), "count")
    if gpus.virtual:
        info["nvml_window_s"] = q(VIRTUAL_WINDOW_S, "s")
    return info
