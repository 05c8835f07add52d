"""forge_load.control.powercap: the duty limit that keeps board power under FORGE_MAX_POWER_W, against model boards."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from forge_load.control.monitor import Reading
from forge_load.control.powercap import (
    DEFAULT_BOARD_LIMIT_W,
    LOWER_WEIGHT,
    MARGIN_RATIO,
    MIN_LEARN_RATIO,
    RELEASE_BAND,
    CapChange,
    PowerCap,
    PowerWatch,
)

IDLE_W = 70.0


def run_board(cap: PowerCap, power_of: Callable[[int, float], float], wanted: float, seconds: int) -> list[float]:
    """One reading a second: the controller wants `wanted`, gets at most the cap's limit, and the board's 1-s mean
    power is `power_of(second, duty)`. Returns the power of every second."""
    cap.observe(IDLE_W, 0.0, quiet=True)  # the reading before our first kernel
    powers, previous = [], 0.0
    for second in range(seconds):
        duty = min(wanted, cap.duty_limit)
        power_w = power_of(second, duty)
        powers.append(power_w)
        cap.observe(power_w, duty, quiet=True, steady=abs(duty - previous) <= 0.1 * max(duty, previous) + 0.01)
        previous = duty
    return powers


@pytest.mark.parametrize("slope_w", [630.0, 400.0, 150.0])  # our kernels at full duty: the limit, or less
@pytest.mark.parametrize("cap_w", [150.0, 300.0, 650.0])
def test_a_linear_board_never_goes_over_and_settles_just_under(slope_w: float, cap_w: float) -> None:
    cap = PowerCap(cap_w, board_limit_w=700.0)
    powers = run_board(cap, lambda _s, d: IDLE_W + slope_w * d, wanted=1.0, seconds=60)
    assert max(powers) <= cap_w
    full_w = IDLE_W + slope_w
    settled_w = min(cap_w * (1 - MARGIN_RATIO), full_w)
    assert powers[-1] == pytest.approx(settled_w, rel=1e-3)
    assert all(b >= a - 1e-9 for a, b in zip(powers, powers[1:]))  # from below, never past it


def test_without_a_board_limit_it_starts_lower_and_still_settles() -> None:
    cap = PowerCap(300.0, board_limit_w=None)
    powers = run_board(cap, lambda _s, d: IDLE_W + 400.0 * d, wanted=1.0, seconds=60)
    assert powers[0] == pytest.approx(IDLE_W + 400.0 * (300.0 * (1 - MARGIN_RATIO) - IDLE_W) / (DEFAULT_BOARD_LIMIT_W
                                                                                             - IDLE_W))
    assert max(powers) <= 300.0 and powers[-1] == pytest.approx(300.0 * (1 - MARGIN_RATIO), rel=1e-3)


def test_a_board_that_heats_up_is_held_under_the_cap() -> None:
    # Our kernels draw more each second as the GPU warms (slope 400 W -> 520 W over two minutes), and idle too.
    def warming(second: int, duty: float) -> float:
        warm = min(second / 120.0, 1.0)
        return IDLE_W + 10.0 * warm + (400.0 + 120.0 * warm) * duty

    cap = PowerCap(300.0, board_limit_w=700.0)
    powers = run_board(cap, warming, wanted=1.0, seconds=240)
    assert max(powers) <= 300.0
    assert powers[-1] == pytest.approx(300.0 * (1 - MARGIN_RATIO), rel=0.01)


def test_a_step_up_in_the_boards_power_is_corrected_at_the_next_reading() -> None:
    # A jump no margin covers (a clock boost): over the cap for one reading only, then back under.
    cap = PowerCap(300.0, board_limit_w=700.0)
    powers = run_board(cap, lambda s, d: IDLE_W + (400.0 if s < 30 else 480.0) * d, wanted=1.0, seconds=60)
    over = [i for i, p in enumerate(powers) if p > 300.0]
    assert over == [30]
    assert max(powers[31:]) <= 300.0


def test_below_the_cap_the_controller_rules_and_nothing_binds() -> None:
    cap = PowerCap(600.0, board_limit_w=700.0)
    powers = run_board(cap, lambda _s, d: IDLE_W + 630.0 * d, wanted=0.5, seconds=20)
    assert powers[-1] == pytest.approx(IDLE_W + 315.0)
    assert cap.after_plan(0.5, cap.duty_limit) is None and not cap.binding


def test_no_limit_before_an_idle_reading_and_none_under_idle() -> None:
    cap = PowerCap(300.0, board_limit_w=700.0)
    assert cap.duty_limit == 0.0  # nothing known: launch nothing
    assert cap.after_plan(0.0, 0.0) is None  # but it does not bind: there is nothing to say yet
    cap.observe(None, 0.0, quiet=True)
    assert cap.duty_limit == 0.0
    cap.observe(80.0, 0.0, quiet=True)
    assert cap.duty_limit == pytest.approx((300.0 * (1 - MARGIN_RATIO) - 80.0) / 620.0)
    below_idle = PowerCap(60.0, board_limit_w=700.0)
    below_idle.observe(80.0, 0.0, quiet=True)
    assert below_idle.duty_limit == 0.0


def test_foreign_power_teaches_nothing() -> None:
    cap = PowerCap(300.0, board_limit_w=700.0)
    cap.observe(IDLE_W, 0.0, quiet=True)
    before = cap.duty_limit
    cap.observe(650.0, 0.0, quiet=False)  # a foreign job at full power while we yield
    cap.observe(650.0, 0.3, quiet=False)
    assert cap.duty_limit == before and cap.idle_w == IDLE_W and cap.power_w == 650.0


def test_a_reading_mid_ramp_teaches_nothing_and_one_at_a_tiny_share_never_raises_the_slope() -> None:
    cap = PowerCap(300.0, board_limit_w=700.0)
    cap.observe(IDLE_W, 0.0, quiet=True)
    cap.observe(80.0, 0.2, quiet=True, steady=False)
    cap.observe(71.0, 0.01, quiet=True)  # 100 W per unit of share: below the limit's 630, but noise at 1 %
    cap.observe(79.0, 0.01, quiet=True)  # 900 W per unit: above it, noise too
    assert cap.learned_slope_w == pytest.approx(630.0 + LOWER_WEIGHT * (100.0 - 630.0))


def test_a_kernel_that_draws_little_lowers_the_slope_even_at_the_tiny_duty_a_cap_near_idle_allows() -> None:
    # A cap 30 W over idle allows 30/630 of duty at first, under MIN_LEARN_RATIO; a lean kernel's readings there show
    # next to nothing over idle. Learning nothing from them would hold that duty for good.
    cap = PowerCap(IDLE_W + 30.0, board_limit_w=700.0)
    cap.observe(IDLE_W, 0.0, quiet=True)
    first = cap.duty_limit
    assert first < MIN_LEARN_RATIO
    for _ in range(20):
        cap.observe(IDLE_W + 0.01, min(cap.duty_limit, 0.5), quiet=True)
    assert cap.duty_limit == 1.0


def test_binding_starts_at_the_limit_and_ends_a_band_below_it() -> None:
    cap = PowerCap(300.0, board_limit_w=700.0)
    cap.observe(IDLE_W, 0.0, quiet=True)
    limit = cap.duty_limit
    assert cap.after_plan(limit, limit) == CapChange(True, IDLE_W, 300.0, limit)
    assert cap.after_plan(limit - RELEASE_BAND / 2, limit) is None  # within the band: still binding
    assert cap.after_plan(limit - 2 * RELEASE_BAND, limit) == CapChange(False, IDLE_W, 300.0, limit)
    assert cap.after_plan(1.0, 1.0) is None  # a limit of 1 is no cap
    cap.after_plan(limit, limit)
    assert cap.stop_binding() == CapChange(False, IDLE_W, 300.0, limit) and cap.stop_binding() is None


# PowerWatch: which readings the cap learns from, and when, against a fake busy log.

class FakeBusy:
    """Our kernels as (start, end) spans, timed completely up to `complete_until_s`."""

    def __init__(self, spans: list[tuple[float, float]], complete_until_s: float = float("-inf")) -> None:
        self.spans = spans
        self.complete_until_s = complete_until_s

    def busy_s(self, begin_s: float, end_s: float) -> float:
        return sum(max(min(b, end_s) - max(a, begin_s), 0.0) for a, b in self.spans)


class RecordingCap(PowerCap):
    def __init__(self) -> None:
        super().__init__(300.0, board_limit_w=700.0)
        self.seen: list[tuple[float | None, float, bool, bool]] = []

    def observe(self, power_w: float | None, own_ratio: float, quiet: bool, steady: bool = True) -> None:
        self.seen.append((power_w, round(own_ratio, 9), quiet, steady))
        super().observe(power_w, own_ratio, quiet, steady)


def reading(seq: int, power_w: float | None, power_t_s: float | None, reason: str | None = None) -> Reading:
    return Reading(seq, t_s=float(seq), window_s=0.1, samples=(), memory_used_mib=None, own_mem_mib=None,
                   own_mem_process_mib=None, foreign_mem_mib=None, foreign_pids=(), signals=(), reason=reason,
                   power_w=power_w, power_t_s=power_t_s)


def test_a_power_reading_waits_until_the_busy_log_covers_it_and_is_learnt_from_once() -> None:
    busy = FakeBusy([(8.0, 8.5), (9.0, 9.5), (9.9, 10.2)], complete_until_s=9.95)  # the last burst still in flight
    cap = RecordingCap()
    watch = PowerWatch(cap, busy)
    watch.observe(10.0, reading(1, 250.0, 9.98))
    assert cap.seen == []
    busy.complete_until_s = 10.05
    watch.observe(10.1, reading(2, 260.0, 9.98))  # the same power reading again: not a second lesson
    # Its own power, our share of the second before it came (9.0-9.5 and 9.9-10.0), and of the one before that.
    assert cap.seen == [(250.0, 0.6, True, False)]
    watch.observe(10.2, reading(3, 260.0, 9.98))
    assert len(cap.seen) == 1
    busy.complete_until_s = 11.0
    watch.observe(11.0, reading(4, 270.0, 10.98))
    assert cap.seen[1][0] == 270.0 and len(cap.seen) == 2


def test_one_reading_waits_at_a_time() -> None:
    busy = FakeBusy([], complete_until_s=0.0)
    cap = RecordingCap()
    watch = PowerWatch(cap, busy)
    watch.observe(1.0, reading(1, 100.0, 0.9))
    watch.observe(2.0, reading(2, 200.0, 1.9))  # still waiting on the first
    busy.complete_until_s = 2.0
    watch.observe(2.1, reading(3, 200.0, 1.9))
    assert cap.seen == [(100.0, 0.0, True, True)]


def test_readings_without_power_teach_nothing_and_a_foreign_one_is_not_quiet() -> None:
    busy = FakeBusy([], complete_until_s=100.0)
    cap = RecordingCap()
    watch = PowerWatch(cap, busy)
    watch.observe(1.0, reading(1, None, None))
    watch.observe(2.0, reading(2, 400.0, 1.9, reason="foreign process 4242"))
    assert cap.seen == [(400.0, 0.0, False, True)]
    assert cap.idle_w is None  # a foreign job's power is not our idle


@pytest.mark.parametrize(("before_s", "steady"), [(0.5, True), (0.46, True), (0.43, False), (0.0, False)])
def test_steady_when_our_share_the_second_before_was_about_the_same(before_s: float, steady: bool) -> None:
    # 0.5 s busy in the last second; `before_s` in the one before: within 10 % of the larger plus 0.01.
    busy = FakeBusy([(8.0, 8.0 + before_s), (9.0, 9.5)], complete_until_s=10.0)
    cap = RecordingCap()
    PowerWatch(cap, busy).observe(10.0, reading(1, 200.0, 9.9))
    assert cap.seen == [(200.0, 0.5, True, steady)]


def test_a_share_over_one_counts_as_one() -> None:
    busy = FakeBusy([(9.0, 10.0), (9.0, 9.5)], complete_until_s=10.0)  # overlapping spans sum past the second
    cap = RecordingCap()
    PowerWatch(cap, busy).observe(10.0, reading(1, 500.0, 9.9))
    assert cap.seen == [(500.0, 1.0, True, False)]


def test_a_reading_whose_second_began_before_our_context_teaches_no_idle() -> None:
    # NVML's 1-s mean at our start is the board before our context existed (bare idle, below the context's idle
    # by tens of watts: docs/design.md §15). Taken for idle, it would put the line's intercept too low: a cap under
    # the context's idle power would still launch, and every slope learnt after it would be too steep.
    busy = FakeBusy([], complete_until_s=100.0)
    cap = RecordingCap()
    watch = PowerWatch(cap, busy, since_s=5.0)
    watch.observe(5.0, reading(1, 32.0, 5.0))  # its second, 4.0 to 5.0, began before our context at 5.0
    assert cap.seen == [] and cap.idle_w is None and cap.power_w == 32.0  # shown, not learnt from
    watch.observe(6.0, reading(2, 70.0, 6.0))
    assert cap.seen == [(70.0, 0.0, True, True)] and cap.idle_w == 70.0
