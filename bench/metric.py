"""The metric scenario: the filler holding a GPM metric (FORGE_METRIC=sm_activity, then gr_activity) at 0.5 on a
GPU with GPM (Hopper and newer, docs/design.md §12), judged by 1-s GPM readings the benchmark takes itself (its
own nvmlGpmSampleGet pairs, bench/sampler.py), with what NVML's utilization and the other GPM metric read
meanwhile. Skipped, saying why, where the GPU has no GPM (the simulated GPU, cc < 9.0).

`held()` is the one computation of settle, mean error and p95 from such readings; scripts/mig_metric_bench.py
uses it too."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench import BenchError
from bench.analysis import count
from bench.real import RealBench
from bench.results import JUDGE_FROM_S, MetricRun, Quantity, Scenario, mean
from forge_load.control.scoring import one_second_readings, percentile

METRIC_TARGET = 0.5
HELD_METRICS = ("sm_activity", "gr_activity")  # the FORGE_METRIC values that read GPM; utilization is tracking's
READ_METRICS = ("utilization", "sm_activity", "gr_activity")  # what the benchmark reads during each run
SETTLE_BAND_RATIO = 0.05  # settled: every later 1-s reading within this of the target
METRIC_CONTROLLER = "pi"  # the legacy law holds utilization only (forge_load/config/load.py refuses the rest)


@dataclass(frozen=True)
class Held:
    """How 1-s readings of one metric held a target: settle is from the start to the first reading after which
    every reading stays within the band (None: never); the errors are over the readings from there on."""

    settle_s: float | None
    readings: int
    mean_error_ratio: float | None  # signed: mean reading - target
    p95_abs_error_ratio: float | None
    after: tuple[float, ...]  # the readings the errors are over


def held(readings: Sequence[tuple[float, float]], target: float, start_s: float, end_s: float,
         band_ratio: float = SETTLE_BAND_RATIO) -> Held:
    """readings: (time the reading's second ended, value). The first second is left out: a reading that
    began before the start would mix in what ran before."""
    series = sorted((t, v) for t, v in readings if start_s + 1.0 <= t <= end_s)
    for i, (t, _) in enumerate(series):
        after = [v for _, v in series[i:]]
        if all(abs(v - target) <= band_ratio for v in after):
            return Held(t - start_s, len(series), sum(after) / len(after) - target,
                        percentile([abs(v - target) for v in after], 95), tuple(after))
    return Held(None, len(series), None, None, ())


def no_gpm_reason(info: Any, simulated: bool) -> str | None:
    """Why the metric scenario cannot run on this device (None: it can). `info` is forge_load's DeviceInfo, whose
    `gpm` is nvmlGpmQueryDeviceSupport's answer (forge_load/gpu/nvml_mig.py)."""
    if simulated:
        return "metric: the simulated GPU models no GPM (SM activity and graphics activity need a GPU " \
               "with NVML GPM: Hopper, cc 9.0, or newer)"
    if getattr(info, "gpm", False):
        return None
    return (f"metric: {info.name} has no NVML GPM (nvmlGpmQueryDeviceSupport: not supported; GPM needs "
            "Hopper, cc 9.0, or newer, and a driver and pynvml that have it), so FORGE_METRIC=sm_activity and "
            "gr_activity cannot be read there")


def metric_run(metric: str, target: float, start_s: float, end_s: float,
               readings: dict[str, list[tuple[float, float]]]) -> MetricRun:
    """One held metric's numbers from every metric's 1-s readings over one run (wall time)."""
    h = held(readings.get(metric, []), target, start_s, end_s)
    never = None if h.settle_s is not None else \
        f"never within +-{SETTLE_BAND_RATIO:g} to the end of the {end_s - start_s:g}-s run"
    # The other metrics meanwhile: from the held one's settling on (from 5 s where it never settled).
    from_s = start_s + (h.settle_s if h.settle_s is not None else JUDGE_FROM_S)
    meanwhile = {}
    for key in READ_METRICS:
        values = [v for t, v in readings.get(key, []) if from_s <= t <= end_s]
        meanwhile[key] = Quantity.of(mean(values), "ratio", None if values else "no readings")
    return MetricRun(
        metric=metric,
        target=Quantity.of(target, "ratio"),
        duration_s=Quantity.of(end_s - start_s, "s"),
        readings=Quantity.of(h.readings, "count"),
        settle_s=Quantity.of(h.settle_s, "s", never),
        mean_error=Quantity.of(h.mean_error_ratio, "ratio", never),
        p95_abs_error=Quantity.of(h.p95_abs_error_ratio, "ratio", never),
        read_meanwhile=meanwhile,
        read_from=("settled" if h.settle_s is not None else f"from {JUDGE_FROM_S:g} s (never settled)"),
    )


def real_metric(bench: RealBench, metric: str) -> Scenario:
    """The filler with FORGE_METRIC=`metric` at METRIC_TARGET for --metric-s, alone on the GPU."""
    bench.wait_idle()
    d = bench.args.metric_s
    child = bench.start_filler(METRIC_TARGET, METRIC_CONTROLLER, d, {"FORGE_METRIC": metric})
    run = bench.finish(child, d + 60.0)
    a, b = run.wall(0.0), run.wall(d)
    gpm = bench.sampler.between("gpm", a, b)
    if not gpm:
        raise BenchError(f"NVML's GPM gave the benchmark no readings during {child.name}")
    util = one_second_readings(bench.sampler.between("util", a, b), a, b)
    readings = {"sm_activity": [(t, sm) for t, _, sm, _ in gpm], "gr_activity": [(t, gr) for t, _, _, gr in gpm],
                "utilization": [(t + 1.0, u) for t, u in util]}  # each reading at the end of its second
    metrics = metric_run(metric, METRIC_TARGET, a, b, readings)
    metrics.yields = Quantity.of(count(run.events, "yield"), "count")
    others = bench.sampler.foreign_pids({run.pid}, a, b)
    if others:
        metrics.warning = f"other processes on the GPU during the run: {sorted(others)}"
    series = bench.series(run, d, METRIC_TARGET)
    for key in HELD_METRICS:
        series[key] = [[round(run.t(t), 4), v] for t, v in readings[key]]
    return Scenario(f"metric_{metric}", metrics, series)
