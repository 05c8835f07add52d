"""The yield scenario: a foreign job arrives while the filler fills at YIELD_TARGET and leaves again; how fast the
filler steps aside and comes back, and what the job lost to it. Each variant hides more of the job from the filler
(the process list, the memory signal), down to the utilization signal alone. The foreign job's solo runs, what its
throughput beside the filler is compared with, are here too."""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench import BenchError, log
from bench.analysis import YIELD_SLACK_S, first, marks, yield_metrics
from bench.real import RealBench
from bench.results import YIELD_TARGET, Quantity, Scenario, mean, q
from bench.runner import Child
from bench.simulated import run_sim, sim_argv, sim_series

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


def foreign_solo(bench: RealBench) -> dict[str, Any]:
    """The foreign job alone on the GPU: the throughput the yield runs compare theirs with (kept in bench.solo)."""
    bench.wait_idle()
    child = bench.foreign("foreign job (solo)", wait=False)
    child.wait_exit(bench.args.foreign_s + bench.args.start_timeout + 60.0)
    done = first(child.events, "done")
    backend = first(child.events, "backend") or {}
    if child.proc.returncode != 0 or done is None:
        raise BenchError(f"foreign_job.py (solo) exited with code {child.proc.returncode}{child.tail()}")
    bench.solo.append(done)
    return {"backend": f"{backend.get('backend')} {backend.get('version')}",
            "size": q(backend.get("size"), "count"), "batch": q(backend.get("batch"), "count"),
            "steps": q(done["steps"], "count"), "elapsed_s": q(done["elapsed_s"], "s"),
            "steps_per_s": q(done["steps_per_s"], "steps/s"),
            "steady_steps_per_s": q(done.get("steady_steps_per_s"), "steps/s")}


def real_yield(bench: RealBench, controller: str, variant: str) -> Scenario:
    label, env_extra = REAL_VARIANTS[variant]
    args = bench.args
    bench.wait_idle()
    budget = args.warmup_s + args.foreign_s + args.start_timeout + args.resume_after + 120.0
    # The job imports its libraries while the filler starts, then waits for "go": its context is
    # created at a moment we choose, with nothing else in flight.
    job = bench.foreign("foreign job", wait=True)
    filler: Child | None = None
    try:
        filler = bench.start_filler(YIELD_TARGET, controller, budget, env_extra)
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
    run = bench.finish(filler, 30.0)
    a_t, b_t = run.t(float(context["wall_time"])), run.t(end_wall)
    metrics = yield_metrics(run.events, a_t, b_t, args.resume_after,
                            context_begin_t=run.t(float(context["wall_time_begin"])))
    solo = [d["steps_per_s"] for d in bench.solo]
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
    series = bench.series(run, end_t, YIELD_TARGET)
    series["marks"] = marks(run.events, a_t, b_t)
    return Scenario(f"yield_{controller}_{variant}", metrics, series)
