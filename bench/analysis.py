"""Numbers from what a run leaves: the filler's JSON log lines, and utilization samples (NVML's, or the virtual
GPU's kernel record turned into samples). Shared by every mode."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

from bench.results import JUDGE_FROM_S, AnnouncedJob, Quantity, TrackingMetrics, YieldMetrics, mean
from forge_load.control.probe import UtilSample
from forge_load.control.scoring import one_second_readings, percentile, tracking

# A yield logged this long before the foreign job's context is still its (clocks of two processes, rounding).
YIELD_SLACK_S = 0.05

Event = dict[str, Any]


def parse_events(lines: Iterable[str]) -> list[Event]:
    events = []
    for line in lines:
        line = line.strip()
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return events


def first(events: Sequence[Event], name: str, after_t: float = -math.inf) -> Event | None:
    return next((e for e in events if e.get("event") == name and (e.get("t") or 0.0) >= after_t), None)


def count(events: Sequence[Event], name: str, after_t: float = -math.inf, before_t: float = math.inf) -> int:
    return sum(1 for e in events if e.get("event") == name and after_t <= (e.get("t") or 0.0) < before_t)


def status_series(events: Sequence[Event], key: str) -> list[list[float]]:
    return [[e["t"], e[key]] for e in events if e.get("event") == "status" and e.get(key) is not None]


def tracking_metrics(samples: Sequence[UtilSample], target: float, start_s: float, end_s: float) -> TrackingMetrics:
    """forge_load.control.scoring's numbers for one run, plus the errors from JUDGE_FROM_S on (settled or not)."""
    result = tracking(samples, target, start_s, end_s)
    readings = one_second_readings(samples, start_s, end_s)
    late = [abs(u - target) for t_s, u in readings if t_s >= start_s + JUDGE_FROM_S]
    never = None if result.settle_s is not None else f"never within +-0.02 for 5 s in {end_s - start_s:g} s"
    return TrackingMetrics(
        target=Quantity.of(target, "ratio"),
        duration_s=Quantity.of(end_s - start_s, "s"),
        settle_s=Quantity.of(result.settle_s, "s", never),
        mae=Quantity.of(result.mae_ratio, "ratio", never),
        p95_error=Quantity.of(result.p95_error_ratio, "ratio", never),
        within_005=Quantity.of(result.within_005_ratio, "ratio", never),
        seconds_judged=Quantity.of(result.seconds, "s"),
        mae_from_5s=Quantity.of(mean(late), "ratio"),
        p95_error_from_5s=Quantity.of(percentile(late, 95) if late else None, "ratio"),
        mean_util=Quantity.of(mean([u for t_s, u in readings if t_s >= start_s + JUDGE_FROM_S]), "ratio"),
    )


def yield_metrics(events: Sequence[Event], foreign_start_t: float, foreign_end_t: float,
                  resume_after_s: float, context_begin_t: float | None = None) -> YieldMetrics:
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
    metrics = YieldMetrics(
        foreign_start_t=Quantity.of(foreign_start_t, "s"),
        foreign_end_t=Quantity.of(foreign_end_t, "s"),
        detected=bool(yielded),
        signals=(yielded or {}).get("signals", ""),
        reason=(yielded or {}).get("reason", ""),
        detect_s=Quantity.of(yielded["t"] - foreign_start_t if yielded else None, "s",
                             None if yielded else "the filler never yielded"),
        yield_s=Quantity.of(max(drained["last_kernel_end_t"] - foreign_start_t, 0.0) if drained else None, "s",
                            None if drained else "no drained line"),
        resume_s=Quantity.of(resumed["t"] - foreign_end_t if resumed else None, "s",
                             None if resumed else "no resume line before the run ended"),
        resume_after_s=Quantity.of(resume_after_s, "s"),
        yields=Quantity.of(count(events, "yield", look_from - YIELD_SLACK_S, foreign_end_t), "count"),
        resumes_while_foreign=Quantity.of(count(events, "resume", look_from, foreign_end_t), "count"),
    )
    if context_begin_t is not None and drained:
        metrics.yield_from_context_begin_s = Quantity.of(max(drained["last_kernel_end_t"] - context_begin_t, 0.0),
                                                         "s")
    return metrics


def marks(events: list[Event], a: float, b: float) -> dict[str, Any]:
    """The moments a yield plot marks: the foreign job's span, our drain and our resume."""
    yielded = first(events, "yield", after_t=a - YIELD_SLACK_S)
    drained = first(events, "drained", after_t=yielded["t"]) if yielded else None
    resumed = first(events, "resume", after_t=b)
    return {"foreign": [a, b], "yield": yielded["t"] if yielded else None,
            "drained": drained["last_kernel_end_t"] if drained else None,
            "resume": resumed["t"] if resumed else None}


def announced_job(events: Sequence[Event], hold_began_t: float, hold_answered_t: float | None,
                  hold_code: int | None, context_begin_t: float, release_t: float,
                  own_kernels_while_held: int | None, path: str = "hold",
                  own_kernels_while_ran: int | None = None) -> AnnouncedJob:
    """One foreign job from the filler's log, on its clock (t = seconds since its start).

    `hold_began_t` is the announcement: the hold command's start (path hold), the kubelet's assignment, the
    `docker run`; for `nvml`, which nobody announces, the job's context creation. Our last kernel is the one the
    `drained` line after the filler's `hold` line (its `yield` line for nvml) names (the filler's CUDA events, as
    the yield scenario's); the lead time is the job's context creation beginning minus its end: > 0 when the
    filler had drained before the job touched the GPU. `release_t`: the release, or the job's end where nothing
    is released. The hold command's answer and exit code are path hold's only (None elsewhere)."""
    announced = path != "nvml"
    trigger = "hold" if announced else "yield"
    held = first(events, trigger, after_t=hold_began_t - YIELD_SLACK_S)
    drained = first(events, "drained", after_t=held["t"]) if held else None
    resumed = first(events, "resume", after_t=release_t)
    last_end_t = drained.get("last_kernel_end_t") if drained else None
    why = f"the filler logged no {trigger}" if held is None else f"the filler logged no drain after its {trigger}"
    command = path == "hold" and hold_answered_t is not None
    no_kernels = "n/a: only the virtual GPU records every kernel"
    return AnnouncedJob(
        hold_s=Quantity.of(hold_answered_t - hold_began_t if command and hold_answered_t is not None else None, "s",
                           None if command else "n/a: no command to answer on this path"),
        acknowledged=(hold_code == 0 and drained is not None and hold_answered_t is not None
                      and drained["t"] <= hold_answered_t + YIELD_SLACK_S) if command else None,
        held_after_s=Quantity.of(held["t"] - hold_began_t if held else None, "s",
                                 None if held else f"the filler logged no {trigger}"),
        lead_s=Quantity.of(context_begin_t - last_end_t if last_end_t is not None else None, "s",
                           None if last_end_t is not None else why),
        own_kernels_while_held=Quantity.of(own_kernels_while_held, "count",
                                           None if own_kernels_while_held is not None else
                                           no_kernels if command else "n/a: path hold only"),
        own_kernels_while_ran=Quantity.of(own_kernels_while_ran, "count",
                                          None if own_kernels_while_ran is not None else no_kernels),
        resume_s=Quantity.of(resumed["t"] - release_t if resumed else None, "s",
                             None if resumed else "no resume line after the release"),
    )
