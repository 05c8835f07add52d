"""The tracking scenario: the filler alone at each target, for each control law (pi against legacy), judged by NVML's
samples after the first JUDGE_FROM_S; with its power, memory and CPU on the way. On the simulated GPU in virtual
time, or on a real GPU (or the virtual one)."""

from __future__ import annotations

import argparse
import time

from bench import BenchError
from bench.analysis import count, first, tracking_metrics
from bench.real import RealBench
from bench.results import JUDGE_FROM_S, Quantity, Scenario, mean
from bench.runner import cpu_percent
from bench.simulated import run_sim, sim_argv, sim_series


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


def real_tracking(bench: RealBench, target: float, controller: str) -> Scenario:
    bench.wait_idle()
    d = bench.args.track_s
    began = time.monotonic()
    child = bench.start_filler(target, controller, d)
    run = bench.finish(child, d + 60.0)
    bench.overhead_s = max(bench.overhead_s, time.monotonic() - began - d)
    a, b = run.wall(0.0), run.wall(d)
    samples = bench.sampler.between("util", a, b)
    if not samples:
        raise BenchError(f"NVML gave no utilization samples during {child.name}")
    metrics = tracking_metrics(samples, target, a, b)
    power = [p for _, p in bench.sampler.between("power", a + JUDGE_FROM_S, b)]
    metrics.power_w = Quantity.of(mean(power), "W", None if power else "NVML gave no power reading")
    metrics.yields = Quantity.of(count(run.events, "yield"), "count")
    own_mib = [procs.get(run.pid) for _, procs in bench.sampler.between("processes", a, b)]
    own_mib = [m for m in own_mib if m is not None]
    start = first(run.events, "start") or {}
    metrics.gpu_mem_mib = Quantity.of(max(own_mib) if own_mib else None, "MiB",
                                      None if own_mib else "NVML did not report the filler's process memory")
    metrics.gpu_mem_mib_logged = Quantity.of(start.get("gpu_mem_mib"), "MiB")
    device = sorted(m for _, m in bench.sampler.between("memory", a, b))
    metrics.device_mem_used_mib = Quantity.of(device[len(device) // 2] if device else None, "MiB",
                                              None if device else "NVML gave no memory reading")
    metrics.cpu_pct_one_core = Quantity.of(
        cpu_percent(bench.sampler.cpu.get(run.pid, []), a + JUDGE_FROM_S, b), "% of one core")
    others = bench.sampler.foreign_pids({run.pid}, a, b)
    if others:
        metrics.warning = f"other processes on the GPU during the run: {sorted(others)}"
    bench.start_event = start
    return Scenario(f"tracking_{controller}_{target:g}", metrics, bench.series(run, d, target))
