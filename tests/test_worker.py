"""forge_load.control.worker: the BusyLog and the Worker's pacing, against the simulated GPU in virtual time."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from forge_load.config.sim import SimConfig
from forge_load.control.probe import GpuFailedError
from forge_load.control.worker import IDLE_PLAN, MAX_KERNELS, BusyLog, Completed, Plan, Worker
from forge_load.gpu.sim import (
    LAUNCH_LATENCY_S,
    LAUNCH_OVERHEAD_S,
    SLEEP_QUANTUM_S,
    SLEEP_RATIO,
    WAVE_S,
    SimGpu,
    SimLauncher,
    VirtualClock,
)

# --- BusyLog ----------------------------------------------------------------------------------------


def log_of(*intervals: tuple[float, float], keep_s: float = 30.0) -> BusyLog:
    log = BusyLog(keep_s=keep_s)
    for a, b in intervals:
        log.add(a, b)
    return log


def test_busy_none_before_after_and_between() -> None:
    log = log_of((1.0, 2.0), (3.0, 4.0))
    assert log.busy_s(0.0, 1.0) == 0.0
    assert log.busy_s(2.0, 3.0) == 0.0
    assert log.busy_s(4.0, 10.0) == 0.0
    assert log.busy_s(2.2, 2.8) == 0.0


def test_busy_partial_overlaps() -> None:
    log = log_of((1.0, 2.0), (3.0, 4.0))
    assert log.busy_s(1.5, 3.25) == pytest.approx(0.5 + 0.25)
    assert log.busy_s(0.0, 1.25) == pytest.approx(0.25)
    assert log.busy_s(3.75, 9.0) == pytest.approx(0.25)
    assert log.busy_s(1.2, 1.7) == pytest.approx(0.5)  # window inside one kernel
    assert log.busy_s(0.0, 10.0) == pytest.approx(2.0)


def test_busy_many_kernels() -> None:
    # 1000 kernels of 2 ms every 5 ms from t = 0: 40 % busy.
    log = log_of(*[(k * 0.005, k * 0.005 + 0.002) for k in range(1000)])
    assert log.busy_s(0.0, 5.0) == pytest.approx(2.0)
    assert log.busy_s(1.0, 2.0) == pytest.approx(0.4)
    assert log.busy_s(1.001, 1.006) == pytest.approx(0.001 + 0.001)
    assert log.total_busy_s == pytest.approx(2.0)
    assert log.last_end_s == pytest.approx(999 * 0.005 + 0.002)


def test_busy_pruning_keeps_the_recent_past() -> None:
    log = BusyLog(keep_s=1.0)
    for k in range(10000):  # 50 s of kernels
        log.add(k * 0.005, k * 0.005 + 0.002)
    end_s = 50.0
    # The last keep_s is exact; what is older may be dropped, but never what is recent.
    assert log.busy_s(end_s - 1.0, end_s) == pytest.approx(0.4)
    assert log.busy_s(end_s - 0.5, end_s) == pytest.approx(0.2)
    assert log.busy_s(0.0, 1.0) <= 0.4 + 1e-9
    assert len(log._starts) < 2000  # pruned, not kept for all 50 s
    assert log.total_busy_s == pytest.approx(20.0)  # the running total is not pruned


def test_complete_until_only_moves_forward() -> None:
    log = BusyLog()
    assert log.complete_until_s == float("-inf")
    log.mark_complete_until(2.0)
    log.mark_complete_until(1.0)
    assert log.complete_until_s == 2.0


def test_idle_means_complete_until_the_next_launch_begins() -> None:
    # With nothing in flight, every window is complete whenever it ends, until a launch begins.
    log = BusyLog()
    log.mark_idle(3.0)
    assert log.complete_until_s == float("inf")
    log.launching(5.0)
    assert log.complete_until_s == 5.0
    log.launching(6.0)  # a second launch while the first is in flight: nothing new is complete
    assert log.complete_until_s == 5.0
    log.mark_complete_until(5.5)
    assert log.complete_until_s == 5.5


# --- Worker on the simulated GPU ---------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    submit_s: float
    start_s: float
    end_s: float
    grid_blocks: int
    quanta: int | None = None  # a lean kernel's length in sleep quanta; None for a burn kernel


class RecordingGpu(SimGpu):
    """The simulated GPU, remembering every kernel it was given (its timeline)."""

    def __init__(self, config: SimConfig, clock: VirtualClock) -> None:
        super().__init__(config, clock)
        self.runs: list[Run] = []

    def run_kernel(self, submit_s: float, grid_blocks: int, quanta: int | None = None) -> tuple[float, float]:
        start_s, end_s = super().run_kernel(submit_s, grid_blocks, quanta)
        self.runs.append(Run(submit_s, start_s, end_s, grid_blocks, quanta))
        return start_s, end_s


@dataclass
class Rig:
    clock: VirtualClock
    gpu: RecordingGpu
    log: BusyLog
    worker: Worker

    def drive(self, until_s: float) -> int:
        """Step the Worker at the times it asks for, up to until_s; returns the number of steps."""
        steps = 0
        t = self.clock.now()
        while t < until_s:
            due = self.worker.step(t)
            assert due > t, f"step({t}) asked to be called again at {due}"
            steps += 1
            t = min(due, until_s)
            self.clock.advance_to(t)
        return steps

    def share(self, a_s: float, b_s: float) -> float:
        return self.gpu.own_busy_s(a_s, b_s) / (b_s - a_s)


def rig(plan: Plan | None = None, sms: int = 132, seed: int = 0, shape: str = "burn",
        gpu_type: type[RecordingGpu] = RecordingGpu) -> Rig:
    clock = VirtualClock()
    gpu = gpu_type(SimConfig(sms=sms, seed=seed), clock)
    log = BusyLog()
    worker = Worker(SimLauncher(gpu, shape), log)
    if plan is not None:
        worker.set_plan(plan)
    return Rig(clock, gpu, log, worker)


def kernel_s(multiplier: int) -> float:
    """The simulated kernel time without jitter: one wave per 8 blocks per SM."""
    return LAUNCH_OVERHEAD_S + WAVE_S * -(-multiplier // 8)


M = 800  # 100 waves: about 10 ms per kernel, the size the PI law aims for
PERIODS = (1 / 6, 1 / 12, 1 / 24)


@pytest.mark.parametrize("period_s", PERIODS)
@pytest.mark.parametrize("duty", [0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95])
def test_busy_share_follows_duty(duty: float, period_s: float) -> None:
    r = rig(Plan(M, duty, period_s=period_s))
    r.drive(6.0)
    assert r.share(1.0, 6.0) == pytest.approx(duty, abs=0.005)
    # Also second by second, not only on average.
    for a in range(1, 6):
        assert r.share(a, a + 1) == pytest.approx(duty, abs=0.01)


@pytest.mark.parametrize("window_s", [1 / 6, 1.0])
@pytest.mark.parametrize("duty", [0.3, 0.5, 0.8])
def test_a_period_that_divides_the_window_gives_every_window_the_same_share(window_s: float, duty: float) -> None:
    # Any window, whatever its phase, holds whole periods, hence whole bursts.
    r = rig(Plan(M, duty, period_s=window_s / max(1, round(window_s * 12 * duty))))
    r.drive(2.0 + 60 * 0.0917 + window_s)
    for k in range(60):
        a = 2.0 + k * 0.0917  # phases all over the period
        assert r.share(a, a + window_s) == pytest.approx(duty, abs=0.015), a


@pytest.mark.parametrize("multiplier", [8, 40, 400, 3200])
def test_busy_share_follows_duty_whatever_the_kernel_size(multiplier: int) -> None:
    r = rig(Plan(multiplier, 0.5))
    r.drive(4.0)
    assert r.share(1.0, 4.0) == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize(("duty", "period_s"), [(0.3, 1 / 6), (0.5, 1 / 6), (0.8, 1 / 12)])
def test_one_wake_up_and_one_launch_call_per_period(duty: float, period_s: float) -> None:
    # What the loop costs in CPU is per wake-up and per launch call: once each per period, not per kernel.
    r = rig(Plan(M, duty, period_s=period_s))
    r.drive(1.0)
    steps = r.drive(6.0)
    calls = {run.submit_s for run in r.gpu.runs if run.submit_s >= 1.0}
    assert steps == pytest.approx(5.0 / period_s, abs=1)
    assert len(calls) == pytest.approx(5.0 / period_s, abs=1)
    assert len(r.gpu.runs) > 2 * len(calls)  # several kernels per call: none longer than the plan's size
    assert max(run.end_s - run.start_s for run in r.gpu.runs if run.submit_s >= 1.0) <= kernel_s(M) * 1.03


def test_a_burst_is_back_to_back_kernels() -> None:
    r = rig(Plan(M, 0.5, period_s=1 / 6))
    r.drive(3.0)
    burst = [run for run in r.gpu.runs if 2.0 <= run.submit_s < 2.0 + 1 / 6]
    assert len(burst) >= 2 and len({run.submit_s for run in burst}) == 1
    assert all(b.start_s == a.end_s for a, b in zip(burst, burst[1:]))
    assert sum(run.end_s - run.start_s for run in burst) == pytest.approx(0.5 / 6, abs=0.002)


def test_busy_log_matches_the_gpu_timeline() -> None:
    r = rig(Plan(M, 0.4))
    r.drive(3.0)
    assert r.log.complete_until_s > 3.0 - r.worker.period_s
    upto = r.log.complete_until_s
    assert r.log.busy_s(0.5, upto) == pytest.approx(r.gpu.own_busy_s(0.5, upto), abs=1e-9)


def test_the_log_is_never_complete_past_a_launch_still_in_flight() -> None:
    r = rig(Plan(M, 0.5, period_s=1 / 6))
    r.drive(2.0)
    for _ in range(30):
        t = r.clock.now()
        in_flight = [run for run in r.gpu.runs if run.end_s > t]
        if in_flight:
            assert r.log.complete_until_s <= min(run.submit_s for run in in_flight)
        r.drive(t + 0.013)
    # Between bursts, once the last one is collected, nothing holds the Monitor back.
    slot_s = r.worker.step(r.clock.now())
    r.drive(slot_s + 0.12)  # past the burst's end: a reading wakes the Worker, which collects it
    r.worker.step(r.clock.now())
    assert r.log.complete_until_s == float("inf")


def test_duty_zero_launches_nothing() -> None:
    r = rig(Plan(M, 0.0))
    steps = r.drive(5.0)
    assert r.gpu.runs == []
    assert steps <= 5 + 1  # it sleeps rather than spins
    assert r.worker.in_flight == 0


def test_idle_plan_after_filling_stops_launching() -> None:
    r = rig(Plan(M, 0.5))
    r.drive(2.0)
    r.worker.set_plan(IDLE_PLAN)
    launched = len(r.gpu.runs)
    r.drive(4.0)
    assert len(r.gpu.runs) == launched
    assert r.share(2.1, 4.0) == 0.0


def queue_limit_s(r: Rig) -> float:
    """queue_s, plus the kernels' jitter and whole waves against what was expected of them (a kernel runs in
    whole waves; the Worker sizes kernels by the seconds per block per SM), plus the launch latency."""
    return r.worker.queue_s * (1 + 0.03) + MAX_KERNELS * WAVE_S + LAUNCH_LATENCY_S


@pytest.mark.parametrize("period_s", [1 / 6, 1 / 12])
@pytest.mark.parametrize("multiplier", [8, 40, 320, 800, 3200])
@pytest.mark.parametrize("duty", [0.3, 0.7, 1.0])
def test_queue_never_holds_more_than_queue_s(multiplier: int, duty: float, period_s: float) -> None:
    r = rig(Plan(multiplier, duty, period_s=period_s))
    r.drive(3.0)
    assert r.gpu.runs
    assert max(run.end_s - run.submit_s for run in r.gpu.runs) <= queue_limit_s(r)


@pytest.mark.parametrize("multiplier", [400, 3200])
def test_queue_bound_holds_right_after_a_multiplier_change(multiplier: int) -> None:
    r = rig(Plan(160, 1.0))
    r.drive(1.0)
    before = len(r.gpu.runs)
    r.worker.set_plan(Plan(multiplier, 1.0))
    r.drive(1.5)
    after = r.gpu.runs[before:]
    assert max(run.end_s - run.submit_s for run in after) <= queue_limit_s(r)


def test_a_burst_longer_than_the_queue_is_queued_in_parts_back_to_back() -> None:
    r = rig(Plan(M, 1.0, period_s=1 / 6))  # 1/6 s of work per period, queue_s = 0.09 s
    r.drive(3.0)
    assert r.share(1.0, 3.0) == pytest.approx(1.0, abs=0.005)  # the GPU never waits on us
    calls = sorted({run.submit_s for run in r.gpu.runs if run.submit_s >= 1.0})
    assert len(calls) == pytest.approx(2 * 2.0 * 6, abs=2)  # two parts per period


@pytest.mark.parametrize("period_s", [1 / 6, 1 / 12])
@pytest.mark.parametrize("offset_s", [0.0, 0.0004, 0.011, 0.037, 0.071, 0.123])
def test_drain_stops_launching_and_ends_within_queue_s(offset_s: float, period_s: float) -> None:
    r = rig(Plan(M, 1.0, period_s=period_s))  # the fullest queue there is
    r.drive(2.0 + offset_s)
    drain_s = r.clock.now()
    launched = len(r.gpu.runs)
    t = drain_s
    for _ in range(100):
        due = r.worker.drain(t)
        if due == t:
            break
        t = due
        r.clock.advance_to(t)
    else:
        pytest.fail("drain() never reported the GPU empty")
    assert len(r.gpu.runs) == launched
    assert r.worker.in_flight == 0
    last_end_s = r.gpu.runs[-1].end_s
    assert last_end_s <= drain_s + queue_limit_s(r)
    assert r.log.last_end_s == pytest.approx(last_end_s)
    assert r.log.complete_until_s >= last_end_s
    # And stepping afterwards launches nothing.
    r.drive(t + 1.0)
    assert len(r.gpu.runs) == launched


def test_filling_again_starts_with_a_burst_at_once() -> None:
    r = rig(Plan(M, 0.5, period_s=1 / 6))
    r.drive(2.0)
    r.worker.set_plan(IDLE_PLAN)
    r.drive(3.05)
    r.worker.set_plan(Plan(M, 0.5, period_s=1 / 6))
    r.drive(4.0)
    assert min(run.submit_s for run in r.gpu.runs if run.submit_s > 3.0) == 3.05
    assert r.share(3.05, 3.05 + 1 / 6) == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("offset_s", [0.01, 0.09, 0.15])
def test_a_new_target_applies_at_once_not_from_the_next_period(offset_s: float) -> None:
    # A boost (0.5 -> 0.8) mid-period: the rest of the period follows the new duty at once, or the window
    # right after the change reads the old duty and the controller's integral winds up on it.
    r = rig(Plan(M, 0.5, period_s=1 / 6))
    r.drive(2.0)
    slot_s = r.worker.step(2.0)  # a burst is due then: change the plan within the period after it
    change_s = slot_s + offset_s
    r.drive(change_s)
    r.worker.set_plan(Plan(M, 0.8, period_s=1 / 12))
    end_s = slot_s + 1 / 6 + 1.0  # the old period, then twelve new ones
    r.drive(end_s + 0.1)
    assert any(run.submit_s == change_s for run in r.gpu.runs)  # topped up at once
    expected_s = 0.5 * offset_s + 0.8 * (1 / 6 - offset_s) + 0.8 * 1.0
    assert r.gpu.own_busy_s(slot_s, end_s) == pytest.approx(expected_s, abs=0.003)


def test_the_integrals_small_steps_wait_for_the_next_period() -> None:
    r = rig(Plan(M, 0.5, period_s=1 / 6))
    r.drive(2.0)
    change_s = r.worker.step(2.0) + 0.05
    r.drive(change_s)
    r.worker.set_plan(Plan(M, 0.51, period_s=1 / 6))
    assert r.worker.step(change_s) > change_s + 0.05  # no wake-up or launch of its own
    assert all(run.submit_s != change_s for run in r.gpu.runs)


def test_a_stall_is_not_caught_up_in_one_flood() -> None:
    r = rig(Plan(M, 0.5, period_s=1 / 12))
    r.drive(2.0)
    r.clock.advance_to(3.0)  # the process was not scheduled for a second
    r.drive(4.5)
    assert max(run.end_s - run.submit_s for run in r.gpu.runs) <= queue_limit_s(r)
    assert r.share(3.0, 3.0 + 1 / 12) <= 0.5 + 0.01
    assert r.share(3.0 + 1 / 12, 4.0 + 1 / 12) == pytest.approx(0.5, abs=0.005)


def test_a_wake_up_a_little_late_keeps_the_grid() -> None:
    r = rig(Plan(M, 0.5, period_s=0.1))
    r.drive(1.0)
    slot_s = r.worker.step(1.0)
    r.clock.advance_to(slot_s + 0.03)
    assert r.worker.step(slot_s + 0.03) == pytest.approx(slot_s + 0.1)  # not 0.13 later


def test_the_first_kernels_are_timed_alone_and_the_burst_follows_in_the_same_period() -> None:
    r = rig(Plan(M, 0.5, period_s=1 / 6))
    r.drive(1 / 6)
    probe, rest = r.gpu.runs[:2], r.gpu.runs[2:]
    assert probe[0].submit_s == probe[1].submit_s  # two: the second, queued, is timed exactly
    assert probe[1].end_s <= rest[0].submit_s  # nothing launched beside kernels of unknown length
    assert r.share(0.0, 1 / 6) == pytest.approx(0.5, abs=0.02)  # no period lost, none doubled


class LateClockLauncher(SimLauncher):
    """Reports a lone kernel as a launcher whose host clock was read late after the launch call would: far
    shorter than it ran (a busy process, its GIL held elsewhere). Bursts of two or more are timed exactly."""

    def poll(self, now_s: float) -> list[Completed]:
        return [Completed(k.end_s - 0.15 * (k.end_s - k.start_s), k.end_s, k.multiplier, k.count) if k.count == 1
                else k for k in super().poll(now_s)]


def test_a_lone_kernel_read_short_does_not_shrink_the_measured_rate() -> None:
    # Learning from it made the next bursts six times longer than queue_s (seen with 8 GPUs in one process).
    clock = VirtualClock()
    gpu = RecordingGpu(SimConfig(), clock)
    worker = Worker(LateClockLauncher(gpu, "burn"), BusyLog())
    worker.set_plan(Plan(M, 0.03, period_s=1 / 6))  # 5-ms bursts: one kernel each
    r = Rig(clock, gpu, worker.busy_log, worker)
    r.drive(3.0)
    assert worker.launch_s == pytest.approx(kernel_s(M), rel=0.03)
    assert max(run.end_s - run.submit_s for run in gpu.runs) <= queue_limit_s(r)


@pytest.mark.parametrize(("multiplier", "gap_s"), [(160, 0.005), (400, 0.005), (160, 0.01), (40, 0.003)])
def test_gap_mode_util_is_kernel_over_kernel_plus_gap(multiplier: int, gap_s: float) -> None:
    r = rig(Plan(multiplier, duty_ratio=1.0, gap_s=gap_s))
    r.drive(4.0)
    k = kernel_s(multiplier)
    assert r.share(1.0, 4.0) == pytest.approx(k / (k + gap_s), abs=0.01)
    # One kernel at a time, each submitted at least gap_s after the previous one ended.
    runs = [run for run in r.gpu.runs if run.submit_s > 0.5]
    assert all(b.submit_s >= a.end_s + gap_s - 1e-12 for a, b in zip(runs, runs[1:]))


def test_gap_mode_with_duty_zero_launches_nothing() -> None:
    r = rig(Plan(M, duty_ratio=0.0, gap_s=0.005))
    r.drive(2.0)
    assert r.gpu.runs == []


class FailingLauncher:
    sm_count = 132

    def __init__(self, error: Exception, on: str) -> None:
        self.error = error
        self.on = on

    def launch(self, multiplier: int, now_s: float, count: int = 1) -> None:
        if self.on == "launch":
            raise self.error

    def poll(self, now_s: float) -> list[Completed]:
        if self.on == "poll":
            raise self.error
        return []

    def close(self) -> None:
        pass


@pytest.mark.parametrize("plan", [Plan(M, 0.5), Plan(M, 1.0, gap_s=0.005)])
def test_launch_raising_becomes_gpu_failed(plan: Plan) -> None:
    worker = Worker(FailingLauncher(RuntimeError("CUDA_ERROR_LAUNCH_FAILED"), "launch"), BusyLog())
    worker.set_plan(plan)
    with pytest.raises(GpuFailedError, match="CUDA_ERROR_LAUNCH_FAILED") as info:
        t = 0.0
        for _ in range(100):
            t = worker.step(t)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_poll_raising_becomes_gpu_failed() -> None:
    worker = Worker(FailingLauncher(RuntimeError("an illegal memory access"), "poll"), BusyLog())
    with pytest.raises(GpuFailedError, match="illegal memory access"):
        worker.step(0.0)


def test_gpu_failed_from_the_launcher_passes_through() -> None:
    error = GpuFailedError("GPU is lost")
    worker = Worker(FailingLauncher(error, "launch"), BusyLog())
    worker.set_plan(Plan(M, 1.0))
    with pytest.raises(GpuFailedError) as info:
        t = 0.0
        for _ in range(100):
            t = worker.step(t)
    assert info.value is error


def test_launch_s_is_the_measured_length_of_a_kernel_at_the_plans_multiplier() -> None:
    r = rig(Plan(800, 0.5))
    assert r.worker.launch_s is None
    r.drive(1.0)
    assert r.worker.launch_s == pytest.approx(kernel_s(800), rel=0.02)
    # Learned per block per SM, so a new multiplier needs no new measurement.
    r.worker.set_plan(Plan(400, 0.5))
    assert r.worker.launch_s == pytest.approx(kernel_s(400), rel=0.03)
    r.drive(2.0)
    assert r.worker.launch_s == pytest.approx(kernel_s(400), rel=0.03)


class LateAnchorLauncher(SimLauncher):
    """Reports kernels as a launcher whose event timeline is anchored `late_s` late would: shifted later, and
    the end capped at the poll's `now_s` (the start not), so a kernel that just ended can read as negative."""

    def __init__(self, gpu: SimGpu, late_s: float) -> None:
        super().__init__(gpu, "burn")
        self.late_s = late_s

    def poll(self, now_s: float) -> list[Completed]:
        return [Completed(k.start_s + self.late_s, min(k.end_s + self.late_s, now_s), k.multiplier, k.count)
                for k in super().poll(now_s)]


@pytest.mark.parametrize("multiplier", [1, 4, 16])
def test_a_kernel_measured_with_a_negative_duration_does_not_stall_the_worker(multiplier: int) -> None:
    clock = VirtualClock()
    gpu = RecordingGpu(SimConfig(), clock)
    worker = Worker(LateAnchorLauncher(gpu, late_s=0.002), BusyLog())
    worker.set_plan(Plan(multiplier, 0.5))
    r = Rig(clock, gpu, worker.busy_log, worker)
    r.drive(1.0)
    assert worker.launch_s is None or worker.launch_s > 0
    assert all(end_s >= start_s for start_s, end_s in zip(worker.busy_log._starts, worker.busy_log._ends))
    launched = len(gpu.runs)
    r.drive(2.0)
    assert len(gpu.runs) > launched + 10  # still launching


# --- quick successions of stops and starts, and of limits ---------------------------------------------------------

def peak_share(r: Rig, from_s: float, to_s: float) -> float:
    """Our largest busy share over any second in [from_s, to_s] (sliding by a millisecond)."""
    return max(r.share(from_s + i * 0.001, from_s + i * 0.001 + 1.0) for i in range(round((to_s - from_s - 1) * 1000)))


@pytest.mark.parametrize("gap_s", [0.003, 0.01, 0.05, 0.1])
@pytest.mark.parametrize("period_s", [1 / 6, 1 / 12])
def test_a_storm_of_stops_and_starts_never_runs_more_than_the_duty(gap_s: float, period_s: float) -> None:
    # A pause and an unpause by turns (a signal storm, holds, short yields): a start does not burst at once.
    plan = Plan(M, 0.5, period_s=period_s)
    r = rig(plan)
    r.drive(1.0)
    t, filling = 1.0, True
    while t < 5.0:
        t += gap_s
        filling = not filling
        r.worker.set_plan(plan if filling else IDLE_PLAN)
        r.drive(t)
    assert peak_share(r, 1.0, 5.0) <= 0.5 + 0.005
    assert r.worker.launch_s == pytest.approx(kernel_s(M), rel=0.03)  # still the filling plan's size


def test_a_start_soon_after_a_stop_waits_for_the_grid_then_starts_it_afresh() -> None:
    r = rig(Plan(M, 0.5, period_s=0.1))
    r.drive(1.0)
    slot_s = r.worker.step(1.0)
    r.drive(slot_s + 0.01)
    r.worker.set_plan(IDLE_PLAN)
    r.drive(slot_s + 0.02)
    r.worker.set_plan(Plan(M, 0.5, period_s=0.1))
    assert r.worker.step(slot_s + 0.02) == pytest.approx(slot_s + 0.1)  # nothing more this period
    r.clock.advance_to(slot_s + 0.13)  # woken late: this burst starts the grid afresh
    assert r.worker.step(slot_s + 0.13) == pytest.approx(slot_s + 0.23)


def test_a_limit_changing_at_every_step_never_runs_more_than_the_higher_duty() -> None:
    # The power cap's limit moving each poll: each change retargets the period's rest, never more.
    r = rig(Plan(M, 0.6, period_s=1 / 12))
    r.drive(1.0)
    t, high = 1.0, True
    while t < 5.0:
        t += 0.01
        high = not high
        r.worker.set_plan(Plan(M, 0.6 if high else 0.3, period_s=1 / 12))
        r.drive(t)
    assert peak_share(r, 1.0, 5.0) <= 0.6 + 0.005


# --- the lean kernel: its length is its sleep loop, which nanosleep does not promise ------------------------------

LEAN_M = 1000  # quanta: about 12 ms per kernel on the simulated GPU (its sleeps last SLEEP_RATIO of their request)


def lean_kernel_s(quanta: int, ratio: float = SLEEP_RATIO) -> float:
    return LAUNCH_OVERHEAD_S + quanta * SLEEP_QUANTUM_S * ratio


class NanosleepGpu(RecordingGpu):
    """Sleeps as nanosleep promises no better: each quantum between 0 and twice RATIO x its request (a mean of RATIO
    of it, 1.7 here, which nothing tells the Worker), so a kernel's length is the sum of its quanta's."""

    RATIO = 1.7

    def kernel_s(self, grid_blocks: int, quanta: int | None = None) -> float:
        if quanta is None:
            return super().kernel_s(grid_blocks)
        # The sum of `quanta` uniform draws on [0, 2 RATIO q]: mean quanta RATIO q, variance quanta (RATIO q)^2 / 3.
        mean_s = quanta * self.RATIO * SLEEP_QUANTUM_S
        return LAUNCH_OVERHEAD_S + max(self._rng.gauss(mean_s, self.RATIO * SLEEP_QUANTUM_S * (quanta / 3) ** 0.5),
                                       0.0)


@pytest.mark.parametrize("gpu_type", [RecordingGpu, NanosleepGpu])
@pytest.mark.parametrize("period_s", PERIODS)
@pytest.mark.parametrize("duty", [0.1, 0.3, 0.5, 0.8, 0.95])
def test_busy_share_follows_duty_with_the_lean_kernel(duty: float, period_s: float,
                                                       gpu_type: type[RecordingGpu]) -> None:
    r = rig(Plan(LEAN_M, duty, period_s=period_s), shape="lean", gpu_type=gpu_type)
    r.drive(6.0)
    assert r.share(1.0, 6.0) == pytest.approx(duty, abs=0.005)
    for a in range(1, 6):
        assert r.share(a, a + 1) == pytest.approx(duty, abs=0.01)
    assert {run.grid_blocks for run in r.gpu.runs} == {1}  # one warp, whatever the length
    assert max(run.end_s - run.submit_s for run in r.gpu.runs) <= r.worker.queue_s * 1.05 + LAUNCH_LATENCY_S


@pytest.mark.parametrize(("gpu_type", "ratio"), [(RecordingGpu, SLEEP_RATIO), (NanosleepGpu, NanosleepGpu.RATIO)])
def test_the_worker_learns_what_a_sleep_quantum_really_lasts(gpu_type: type[RecordingGpu], ratio: float) -> None:
    r = rig(Plan(LEAN_M, 0.5), shape="lean", gpu_type=gpu_type)
    assert r.worker.launch_s is None
    r.drive(2.0)
    assert r.worker.launch_s == pytest.approx(lean_kernel_s(LEAN_M, ratio), rel=0.03)  # not the requested 10 ms
    r.worker.set_plan(Plan(LEAN_M // 2, 0.5))  # per quantum, so a new length needs no new measurement
    assert r.worker.launch_s == pytest.approx(lean_kernel_s(LEAN_M // 2, ratio), rel=0.03)


@pytest.mark.parametrize("offset_s", [0.0, 0.011, 0.071])
def test_a_drain_of_lean_kernels_ends_within_queue_s(offset_s: float) -> None:
    r = rig(Plan(LEAN_M, 1.0, period_s=1 / 6), shape="lean", gpu_type=NanosleepGpu)  # the fullest queue
    r.drive(2.0 + offset_s)
    drain_s = t = r.clock.now()
    while (due := r.worker.drain(t)) != t:
        t = due
        r.clock.advance_to(t)
    assert r.worker.in_flight == 0
    assert r.gpu.runs[-1].end_s <= drain_s + r.worker.queue_s * 1.05 + LAUNCH_LATENCY_S


def test_the_lean_kernel_for_sm_activity_is_one_warp_on_every_sm() -> None:
    clock = VirtualClock()
    gpu = RecordingGpu(SimConfig(sms=114), clock)
    worker = Worker(SimLauncher(gpu, "lean", "sm_activity"), BusyLog())
    worker.set_plan(Plan(LEAN_M, 0.5))
    Rig(clock, gpu, worker.busy_log, worker).drive(1.0)
    assert {run.grid_blocks for run in gpu.runs} == {114}
    assert {run.quanta for run in gpu.runs} >= {LEAN_M}
