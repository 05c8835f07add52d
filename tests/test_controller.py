"""forge_load.control.controller: the PI law (feed-forward, integral, multiplier sizing) and the legacy law."""

from __future__ import annotations

import pytest

from forge_load.control.controller import LegacyController, PiController, make_controller
from forge_load.control.probe import UtilSample
from forge_load.control.worker import IDLE_PLAN, Plan


def samples_at(times_s: list[float], ratio: float) -> list[UtilSample]:
    return [UtilSample(t, ratio) for t in times_s]


def grid(start_s: float, stop_s: float, step_s: float) -> list[float]:
    """start_s, start_s + step_s, ... up to and including stop_s (computed without drift)."""
    n = round((stop_s - start_s) / step_s)
    return [start_s + i * step_s for i in range(n + 1)]


# --- PiController: feed-forward and start() ------------------------------------------------------------


@pytest.mark.parametrize("target", [0.2, 0.5, 0.9])
def test_pi_feed_forward_duty_is_target_at_once(target: float) -> None:
    c = PiController()
    c.start(0.0)
    plan = c.update(target, [], 1 / 6, None)
    assert plan.duty_ratio == target
    assert plan.gap_s == 0.0
    assert plan.multiplier == c.multiplier == 8


def test_pi_ignores_every_sample_before_start() -> None:
    c = PiController()
    plan = c.update(0.5, samples_at([1.0, 2.0, 3.0], 0.1), 0.5, None)
    assert c.integral_duty == 0.0
    assert plan.duty_ratio == 0.5


def test_pi_ignores_samples_whose_window_began_before_start() -> None:
    c = PiController(ki_per_s=0.6)
    c.start(10.0)
    # window 0.5 s: a sample at 10.4 s saw [9.9, 10.4], before we filled; one at 10.5 s saw [10.0, 10.5].
    plan = c.update(0.5, [UtilSample(10.4, 0.0)], 0.5, None)
    assert c.integral_duty == 0.0
    assert plan.duty_ratio == 0.5
    plan = c.update(0.5, [UtilSample(10.5, 0.4)], 0.5, None)
    gain = 0.6 * 0.5
    assert c.integral_duty == pytest.approx(gain * (0.5 - 0.4))
    assert plan.duty_ratio == pytest.approx(0.5 + gain * 0.1)


def test_pi_restart_ignores_old_windows_but_keeps_learned_integral() -> None:
    c = PiController()
    c.start(0.0)
    for t in grid(1.0, 5.0, 0.5):
        c.update(0.5, [UtilSample(t, 0.45)], 0.5, None)
    learned = c.integral_duty
    assert learned > 0
    c.start(20.0)  # resume after yielding: the learned bias still holds
    plan = c.update(0.5, [UtilSample(20.2, 0.0)], 0.5, None)  # window began at 19.7, before the resume
    assert c.integral_duty == learned
    assert plan.duty_ratio == pytest.approx(0.5 + learned)


def test_pi_gain_grows_with_window_up_to_max_gain() -> None:
    small = PiController(ki_per_s=0.6, max_gain=0.3)
    small.start(0.0)
    small.update(0.5, [UtilSample(1.0, 0.4)], 0.1, None)
    assert small.integral_duty == pytest.approx(0.06 * 0.1)
    big = PiController(ki_per_s=0.6, max_gain=0.3)
    big.start(0.0)
    big.update(0.5, [UtilSample(2.0, 0.4)], 1.0, None)  # 0.6 per sample would be capped at 0.3
    assert big.integral_duty == pytest.approx(0.3 * 0.1)


# --- PiController: the integral against a simulated plant ---------------------------------------------


def run_plant(c: PiController, target: float, bias: float, window_s: float, n: int,
              delay_samples: int) -> list[float]:
    """Plant: NVML util = duty + bias (clipped to [0, 1]); each sample sees the duty of the plan
    `delay_samples` updates back. Returns the duty after each update."""
    c.start(0.0)
    duties = [c.update(target, [], window_s, None).duty_ratio]
    for k in range(1, n + 1):
        seen_duty = duties[max(len(duties) - delay_samples, 0)]
        util = min(max(seen_duty + bias, 0.0), 1.0)
        duties.append(c.update(target, [UtilSample(k * window_s, util)], window_s, None).duty_ratio)
    return duties


@pytest.mark.parametrize("bias", [0.05, -0.05, 0.03, -0.08])
@pytest.mark.parametrize("window_s", [1 / 6, 0.5, 1.0])
def test_pi_integral_removes_constant_bias_monotonically(bias: float, window_s: float) -> None:
    target = 0.5
    duties = run_plant(PiController(), target, bias, window_s, n=200, delay_samples=1)
    assert duties[-1] == pytest.approx(target - bias, abs=1e-3)
    # No overshoot: the duty moves toward target - bias and never past it.
    steps = [b - a for a, b in zip(duties, duties[1:])]
    if bias > 0:
        assert all(s <= 1e-12 for s in steps)
        assert min(duties) >= target - bias - 1e-9
    else:
        assert all(s >= -1e-12 for s in steps)
        assert max(duties) <= target - bias + 1e-9


@pytest.mark.parametrize("bias", [0.05, -0.05])
@pytest.mark.parametrize("window_s", [1 / 6, 0.5, 1.0])
def test_pi_converges_with_one_sample_of_delay_and_bounded_overshoot(bias: float, window_s: float) -> None:
    target = 0.5
    duties = run_plant(PiController(), target, bias, window_s, n=200, delay_samples=2)
    final = target - bias
    assert duties[-1] == pytest.approx(final, abs=1e-3)
    # Overshoot past the final value is at most a quarter of the correction.
    overshoot = max((final - d) * (1 if bias > 0 else -1) for d in duties)
    assert overshoot <= 0.25 * abs(bias) + 1e-9
    # The plant output settles: within 0.005 of the target after 20 samples and stays there.
    utils = [d + bias for d in duties]
    assert all(abs(u - target) <= 0.005 for u in utils[25:])


@pytest.mark.parametrize("target", [0.2, 0.5, 0.9])
def test_pi_integral_clamped_duty_stays_within_0_1(target: float) -> None:
    high = PiController()
    high.start(0.0)
    # The GPU reads 0 whatever we do (e.g. a broken counter): the duty must stop at 1.
    for k in range(1, 100):
        plan = high.update(target, [UtilSample(k * 1.0, 0.0)], 1.0, None)
        assert 0.0 <= plan.duty_ratio <= 1.0
    assert plan.duty_ratio == pytest.approx(1.0)
    assert high.integral_duty == pytest.approx(1.0 - target)
    low = PiController()
    low.start(0.0)
    for k in range(1, 100):
        plan = low.update(target, [UtilSample(k * 1.0, 1.0)], 1.0, None)
        assert 0.0 <= plan.duty_ratio <= 1.0
    assert plan.duty_ratio == pytest.approx(0.0)
    assert low.integral_duty == pytest.approx(-target)


def test_pi_clamp_does_not_wind_up() -> None:
    """After a long saturation the first opposite error moves the duty off the limit at once."""
    c = PiController()
    c.start(0.0)
    for k in range(1, 200):
        c.update(0.5, [UtilSample(k * 1.0, 0.0)], 1.0, None)
    plan = c.update(0.5, [UtilSample(200.0, 0.9)], 1.0, None)
    assert plan.duty_ratio < 1.0 - 0.1


# --- PiController: the multiplier -------------------------------------------------------------------


@pytest.mark.parametrize(("launch_s", "expected"), [
    (0.004, 4),      # twice too long: halve
    (0.001, 16),     # twice too short: double
    (0.0005, 32),    # four times too short
    (0.016, 1),      # 8 * 0.125 = 1
])
def test_pi_multiplier_rescaled_toward_slice(launch_s: float, expected: int) -> None:
    c = PiController(slice_s=0.002, initial_multiplier=8)
    c.start(0.0)
    plan = c.update(0.5, [], 1 / 6, launch_s)
    assert plan.multiplier == expected == c.multiplier


@pytest.mark.parametrize("launch_s", [0.002, 0.0015, 0.0025, 0.0028, 0.0015 + 1e-5])
def test_pi_multiplier_dead_band(launch_s: float) -> None:
    # scale = 0.002 / launch_s within [0.7, 1.4]: kernel time moves in whole waves, leave it alone.
    c = PiController(slice_s=0.002, initial_multiplier=8)
    c.start(0.0)
    assert c.update(0.5, [], 1 / 6, launch_s).multiplier == 8


@pytest.mark.parametrize("launch_s", [None, 0.0, -0.001])
def test_pi_multiplier_unchanged_without_a_measurement(launch_s: float | None) -> None:
    c = PiController(initial_multiplier=8)
    c.start(0.0)
    assert c.update(0.5, [], 1 / 6, launch_s).multiplier == 8


def test_pi_multiplier_clamped_to_1_and_max() -> None:
    c = PiController(slice_s=0.002, initial_multiplier=8, max_multiplier=100)
    c.start(0.0)
    assert c.update(0.5, [], 1 / 6, 1e-7).multiplier == 100
    assert c.update(0.5, [], 1 / 6, 1e-7).multiplier == 100
    assert c.update(0.5, [], 1 / 6, 10.0).multiplier == 1
    assert c.update(0.5, [], 1 / 6, 10.0).multiplier == 1


def test_pi_multiplier_converges_on_a_linear_kernel() -> None:
    """Kernel time proportional to the multiplier (0.1 ms per block per SM): settles at 20 and stays."""
    c = PiController(slice_s=0.002, initial_multiplier=8)
    c.start(0.0)
    seen = []
    for _ in range(10):
        seen.append(c.update(0.5, [], 1 / 6, 0.0001 * c.multiplier).multiplier)
    assert seen[-1] == 20
    assert seen[-5:] == [20] * 5
    assert all(1 <= m <= 4096 for m in seen)


# --- LegacyController ---------------------------------------------------------------------------------


def run_legacy(c: LegacyController, target: float, times_s: list[float], ratio: float) -> Plan:
    plan = c.update(target, [], 1.0, None)
    for t in times_s:
        plan = c.update(target, [UtilSample(t, ratio)], 1.0, None)
    return plan


def test_legacy_plan_is_full_duty_with_gap_pacing() -> None:
    c = LegacyController(gap_s=0.007, initial_multiplier=32.0)
    c.start(0.0)
    plan = c.update(0.5, [], 1.0, None)
    assert plan == Plan(multiplier=32, duty_ratio=1.0, gap_s=0.007)


def test_legacy_grows_x1_2_after_a_low_run() -> None:
    c = LegacyController(initial_multiplier=32.0)
    c.start(0.0)
    run_legacy(c, 0.5, grid(0.5, 9.5, 0.5), 0.3)
    assert c.multiplier_f == 32.0  # the run is not over yet
    plan = c.update(0.5, [UtilSample(10.0, 0.3)], 1.0, None)
    assert c.multiplier_f == pytest.approx(38.4)
    assert plan.multiplier == 38
    assert plan.duty_ratio == 1.0
    # The next run starts where the last ended: the next growth comes 10 s later, not before.
    run_legacy(c, 0.5, grid(10.5, 19.5, 0.5), 0.3)
    assert c.multiplier_f == pytest.approx(38.4)
    c.update(0.5, [UtilSample(20.0, 0.3)], 1.0, None)
    assert c.multiplier_f == pytest.approx(38.4 * 1.2)


@pytest.mark.parametrize("ratio", [0.46, 0.5, 0.55])
def test_legacy_unchanged_inside_the_band(ratio: float) -> None:
    # mean in [0.9, 1.2] x target and peak not above 1.1 x target
    c = LegacyController(initial_multiplier=32.0)
    c.start(0.0)
    plan = run_legacy(c, 0.5, grid(0.5, 30.0, 0.5), ratio)
    assert c.multiplier_f == 32.0
    assert plan.duty_ratio == 1.0


def test_legacy_shrinks_by_1_5_after_a_high_run_then_idles() -> None:
    c = LegacyController(initial_multiplier=32.0, idle_s=5.0)
    c.start(0.0)
    plan = run_legacy(c, 0.5, grid(0.5, 9.5, 0.5), 0.7)  # every sample above 1.2 x target
    assert c.multiplier_f == 32.0  # judged at the end of the run, not before
    assert plan.duty_ratio == 1.0
    plan = c.update(0.5, [UtilSample(10.0, 0.7)], 1.0, None)
    assert c.multiplier_f == pytest.approx(32.0 / 1.5)
    assert plan.multiplier == 21
    assert plan.duty_ratio == 0.0  # and the peak (0.7 > 0.55) idles it


def test_legacy_sustained_overshoot_keeps_shrinking() -> None:
    c = LegacyController(initial_multiplier=32.0, idle_s=5.0)
    c.start(0.0)
    run_legacy(c, 0.5, grid(0.5, 60.0, 0.5), 0.7)
    # Runs end at 10, 25, 40 and 55 s, each followed by 5 s of idle.
    assert c.multiplier_f == pytest.approx(32.0 / 1.5 ** 4)


def test_legacy_idles_5_s_when_the_run_peak_exceeds_1_1_target() -> None:
    c = LegacyController(initial_multiplier=32.0, idle_s=5.0)
    c.start(0.0)
    assert run_legacy(c, 0.5, grid(0.5, 9.5, 0.5), 0.5).duty_ratio == 1.0
    plan = c.update(0.5, [UtilSample(10.0, 0.56)], 1.0, None)  # 0.56 > 0.55 in the run's last 5 s
    assert plan.duty_ratio == 0.0
    assert plan.gap_s == c.gap_s
    assert c.multiplier_f == 32.0  # mean about 0.503: inside the band
    # Idle through 15 s, whatever the samples say (our idle GPU, or foreign work).
    for t in grid(10.5, 14.5, 0.5):
        assert c.update(0.5, [UtilSample(t, 0.9)], 1.0, None).duty_ratio == 0.0
        assert c.update(0.5, [], 1.0, None).duty_ratio == 0.0
    assert c.update(0.5, [UtilSample(15.0, 0.0)], 1.0, None).duty_ratio == 1.0
    assert c.multiplier_f == 32.0  # idling does not touch the multiplier


def test_legacy_peak_at_exactly_1_1_target_does_not_idle() -> None:
    c = LegacyController(initial_multiplier=32.0)
    c.start(0.0)
    plan = run_legacy(c, 0.5, grid(0.5, 20.0, 0.5), 0.55)  # "exceeds" is strict
    assert plan.duty_ratio == 1.0


def test_legacy_peak_counts_only_the_last_5_s_of_the_run() -> None:
    c = LegacyController(initial_multiplier=32.0)
    c.start(0.0)
    c.update(0.5, [UtilSample(1.0, 0.9)], 1.0, None)  # a spike early in the run
    plan = run_legacy(c, 0.5, grid(1.5, 10.0, 0.5), 0.5)  # mean 0.52: in the band
    assert plan.duty_ratio == 1.0
    assert c.multiplier_f == 32.0


def test_legacy_run_restarts_after_idle() -> None:
    """After an idle the next run counts 10 s from the idle's end, over samples taken after it."""
    c = LegacyController(initial_multiplier=32.0, idle_s=5.0)
    c.start(0.0)
    run_legacy(c, 0.5, grid(1.0, 9.0, 1.0), 0.5)
    c.update(0.5, [UtilSample(10.0, 0.9)], 1.0, None)  # mean 0.54, peak 0.9: idle from 10 to 15
    assert c.multiplier_f == 32.0
    run_legacy(c, 0.5, grid(11.0, 14.0, 1.0), 0.0)  # ignored: idle
    run_legacy(c, 0.5, grid(15.0, 24.5, 0.5), 0.2)
    assert c.multiplier_f == 32.0  # the run began at 15: not over at 24.5
    c.update(0.5, [UtilSample(25.0, 0.2)], 1.0, None)
    assert c.multiplier_f == pytest.approx(38.4)  # mean 0.2 over the post-idle samples only


def test_legacy_start_ends_an_idle_and_begins_a_new_run() -> None:
    c = LegacyController(initial_multiplier=32.0, idle_s=5.0)
    c.start(0.0)
    assert run_legacy(c, 0.5, grid(0.5, 10.0, 0.5), 0.9).duty_ratio == 0.0  # idle until 15
    c.start(12.0)  # resume after a yield
    assert c.update(0.5, [], 1.0, None).duty_ratio == 1.0
    run_legacy(c, 0.5, grid(12.5, 21.5, 0.5), 0.2)
    assert c.multiplier_f == pytest.approx(32.0 / 1.5)
    c.update(0.5, [UtilSample(22.0, 0.2)], 1.0, None)
    assert c.multiplier_f == pytest.approx(32.0 / 1.5 * 1.2)


def test_legacy_multiplier_bounded() -> None:
    c = LegacyController(initial_multiplier=60000.0, max_multiplier=65536.0)
    c.start(0.0)
    run_legacy(c, 0.5, grid(1.0, 40.0, 1.0), 0.0)
    assert c.multiplier_f == 65536.0
    assert c.multiplier == 65536
    low = LegacyController(initial_multiplier=1.2, idle_s=0.0)
    low.start(0.0)
    run_legacy(low, 0.5, grid(1.0, 40.0, 1.0), 1.0)
    assert low.multiplier_f == 1.0
    assert low.multiplier == 1


def test_legacy_update_without_new_samples_after_idle_keeps_running() -> None:
    """The Monitor publishes readings more often than NVML has samples: most updates carry none."""
    c = LegacyController(initial_multiplier=32.0, idle_s=5.0)
    c.start(0.0)
    run_legacy(c, 0.5, grid(1.0, 10.0, 1.0), 0.9)  # idle until 15
    assert c.update(0.5, [], 1.0, None).duty_ratio == 0.0
    assert c.update(0.5, [UtilSample(16.0, 0.3)], 1.0, None).duty_ratio == 1.0  # idle over
    assert c.update(0.5, [], 1.0, None).duty_ratio == 1.0


def test_legacy_update_without_samples_before_any_idle_runs() -> None:
    c = LegacyController()
    c.start(0.0)
    assert c.update(0.5, [], 1.0, None).duty_ratio == 1.0


# --- make_controller ----------------------------------------------------------------------------------


def test_make_controller() -> None:
    legacy = make_controller("legacy")
    assert isinstance(legacy, LegacyController)
    assert legacy.name == "legacy"
    pi = make_controller("pi")
    assert isinstance(pi, PiController)
    assert pi.name == "pi"
    assert make_controller("pi") is not pi  # a fresh controller each time


def test_idle_plan_launches_nothing() -> None:
    assert IDLE_PLAN.duty_ratio == 0.0
    assert IDLE_PLAN.multiplier >= 1


def test_make_controller_refuses_a_name_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="'pid'.*pi, legacy"):
        make_controller("pid")


def test_every_controller_the_config_accepts_can_be_made() -> None:
    from forge_load.config.settings import CONTROLLER_NAMES

    assert {make_controller(name).name for name in CONTROLLER_NAMES} == set(CONTROLLER_NAMES)


# --- PiController: the Worker's period -----------------------------------------------------------------


@pytest.mark.parametrize("window_s", [1 / 6, 0.2, 0.25, 1 / 3, 0.5, 0.7, 1.0])
@pytest.mark.parametrize("target", [0.1, 0.3, 0.5, 0.54, 0.65, 0.8, 0.9, 1.0])
def test_pi_period_divides_the_window_and_keeps_bursts_short(window_s: float, target: float) -> None:
    c = PiController()
    period_s = c.period_for(target, window_s)
    parts = window_s / period_s
    assert parts == pytest.approx(round(parts), abs=1e-9)  # whole bursts in every window
    assert period_s <= c.max_period_s * 1.01
    assert target * period_s <= c.burst_s * 1.01  # what a yield waits for


@pytest.mark.parametrize("target", [0.3, 0.5, 0.65, 0.8])
def test_pi_period_is_the_same_before_and_after_the_window_is_learned(target: float) -> None:
    # The Monitor assumes 1/6 s until two samples have come; a period switch would upset one window.
    c = PiController()
    assert c.period_for(target, 1.0) == pytest.approx(c.period_for(target, 1 / 6))
    assert c.period_for(target, 0.5) == pytest.approx(c.period_for(target, 1 / 6))


@pytest.mark.parametrize(("window_s", "learned_s"), [(1 / 6, 0.1666667), (1 / 6, 0.166666), (1.0, 1.000001),
                                                      (1.0, 0.999999)])
def test_pi_period_divides_a_learned_window_exactly(window_s: float, learned_s: float) -> None:
    c = PiController()
    assert learned_s / c.period_for(0.5, learned_s) == pytest.approx(window_s / c.period_for(0.5, window_s))
    assert (learned_s / c.period_for(0.5, learned_s)) % 1 == pytest.approx(0.0, abs=1e-9)


def test_pi_plan_carries_the_period_chosen_by_the_target_not_the_duty() -> None:
    c = PiController()
    c.start(0.0)
    first = c.update(0.5, [], 1 / 6, None)
    assert first.period_s == pytest.approx(1 / 6)  # half of it busy: a burst of 1/12 s
    # The integral moves the duty; the period stays.
    later = c.update(0.5, [UtilSample(1.0, 0.45), UtilSample(1.2, 0.45)], 1 / 6, None)
    assert later.duty_ratio > 0.5 and later.period_s == first.period_s
    assert c.update(0.8, [], 1 / 6, None).period_s == pytest.approx(1 / 12)


# --- the duty limit (the power cap's): no duty above it, no integral wound up against it --------------------


def test_pi_duty_never_exceeds_the_limit_and_the_integral_does_not_wind_up() -> None:
    c = PiController()
    c.start(0.0)
    bias = -0.02  # NVML reads a little below our duty: the integral has learned +0.02 before the cap binds
    plan = c.update(0.5, [], 1.0, None)
    for k in range(1, 60):
        plan = c.update(0.5, [UtilSample(float(k), plan.duty_ratio + bias)], 1.0, None)
    learned = c.integral_duty
    assert learned == pytest.approx(0.02, abs=1e-3)
    for k in range(60, 300):  # capped at 0.3: NVML reads 0.28, far below target, for four minutes
        plan = c.update(0.5, [UtilSample(float(k), 0.28)], 1.0, None, max_duty=0.3)
        assert plan.duty_ratio == pytest.approx(0.3)
    assert c.integral_duty == pytest.approx(learned)  # frozen while capped: the bias it learned is kept
    plan = c.update(0.5, [], 1.0, None)  # the cap lifts: the learned duty at once
    assert plan.duty_ratio == pytest.approx(0.5 + learned, abs=1e-3)


def test_pi_integral_still_falls_while_capped() -> None:
    c = PiController()
    c.start(0.0)
    for k in range(1, 10):  # NVML reads above the target: the integral must come down, cap or not
        plan = c.update(0.5, [UtilSample(float(k), 0.6)], 1.0, None, max_duty=0.45)
    assert c.integral_duty < 0
    assert plan.duty_ratio <= 0.45


def test_pi_limit_of_zero_launches_nothing() -> None:
    c = PiController()
    c.start(0.0)
    assert c.update(0.5, [], 1 / 6, None, max_duty=0.0).duty_ratio == 0.0


def test_legacy_under_a_limit_is_paced_by_duty_instead_of_its_gap() -> None:
    c = LegacyController()
    c.start(0.0)
    assert c.update(0.5, [], 1.0, None, max_duty=1.0).gap_s > 0  # no limit: the original pacing
    plan = c.update(0.5, [], 1.0, None, max_duty=0.4)
    assert (plan.duty_ratio, plan.gap_s, plan.multiplier) == (0.4, 0.0, c.multiplier)
