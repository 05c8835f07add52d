"""forge_load/control/scoring.py: 1-s readings, settle time, percentiles and the tracking numbers, on hand-built
series."""

from __future__ import annotations

import math

import pytest

from forge_load.control.probe import UtilSample
from forge_load.control.scoring import one_second_readings, percentile, settle_time_s, tracking


def test_one_second_readings_bins() -> None:
    samples = [
        UtilSample(9.99, 1.0),   # before start: out
        UtilSample(10.0, 0.4), UtilSample(10.5, 0.6), UtilSample(10.999, 0.5),  # second 0
        UtilSample(11.2, 0.3),   # second 1
        # second 2: no samples, no reading
        UtilSample(13.0, 0.8), UtilSample(13.9, 0.6),  # second 3
        UtilSample(14.0, 1.0),   # at end: out
    ]
    readings = one_second_readings(samples, 10.0, 14.0)
    assert [t for t, _ in readings] == [10.0, 11.0, 13.0]
    assert [u for _, u in readings] == pytest.approx([0.5, 0.3, 0.7])


def test_one_second_readings_unsorted_input() -> None:
    samples = [UtilSample(1.5, 0.2), UtilSample(0.5, 0.4), UtilSample(1.2, 0.4)]
    assert one_second_readings(samples, 0.0, 2.0) == [(0.0, 0.4), (1.0, pytest.approx(0.3))]


def series(values: list[float], start_s: float = 0.0) -> list[tuple[float, float]]:
    return [(start_s + k, v) for k, v in enumerate(values)]


def test_settle_never() -> None:
    assert settle_time_s(series([0.3] * 20), 0.5, 0.0) is None
    assert settle_time_s([], 0.5, 0.0) is None


def test_settle_then_hold() -> None:
    readings = series([0.2, 0.35, 0.45, 0.49, 0.5, 0.51, 0.5, 0.49, 0.5, 0.5, 0.51, 0.5])
    assert settle_time_s(readings, 0.5, 0.0) == 4.0  # the reading of second 3 is the first that holds


def test_settle_ignores_a_pass_through_that_does_not_hold() -> None:
    # Within tolerance at second 1, out again at 3: settling is the reading of second 4.
    readings = series([0.3, 0.5, 0.51, 0.6, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    assert settle_time_s(readings, 0.5, 0.0) == 5.0


def test_settle_relative_to_start_and_hold_window() -> None:
    readings = series([0.1, 0.5, 0.5, 0.1, 0.5, 0.5, 0.5], start_s=100.0)
    assert settle_time_s(readings, 0.5, 100.0, hold_s=2.0) == 2.0   # 101 and 102 hold for 2 s
    assert settle_time_s(readings, 0.5, 100.0, hold_s=5.0) == 5.0   # only from 104 on (to the end)
    assert settle_time_s(readings, 0.5, 99.0, hold_s=5.0) == 6.0


def test_settle_tolerance() -> None:
    readings = series([0.53] * 10)
    assert settle_time_s(readings, 0.5, 0.0, tolerance_ratio=0.02) is None
    assert settle_time_s(readings, 0.5, 0.0, tolerance_ratio=0.05) == 1.0


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
    ([4.0, 1.0, 3.0, 2.0], 0, 1.0),
    ([4.0, 1.0, 3.0, 2.0], 100, 4.0),
    ([0.0, 10.0], 95, 9.5),
    ([float(k) for k in range(101)], 95, 95.0),
    ([7.0], 95, 7.0),
    ([0.06, 0.0, 0.01, 0.0, 0.015, 0.01], 95, 0.015 + 0.75 * (0.06 - 0.015)),  # rank 4.75
])
def test_percentile(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_empty_is_nan() -> None:
    assert math.isnan(percentile([], 95))


def test_tracking_numbers_on_a_hand_built_series() -> None:
    # One sample per second, in the middle of the second; target 0.5.
    values = [0.2, 0.5, 0.51, 0.49, 0.5, 0.515, 0.44, 0.5]
    samples = [UtilSample(k + 0.5, v) for k, v in enumerate(values)]
    result = tracking(samples, 0.5, 0.0, 8.0)
    assert result.settle_s == 2.0  # second 1 is followed by 5 s within 0.02
    # Judged: seconds 2..7, errors 0.01 0.01 0 0.015 0.06 0.
    assert result.seconds == 6
    assert result.mae_ratio == pytest.approx((0.01 + 0.01 + 0.0 + 0.015 + 0.06 + 0.0) / 6)
    assert result.p95_error_ratio == pytest.approx(0.015 + 0.75 * (0.06 - 0.015))
    assert result.within_005_ratio == pytest.approx(5 / 6)


def test_tracking_never_settled() -> None:
    samples = [UtilSample(k + 0.5, 0.3) for k in range(10)]
    result = tracking(samples, 0.5, 0.0, 10.0)
    assert result.settle_s is None
    assert result.seconds == 0
    assert math.isnan(result.mae_ratio) and math.isnan(result.p95_error_ratio)
    assert math.isnan(result.within_005_ratio)


def test_tracking_with_several_samples_per_second() -> None:
    # 1/6-s windows alternating 0.48 / 0.52: each 1-s reading is exactly on target.
    samples = [UtilSample(k / 6 + 0.01, 0.48 if k % 2 else 0.52) for k in range(60)]
    result = tracking(samples, 0.5, 0.0, 10.0)
    assert result.settle_s == 1.0
    assert result.seconds == 9
    assert result.mae_ratio == pytest.approx(0.0, abs=1e-9)
    assert result.within_005_ratio == 1.0
