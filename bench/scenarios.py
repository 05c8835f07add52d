"""The benchmark's runs: which scenarios run, in what order, and what they share, on the simulated GPU in virtual time
(run_simulated_bench) or on a real GPU, or the virtual one (run_real_bench, real_plan). Each scenario is a module of
its own: tracking.py, metric.py, yielding.py, footprint.py, announced.py (and cpu.py, which cli.py runs);
simulated.py and real.py are how each kind of GPU runs the filler.
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Callable
from typing import Any

from bench import BenchError, NoGpu, log
from bench.analysis import first
from bench.announced import docker_unavailable, kubelet_unavailable, real_announced
from bench.footprint import bare_context, idle, real_footprint, sim_footprint
from bench.metric import HELD_METRICS, METRIC_TARGET, no_gpm_reason, real_metric
from bench.power import power_plan
from bench.real import RealBench
from bench.results import add_scenario, add_tracking, mean, q
from bench.runner import CHILDREN
from bench.sampler import Sampler
from bench.simulated import run_sim, sim_argv
from bench.tracking import real_tracking, sim_tracking
from bench.yielding import (
    REAL_VARIANTS,
    REAL_YIELD_PLAN,
    SIM_VARIANTS,
    SIM_YIELD_PLAN,
    foreign_solo,
    real_yield,
    sim_yield,
)

# What cli.py imports from here (the variants: to check --variants against).
__all__ = ["REAL_VARIANTS", "SIM_VARIANTS", "real_plan", "run_real_bench", "run_simulated_bench"]


def run_simulated_bench(args: argparse.Namespace, results: dict[str, Any], save: Callable[[], None]) -> None:
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
    if "metric" in args.scenarios:
        results["skipped"].append(no_gpm_reason(run.gpu.info, simulated=True))
    results["footprint"] = sim_footprint(args, results)


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
        return lambda: add_tracking(results, real_tracking(bench, target, controller))

    def yield_run(controller: str, variant: str) -> Callable[[], None]:
        return lambda: add_scenario(results, "yield", real_yield(bench, controller, variant))

    def metric_run(metric: str) -> Callable[[], None]:
        return lambda: add_scenario(results, "metric", real_metric(bench, metric))

    metric: list[tuple[str, float, Callable[[], Any]]] = []
    why = no_gpm_reason(bench.probe.info, simulated=False) if bench is not None else None
    if "metric" in args.scenarios and why is not None:
        results["skipped"].append(why)
    elif "metric" in args.scenarios:
        metric = [(f"metric {m} at {METRIC_TARGET:g} ({args.metric_s:g} s)", args.metric_s + overhead,
                   metric_run(m)) for m in HELD_METRICS]
    tracking = [[(f"tracking {controller} at {target:g} ({args.track_s:g} s)", track,
                  tracking_run(target, controller)) for target in args.targets]
                for controller in args.controllers] if "tracking" in args.scenarios else [[]]
    # The metric runs right after our controller's tracking: GPM's SM activity has never been measured on a real
    # GPU, so it ranks above the contrast with the original law and the yield variants a budget may cut.
    plan += tracking[0] + metric + [step for steps in tracking[1:] for step in steps]
    if "power" in args.scenarios:
        plan += power_plan(bench, args, results, overhead)
    if "yield" in args.scenarios:
        def solo_run() -> None:
            results.setdefault("foreign_solo", []).append(foreign_solo(bench))

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
            return lambda: add_scenario(results, "announced", real_announced(bench, path, controller))

        announced_s = args.warmup_s + args.announced_jobs * (args.foreign_s + args.resume_after + overhead + 5.0)
        controller = args.controllers[0]
        for path in args.announced_by:
            why = {"docker": docker_unavailable, "kubelet": kubelet_unavailable,
                   "dra": kubelet_unavailable}.get(path, lambda: None)()
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
        idle_gpu = attempt("idle board power and memory (3 s)", 5.0, lambda: idle(bench)) or {}
        footprint["idle_power_w"] = idle_gpu.get("power_w", q(None, "W", "not measured"))
        footprint["idle_memory_used_mib"] = idle_gpu.get("memory_used_mib", q(None, "MiB", "not measured"))
        bare = (attempt("bare CUDA context", 15.0, lambda: bare_context(bench))
                if "footprint" in args.scenarios else None)
        for what, estimate, fn in real_plan(args, bench, results):
            attempt(what, estimate, fn)
            if sampler.failure:
                raise BenchError(f"reading NVML failed: {sampler.failure}")
        solo = [d["steps_per_s"] for d in bench.solo]
        if len(solo) >= 2:
            results["foreign"] = {"solo_spread_ratio": q((max(solo) - min(solo)) / mean(solo), "ratio")}
        if results.get("foreign_solo"):
            results["software"]["foreign_backend"] = results["foreign_solo"][0]["backend"]
        real_footprint(args, results, footprint, bare)
        if bench.start_event:
            results["gpu"]["sm_count"] = q(bench.start_event.get("sm_count"), "count")
    finally:
        sampler.stop_event.set()
        sampler.join(timeout=2.0)
        CHILDREN.kill_all()
        for close in bench.closers:
            close()
        probe.close()


