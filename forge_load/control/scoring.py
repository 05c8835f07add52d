"""How well a run held its target, from NVML samples: the numbers the tests and the benchmark judge by.

A "1-s reading" is the mean of the NVML samples whose window ended within that second of the run, which
is what a dashboard scraping once a second sees, whatever the GPU's own sample window.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from forge_load.control.probe import UtilSample


@dataclass(frozen=True)
class Tracking:
    settle_s: float | None  # first second from which readings stay within the tolerance; None if never
    mae_ratio: float  # mean absolute error of the 1-s readings after settling
    p95_error_ratio: float  # 95th percentile of the absolute error after settling
    within_005_ratio: float  # share of 1-s readings within +-0.05 after settling
    seconds: int  # 1-s readings judged


def one_second_readings(samples: Iterable[UtilSample], start_s: float, end_s: float) -> list[tuple[float, float]]:
    """(second start, mean utilization) for each whole second in [start_s, end_s) that has samples."""
    bins: dict[int, list[float]] = {}
    for sample in samples:
        if start_s <= sample.t_s < end_s:
            bins.setdefault(math.floor(sample.t_s - start_s), []).append(sample.ratio)
    return [(start_s + k, sum(v) / len(v)) for k, v in sorted(bins.items())]


def busy_samples(spans: Iterable[tuple[float, float]], begin_s: float, end_s: float,
                 window_s: float = 1 / 6) -> list[UtilSample]:
    """What NVML would report from one device's kernels alone, given as (start, end) spans: the busy share of
    each window of `window_s` from `begin_s` to `end_s` (a device runs one kernel at a time: no overlaps)."""
    ordered = sorted(spans)
    starts = [a for a, _ in ordered]
    longest_s = max((b - a for a, b in ordered), default=0.0)
    samples = []
    t_s = begin_s + window_s
    while t_s <= end_s:
        lo = bisect.bisect_left(starts, t_s - window_s - longest_s)
        hi = bisect.bisect_left(starts, t_s)
        busy_s = sum(max(0.0, min(b, t_s) - max(a, t_s - window_s)) for a, b in ordered[lo:hi])
        samples.append(UtilSample(t_s, busy_s / window_s))
        t_s += window_s
    return samples


def settle_time_s(readings: Sequence[tuple[float, float]], target_ratio: float, start_s: float,
                  tolerance_ratio: float = 0.02, hold_s: float = 5.0) -> float | None:
    """Seconds from `start_s` to the end of the first reading that is within tolerance and is followed by
    `hold_s` seconds of readings all within tolerance (or by the end of the run)."""
    errors = [abs(u - target_ratio) <= tolerance_ratio for _, u in readings]
    for i, (t_s, _) in enumerate(readings):
        following = [ok for (t2_s, _), ok in zip(readings[i:], errors[i:]) if t2_s < t_s + hold_s]
        if all(following):
            return t_s + 1.0 - start_s
    return None


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def tracking(samples: Iterable[UtilSample], target_ratio: float, start_s: float, end_s: float) -> Tracking:
    readings = one_second_readings(samples, start_s, end_s)
    settle_s = settle_time_s(readings, target_ratio, start_s)
    after = [abs(u - target_ratio) for t_s, u in readings if settle_s is not None and t_s >= start_s + settle_s]
    if not after:
        return Tracking(settle_s, math.nan, math.nan, math.nan, 0)
    return Tracking(settle_s, sum(after) / len(after), percentile(after, 95),
                    sum(e <= 0.05 for e in after) / len(after), len(after))
