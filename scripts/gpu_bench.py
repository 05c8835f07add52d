#!/usr/bin/env python3
"""forge_load's benchmark: tracking, yield and footprint on one GPU, or on the simulated GPU (--simulate).

Writes into an output folder (default docs/benchmarks/<gpu-name>_<YYYY-MM-DD>/, or
docs/benchmarks/simulated_<YYYY-MM-DD>/ with --simulate, or docs/benchmarks/virtual_<YYYY-MM-DD>/ on the virtual
GPU: --vgpu, or run under scripts/vgpu; every result from there says "virtual GPU"):
  results.json  every number with its unit ({"value": ..., "unit": ...}), the GPU, driver, date, command, mode
  results.md    the Markdown tables (goals, tracking pi vs legacy, yield, footprint); also printed on stdout
  series.json   the time series behind the plots
  *.png         plots of utilization, own and foreign share and multiplier over time (needs matplotlib)
Nothing in them is typed by hand. What every number means: docs/benchmarks/README.md.

    python3 scripts/gpu_bench.py --out "$OUT/bench" --budget-s 560   # the real GPU 0 (under 10 minutes)
    python3 scripts/gpu_bench.py --simulate                          # the simulated GPU (seconds)
    python3 scripts/gpu_bench.py --vgpu --budget-s 300               # real mode on the virtual GPU
    python3 scripts/gpu_bench.py --render DIR --section FILE         # redraw plots/tables from DIR

Exit codes: 0 done; 1 a scenario failed (or, with --strict, a goal was missed); 2 bad arguments;
3 no usable GPU / NVML (with a hint); 130 interrupted (the results so far are written).
"""

from __future__ import annotations

import argparse
import atexit
import io
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from forge_load import __version__ as FORGE_VERSION  # noqa: E402
from forge_load.probe import UtilSample  # noqa: E402
from forge_load.scoring import one_second_readings, percentile, tracking  # noqa: E402

SCHEMA = 1
TARGETS = (0.3, 0.5, 0.8)
CONTROLLERS = ("pi", "legacy")
YIELD_TARGET = 0.5
FOOTPRINT_TARGET = 0.5
# A yield logged this long before the foreign job's context is still its (clocks of two processes, rounding).
YIELD_SLACK_S = 0.05
JUDGE_FROM_S = 5.0  # the "from 5 s" errors: readings from the settle goal on, whether or not it settled
HUGE_MIB = "1000000"  # a foreign-memory threshold no job reaches: turns the memory signal off
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_GPU, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

# Issue 5's goals, judged on our controller's (pi's) numbers.
GOALS = (
    {"key": "settle", "goal": "settle time (worst target)", "op": "<=", "limit": 5.0, "unit": "s"},
    {"key": "mae", "goal": "mean abs error after settling (worst target)", "op": "<=", "limit": 0.02,
     "unit": "ratio"},
    {"key": "p95", "goal": "p95 abs error after settling (worst target)", "op": "<=", "limit": 0.05,
     "unit": "ratio"},
    {"key": "yield", "goal": "yield: foreign context to our last kernel (worst variant)", "op": "<=",
     "limit": 0.5, "unit": "s"},
    {"key": "foreign", "goal": "foreign job throughput vs solo (worst variant)", "op": ">=", "limit": 0.99,
     "unit": "ratio"},
    {"key": "memory", "goal": "filler GPU memory over a bare context", "op": "<=", "limit": 16.0,
     "unit": "MiB"},
    {"key": "cpu", "goal": "filler host CPU at 0.5", "op": "<=", "limit": 5.0, "unit": "% of one core"},
)

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


def log(message: str) -> None:
    print(f"[gpu_bench] {message}", file=sys.stderr, flush=True)


class BenchError(Exception):
    """A scenario could not be run or measured; the message says why."""


class NoGpu(Exception):
    pass


class Interrupted(Exception):
    pass


# --- numbers with units -----------------------------------------------------------------------------------

def q(value: float | int | None, unit: str, note: str | None = None) -> dict[str, Any]:
    """A number with its unit. NaN and inf become None (JSON has neither); `note` says why it is missing."""
    if isinstance(value, float) and not math.isfinite(value):
        value = None
    if isinstance(value, float):
        value = round(value, 6)
    out: dict[str, Any] = {"value": value, "unit": unit}
    if value is None and not note:
        note = "not measured"
    if note:
        out["note"] = note
    return out


def val(quantity: dict[str, Any] | None) -> float | None:
    return None if quantity is None else quantity.get("value")


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "gpu"


# --- analysis shared by both modes ------------------------------------------------------------------------

def tracking_metrics(samples: Sequence[UtilSample], target: float, start_s: float, end_s: float) -> dict[str, Any]:
    """forge_load.scoring's numbers for one run, plus the errors from JUDGE_FROM_S on (settled or not)."""
    result = tracking(samples, target, start_s, end_s)
    readings = one_second_readings(samples, start_s, end_s)
    late = [abs(u - target) for t_s, u in readings if t_s >= start_s + JUDGE_FROM_S]
    never = None if result.settle_s is not None else f"never within +-0.02 for 5 s in {end_s - start_s:g} s"
    return {
        "target": q(target, "ratio"),
        "duration_s": q(end_s - start_s, "s"),
        "settle_s": q(result.settle_s, "s", never),
        "mae": q(result.mae_ratio, "ratio", never),
        "p95_error": q(result.p95_error_ratio, "ratio", never),
        "within_0.05": q(result.within_005_ratio, "ratio", never),
        "seconds_judged": q(result.seconds, "s"),
        "mae_from_5s": q(mean(late), "ratio"),
        "p95_error_from_5s": q(percentile(late, 95) if late else None, "ratio"),
        "mean_util": q(mean([u for t_s, u in readings if t_s >= start_s + JUDGE_FROM_S]), "ratio"),
    }


def legacy_over_pi(pi: dict[str, Any], legacy: dict[str, Any]) -> dict[str, Any]:
    """legacy / pi for each error and the settle time: how many times worse the original law is."""
    out: dict[str, Any] = {}
    for key in ("settle_s", "mae", "p95_error", "mae_from_5s", "p95_error_from_5s"):
        a, b = val(pi.get(key)), val(legacy.get(key))
        if a is None or b is None:
            out[key] = q(None, "x", "legacy never settled" if b is None else "pi never settled")
        elif a == 0:
            out[key] = q(None, "x", "pi's value is 0")
        else:
            out[key] = q(b / a, "x")
    return out


def parse_events(lines: Iterable[str]) -> list[dict[str, Any]]:
    events = []
    for line in lines:
        line = line.strip()
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return events


def first(events: Sequence[dict[str, Any]], name: str, after_t: float = -math.inf) -> dict[str, Any] | None:
    return next((e for e in events if e.get("event") == name and (e.get("t") or 0.0) >= after_t), None)


def count(events: Sequence[dict[str, Any]], name: str, after_t: float = -math.inf,
          before_t: float = math.inf) -> int:
    return sum(1 for e in events if e.get("event") == name and after_t <= (e.get("t") or 0.0) < before_t)


def status_series(events: Sequence[dict[str, Any]], key: str) -> list[list[float]]:
    return [[e["t"], e[key]] for e in events if e.get("event") == "status" and e.get(key) is not None]


def yield_metrics(events: Sequence[dict[str, Any]], foreign_start_t: float, foreign_end_t: float,
                  resume_after_s: float, context_begin_t: float | None = None) -> dict[str, Any]:
    """Yield numbers from the filler's log, on its clock (t = seconds since its start).

    foreign_start_t: the foreign job's CUDA context exists; foreign_end_t: the job has exited.
    yield_s: from the context to the end of our last kernel after the yield (0 if it ended before);
    detect_s: to the `yield` line; resume_s: from the job's exit to the `resume` line.
    """
    # A yield may come while the job is still creating its context: look from its process start on.
    look_from = context_begin_t if context_begin_t is not None else foreign_start_t
    yielded = first(events, "yield", after_t=look_from - YIELD_SLACK_S)
    if yielded is not None and yielded["t"] > foreign_end_t:
        yielded = None
    drained = first(events, "drained", after_t=yielded["t"]) if yielded else None
    resumed = first(events, "resume", after_t=foreign_end_t)
    yields_during = count(events, "yield", look_from - YIELD_SLACK_S, foreign_end_t)
    resumes_during = count(events, "resume", look_from, foreign_end_t)
    out: dict[str, Any] = {
        "foreign_start_t": q(foreign_start_t, "s"),
        "foreign_end_t": q(foreign_end_t, "s"),
        "detected": bool(yielded),
        "signals": (yielded or {}).get("signals", ""),
        "reason": (yielded or {}).get("reason", ""),
        "detect_s": q(yielded["t"] - foreign_start_t if yielded else None, "s",
                      None if yielded else "the filler never yielded"),
        "yield_s": q(max(drained["last_kernel_end_t"] - foreign_start_t, 0.0) if drained else None, "s",
                     None if drained else "no drained line"),
        "resume_s": q(resumed["t"] - foreign_end_t if resumed else None, "s",
                      None if resumed else "no resume line before the run ended"),
        "resume_after_s": q(resume_after_s, "s"),
        "yields": q(yields_during, "count"),
        "resumes_while_foreign": q(resumes_during, "count"),
    }
    if context_begin_t is not None and drained:
        out["yield_from_context_begin_s"] = q(max(drained["last_kernel_end_t"] - context_begin_t, 0.0), "s")
    return out


# --- the simulated GPU ------------------------------------------------------------------------------------

@dataclass
class Scenario:
    """One run's numbers and the series to plot."""

    name: str
    metrics: dict[str, Any]
    series: dict[str, Any] = field(default_factory=dict)


def sim_config(argv: list[str]):  # -> forge_load.config.Config
    from forge_load.config import load_config

    return load_config(argv, env={})  # the caller's FORGE_* environment must not leak into the runs


def sim_argv(args: argparse.Namespace, target: float, controller: str, duration_s: float) -> list[str]:
    return ["--simulate", "--sim-speed", "0", "--duration", f"{duration_s:g}", "--target", f"{target:g}",
            "--controller", controller, "--log-format", "json", "--log-interval", "1", "--boost-after", "0",
            "--sim-seed", str(args.seed), "--sim-window", f"{args.sim_window:g}",
            "--resume-after", f"{args.resume_after:g}"]


def run_sim(argv: list[str]):
    from forge_load.app import run_simulated

    stream = io.StringIO()
    run = run_simulated(sim_config(argv), stream, keep_history=True)  # scored afterwards
    return run, parse_events(stream.getvalue().splitlines())


def sim_series(run: Any, events: list[dict[str, Any]], end_s: float, target: float) -> dict[str, Any]:
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
    metrics["power_w"] = q(mean(power), "W", "simulated: the simulator's power model")
    metrics["yields"] = q(count(events, "yield"), "count")
    start = first(events, "start") or {}
    metrics["gpu_mem_mib"] = q(start.get("gpu_mem_mib"), "MiB", "simulated")
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
    metrics["foreign_throughput_ratio"] = q(None, "ratio", "n/a (simulated): the simulator does not model "
                                            "contention; see foreign_worst_case_ratio")
    metrics["foreign_contended_s"] = q(max(contended, 0.0), "s")
    metrics["foreign_busy_s"] = q(foreign_busy, "s")
    metrics["foreign_worst_case_ratio"] = q(1.0 - max(contended, 0.0) / foreign_busy if foreign_busy else None,
                                            "ratio", "simulated bound: 1 - contended / foreign busy time")
    metrics.update(controller=controller, variant=variant, label=label, target=q(YIELD_TARGET, "ratio"))
    series = sim_series(run, events, duration, YIELD_TARGET)
    series["marks"] = marks(events, a, b)
    return Scenario(f"yield_{controller}_{variant}", metrics, series)


def marks(events: list[dict[str, Any]], a: float, b: float) -> dict[str, Any]:
    yielded = first(events, "yield", after_t=a - YIELD_SLACK_S)
    drained = first(events, "drained", after_t=yielded["t"]) if yielded else None
    resumed = first(events, "resume", after_t=b)
    return {"foreign": [a, b], "yield": yielded["t"] if yielded else None,
            "drained": drained["last_kernel_end_t"] if drained else None,
            "resume": resumed["t"] if resumed else None}


def run_simulated_bench(args: argparse.Namespace, results: dict[str, Any], save: Callable[[], None]) -> None:
    from forge_load import sim

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

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of a process, in clock ticks, from /proc/<pid>/stat (None once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), counted from the state (3)


def cpu_percent(readings: Sequence[tuple[float, int]], start_s: float, end_s: float) -> float | None:
    """% of one core between the first reading at or after start_s and the last at or before end_s."""
    inside = [(t, ticks) for t, ticks in readings if start_s <= t <= end_s]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < 1.0:
        return None
    return 100.0 * (inside[-1][1] - inside[0][1]) / CLK_TCK / (inside[-1][0] - inside[0][0])


class Children:
    """Every process the bench started; all are ended (by their own process group id) on exit."""

    def __init__(self) -> None:
        self.alive: list[Child] = []
        self.lock = threading.Lock()

    def add(self, child: Child) -> None:
        with self.lock:
            self.alive.append(child)

    def kill_all(self) -> None:
        with self.lock:
            children = list(self.alive)
        for child in children:
            child.stop(grace_s=3.0)


CHILDREN = Children()
atexit.register(CHILDREN.kill_all)


class Child:
    """A subprocess whose stdout lines are parsed as JSON events as they come, with a wall-clock stamp."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], stdin: bool = False) -> None:
        self.name = name
        self.events: list[dict[str, Any]] = []
        self.text: list[str] = []
        self.stderr: list[str] = []
        self.exit_wall: float | None = None
        self.cond = threading.Condition()
        self.started_wall = time.time()
        # Its own session, so that stop() can signal its whole process group by its id.
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                                     env=env, cwd=str(REPO), start_new_session=True)
        self.pid = self.proc.pid
        CHILDREN.add(self)
        threading.Thread(target=self._read_out, daemon=True, name=f"{name}-out").start()
        threading.Thread(target=self._read_err, daemon=True, name=f"{name}-err").start()
        threading.Thread(target=self._wait, daemon=True, name=f"{name}-wait").start()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            received = time.time()
            with self.cond:
                self.text.append(line.rstrip("\n"))
                for event in parse_events([line]):
                    event["_received_wall"] = received
                    self.events.append(event)
                self.cond.notify_all()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self.cond:
                self.stderr = (self.stderr + [line.rstrip("\n")])[-40:]

    def _wait(self) -> None:
        self.proc.wait()
        with self.cond:
            self.exit_wall = time.time()
            self.cond.notify_all()
        with CHILDREN.lock:
            if self in CHILDREN.alive:
                CHILDREN.alive.remove(self)

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float,
                 what: str) -> dict[str, Any]:
        """The first event matching `predicate`; BenchError on timeout or if the process exits first."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                hit = next((e for e in self.events if predicate(e)), None)
                if hit is not None:
                    return hit
                if self.exit_wall is not None:
                    raise BenchError(f"{self.name} exited with code {self.proc.returncode} before {what}"
                                     f"{self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BenchError(f"{self.name}: no {what} within {timeout_s:g} s{self.tail()}")
                self.cond.wait(min(left, 0.5))

    def wait_exit(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.exit_wall is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stop(grace_s=5.0)
                    raise BenchError(f"{self.name} did not finish within {timeout_s:g} s (killed){self.tail()}")
                self.cond.wait(min(left, 0.5))
        return self.proc.returncode

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM its process group, then SIGKILL after `grace_s`."""
        if self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as error:
            raise BenchError(f"{self.name}: cannot write to it ({error}){self.tail()}") from error

    def tail(self) -> str:
        lines = [line for line in self.stderr if line.strip()][-5:]
        return (": " + " | ".join(lines)) if lines else ""


class Sampler(threading.Thread):
    """Reads NVML in the bench process (no CUDA context here) every `interval_s`: the device's utilization
    samples, memory, power, processes, and /proc CPU times of the pids in `watch`. Times are wall-clock."""

    def __init__(self, probe: Any, interval_s: float = 0.1) -> None:
        super().__init__(daemon=True, name="nvml-sampler")
        self.probe = probe
        self.interval_s = interval_s
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.util: list[UtilSample] = []
        self.memory: list[tuple[float, float]] = []
        self.power: list[tuple[float, float]] = []
        self.processes: list[tuple[float, dict[int, float | None]]] = []
        self.cpu: dict[int, list[tuple[float, int]]] = {}
        self.watch: set[int] = set()
        self.failure: str | None = None

    def run(self) -> None:
        last_mono = -math.inf
        try:
            while not self.stop_event.is_set():
                offset = time.time() - time.monotonic()
                now = time.time()
                samples = self.probe.utilization_samples(last_mono)
                if samples:
                    last_mono = samples[-1].t_s
                    fresh = [UtilSample(s.t_s + offset, s.ratio) for s in samples]
                elif samples is None:  # no buffered samples on this GPU: the latest window instead
                    ratio = self.probe.utilization_ratio()
                    fresh = [UtilSample(now, ratio)] if ratio is not None else []
                else:
                    fresh = []
                memory = self.probe.memory_used_mib()
                power = self.probe.power_w()
                processes = self.probe.processes()
                with self.lock:
                    self.util.extend(fresh)
                    if memory is not None:
                        self.memory.append((now, memory))
                    if power is not None:
                        self.power.append((now, power))
                    if processes is not None:
                        self.processes.append((now, {p.pid: p.used_mib for p in processes}))
                    for pid in list(self.watch):
                        ticks = cpu_ticks(pid)
                        if ticks is None:
                            self.watch.discard(pid)
                        else:
                            self.cpu.setdefault(pid, []).append((now, ticks))
                self.stop_event.wait(self.interval_s)
        except Exception as error:  # noqa: BLE001 - reported with the results
            self.failure = f"{type(error).__name__}: {error}"

    def between(self, name: str, a: float, b: float) -> list[Any]:
        with self.lock:
            items = list(getattr(self, name))
        if name == "util":
            return [s for s in items if a <= s.t_s <= b]
        return [x for x in items if a <= x[0] <= b]

    def foreign_pids(self, ours: set[int], a: float, b: float) -> set[int]:
        return {pid for _, procs in self.between("processes", a, b) for pid in procs if pid not in ours}


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
        metrics["power_w"] = q(mean(power), "W", None if power else "NVML gave no power reading")
        metrics["yields"] = q(count(run.events, "yield"), "count")
        own_mib = [procs.get(run.pid) for _, procs in self.sampler.between("processes", a, b)]
        own_mib = [m for m in own_mib if m is not None]
        start = first(run.events, "start") or {}
        metrics["gpu_mem_mib"] = q(max(own_mib) if own_mib else None, "MiB",
                                   None if own_mib else "NVML did not report the filler's process memory")
        metrics["gpu_mem_mib_logged"] = q(start.get("gpu_mem_mib"), "MiB")
        device = sorted(m for _, m in self.sampler.between("memory", a, b))
        metrics["device_mem_used_mib"] = q(device[len(device) // 2] if device else None, "MiB",
                                           None if device else "NVML gave no memory reading")
        metrics["cpu_pct_one_core"] = q(cpu_percent(self.sampler.cpu.get(run.pid, []), a + JUDGE_FROM_S, b),
                                        "% of one core")
        others = self.sampler.foreign_pids({run.pid}, a, b)
        if others:
            metrics["warning"] = f"other processes on the GPU during the run: {sorted(others)}"
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
        metrics["foreign_steps_per_s"] = q(done["steps_per_s"], "steps/s")
        metrics["foreign_steps"] = q(done["steps"], "count")
        metrics["solo_steps_per_s"] = q(mean(solo), "steps/s", None if solo else "no solo run yet")
        metrics["foreign_throughput_ratio"] = q(done["steps_per_s"] / mean(solo) if solo else None, "ratio",
                                                None if solo else "no solo run to compare with")
        # The same as seconds of the job's run lost to us, which does not depend on how long the job ran.
        metrics["foreign_lost_s"] = q(done["elapsed_s"] - done["steps"] / mean(solo) if solo else None, "s",
                                      None if solo else "no solo run to compare with")
        metrics["foreign_elapsed_s"] = q(done["elapsed_s"], "s")
        metrics.update(controller=controller, variant=variant, label=label, target=q(YIELD_TARGET, "ratio"))
        end_t = max(e.get("t") or 0.0 for e in run.events)
        series = self.series(run, end_t, YIELD_TARGET)
        series["marks"] = marks(run.events, a_t, b_t)
        return Scenario(f"yield_{controller}_{variant}", metrics, series)


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
    if "tracking" in args.scenarios:
        for controller in args.controllers:
            for target in args.targets:
                plan.append((f"tracking {controller} at {target:g} ({args.track_s:g} s)", track,
                             lambda t=target, c=controller: add_tracking(results, bench.tracking(t, c))))
    if "yield" in args.scenarios:
        def solo_run() -> None:
            results.setdefault("foreign_solo", []).append(bench.foreign_solo())

        plan.append(("foreign job alone", solo, solo_run))
        yields = [(c, v) for c, v in REAL_YIELD_PLAN if c in args.controllers and v in args.variants]
        for i, (c, v) in enumerate(yields):
            if i == len(yields) - 1 and len(yields) > 1:
                plan.append(("foreign job alone again (run-to-run noise)", solo, solo_run))
            plan.append((f"yield {c} {v}", yield_s,
                         lambda c=c, v=v: add_scenario(results, "yield", bench.yield_run(c, v))))
        if len(yields) == 1:
            plan.append(("foreign job alone again (run-to-run noise)", solo, solo_run))
    return plan


def run_real_bench(args: argparse.Namespace, results: dict[str, Any], save: Callable[[], None],
                   failures: list[str]) -> None:
    from forge_load import nvml
    from forge_load.backend import NvidiaBackend
    from forge_load.probe import NoGpuError

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
        footprint["over_bare_mib"] = q(filler_mib - bare_mib if both else None, "MiB", missing)
        footprint["over_bare_ratio"] = q(filler_mib / bare_mib if both else None, "x", missing)
        footprint["power_w"] = {f"{t:g}": first_controller.get(f"{t:g}", {}).get("power_w", q(None, "W"))
                                for t in args.targets}
        if bench.start_event:
            results["gpu"]["sm_count"] = q(bench.start_event.get("sm_count"), "count")
    finally:
        sampler.stop_event.set()
        sampler.join(timeout=2.0)
        CHILDREN.kill_all()
        probe.close()


# --- results ----------------------------------------------------------------------------------------------

def add_tracking(results: dict[str, Any], scenario: Scenario) -> None:
    controller = scenario.name.split("_")[1]
    target = val(scenario.metrics["target"])
    results["tracking"].setdefault(controller, {})[f"{target:g}"] = scenario.metrics
    results["_series"][scenario.name] = scenario.series
    pi, legacy = results["tracking"].get("pi", {}), results["tracking"].get("legacy", {})
    for key in pi:
        if key in legacy:
            results["tracking"].setdefault("legacy_over_pi", {})[key] = legacy_over_pi(pi[key], legacy[key])


def add_scenario(results: dict[str, Any], kind: str, scenario: Scenario) -> None:
    results[kind][scenario.name.split("_", 1)[1]] = scenario.metrics
    results["_series"][scenario.name] = scenario.series


def judge_goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each of issue 5's goals against our controller's (pi's) numbers: pass True/False, or None where the
    mode cannot measure it (footprint on the simulated GPU)."""
    simulated = results["mode"] == "simulated"
    pi = results["tracking"].get("pi", {})
    pi_yields = {k: v for k, v in results["yield"].items() if v.get("controller") == "pi"}
    footprint = results.get("footprint", {})

    def worst(values: list[float | None], higher_is_worse: bool) -> float | None:
        if not values or any(v is None for v in values):
            return None  # a missing number (never settled, never yielded) fails the goal
        return max(values) if higher_is_worse else min(values)

    measured: dict[str, tuple[float | None, str, str | None]] = {
        "settle": (worst([val(m["settle_s"]) for m in pi.values()], True), "pi at " + ", ".join(pi), None),
        "mae": (worst([val(m["mae"]) for m in pi.values()], True), "pi at " + ", ".join(pi), None),
        "p95": (worst([val(m["p95_error"]) for m in pi.values()], True), "pi at " + ", ".join(pi), None),
        "yield": (worst([val(m["yield_s"]) for m in pi_yields.values()], True), ", ".join(pi_yields), None),
    }
    if simulated:
        measured["foreign"] = (worst([val(m["foreign_worst_case_ratio"]) for m in pi_yields.values()], False),
                               ", ".join(pi_yields), "simulated worst-case bound: 1 - contended / foreign busy")
        measured["memory"] = (None, "", "n/a (simulated)")
        measured["cpu"] = (None, "", "n/a (simulated)")
    else:
        measured["foreign"] = (worst([val(m["foreign_throughput_ratio"]) for m in pi_yields.values()], False),
                               ", ".join(pi_yields), None)
        measured["memory"] = (val(footprint.get("over_bare_mib")), "filler at 0.5 vs bare context", None)
        measured["cpu"] = (val(footprint.get("cpu_pct_one_core")), "filler at 0.5", None)
    goals = []
    for goal in GOALS:
        value, over, note = measured[goal["key"]]
        if note and note.startswith("n/a"):
            ok = None
        elif value is None:
            ok = False
            note = note or "not measured, or never reached"
        else:
            ok = value <= goal["limit"] if goal["op"] == "<=" else value >= goal["limit"]
        entry = {"key": goal["key"], "goal": goal["goal"], "limit": q(goal["limit"], goal["unit"]),
                 "op": goal["op"], "measured": q(value, goal["unit"], note if value is None else None),
                 "over": over, "pass": ok}
        if note:
            entry["note"] = note
        goals.append(entry)
    return goals


def fmt(quantity: dict[str, Any] | None, digits: int = 3, unit: bool = False) -> str:
    if not quantity or quantity.get("value") is None:
        note = (quantity or {}).get("note", "")
        if note.startswith("n/a"):
            return "n/a"
        return "never" if note.startswith("never") else "—"
    value = quantity["value"]
    text = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    if quantity["unit"] == "x":
        text += "×"
    elif unit and quantity["unit"] not in ("ratio", "count"):
        text += f" {quantity['unit']}"
    return text


def render_markdown(results: dict[str, Any]) -> str:
    simulated = results["mode"] == "simulated"
    gpu = results["gpu"]
    tag = " (simulated)" if simulated and "simulated" not in gpu["name"].lower() else ""
    tag = " (virtual GPU)" if results.get("virtual_gpu") else tag
    out = [f"## forge_load benchmark: {gpu['name']}{tag}, {results['date']}", ""]
    if results.get("virtual_gpu"):
        out += [VIRTUAL_NOTE, ""]
    if simulated:
        out += ["> **Simulated GPU, virtual time.** These numbers come from forge_load's GPU model "
                "(`forge_load/sim.py`), not from hardware: they check the control loop and the output format. "
                "Footprint and foreign-job slowdown cannot be simulated and are marked n/a or labelled.", ""]
    out += [f"GPU {gpu['name']} · driver {gpu['driver']} · forge_load {results['software']['forge_load']} · "
            f"mode {results['mode']}" + (" on the virtual GPU" if results.get("virtual_gpu") else "")
            + (" · incomplete run" if not results.get("complete") else ""),
            "", f"`{results['command']}`", ""]

    out += ["### Goals (our controller, pi)", "", "| goal | target | measured | result |", "|---|---|---|---|"]
    for goal in results["goals"]:
        result = {True: "pass", False: "**FAIL**", None: "n/a"}[goal["pass"]]
        note = f" ({goal['note']})" if goal.get("note") and goal["pass"] is not None else ""
        digits = 4 if goal["limit"]["unit"] == "ratio" else 3
        out.append(f"| {goal['goal']} | {goal['op'].replace('<=', '≤').replace('>=', '≥')} "
                   f"{fmt(goal['limit'], 2, True)} | {fmt(goal['measured'], digits, True)}{note} | {result} |")

    tr = results["tracking"]
    if tr.get("pi") or tr.get("legacy"):
        d = next(iter((tr.get("pi") or tr.get("legacy")).values()))["duration_s"]["value"]
        out += ["", f"### Tracking: 1-s NVML readings, {d:g} s per target", "",
                "| target | metric | pi | legacy | legacy / pi |", "|---|---|---|---|---|"]
        rows = (("settle_s", "settle time (s)", 1), ("mae", "mean abs error after settling", 4),
                ("p95_error", "p95 abs error after settling", 4), ("mae_from_5s", "mean abs error from 5 s", 4),
                ("p95_error_from_5s", "p95 abs error from 5 s", 4), ("mean_util", "mean utilization from 5 s", 3),
                ("yields", "yields (a false alarm if not 0)", 0))
        for target in sorted({t for c in ("pi", "legacy") for t in tr.get(c, {})}, key=float):
            pi, legacy = tr.get("pi", {}).get(target, {}), tr.get("legacy", {}).get(target, {})
            ratio = tr.get("legacy_over_pi", {}).get(target, {})
            for key, label, digits in rows:
                r = ratio.get(key)
                r_text = "" if r is None else (fmt(r, 1) if r.get("value") is not None else "—")
                out.append(f"| {target} | {label} | {fmt(pi.get(key), digits)} | {fmt(legacy.get(key), digits)} "
                           f"| {r_text} |")

    if results["yield"]:
        solo = results.get("foreign", {})
        out += ["", f"### Yield: a foreign job starts while the filler runs at {YIELD_TARGET:g}", "",
                "| controller | foreign job | signals | detected (s) | yield: last kernel ended (s) | "
                "foreign throughput vs solo | resumed after exit (s) | yields |",
                "|---|---|---|---|---|---|---|---|"]
        for m in results["yield"].values():
            if simulated:
                thr = (f"n/a (sim; worst case {fmt(m.get('foreign_worst_case_ratio'), 4)}, "
                       f"{fmt(m.get('foreign_contended_s'), 3)} s shared)")
            else:
                thr = f"{fmt(m.get('foreign_throughput_ratio'), 4)} ({fmt(m.get('foreign_lost_s'), 3)} s lost)"
            out.append(f"| {m['controller']} | {m['label']} | {m['signals'] or '—'} | {fmt(m['detect_s'], 3)} | "
                       f"{fmt(m['yield_s'], 3)} | {thr} | {fmt(m['resume_s'], 2)} | {fmt(m['yields'])} |")
        resume_after = next(iter(results["yield"].values()))["resume_after_s"]["value"]
        out += ["", f"Times from the foreign job's CUDA context; the filler waits {resume_after:g} s "
                "(`--resume-after`) of a quiet GPU before resuming."]
        if "solo_spread_ratio" in solo:
            out.append(f"Solo runs of the foreign job differ by {fmt(solo['solo_spread_ratio'], 4)} "
                       "(run-to-run noise of the throughput ratio).")

    fp = results.get("footprint")
    if fp:
        lab = " (simulated)" if fp.get("simulated") else ""
        out += ["", f"### Footprint{lab}", "", "| quantity | value |", "|---|---|",
                f"| filler process GPU memory | {fmt(fp.get('filler_process_mib'), 1, True)} |",
                f"| bare CUDA context, same GPU | {fmt(fp.get('bare_context_mib'), 1, True)} |",
                f"| filler over bare context | {fmt(fp.get('over_bare_mib'), 1, True)} "
                f"({fmt(fp.get('over_bare_ratio'), 3)}) |",
                f"| filler host CPU at {FOOTPRINT_TARGET:g} | {fmt(fp.get('cpu_pct_one_core'), 2, True)} |",
                f"| board power, idle | {fmt(fp.get('idle_power_w'), 1, True)} |"]
        for target, power in fp.get("power_w", {}).items():
            out.append(f"| board power at {target} (pi) | {fmt(power, 1, True)} |")
        if fp.get("method"):
            out += ["", f"GPU memory: {fp['method']}."]

    if results.get("plots"):
        out += ["", "### Plots", ""] + [f"![{p}]({p})" for p in results["plots"]]
    elif results.get("plots_note"):
        out += ["", f"Plots: {results['plots_note']}"]
    if results.get("skipped"):
        out += ["", "### Skipped", ""] + [f"- {f}" for f in results["skipped"]]
    if results.get("failures"):
        out += ["", "### Failures", ""] + [f"- {f}" for f in results["failures"]]
    if results.get("notes"):
        out += ["", "### Notes", ""] + [f"- {n}" for n in results["notes"]]
    return "\n".join(out) + "\n"


def render_section(results: dict[str, Any], out_dir: Path, section: Path) -> str:
    """The README's parts, from one run: the tracking table for "How it holds the target" (between the
    BENCH-TABLE markers) and the Benchmarks section (between the BENCH-SECTION markers)."""
    try:
        rel = out_dir.resolve().relative_to(REPO).as_posix()
    except ValueError:
        rel = out_dir.as_posix()
    simulated = results["mode"] == "simulated"
    gpu = results["gpu"]
    where = (f"{gpu['name']} (virtual time), {results['date']}" if simulated else
             f"{gpu['name']}, driver {gpu['driver']}, {results['date']}")
    if results.get("virtual_gpu"):
        where = f"the virtual GPU ({gpu['name']}, driver {gpu['driver']}; not hardware), {results['date']}"
    generated = (f"<!-- generated by scripts/gpu_bench.py --section from {rel}/results.json (the run: "
                 f"{results['command']}); do not edit by hand -->")
    tr = results["tracking"]
    table = ["| target | settle (s), pi / legacy | mean abs error from 5 s, pi / legacy | legacy / pi "
             "| p95 abs error from 5 s, pi / legacy |", "|---|---|---|---|---|"]
    for target in sorted(tr.get("pi", {}), key=float):
        pi, legacy = tr["pi"][target], tr.get("legacy", {}).get(target, {})
        ratio = tr.get("legacy_over_pi", {}).get(target, {}).get("mae_from_5s")
        table.append(f"| {target} | {fmt(pi['settle_s'], 1)} / {fmt(legacy.get('settle_s'), 1)} "
                     f"| {fmt(pi['mae_from_5s'], 4)} / {fmt(legacy.get('mae_from_5s'), 4)} "
                     f"| {fmt(ratio, 0) if ratio else '—'} "
                     f"| {fmt(pi['p95_error_from_5s'], 4)} / {fmt(legacy.get('p95_error_from_5s'), 4)} |")
    d = next(iter(tr["pi"].values()))["duration_s"]["value"] if tr.get("pi") else 0
    out = ["<!-- BENCH-TABLE -->", generated, "",
           f"From `scripts/gpu_bench.py` on {where}: 1-s NVML readings over {d:g} s per target"
           + (" (simulated: a model of the GPU, not a measurement)." if simulated else "."), "", *table, "",
           "<!-- /BENCH-TABLE -->", "", "<!-- BENCH-SECTION -->", generated, "", "## Benchmarks", "",
           "`scripts/gpu_bench.py` measures the claims on one GPU: how closely the target is held "
           "(against the original law, `FORGE_CONTROLLER=legacy`), how fast the filler steps aside when a "
           "real CUDA job starts and how much that job loses, and what the filler costs in GPU memory, CPU and "
           "power. [docs/benchmarks/README.md](docs/benchmarks/README.md) says how to run it and what each "
           "number means. Every number below comes from the run's `results.json`.", ""]
    if results.get("virtual_gpu"):
        out += [VIRTUAL_NOTE, ""]
    if simulated:
        out += ["> **No real-GPU run yet: these are the simulated GPU's numbers.** They check the control loop "
                "and the benchmark itself; footprint and the foreign job's slowdown cannot be simulated. "
                "On a GPU machine: `python3 scripts/gpu_bench.py --out \"$OUT/bench\" --budget-s 560`.", ""]
    out += [f"**{where}** ([all results]({rel}/results.md)).", "", "| goal | target | measured | result |",
            "|---|---|---|---|"]
    for goal in results["goals"]:
        result = {True: "pass", False: "**FAIL**", None: "n/a"}[goal["pass"]]
        digits = 4 if goal["limit"]["unit"] == "ratio" else 3
        measured = fmt(goal["measured"], digits, True)
        if goal.get("note") and goal["pass"] is not None:
            measured += f" ({goal['note']})"
        out.append(f"| {goal['goal']} | {goal['op'].replace('<=', '≤').replace('>=', '≥')} "
                   f"{fmt(goal['limit'], 2, True)} | {measured} | {result} |")
    if "tracking.png" in results.get("plots", []):
        out += ["", f"![Tracking, pi vs legacy]({rel}/tracking.png)"]
    if "yield_pi_visible.png" in results.get("plots", []):
        out += ["", f"![A foreign job arrives and leaves]({rel}/yield_pi_visible.png)"]
    out += ["", "<!-- /BENCH-SECTION -->"]
    return "\n".join(out) + "\n"


def write_section(path: Path, text: str) -> None:
    """Write the section to `path`; where `path` already holds the markers (the README), replace the
    marked blocks in place and keep the rest."""
    current = path.read_text() if path.exists() else ""
    if "<!-- BENCH-TABLE -->" not in current or "<!-- /BENCH-SECTION -->" not in current:
        path.write_text(text)
        return
    for name in ("BENCH-TABLE", "BENCH-SECTION"):
        block = re.search(rf"<!-- {name} -->.*?<!-- /{name} -->", text, re.S)
        assert block is not None, name
        current = re.sub(rf"<!-- {name} -->.*?<!-- /{name} -->", lambda _m: block.group(0), current, flags=re.S)
    path.write_text(current)


def write_plots(results: dict[str, Any], series: dict[str, Any], out_dir: Path) -> list[str]:
    """One PNG per scenario and a tracking overview; [] (and a note in results) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        results["plots_note"] = ("matplotlib is not installed, so no PNG plots were drawn (`pip install "
                                 "matplotlib`, then rerun); results.json, results.md and series.json are complete")
        log(results["plots_note"])
        return []
    simulated_name = "simulated" in results["gpu"]["name"].lower()
    tag = " (simulated)" if results["mode"] == "simulated" and not simulated_name else ""
    tag = " (virtual GPU)" if results.get("virtual_gpu") else tag
    names: list[str] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        names.append(name)

    def xy(points: list[list[float]]) -> tuple[list[float], list[float]]:
        return [p[0] for p in points], [p[1] for p in points]

    for name, s in series.items():
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True,
                                          gridspec_kw={"height_ratios": [3, 1]})
        if s.get("util"):
            top.plot(*xy(s["util"]), lw=0.6, color="0.6", label="device utilization (NVML samples)")
            ones = one_second_readings([UtilSample(t, u) for t, u in s["util"]], 0.0, s["util"][-1][0] + 1)
            top.plot([t + 0.5 for t, _ in ones], [u for _, u in ones], "o-", ms=2.5, lw=1, color="C0",
                     label="1-s reading")
        if s.get("own"):
            top.plot(*xy(s["own"]), lw=1, color="C2", label="own share")
        if s.get("foreign"):
            top.plot(*xy(s["foreign"]), lw=1, color="C3", label="foreign share")
        top.axhline(s["target"], ls="--", color="k", lw=1, label=f"target {s['target']:g}")
        m = s.get("marks")
        if m:
            top.axvspan(m["foreign"][0], m["foreign"][1], color="C3", alpha=0.08, label="foreign job")
            for key, style in (("drained", ":"), ("resume", "-.")):
                if m.get(key) is not None:
                    top.axvline(m[key], ls=style, color="C1", lw=1, label=f"{key} {m[key]:.2f} s")
        top.set_ylim(-0.02, 1.05)
        top.set_ylabel("ratio")
        top.set_title(f"{name.replace('_', ' ')} — {results['gpu']['name']}{tag}")
        top.legend(loc="upper right", fontsize=7, ncol=2)
        if s.get("multiplier"):
            bottom.step(*xy(s["multiplier"]), where="post", color="C4")
        bottom.set_ylabel("multiplier")
        bottom.set_xlabel("seconds since the filler started")
        save(fig, f"{name}.png")

    tracking_names = sorted({n.rsplit("_", 1)[1] for n in series if n.startswith("tracking_")}, key=float)
    if tracking_names:
        fig, axes = plt.subplots(len(tracking_names), 1, figsize=(10, 2.6 * len(tracking_names)), sharex=True,
                                 squeeze=False)
        for ax, target in zip(axes[:, 0], tracking_names):
            for i, controller in enumerate(CONTROLLERS):
                s = series.get(f"tracking_{controller}_{target}")
                if not s or not s.get("util"):
                    continue
                ones = one_second_readings([UtilSample(t, u) for t, u in s["util"]], 0.0, s["util"][-1][0] + 1)
                ax.plot([t + 0.5 for t, _ in ones], [u for _, u in ones], "o-", ms=2, lw=1, color=f"C{i}",
                        label=f"{controller}: 1-s NVML reading")
            ax.axhline(float(target), ls="--", color="k", lw=1, label=f"target {target}")
            ax.set_ylim(-0.02, 1.05)
            ax.set_ylabel("utilization")
            ax.legend(loc="lower right", fontsize=7)
        axes[0, 0].set_title(f"Tracking, pi vs legacy — {results['gpu']['name']}{tag}")
        axes[-1, 0].set_xlabel("seconds since the filler started")
        save(fig, "tracking.png")
    return sorted(names)


def write_outputs(results: dict[str, Any], out_dir: Path, final: bool) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    series = results.pop("_series")
    try:
        if final:
            results["plots"] = write_plots(results, series, out_dir)
        results["goals"] = judge_goals(results)
        markdown = render_markdown(results)
        (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        (out_dir / "results.md").write_text(markdown)
        (out_dir / "series.json").write_text(json.dumps(series, separators=(",", ":")) + "\n")
    finally:
        results["_series"] = series
    return markdown


# --- main -------------------------------------------------------------------------------------------------

VIRTUAL_NOTE = ("> **Virtual GPU: not a GPU measurement.** These numbers come from the real filler, numba-cuda and "
                "pynvml running on driver-free stand-ins for libcuda and libnvidia-ml (`scripts/vgpu`, a model of "
                "an H100-like GPU; README, Testing). They check our code against the real libraries; timing, "
                "memory and power are the model's, and CPU is this machine's.")


def on_virtual_gpu() -> bool:
    """True when the driver libraries this process loads are the virtual GPU's (scripts/vgpu sets VGPU_STATE)."""
    return bool(os.environ.get("VGPU_STATE"))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu_bench.py", description="forge_load's benchmark: tracking, yield and footprint.",
        epilog="Every number's meaning: docs/benchmarks/README.md")
    parser.add_argument("--simulate", action="store_true", help="the simulated GPU, in virtual time")
    parser.add_argument("--vgpu", action="store_true",
                        help="real mode on a fresh virtual GPU (scripts/vgpu): the real libraries on driver-free "
                             "stand-ins; results say \"virtual GPU\" and go to docs/benchmarks/virtual_<date>/")
    parser.add_argument("--out", type=Path, help="output folder; default docs/benchmarks/<gpu>_<date>/ "
                        "(simulated_<date>/ with --simulate)")
    parser.add_argument("--gpu", type=int, default=0, help="GPU index (NVML order = PCI bus order); default 0")
    parser.add_argument("--track-s", type=float, default=60.0, help="seconds per tracking run; default 60")
    parser.add_argument("--targets", default=",".join(f"{t:g}" for t in TARGETS),
                        help="tracking targets, comma separated; default 0.3,0.5,0.8")
    parser.add_argument("--controllers", default="pi,legacy", help="default pi,legacy (pi first)")
    parser.add_argument("--scenarios", default="tracking,yield,footprint",
                        help="which to run, comma separated; default all")
    parser.add_argument("--foreign-s", type=float, default=None,
                        help="seconds the foreign job trains; default 15 (simulated: 20)")
    parser.add_argument("--warmup-s", type=float, default=None,
                        help="seconds of filling before the foreign job starts; default 3 (simulated: 10)")
    parser.add_argument("--resume-after", type=float, default=2.0,
                        help="the filler's --resume-after in every run, seconds (its own default is 60); "
                             "default 2")
    parser.add_argument("--variants", default=None,
                        help="yield variants, comma separated; default all: visible,hidden,utilization_only "
                             "(simulated: also no_process_list)")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="real GPU: skip (and list) the scenarios that would end after this many seconds "
                             "of benchmark; the most telling run first; default 0 = no limit")
    parser.add_argument("--start-timeout", type=float, default=180.0,
                        help="seconds a process may take to start (imports, CUDA, compiling); default 180")
    parser.add_argument("--filler-args", default="",
                        help="extra flags for every filler run, one string (e.g. '--poll-interval 0.05')")
    parser.add_argument("--foreign-args", default="",
                        help="extra flags for scripts/foreign_job.py, one string (e.g. '--backend cupy')")
    parser.add_argument("--sim-window", type=float, default=1 / 6, help="simulated NVML window; default 1/6 s")
    parser.add_argument("--seed", type=int, default=0, help="simulator seed; default 0")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    parser.add_argument("--section", type=Path, default=None,
                        help="also write the README's benchmark section (Markdown) to this file, with "
                             "links relative to the repository root")
    parser.add_argument("--render", type=Path, default=None, metavar="DIR",
                        help="measure nothing: redraw results.md, the plots (and --section) from DIR's "
                             "results.json and series.json")
    args = parser.parse_args(argv)
    try:
        args.targets = [float(t) for t in args.targets.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--targets {args.targets!r}: expected ratios such as 0.3,0.5,0.8")
    if not args.targets or not all(0 < t <= 1 for t in args.targets):
        parser.error("--targets: each must be in (0, 1]")
    args.controllers = [c.strip() for c in args.controllers.split(",") if c.strip()]
    if not args.controllers or any(c not in CONTROLLERS for c in args.controllers):
        parser.error(f"--controllers: expected some of {', '.join(CONTROLLERS)}")
    args.scenarios = {s.strip() for s in args.scenarios.split(",") if s.strip()}
    if not args.scenarios or not args.scenarios <= {"tracking", "yield", "footprint"}:
        parser.error("--scenarios: expected some of tracking, yield, footprint")
    known = SIM_VARIANTS if args.simulate else REAL_VARIANTS
    args.variants = [v.strip() for v in (args.variants or ",".join(known)).split(",") if v.strip()]
    if not args.variants or any(v not in known for v in args.variants):
        parser.error(f"--variants: expected some of {', '.join(known)}")
    if args.foreign_s is None:
        args.foreign_s = 20.0 if args.simulate else 15.0
    if args.warmup_s is None:
        args.warmup_s = 10.0 if args.simulate else 3.0
    if args.track_s < JUDGE_FROM_S + 5 or args.foreign_s <= 0 or args.warmup_s < 1 or args.resume_after < 0:
        parser.error(f"--track-s must be >= {JUDGE_FROM_S + 5:g}, --foreign-s > 0, --warmup-s >= 1, "
                     "--resume-after >= 0")
    try:
        args.filler_args = shlex.split(args.filler_args)
        args.foreign_args = shlex.split(args.foreign_args)
    except ValueError as error:
        parser.error(f"--filler-args / --foreign-args: {error}")
    return args


def estimate_s(args: argparse.Namespace) -> float:
    """A rough length of a real run, for the first log line."""
    return sum(estimate for _, estimate, _ in real_plan(args, None, {})) + 20.0  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
    except SystemExit as exit_:
        return EXIT_USAGE if exit_.code else EXIT_OK
    if args.render:
        return render_saved(args)
    if args.vgpu and args.simulate:
        print("gpu_bench: --vgpu and --simulate exclude each other", file=sys.stderr)
        return EXIT_USAGE
    if args.vgpu and not on_virtual_gpu():
        # The same command again, on a fresh virtual GPU (where --vgpu then only names the run).
        cmd = [sys.executable, str(REPO / "scripts" / "vgpu"), "run", "--", sys.executable, str(Path(__file__)), *argv]
        return subprocess.run(cmd, check=False).returncode
    today = date.today().isoformat()
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "mode": "simulated" if args.simulate else "real",
        "virtual_gpu": not args.simulate and on_virtual_gpu(),  # real mode, on scripts/vgpu's stand-ins
        "date": today,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "scripts/gpu_bench.py", *argv]),
        "complete": False,
        "software": {"forge_load": FORGE_VERSION, "python": platform.python_version()},
        "settings": {
            "track_s": q(args.track_s, "s"), "targets": [q(t, "ratio") for t in args.targets],
            "controllers": args.controllers, "scenarios": sorted(args.scenarios),
            "yield_target": q(YIELD_TARGET, "ratio"), "warmup_s": q(args.warmup_s, "s"),
            "foreign_s": q(args.foreign_s, "s"), "resume_after_s": q(args.resume_after, "s"),
            "judge_from_s": q(JUDGE_FROM_S, "s"), "variants": args.variants,
            "filler_args": args.filler_args, "foreign_args": args.foreign_args,
            "budget_s": q(args.budget_s or None, "s", None if args.budget_s else "no limit"),
        },
        "gpu": {"name": "unknown", "driver": "unknown"},
        "tracking": {}, "yield": {}, "footprint": {}, "notes": [], "failures": [], "skipped": [],
        "_series": {},
    }
    if args.simulate:
        results["settings"].update(sim_window_s=q(args.sim_window, "s"), seed=args.seed)
    try:
        import numba

        results["software"]["numba"] = numba.__version__
    except ImportError:
        pass
    out_dir: Path | None = args.out

    def save() -> None:
        if out_dir is not None:
            write_outputs(results, out_dir, final=False)

    def on_signal(signum: int, _frame: object) -> None:
        raise Interrupted(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    code = EXIT_OK
    try:
        if args.simulate:
            out_dir = out_dir or REPO / "docs" / "benchmarks" / f"simulated_{today}"
            run_simulated_bench(args, results, save)
        else:
            kind = "virtual GPU (scripts/vgpu, not hardware)" if results.get("virtual_gpu") else "real GPU"
            log(f"{kind} {args.gpu}: about {estimate_s(args) / 60:.1f} minutes; results go to the output "
                "folder as each scenario ends")
            try:
                from forge_load.nvml import list_devices

                devices = {d.index: d for d in list_devices()}
            except Exception as error:  # NoGpuError, or pynvml missing
                raise NoGpu(str(error)) from error
            if args.gpu not in devices:
                raise NoGpu(f"GPU index {args.gpu} does not exist: {len(devices)} GPU(s) visible")
            stem = "virtual" if results.get("virtual_gpu") else slug(devices[args.gpu].name)
            out_dir = out_dir or REPO / "docs" / "benchmarks" / f"{stem}_{today}"
            log(f"output: {out_dir}")
            run_real_bench(args, results, save, results["failures"])
        results["complete"] = True
    except NoGpu as error:
        print(f"gpu_bench: no usable GPU: {error}\n"
              "gpu_bench: run with --simulate to benchmark the simulated GPU instead", file=sys.stderr)
        return EXIT_NO_GPU
    except Interrupted as error:
        log(f"interrupted by {error}: stopping the child processes, writing what was measured")
        results["failures"].append(f"interrupted by {error}")
        code = EXIT_INTERRUPTED
    except BenchError as error:
        log(f"FAILED: {error}")
        results["failures"].append(str(error))
        code = EXIT_FAILED
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        CHILDREN.kill_all()
    if results["failures"] and code == EXIT_OK:
        code = EXIT_FAILED
    if out_dir is None:  # stopped before the GPU was known: nothing was measured
        return code
    return finish_outputs(results, out_dir, args, code)


def finish_outputs(results: dict[str, Any], out_dir: Path, args: argparse.Namespace, code: int) -> int:
    markdown = write_outputs(results, out_dir, final=True)
    print(markdown)
    log(f"wrote {out_dir}/results.json, results.md" + (", plots" if results.get("plots") else ""))
    if args.section:
        args.section.parent.mkdir(parents=True, exist_ok=True)
        write_section(args.section, render_section(results, out_dir, args.section))
        log(f"wrote {args.section}")
    if args.strict and any(g["pass"] is False for g in results["goals"]) and code == EXIT_OK:
        code = EXIT_FAILED
    return code


def render_saved(args: argparse.Namespace) -> int:
    """--render DIR: results.md, the plots and --section again from DIR's results.json and series.json,
    e.g. after a run on a machine without matplotlib. Nothing is measured."""
    out_dir: Path = args.render
    try:
        results = json.loads((out_dir / "results.json").read_text())
        results["_series"] = json.loads((out_dir / "series.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        print(f"gpu_bench: --render {out_dir}: cannot read results.json and series.json there: {error}",
              file=sys.stderr)
        return EXIT_USAGE
    results.pop("plots_note", None)
    return finish_outputs(results, out_dir, args, EXIT_OK)


if __name__ == "__main__":
    raise SystemExit(main())
