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
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
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

# Issue 12's goals: CPU per GPU at 0.5 and 0.8 on one GPU, the whole process with 8 GPUs at 0.5, and the
# tracking that must hold meanwhile (the worst run and GPU).
CPU_GOALS = (
    Goal("cpu_1gpu_0.5", "filler CPU per GPU at 0.5, one GPU, steady state", "<=", 1.0, "% of one core"),
    Goal("cpu_1gpu_0.8", "filler CPU per GPU at 0.8, one GPU, steady state", "<=", 1.5, "% of one core"),
    Goal("cpu_8gpus_0.5", "filler CPU, 8 GPUs in one process, at 0.5, steady state", "<=", 8.0, "% of one core"),
    Goal("settle", "settle time (worst run and GPU)", "<=", 2.0, "s"),
    Goal("mae", "mean abs error after settling (worst run and GPU)", "<=", 0.01, "ratio"),
    Goal("p95", "p95 abs error after settling (worst run and GPU)", "<=", 0.03, "ratio"),
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


class Platform(Protocol):
    """Where the runs go: fresh virtual GPUs, or the real GPUs of this machine."""

    virtual: bool
    device_count: int

    def prepare(self, gpus: int) -> tuple[dict[str, str], list[str]]:
        """The environment and the GPU flags for a filler on `gpus` GPUs."""

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

    def prepare(self, gpus: int) -> tuple[dict[str, str], list[str]]:
        from vgpu import VgpuError, VirtualGpu

        self.runs += 1
        try:
            self._gpu = VirtualGpu(self.tmp / f"run{self.runs}", gpus=gpus)
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

    def prepare(self, gpus: int) -> tuple[dict[str, str], list[str]]:
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

    def samples(self, device: int, a: float, b: float) -> list[UtilSample] | None:
        return self.sampler.between("util", a, b) if device == self.index else None

    def check(self) -> None:
        time.sleep(3 * self.sampler.interval_s)  # NVML's last samples of the run
        if self.sampler.failure:
            raise BenchError(f"reading NVML failed: {self.sampler.failure}")


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


def plan(args: argparse.Namespace) -> list[tuple[int, float]]:
    """(GPUs, target) in the order they run: the goals' runs first (1 GPU at 0.5 and 0.8, 8 GPUs at 0.5), so
    that a --budget-s cut leaves out the least telling."""
    runs = [(n, t) for n in args.cpu_gpus for t in args.targets]
    key_runs = [(1, 0.5), (max(args.cpu_gpus), 0.5), (1, 0.8)]
    return sorted(runs, key=lambda r: (key_runs.index(r) if r in key_runs else len(key_runs), r))


def estimate_s(args: argparse.Namespace) -> float:
    return float(len(plan(args)) * (args.cpu_s + OVERHEAD_S))


class CpuBench:
    def __init__(self, args: argparse.Namespace, gpus: Platform, results: Json) -> None:
        self.args = args
        self.gpus = gpus
        self.results = results
        self.start_event: Json | None = None  # the first run's, for the GPU's name and driver

    def run(self, n: int, target: float) -> CpuRun:
        args = self.args
        env, flags = self.gpus.prepare(n)
        label = "1 GPU" if n == 1 else f"{n} GPUs in one process"
        argv = [sys.executable, "-m", "forge_load", "--target", f"{target:g}", "--duration", f"{args.cpu_s:g}",
                "--log-format", "json", *flags, *args.filler_args]
        child = Child(f"filler ({label} at {target:g})", argv, env)
        watch = CpuWatch(child.pid, fast=lambda: not self.gpus.started(child))
        watch.start()
        try:
            code = child.wait_exit(args.start_timeout + args.cpu_s + 60.0)
        finally:
            watch.stop_event.set()
            watch.join(timeout=2.0)
        errors = [e for e in child.events if e.get("event") == "error"]
        starts = {int(e["gpu"]): float(e["wall_time"]) for e in child.events if e.get("event") == "start"}
        if code != 0 or errors or len(starts) != n:
            reason = f": {errors[0].get('reason')}" if errors else child.tail()
            raise BenchError(f"{child.name} exited with code {code} after {len(starts)} of {n} start lines{reason}")
        self.gpus.check()
        if self.start_event is None:
            self.start_event = next(e for e in child.events if e.get("event") == "start")
        return self.measure(child, watch.readings, starts, n, target, label)

    def measure(self, child: Child, readings: list[tuple[float, int]], starts: dict[int, float], n: int,
                target: float, label: str) -> CpuRun:
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
        )


def judge_cpu_goals(results: Json) -> list[Json]:
    """Issue 12's goals against the runs: CPU per GPU (one GPU) at 0.5 and 0.8, the whole process with 8 GPUs
    at 0.5, and tracking (the worst run and GPU)."""
    runs = results["runs"]

    def run(gpus: int, target: float) -> Json | None:
        return next((r for r in runs if r["gpus"]["value"] == gpus and r["target"]["value"] == target), None)

    def cpu(gpus: int, target: float, key: str) -> tuple[float | None, str, str | None]:
        found = run(gpus, target)
        over = f"{gpus} GPU{'s' if gpus > 1 else ''} at {target:g}"
        if found is None:
            devices = (results["gpu"].get("devices") or {}).get("value")
            if devices is not None and gpus > devices:
                return None, over, f"n/a: this machine has {devices} GPU(s)"
            return None, over, f"no run of {over}"
        return found[key]["value"], over, None

    def name(r: Json) -> str:
        return f"{r['label']} at {r['target']['value']:g}"

    def tracked(key: str) -> tuple[float | None, str, str | None]:
        unsettled = [name(r) for r in runs if r[key]["value"] is None]
        why = f"never settled: {'; '.join(unsettled)}" if unsettled else None if runs else "no run"
        return worst([r[key]["value"] for r in runs], True), ", ".join(map(name, runs)), why

    measured = {
        "cpu_1gpu_0.5": cpu(1, 0.5, "cpu_pct_per_gpu"),
        "cpu_1gpu_0.8": cpu(1, 0.8, "cpu_pct_per_gpu"),
        "cpu_8gpus_0.5": cpu(8, 0.5, "cpu_pct_one_core"),
        "settle": tracked("settle_s"),
        "mae": tracked("mae"),
        "p95": tracked("p95_error"),
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
        for n, target in plan(args):
            what = f"cpu: {'1 GPU' if n == 1 else f'{n} GPUs in one process'} at {target:g} ({args.cpu_s:g} s)"
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
                record = bench.run(n, target)
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
