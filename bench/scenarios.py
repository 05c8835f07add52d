"""The scenarios: tracking (pi against legacy at each target), yield (a foreign job arrives and leaves) and
footprint (memory, CPU, power), on the simulated GPU in virtual time or on a real GPU (or the virtual one).

On the simulated GPU the filler runs in this process (forge_load.service.loop.run_simulated), and the simulator's own
record is the ground truth. On a real GPU the filler is `python -m forge_load` as users run it, in a child
process; NVML is read here by the Sampler, and the foreign job is scripts/foreign_job.py.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, Any

from bench import REPO, BenchError, NoGpu, log
from bench.analysis import (
    YIELD_SLACK_S,
    announced_job,
    count,
    first,
    marks,
    parse_events,
    status_series,
    tracking_metrics,
    yield_metrics,
)
from bench.results import (
    ANNOUNCED_LABELS,
    FOOTPRINT_TARGET,
    JUDGE_FROM_S,
    YIELD_TARGET,
    AnnouncedJob,
    AnnouncedMetrics,
    Quantity,
    Scenario,
    add_scenario,
    add_tracking,
    mean,
    q,
    val,
)
from bench.runner import CHILDREN, Child, cpu_percent
from bench.sampler import Sampler

if TYPE_CHECKING:
    from bench.kubelet import TestKubelet
    from forge_load.config.settings import Config
    from forge_load.service.loop import SimRun

HUGE_MIB = "1000000"  # a foreign-memory threshold no job reaches: turns the memory signal off

# Yield variants: (name, label, filler settings). Real mode can only hide the job by making the filler
# ignore the process list; the simulator can also hide it from the list itself.
SIM_VARIANTS = {
    "visible": ("visible", []),
    "hidden": ("hidden from the process list (simulated container)", ["--sim-hide-foreign"]),
    "no_process_list": ("filler ignores the process list", ["--no-process-list"]),
    "utilization_only": ("utilization signal only (list hidden, memory signal off)",
                         ["--sim-hide-foreign", "--foreign-mem-mib", HUGE_MIB]),
}
REAL_VARIANTS = {
    "visible": ("visible", {}),
    "hidden": ("hidden: filler ignores the process list", {"FORGE_USE_PROCESS_LIST": "0"}),
    "utilization_only": ("utilization signal only (list ignored, memory signal off)",
                         {"FORGE_USE_PROCESS_LIST": "0", "FORGE_FOREIGN_MEM_MIB": HUGE_MIB}),
}
SIM_YIELD_PLAN = (("pi", "visible"), ("pi", "hidden"), ("pi", "no_process_list"), ("pi", "utilization_only"),
                  ("legacy", "visible"), ("legacy", "hidden"))
# On a real GPU in the order they run: the least telling last, where a --budget-s cut falls.
REAL_YIELD_PLAN = (("pi", "visible"), ("pi", "hidden"), ("legacy", "visible"), ("pi", "utilization_only"),
                   ("legacy", "hidden"))


# --- the simulated GPU ------------------------------------------------------------------------------------

def sim_config(argv: list[str]) -> Config:
    from forge_load.config.load import load_config

    return load_config(argv, env={})  # the caller's FORGE_* environment must not leak into the runs


def sim_argv(args: argparse.Namespace, target: float, controller: str, duration_s: float) -> list[str]:
    return ["--simulate", "--sim-speed", "0", "--duration", f"{duration_s:g}", "--target", f"{target:g}",
            "--controller", controller, "--log-format", "json", "--log-interval", "1", "--boost-after", "0",
            "--sim-seed", str(args.seed), "--sim-window", f"{args.sim_window:g}",
            "--resume-after", f"{args.resume_after:g}"]


def run_sim(argv: list[str]) -> tuple[SimRun, list[dict[str, Any]]]:
    from forge_load.service.loop import run_simulated

    stream = io.StringIO()
    run = run_simulated(sim_config(argv), stream, keep_history=True)  # scored afterwards
    return run, parse_events(stream.getvalue().splitlines())


def sim_series(run: SimRun, events: list[dict[str, Any]], end_s: float, target: float) -> dict[str, Any]:
    """Ground truth from the simulated GPU: NVML's samples, and per window our and the foreign busy share."""
    gpu = run.gpu
    w = gpu.window_s
    samples = gpu.samples(0.0, end_s)
    return {
        "target": target,
        "util": [[round(s.t_s, 4), s.ratio] for s in samples],
        "own": [[round(s.t_s, 4), round(gpu.own_busy_s(s.t_s - w, s.t_s) / w, 4)] for s in samples],
        "foreign": [[round(s.t_s, 4), round(gpu.foreign_busy_s(s.t_s - w, s.t_s) / w, 4)] for s in samples],
        "multiplier": status_series(events, "multiplier"),
        "power_w": status_series(events, "power_w"),
    }


def sim_tracking(args: argparse.Namespace, target: float, controller: str) -> Scenario:
    duration = args.track_s
    run, events = run_sim(sim_argv(args, target, controller, duration))
    samples = run.gpu.samples(0.0, duration)
    metrics = tracking_metrics(samples, target, 0.0, duration)
    power = [e["power_w"] for e in events if e.get("event") == "status" and e["t"] >= JUDGE_FROM_S
             and e.get("power_w") is not None]
    metrics.power_w = Quantity.of(mean(power), "W", "simulated: the simulator's power model")
    metrics.yields = Quantity.of(count(events, "yield"), "count")
    start = first(events, "start") or {}
    metrics.gpu_mem_mib = Quantity.of(start.get("gpu_mem_mib"), "MiB", "simulated")
    return Scenario(f"tracking_{controller}_{target:g}", metrics, sim_series(run, events, duration, target))


def sim_yield(args: argparse.Namespace, controller: str, variant: str) -> Scenario:
    label, extra = SIM_VARIANTS[variant]
    a = args.warmup_s
    b = a + args.foreign_s
    duration = b + args.resume_after + 5.0
    argv = sim_argv(args, YIELD_TARGET, controller, duration) + ["--sim-foreign", f"{a:g}-{b:g}"] + extra
    run, events = run_sim(argv)
    metrics = yield_metrics(events, a, b, args.resume_after)
    gpu = run.gpu
    # The simulator does not slow foreign work down (its busy time is fixed, overlapping ours), so the
    # real throughput ratio cannot come from it. What it can say: the share of the job's busy time during
    # which our kernels ran too. If each such second cost the job a second, that is its worst-case loss.
    foreign_busy = gpu.foreign_busy_s(a, b)
    union = gpu.busy_ratio(a, b) * (b - a)
    contended = gpu.own_busy_s(a, b) + foreign_busy - union
    metrics.foreign_throughput_ratio = Quantity.of(None, "ratio", "n/a (simulated): the simulator does not "
                                                   "model contention; see foreign_worst_case_ratio")
    metrics.foreign_contended_s = Quantity.of(max(contended, 0.0), "s")
    metrics.foreign_busy_s = Quantity.of(foreign_busy, "s")
    metrics.foreign_worst_case_ratio = Quantity.of(
        1.0 - max(contended, 0.0) / foreign_busy if foreign_busy else None, "ratio",
        "simulated bound: 1 - contended / foreign busy time")
    metrics.controller, metrics.variant, metrics.label = controller, variant, label
    metrics.target = Quantity.of(YIELD_TARGET, "ratio")
    series = sim_series(run, events, duration, YIELD_TARGET)
    series["marks"] = marks(events, a, b)
    return Scenario(f"yield_{controller}_{variant}", metrics, series)


def run_simulated_bench(args: argparse.Namespace, results: dict[str, Any], save: Callable[[], None]) -> None:
    from forge_load.gpu import sim

    run, events = run_sim(sim_argv(args, 0.5, "pi", 0.0) + ["--duration", "0.001"])
    start = first(events, "start") or {}
    results["gpu"] = {"name": run.gpu.info.name, "uuid": run.gpu.info.uuid, "driver": run.gpu.info.driver_version,
                      "index": run.gpu.info.index, "sm_count": q(start.get("sm_count"), "count"),
                      "memory_total_mib": q(run.gpu.info.memory_total_mib, "MiB"),
                      "nvml_window_s": q(args.sim_window, "s")}
    for target in args.targets if "tracking" in args.scenarios else ():
        for controller in args.controllers:
            log(f"tracking {controller} at {target:g} ({args.track_s:g} virtual s)")
            add_tracking(results, sim_tracking(args, target, controller))
        save()
    if "yield" in args.scenarios:
        for controller, variant in SIM_YIELD_PLAN:
            if controller in args.controllers and variant in args.variants:
                log(f"yield {controller} {variant}")
                add_scenario(results, "yield", sim_yield(args, controller, variant))
        save()
    pi_05 = results["tracking"].get("pi", {}).get(f"{FOOTPRINT_TARGET:g}", {})
    filler_mib = val(pi_05.get("gpu_mem_mib"))
    note = "simulated: the simulator's model, not a measurement"
    results["footprint"] = {
        "simulated": True,
        "filler_process_mib": q(filler_mib, "MiB", note),
        "bare_context_mib": q(sim.CONTEXT_MIB, "MiB", note),
        "over_bare_mib": q(filler_mib - sim.CONTEXT_MIB if filler_mib is not None else None, "MiB", note),
        "over_bare_ratio": q(filler_mib / sim.CONTEXT_MIB if filler_mib is not None else None, "x", note),
        "cpu_pct_one_core": q(None, "% of one core", "n/a (simulated): virtual time has no CPU cost"),
        "power_w": {f"{t:g}": results["tracking"].get("pi", {}).get(f"{t:g}", {}).get(
            "power_w", q(None, "W")) for t in args.targets},
        "idle_power_w": q(sim.IDLE_POWER_W, "W", note),
    }


# --- a real GPU -------------------------------------------------------------------------------------------

@dataclass
class RealRun:
    """A finished filler process: its log, and its clock (t = seconds since its start) against wall time."""

    events: list[dict[str, Any]]
    start_wall: float
    pid: int

    def wall(self, t: float) -> float:
        return self.start_wall + t

    def t(self, wall: float) -> float:
        return wall - self.start_wall


class RealBench:
    """The scenarios on a real GPU. The filler is `python -m forge_load` as a user runs it; NVML is read
    here, in the bench process, which opens no CUDA context of its own."""

    def __init__(self, args: argparse.Namespace, probe: Any, sampler: Sampler) -> None:
        self.args = args
        self.probe = probe
        self.sampler = sampler
        self.gpu = str(args.gpu)
        self.tmp = Path(tempfile.mkdtemp(prefix="forge_bench_"))
        self.solo: list[dict[str, Any]] = []
        self.start_event: dict[str, Any] = {}
        self.overhead_s = 8.0  # seconds a filler run takes beyond its duration (imports, CUDA, compiling)

    # --- processes ---
    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_") and k != "TARGET"}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        env.update(FORGE_GPU=self.gpu, FORGE_LOG_FORMAT="json", CUDA_DEVICE_ORDER="PCI_BUS_ID",
                   FORGE_HEARTBEAT_FILE=str(self.tmp / "heartbeat"), PYTHONUNBUFFERED="1")
        env.setdefault("CUDA_MODULE_LOADING", "LAZY")
        env.update(extra or {})
        return env

    def start_filler(self, target: float, controller: str, duration_s: float,
                     env_extra: dict[str, str] | None = None) -> Child:
        argv = [sys.executable, "-m", "forge_load", "--target", f"{target:g}", "--controller", controller,
                "--duration", f"{duration_s:g}", "--log-format", "json", "--log-interval", "1",
                "--boost-after", "0", "--resume-after", f"{self.args.resume_after:g}", *self.args.filler_args]
        child = Child(f"filler ({controller} at {target:g})", argv, self.env(env_extra))
        try:
            child.wait_for(lambda e: e.get("event") == "start", self.args.start_timeout, "its start line")
        except BaseException:
            child.stop(grace_s=5.0)
            raise
        self.sampler.watch.add(child.pid)
        return child

    def foreign(self, name: str, wait: bool) -> Child:
        argv = [sys.executable, str(REPO / "scripts" / "foreign_job.py"), "--gpu", self.gpu,
                "--seconds", f"{self.args.foreign_s:g}", *self.args.foreign_args] + (["--wait"] if wait else [])
        return Child(name, argv, self.env(), stdin=wait)

    def wait_idle(self, timeout_s: float = 20.0) -> None:
        """Wait until no process is on the GPU (the previous scenario's have exited)."""
        deadline = time.monotonic() + timeout_s
        while True:
            procs = self.probe.processes()
            if not procs:
                return
            if time.monotonic() > deadline:
                pids = ", ".join(str(p.pid) for p in procs)
                raise BenchError(f"the GPU is not idle: process(es) {pids} on it; the benchmark needs the "
                                 "GPU to itself")
            time.sleep(0.25)

    def finish(self, child: Child, timeout_s: float) -> RealRun:
        code = child.wait_exit(timeout_s)
        time.sleep(3 * self.sampler.interval_s)  # let the sampler read NVML's last samples of the run
        start = first(child.events, "start")
        assert start is not None
        error = first(child.events, "error")
        if code != 0 or error:
            raise BenchError(f"{child.name} exited with code {code}"
                             f"{': ' + str(error.get('reason')) if error else child.tail()}")
        return RealRun(child.events, float(start["wall_time"]), child.pid)

    def series(self, run: RealRun, end_t: float, target: float) -> dict[str, Any]:
        a, b = run.wall(0.0), run.wall(end_t)
        return {
            "target": target,
            "util": [[round(run.t(s.t_s), 4), s.ratio] for s in self.sampler.between("util", a, b)],
            "own": status_series(run.events, "own"),
            "foreign": status_series(run.events, "foreign"),
            "multiplier": status_series(run.events, "multiplier"),
            "power_w": [[round(run.t(t), 3), p] for t, p in self.sampler.between("power", a, b)],
        }

    # --- scenarios ---
    def idle(self) -> dict[str, Any]:
        """Board power and device memory in use with nothing of ours on the GPU."""
        a = time.time()
        time.sleep(3.0)
        power = [p for _, p in self.sampler.between("power", a, time.time())]
        memory = [m for _, m in self.sampler.between("memory", a, time.time())]
        return {"power_w": q(mean(power), "W", None if power else "NVML gave no power reading"),
                "memory_used_mib": q(mean(memory), "MiB", None if memory else "NVML gave no memory reading")}

    def bare_context(self) -> dict[str, Any]:
        self.wait_idle()
        child = Child("bare context", [sys.executable, str(REPO / "scripts" / "bare_context.py"), "--gpu", self.gpu],
                      self.env())
        code = child.wait_exit(self.args.start_timeout)
        event = first(child.events, "bare_context")
        if code != 0 or event is None:
            raise BenchError(f"bare_context.py exited with code {code}{child.tail()}")
        return event

    def tracking(self, target: float, controller: str) -> Scenario:
        self.wait_idle()
        d = self.args.track_s
        began = time.monotonic()
        child = self.start_filler(target, controller, d)
        run = self.finish(child, d + 60.0)
        self.overhead_s = max(self.overhead_s, time.monotonic() - began - d)
        a, b = run.wall(0.0), run.wall(d)
        samples = self.sampler.between("util", a, b)
        if not samples:
            raise BenchError(f"NVML gave no utilization samples during {child.name}")
        metrics = tracking_metrics(samples, target, a, b)
        power = [p for _, p in self.sampler.between("power", a + JUDGE_FROM_S, b)]
        metrics.power_w = Quantity.of(mean(power), "W", None if power else "NVML gave no power reading")
        metrics.yields = Quantity.of(count(run.events, "yield"), "count")
        own_mib = [procs.get(run.pid) for _, procs in self.sampler.between("processes", a, b)]
        own_mib = [m for m in own_mib if m is not None]
        start = first(run.events, "start") or {}
        metrics.gpu_mem_mib = Quantity.of(max(own_mib) if own_mib else None, "MiB",
                                          None if own_mib else "NVML did not report the filler's process memory")
        metrics.gpu_mem_mib_logged = Quantity.of(start.get("gpu_mem_mib"), "MiB")
        device = sorted(m for _, m in self.sampler.between("memory", a, b))
        metrics.device_mem_used_mib = Quantity.of(device[len(device) // 2] if device else None, "MiB",
                                                  None if device else "NVML gave no memory reading")
        metrics.cpu_pct_one_core = Quantity.of(
            cpu_percent(self.sampler.cpu.get(run.pid, []), a + JUDGE_FROM_S, b), "% of one core")
        others = self.sampler.foreign_pids({run.pid}, a, b)
        if others:
            metrics.warning = f"other processes on the GPU during the run: {sorted(others)}"
        self.start_event = start
        return Scenario(f"tracking_{controller}_{target:g}", metrics, self.series(run, d, target))

    def foreign_solo(self) -> dict[str, Any]:
        self.wait_idle()
        child = self.foreign("foreign job (solo)", wait=False)
        child.wait_exit(self.args.foreign_s + self.args.start_timeout + 60.0)
        done = first(child.events, "done")
        backend = first(child.events, "backend") or {}
        if child.proc.returncode != 0 or done is None:
            raise BenchError(f"foreign_job.py (solo) exited with code {child.proc.returncode}{child.tail()}")
        self.solo.append(done)
        return {"backend": f"{backend.get('backend')} {backend.get('version')}",
                "size": q(backend.get("size"), "count"), "batch": q(backend.get("batch"), "count"),
                "steps": q(done["steps"], "count"), "elapsed_s": q(done["elapsed_s"], "s"),
                "steps_per_s": q(done["steps_per_s"], "steps/s"),
                "steady_steps_per_s": q(done.get("steady_steps_per_s"), "steps/s")}

    def yield_run(self, controller: str, variant: str) -> Scenario:
        label, env_extra = REAL_VARIANTS[variant]
        args = self.args
        self.wait_idle()
        budget = args.warmup_s + args.foreign_s + args.start_timeout + args.resume_after + 120.0
        # The job imports its libraries while the filler starts, then waits for "go": its context is
        # created at a moment we choose, with nothing else in flight.
        job = self.foreign("foreign job", wait=True)
        filler: Child | None = None
        try:
            filler = self.start_filler(YIELD_TARGET, controller, budget, env_extra)
            job.wait_for(lambda e: e.get("event") == "ready", args.start_timeout, "its ready line")
            time.sleep(args.warmup_s)
            job.send("go")
            context = job.wait_for(lambda e: e.get("event") == "context", 60.0, "its context line")
            job.wait_exit(args.foreign_s + 120.0)
            done = first(job.events, "done")
            if job.proc.returncode != 0 or done is None:
                raise BenchError(f"foreign_job.py exited with code {job.proc.returncode}{job.tail()}")
            end_wall = job.exit_wall or time.time()
            start_wall = float((first(filler.events, "start") or {})["wall_time"])
            yielded = any(e.get("event") == "yield" and start_wall + e["t"] >= float(context["wall_time_begin"])
                          - YIELD_SLACK_S for e in list(filler.events))
            try:
                if not yielded:
                    raise BenchError("the filler never yielded to the foreign job, so there is no resume to "
                                     "wait for")
                filler.wait_for(lambda e: e.get("event") == "resume" and start_wall + e["t"] >= end_wall,
                                args.resume_after + 30.0, "resume line after the foreign job exited")
                time.sleep(1.0)  # a little filling after the resume, for the plot
            except BenchError as error:
                log(str(error))
        finally:
            job.stop(grace_s=5.0)
            if filler is not None:
                filler.stop()
        run = self.finish(filler, 30.0)
        a_t, b_t = run.t(float(context["wall_time"])), run.t(end_wall)
        metrics = yield_metrics(run.events, a_t, b_t, args.resume_after,
                                context_begin_t=run.t(float(context["wall_time_begin"])))
        solo = [d["steps_per_s"] for d in self.solo]
        metrics.foreign_steps_per_s = Quantity.of(done["steps_per_s"], "steps/s")
        metrics.foreign_steps = Quantity.of(done["steps"], "count")
        metrics.solo_steps_per_s = Quantity.of(mean(solo), "steps/s", None if solo else "no solo run yet")
        metrics.foreign_throughput_ratio = Quantity.of(done["steps_per_s"] / mean(solo) if solo else None, "ratio",
                                                       None if solo else "no solo run to compare with")
        # The same as seconds of the job's run lost to us, which does not depend on how long the job ran.
        metrics.foreign_lost_s = Quantity.of(done["elapsed_s"] - done["steps"] / mean(solo) if solo else None,
                                             "s", None if solo else "no solo run to compare with")
        metrics.foreign_elapsed_s = Quantity.of(done["elapsed_s"], "s")
        metrics.controller, metrics.variant, metrics.label = controller, variant, label
        metrics.target = Quantity.of(YIELD_TARGET, "ratio")
        end_t = max(e.get("t") or 0.0 for e in run.events)
        series = self.series(run, end_t, YIELD_TARGET)
        series["marks"] = marks(run.events, a_t, b_t)
        return Scenario(f"yield_{controller}_{variant}", metrics, series)


    def hold_command(self, action: str, hold_dir: Path, *extra: str) -> tuple[int, float, float]:
        """`forge-load hold|release` as a Slurm prolog or epilog runs it: (exit code, began, answered) in wall time."""
        argv = [sys.executable, "-m", "forge_load", action, "--holder", "bench", "--hold-dir", str(hold_dir), *extra]
        began = time.time()
        try:
            proc = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=60, check=False)
        except subprocess.TimeoutExpired as error:
            raise BenchError(f"forge-load {action} did not answer in 60 s") from error
        answered = time.time()
        if proc.returncode not in (0, 1):
            raise BenchError(f"forge-load {action} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
        return proc.returncode, began, answered

    def own_kernels(self, pid: int, a_wall: float, b_wall: float) -> int | None:
        """Our kernels on the GPU in [a, b] by the virtual GPU's record; None on a real GPU (no such record)."""
        state = os.environ.get("VGPU_STATE")
        if not state:
            return None
        pidns = os.stat("/proc/self/ns/pid").st_ino  # the filler's; a container's process can have its PID
        index = str(self.probe.info.index)
        n = 0
        for line in (Path(state) / "kernels.jsonl").read_text().splitlines():
            if line.strip():
                k = json.loads(line)
                if (k["pid"] == pid and k.get("pidns", pidns) == pidns and str(k["device"]) in (self.gpu, index)
                        and k["end"] > a_wall and k["start"] < b_wall):
                    n += 1
        return n

    def announced(self, path: str, controller: str) -> Scenario:
        """Foreign jobs on one path (ANNOUNCED_PATHS): the filler fills; the job is announced (or not, nvml); it
        creates its context and trains; the announcement ends; the filler resumes; again.

        hold: `forge-load hold --wait 2` (the Slurm prolog), then the waiting job's "go", then `forge-load
        release` (the epilog). kubelet: the test kubelet assigns the GPU's UUID to a pod, then the job's process
        starts; freed once it exits. docker: `docker run --gpus device=N` of a driver-API job that opens its
        context 0.5 s after the container's first instruction, `forge-load fleet watch` placing the hold from the
        create event and releasing it when the container dies. nvml: the waiting job's "go", nothing else."""
        args = self.args
        self.wait_idle()
        hold_dir = self.tmp / f"holds_{path}"
        hold_dir.mkdir(mode=0o755, exist_ok=True)  # before the filler: it acknowledges only into a directory
        env_extra = {"FORGE_HOLD_DIR": str(hold_dir)}
        per_job = args.foreign_s + args.resume_after + args.start_timeout + 60.0
        kubelet: TestKubelet | None = None
        watcher: Child | None = None
        filler: Child | None = None
        jobs: list[tuple[float, float | None, int | None, float, float, float, int | None, int | None]] = []
        try:
            if path == "kubelet":
                from bench.kubelet import TestKubelet

                kubelet = TestKubelet(self.tmp / "kubelet.sock").start()
                env_extra.update(FORGE_KUBELET_SOCKET=str(self.tmp / "kubelet.sock"), POD_NAMESPACE=BENCH_NAMESPACE,
                                 POD_NAME="forge-load-bench")
            if path == "docker":
                watcher = Child("docker watcher", [sys.executable, "-m", "forge_load", "fleet", "watch",
                                                   "--hold-dir", str(hold_dir)], self.env())
                watch_line(watcher, lambda line: "event=engine state=connected" in line, 60.0, "its connected line")
            filler = self.start_filler(YIELD_TARGET, controller, args.warmup_s + args.announced_jobs * per_job,
                                       env_extra)
            start_wall = float((first(filler.events, "start") or {})["wall_time"])
            time.sleep(args.warmup_s)
            for i in range(args.announced_jobs):
                name = f"foreign job ({path}, {i + 1} of {args.announced_jobs})"
                answered: float | None = None
                code: int | None = None
                if path == "docker":
                    assert watcher is not None
                    began, context, end_wall, release_wall = self.docker_job(watcher, i)
                else:
                    if path == "kubelet":
                        assert kubelet is not None
                        kubelet.assign(BENCH_NAMESPACE, f"job-{i + 1}", "main", "nvidia.com/gpu",
                                       [self.probe.info.uuid])
                        began = time.time()
                    job = self.foreign(name, wait=path != "kubelet")  # kubelet: its process starts just after
                    try:
                        if path != "kubelet":
                            job.wait_for(lambda e: e.get("event") == "ready", args.start_timeout, "its ready line")
                            began = time.time()
                            if path == "hold":
                                code, began, answered = self.hold_command(
                                    "hold", hold_dir, "--gpu", self.gpu, "--reason",
                                    f"benchmark: announced job {i + 1}", "--wait", "2")
                            job.send("go")
                        context = job.wait_for(lambda e: e.get("event") == "context", args.start_timeout + 60.0,
                                               "its context line")
                        job.wait_exit(args.foreign_s + 120.0)
                        if job.proc.returncode != 0 or first(job.events, "done") is None:
                            raise BenchError(f"foreign_job.py exited with code {job.proc.returncode}{job.tail()}")
                        end_wall = job.exit_wall or time.time()
                    finally:
                        job.stop(grace_s=5.0)
                    if path == "hold":
                        _, release_wall, _ = self.hold_command("release", hold_dir, "--gpu", self.gpu)
                    elif path == "kubelet":
                        assert kubelet is not None
                        release_wall = time.time()
                        kubelet.free(BENCH_NAMESPACE, f"job-{i + 1}")
                    else:
                        release_wall = end_wall
                if path == "nvml":
                    began = float(context["wall_time_begin"])  # nobody announced it: its context is the first sign
                filler.wait_for(resumed_after(start_wall, release_wall), args.resume_after + 30.0,
                                "resume line after the release")
                begin_wall = float(context["wall_time_begin"])
                jobs.append((began, answered, code, begin_wall, release_wall, end_wall,
                             self.own_kernels(filler.pid, answered, release_wall) if answered is not None else None,
                             self.own_kernels(filler.pid, begin_wall, end_wall)))
        finally:
            if filler is not None:
                filler.stop()
            if watcher is not None:
                watcher.stop(grace_s=5.0)
            if kubelet is not None:
                kubelet.stop()
        assert filler is not None
        run = self.finish(filler, 30.0)
        done = [announced_job(run.events, run.t(b), run.t(a) if a is not None else None, code, run.t(ctx),
                              run.t(rel), held, path=path, own_kernels_while_ran=ran)
                for b, a, code, ctx, rel, _, held, ran in jobs]
        metrics = announced_metrics(done, path, controller)
        end_t = max(e.get("t") or 0.0 for e in run.events)
        return Scenario(f"announced_{path}", metrics, self.series(run, end_t, YIELD_TARGET))

    def docker_job(self, watcher: Child, i: int) -> tuple[float, dict[str, Any], float, float]:
        """One `docker run --gpus device=N` of scripts/driver_job.py on the virtual GPU (its libraries and state
        mounted as the NVIDIA toolkit mounts the driver's): (run began, its context line, its exit, the watcher's
        release), in wall time."""
        state = os.environ.get("VGPU_STATE")
        lib = next((d for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)
                    if d and (Path(d) / "libcuda.so.1").exists()), None)
        if not state or lib is None:
            raise BenchError("the docker path runs on the virtual GPU only (its libraries are mounted into the "
                             "container); on a real GPU the NVIDIA container toolkit would mount the driver's")
        name = f"forge_bench_{os.getpid()}_{i + 1}"
        t0 = 'export JOB_T0=$(date +%s.%N); '
        argv = ["docker", "run", "--rm", "--name", name, "--gpus", f"device={self.probe.info.index}",
                "-v", f"{lib}/libcuda.so.1:{DRIVER_DIR}/libcuda.so.1:ro",
                "-v", f"{lib}/libnvidia-ml.so.1:{DRIVER_DIR}/libnvidia-ml.so.1:ro",
                "-v", f"{state}:{state}", "-e", f"VGPU_STATE={state}",
                "-v", f"{REPO / 'scripts' / 'driver_job.py'}:/opt/driver_job.py:ro", docker_base_image(), "sh", "-c",
                t0 + f"exec python3 /opt/driver_job.py run {self.probe.info.uuid} --after {DOCKER_CONTEXT_AFTER_S:g} "
                f"--seconds {self.args.foreign_s:g}"]
        began = time.time()
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=self.args.foreign_s + 120, check=False)
        except subprocess.TimeoutExpired as error:
            subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60, check=False)
            raise BenchError(f"docker run {name} did not end in {self.args.foreign_s + 120:g} s") from error
        end_wall = time.time()
        if proc.returncode != 0:
            raise BenchError(f"docker run {name} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
        context = next((e for e in parse_events(proc.stdout.splitlines()) if e.get("event") == "context"), None)
        if context is None:
            raise BenchError(f"docker run {name}: no context line in its output: {proc.stdout.strip()[-300:]}")
        release = watch_line(watcher, lambda line: f"container={name} " in line and "event=release" in line,
                             30.0, f"release line for container {name}")
        return began, context, end_wall, float(release.split()[0].removeprefix("t="))


BENCH_NAMESPACE = "bench"  # the test kubelet's namespace of the foreign jobs' pods
DRIVER_DIR = "/usr/lib/x86_64-linux-gnu"  # where the NVIDIA toolkit mounts the driver's libraries
DOCKER_CONTEXT_AFTER_S = 0.5  # the harsh case: the container's job opens its context 0.5 s in


def docker_base_image() -> str:
    """The image the docker path runs its job in: python3 and nothing else (scripts/docker_engine.sh builds it)."""
    return os.environ.get("FORGE_BASE_IMAGE", "forge-base:bookworm")


def docker_unavailable() -> str | None:
    """Why the docker path cannot run here (None: it can): an engine that answers, with the `nvidia` driver
    registered, the base image, and the virtual GPU (whose libraries the container is given)."""
    if not os.environ.get("VGPU_STATE"):
        return "runs on the virtual GPU only (the container is given its libraries)"
    if shutil.which("docker") is None:
        return "no docker command-line client here"
    try:
        proc = subprocess.run(["docker", "run", "--rm", "--gpus", "device=0", docker_base_image(), "true"],
                              capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        return "the Docker engine did not answer `docker run --gpus device=0` in 60 s"
    if proc.returncode != 0:
        where = os.environ.get("DOCKER_HOST") or "the default socket"
        return (f"`docker run --gpus device=0 {docker_base_image()} true` fails at {where} "
                f"({(proc.stderr.strip().splitlines() or ['exit ' + str(proc.returncode)])[-1][:160]}); "
                "start an engine with: out=$(scripts/docker_engine.sh start) && eval \"$out\"")
    return None


def kubelet_unavailable() -> str | None:
    """Why the kubelet path cannot run here (None: it can): grpcio, which the test kubelet is served by."""
    try:
        import grpc  # noqa: F401
    except ImportError:
        return "grpcio is not installed (pip install grpcio)"
    return None


def announced_metrics(done: list[AnnouncedJob], path: str, controller: str) -> AnnouncedMetrics:
    leads = [j.lead_s.value for j in done]
    holds = [float(j.hold_s.value) for j in done if j.hold_s.value is not None]
    present = sorted(float(v) for v in leads if v is not None)
    complete = bool(present) and len(present) == len(leads)
    missing = None if complete else "a job without a lead time"
    ran = [j.own_kernels_while_ran.value for j in done]
    return AnnouncedMetrics(
        jobs=done,
        min_lead_s=Quantity.of(present[0] if complete else None, "s", missing),
        median_lead_s=Quantity.of(median(present) if complete else None, "s", missing),
        max_lead_s=Quantity.of(present[-1] if complete else None, "s", missing),
        every_lead_positive=bool(done) and all(v is not None and v > 0 for v in leads),
        own_kernels_while_ran=Quantity.of(sum(int(v) for v in ran if v is not None) if ran and None not in ran
                                          else None, "count",
                                          None if ran and None not in ran else "n/a: only the virtual GPU records "
                                          "every kernel"),
        mean_hold_s=Quantity.of(mean(holds), "s", None if holds else "n/a: no hold command on this path"),
        path=path, label=ANNOUNCED_LABELS[path], announced=path != "nvml",
        controller=controller, target=Quantity.of(YIELD_TARGET, "ratio"))


def watch_line(child: Child, predicate: Callable[[str], bool], timeout_s: float, what: str) -> str:
    """The first stdout line of `child` (a text log, as the Docker watcher's) matching `predicate`."""
    deadline = time.monotonic() + timeout_s
    with child.cond:
        while True:
            hit = next((line for line in child.text if predicate(line)), None)
            if hit is not None:
                return hit
            if child.exit_wall is not None:
                raise BenchError(f"{child.name} exited with code {child.proc.returncode} before {what}{child.tail()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"{child.name}: no {what} within {timeout_s:g} s{child.tail()}")
            child.cond.wait(min(left, 0.5))


def resumed_after(start_wall: float, after_wall: float) -> Callable[[dict[str, Any]], bool]:
    """A filler's `resume` line at or after a wall time (its `t` counts from its start)."""
    return lambda e: e.get("event") == "resume" and start_wall + e["t"] >= after_wall


PLAN_OVERHEAD_S = 10.0  # seconds a run is assumed to take beyond its own length (imports, CUDA, compiling)


def real_plan(args: argparse.Namespace, bench: RealBench, results: dict[str, Any]
              ) -> list[tuple[str, float, Callable[[], Any]]]:
    """(what, estimated seconds, run) in the order they run: the most telling first, so that a run cut
    short by --budget-s (or killed) has already measured what matters most."""
    overhead = PLAN_OVERHEAD_S
    track = args.track_s + overhead
    yield_s = args.warmup_s + args.foreign_s + args.resume_after + overhead + 5.0
    solo = args.foreign_s + overhead
    plan: list[tuple[str, float, Callable[[], Any]]] = []

    def tracking_run(target: float, controller: str) -> Callable[[], None]:
        return lambda: add_tracking(results, bench.tracking(target, controller))

    def yield_run(controller: str, variant: str) -> Callable[[], None]:
        return lambda: add_scenario(results, "yield", bench.yield_run(controller, variant))

    if "tracking" in args.scenarios:
        for controller in args.controllers:
            for target in args.targets:
                plan.append((f"tracking {controller} at {target:g} ({args.track_s:g} s)", track,
                             tracking_run(target, controller)))
    if "yield" in args.scenarios:
        def solo_run() -> None:
            results.setdefault("foreign_solo", []).append(bench.foreign_solo())

        plan.append(("foreign job alone", solo, solo_run))
        yields = [(c, v) for c, v in REAL_YIELD_PLAN if c in args.controllers and v in args.variants]
        for i, (c, v) in enumerate(yields):
            if i == len(yields) - 1 and len(yields) > 1:
                plan.append(("foreign job alone again (run-to-run noise)", solo, solo_run))
            plan.append((f"yield {c} {v}", yield_s, yield_run(c, v)))
        if len(yields) == 1:
            plan.append(("foreign job alone again (run-to-run noise)", solo, solo_run))
    if "announced" in args.scenarios:
        def announced_run(path: str, controller: str) -> Callable[[], None]:
            return lambda: add_scenario(results, "announced", bench.announced(path, controller))

        announced_s = args.warmup_s + args.announced_jobs * (args.foreign_s + args.resume_after + overhead + 5.0)
        controller = args.controllers[0]
        for path in args.announced_by:
            why = {"docker": docker_unavailable, "kubelet": kubelet_unavailable}.get(path, lambda: None)()
            if why is None:
                plan.append((f"announced by {path}, {controller} ({args.announced_jobs} jobs)", announced_s,
                             announced_run(path, controller)))
            elif args.announced_by_default:
                results["notes"].append(f"announced: path {path} left out of the default: {why}")
            else:
                results["skipped"].append(f"announced by {path}: {why}")
    return plan


def run_real_bench(args: argparse.Namespace, results: dict[str, Any], save: Callable[[], None],
                   failures: list[str]) -> None:
    from forge_load.control.probe import NoGpuError
    from forge_load.gpu import nvml
    from forge_load.gpu.backend import NvidiaBackend

    try:
        probe = nvml.NvmlProbe(str(args.gpu))
    except NoGpuError as error:
        raise NoGpu(str(error)) from error
    info = probe.info
    results["gpu"] = {"name": info.name, "uuid": info.uuid, "driver": info.driver_version, "index": info.index,
                      "memory_total_mib": q(info.memory_total_mib, "MiB"), "mig": info.mig_enabled}
    note = NvidiaBackend().start_fields(info).get("note")
    if note:
        results["notes"].append(note)
    sampler = Sampler(probe)
    bench = RealBench(args, probe, sampler)
    try:
        bench.wait_idle(timeout_s=5.0)
    except BenchError as error:
        probe.close()
        raise NoGpu(f"{error} (stop the other work, or pick another GPU with --gpu)") from error
    sampler.start()
    began = time.monotonic()

    def attempt(what: str, estimate_s: float, fn: Callable[[], Any]) -> Any:
        elapsed = time.monotonic() - began
        estimate_s += max(bench.overhead_s - PLAN_OVERHEAD_S, 0.0)  # this machine starts processes slower
        if args.budget_s and elapsed + estimate_s > args.budget_s:
            results["skipped"].append(f"{what}: about {estimate_s:.0f} s left out of the --budget-s "
                                      f"{args.budget_s:g} s ({elapsed:.0f} s used)")
            log(f"skipped {what} (time budget)")
            return None
        log(f"{what} [{elapsed:.0f} s in]")
        try:
            return fn()
        except BenchError as error:
            failures.append(f"{what}: {error}")
            log(f"FAILED {what}: {error}")
            return None
        except Exception as error:  # noqa: BLE001 - a bug here must not cost the other scenarios
            failures.append(f"{what}: internal error in the benchmark: {type(error).__name__}: {error}")
            log(f"FAILED {what}:\n{traceback.format_exc()}")
            return None
        finally:
            CHILDREN.kill_all()  # nothing of a failed scenario may linger into the next
            save()

    try:
        footprint: dict[str, Any] = {"simulated": False}
        results["footprint"] = footprint
        idle = attempt("idle board power and memory (3 s)", 5.0, bench.idle) or {}
        footprint["idle_power_w"] = idle.get("power_w", q(None, "W", "not measured"))
        footprint["idle_memory_used_mib"] = idle.get("memory_used_mib", q(None, "MiB", "not measured"))
        bare = attempt("bare CUDA context", 15.0, bench.bare_context) if "footprint" in args.scenarios else None
        for what, estimate, fn in real_plan(args, bench, results):
            attempt(what, estimate, fn)
            if sampler.failure:
                raise BenchError(f"reading NVML failed: {sampler.failure}")
        solo = [d["steps_per_s"] for d in bench.solo]
        if len(solo) >= 2:
            results["foreign"] = {"solo_spread_ratio": q((max(solo) - min(solo)) / mean(solo), "ratio")}
        if results.get("foreign_solo"):
            results["software"]["foreign_backend"] = results["foreign_solo"][0]["backend"]
        first_controller = results["tracking"].get(args.controllers[0], {})
        at_05 = first_controller.get(f"{FOOTPRINT_TARGET:g}")
        footprint["cpu_pct_one_core"] = at_05["cpu_pct_one_core"] if at_05 else q(
            None, "% of one core", f"no tracking run at {FOOTPRINT_TARGET:g}")
        # Per-process memory from NVML where it says (bare metal, --pid=host); else the device's used
        # memory over the idle GPU's, for the filler and for the bare context alike.
        filler_mib = val(at_05["gpu_mem_mib"]) if at_05 else None
        bare_mib = bare.get("process_mib") if bare else None
        filler_delta = (val(at_05["device_mem_used_mib"]) - val(footprint["idle_memory_used_mib"])
                        if at_05 and val(at_05["device_mem_used_mib"]) is not None
                        and val(footprint["idle_memory_used_mib"]) is not None else None)
        bare_delta = bare.get("device_delta_mib") if bare else None
        footprint["filler_device_delta_mib"] = q(filler_delta, "MiB")
        footprint["bare_context_device_delta_mib"] = q(bare_delta, "MiB")
        if (filler_mib is None or bare_mib is None) and filler_delta is not None and bare_delta is not None:
            filler_mib, bare_mib = filler_delta, bare_delta
            footprint["method"] = "device memory used minus the idle GPU's (NVML gave no per-process memory)"
        else:
            footprint["method"] = "NVML per-process used memory"
        footprint["filler_process_mib"] = q(filler_mib, "MiB", None if filler_mib is not None else "not measured")
        footprint["bare_context_mib"] = q(bare_mib, "MiB", None if bare_mib is not None else "not measured")
        both = filler_mib is not None and bare_mib
        missing = None if both else "needs both the filler's and the bare context's process memory"
        over_mib = filler_mib - bare_mib if filler_mib is not None and bare_mib else None
        over_ratio = filler_mib / bare_mib if filler_mib is not None and bare_mib else None
        footprint["over_bare_mib"] = q(over_mib, "MiB", missing)
        footprint["over_bare_ratio"] = q(over_ratio, "x", missing)
        footprint["power_w"] = {f"{t:g}": first_controller.get(f"{t:g}", {}).get("power_w", q(None, "W"))
                                for t in args.targets}
        if bench.start_event:
            results["gpu"]["sm_count"] = q(bench.start_event.get("sm_count"), "count")
    finally:
        sampler.stop_event.set()
        sampler.join(timeout=2.0)
        CHILDREN.kill_all()
        probe.close()


