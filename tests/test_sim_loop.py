"""The whole loop (real Monitor, controller, policy, logging) on the simulated GPU, in virtual time.

These are the acceptance numbers of the filler: settle, track, yield, stay idle, resume.
"""

from __future__ import annotations

import pytest

from forge_load.control.scoring import one_second_readings, tracking
from forge_load.control.worker import QUEUE_S
from tests.simrun import simulate

WINDOWS_S = (1 / 6, 0.25, 0.5, 1.0)
TARGETS = (0.2, 0.35, 0.5, 0.65, 0.8, 0.9)


def assert_tracks(run_gpu, target: float, start_s: float, end_s: float) -> None:
    """The acceptance numbers over 1-s readings: settled within 2 s, then a mean absolute error of at most
    0.01 and a 95th percentile of at most 0.03."""
    samples = run_gpu.samples(start_s, end_s)
    result = tracking(samples, target, start_s, end_s)
    readings = one_second_readings(samples, start_s, end_s)
    assert result.settle_s is not None and result.settle_s <= 2.0, (result, readings[:8])
    assert result.mae_ratio <= 0.01 and result.p95_error_ratio <= 0.03, (result, readings)
    assert result.seconds >= (end_s - start_s) - 3


@pytest.mark.parametrize("window_s", WINDOWS_S, ids=lambda w: f"window{w:.3f}")
@pytest.mark.parametrize("target", TARGETS)
def test_holds_target_for_every_window_and_target(window_s: float, target: float) -> None:
    scenario = simulate(f"--duration 40 --target {target} --sim-window {window_s} --boost-after 0")
    assert_tracks(scenario.run.gpu, target, 0.0, 40.0)


@pytest.mark.parametrize("sms", (16, 132, 528))
def test_holds_target_whatever_the_sm_count(sms: int) -> None:
    scenario = simulate(f"--duration 30 --target 0.5 --sim-sms {sms}")
    assert_tracks(scenario.run.gpu, 0.5, 0.0, 30.0)


@pytest.mark.parametrize("window_s", (1 / 6, 1.0), ids=("window1/6", "window1"))
@pytest.mark.parametrize("how", ("visible", "hidden", "no-process-list"))
def test_yields_within_half_a_second_stays_idle_and_resumes(window_s: float, how: str) -> None:
    flags = {"visible": "", "hidden": "--sim-hide-foreign", "no-process-list": "--no-process-list"}[how]
    start_s, end_s, resume_after_s = 20.0, 35.0, 10.0
    scenario = simulate(f"--duration 80 --sim-window {window_s} --sim-foreign {start_s:g}-{end_s:g} "
                        f"--resume-after {resume_after_s:g} {flags}")
    gpu = scenario.run.gpu
    yielded = scenario.first("yield")
    assert start_s <= yielded["t"] <= start_s + 0.5
    if how != "visible":
        assert "process" not in yielded["signals"]
    drained = scenario.first("drained")
    assert drained["last_kernel_end_t"] - start_s <= 0.5
    # From the signal to our last kernel's end: no more than was queued (the Worker's queue limit, 90 ms).
    assert drained["last_kernel_end_t"] - yielded["t"] <= QUEUE_S + 0.001 <= 0.1
    # Nothing of ours runs from the drain until the job has ended.
    assert gpu.own_busy_s(drained["last_kernel_end_t"] + 1e-6, end_s) == 0.0
    resumed = scenario.first("resume")
    assert resumed["t"] >= end_s + resume_after_s
    assert resumed["t"] <= end_s + resume_after_s + 2.5  # the last foreign sample plus the wait
    assert len(scenario.of("yield")) == 1
    assert_tracks(gpu, 0.5, resumed["t"], 80.0)


def test_hidden_job_without_memory_is_caught_by_utilization() -> None:
    scenario = simulate("--duration 40 --sim-foreign 10-20 --sim-hide-foreign --sim-foreign-mem 0 "
                        "--sim-foreign-load 0.6 --resume-after 5")
    yielded = scenario.first("yield")
    assert yielded["signals"] == "utilization"
    assert 10.0 <= yielded["t"] <= 11.0  # two 1/6-s samples past the start, and the poll after
    assert scenario.run.gpu.own_busy_s(scenario.first("drained")["last_kernel_end_t"] + 1e-6, 20.0) == 0.0
    assert scenario.first("resume")["t"] >= 25.0


def test_starts_yielding_when_a_job_is_already_there() -> None:
    scenario = simulate("--duration 20 --sim-foreign 0-10 --resume-after 3")
    start = scenario.first("start")
    assert scenario.events[1]["event"] == "yield" and scenario.events[1]["t"] == 0.0, scenario.events[:3]
    assert start["state"] == "filling"
    assert scenario.run.gpu.own_busy_s(0.0, 10.0) == 0.0
    assert scenario.first("resume")["t"] >= 13.0


def test_boosts_after_a_quiet_spell_and_holds_the_boost_target() -> None:
    scenario = simulate("--duration 60 --boost-after 20 --boost-target 0.7")
    boost = scenario.first("boost")
    assert 20.0 <= boost["t"] <= 20.2
    assert_tracks(scenario.run.gpu, 0.7, boost["t"], 60.0)


def test_a_job_ends_the_boost() -> None:
    scenario = simulate("--duration 60 --boost-after 10 --sim-foreign 20-25 --resume-after 5")
    changes = [e for e in scenario.events if e["event"] in ("boost", "yield", "resume")]
    assert [e["event"] for e in changes] == ["boost", "yield", "resume", "boost"]
    assert changes[2]["state"] == "filling"
    assert changes[3]["t"] >= 25.0 + 10.0  # the quiet spell counts from the job's end


def test_legacy_law_runs_the_same_scenarios() -> None:
    scenario = simulate("--duration 120 --controller legacy --sim-foreign 60-70 --resume-after 5")
    gpu = scenario.run.gpu
    assert scenario.first("start")["controller"] == "legacy"
    assert gpu.own_busy_s(0.0, 60.0) > 0.0
    assert 60.0 <= scenario.first("yield")["t"] <= 60.5
    assert gpu.own_busy_s(scenario.first("drained")["last_kernel_end_t"] + 1e-6, 70.0) == 0.0
    assert scenario.first("resume")["t"] >= 75.0


def test_status_lines_carry_the_documented_fields() -> None:
    scenario = simulate("--duration 10 --log-interval 2")
    statuses = scenario.of("status")
    assert [s["t"] for s in statuses] == [2.0, 4.0, 6.0, 8.0]
    for line in statuses:
        for key in ("t", "event", "state", "target", "util", "own", "foreign", "multiplier", "gpu_mem_mib"):
            assert key in line
        assert abs(line["util"] - 0.5) <= 0.02
    assert scenario.events[-1]["event"] == "stop"


def test_same_seed_same_run() -> None:
    first = simulate("--duration 15 --sim-foreign 5-8 --resume-after 2 --sim-seed 7")
    again = simulate("--duration 15 --sim-foreign 5-8 --resume-after 2 --sim-seed 7")
    strip = lambda events: [{k: v for k, v in e.items() if k not in ("wall_time", "ts")} for e in events]  # noqa: E731
    assert strip(first.events) == strip(again.events)


# --- wake-ups ---------------------------------------------------------------------------------------------------

def test_a_foreign_context_is_yielded_to_at_the_poll_that_sees_it_on_memory_and_processes() -> None:
    """The GPU's loop is no longer woken by every reading, but a reading whose verdict changes wakes it at once:
    the yield line is at the first poll after the job's context appears, and both signals fired."""
    scenario = simulate("--duration 30 --sim-foreign 20.03-25 --resume-after 5")
    yielded = scenario.first("yield")
    assert 20.03 <= float(yielded["t"]) <= 20.03 + 0.1 + 1e-9  # type: ignore[arg-type]
    assert {"process", "memory"} <= set(str(yielded["signals"]).split(","))


def test_while_filling_the_loop_wakes_for_its_bursts_not_for_every_poll() -> None:
    """At 0.5 a burst is due 6 times a second and the Monitor polls 10 times: the loop steps about as often as the
    bursts (plus status lines), not once per poll on top; every sample still reaches the controller once."""
    import io

    from forge_load.config.load import load_config
    from forge_load.service.loop import run_simulated
    from forge_load.service.runtime import Runtime

    config = load_config("--simulate --sim-speed 0 --log-format json --duration 20 --target 0.5".split(), env={})
    steps: list[float] = []
    taken: list[float] = []

    def wrap(rt: Runtime) -> None:
        step, take = rt.filler.step, rt.monitor.take

        def counted_step(now_s: float) -> float:
            steps.append(now_s)
            return step(now_s)

        def counted_take():  # type: ignore[no-untyped-def]
            reading = take()
            if reading is not None and reading.seq != getattr(counted_take, "seq", None):
                counted_take.seq = reading.seq  # type: ignore[attr-defined]
                taken.extend(s.t_s for s in reading.samples)
            return reading

        rt.filler.step = counted_step  # type: ignore[method-assign]
        rt.monitor.take = counted_take  # type: ignore[method-assign]

    run = run_simulated(config, io.StringIO(), keep_history=True, on_start=wrap)
    steady = [t for t in steps if 5.0 <= t < 20.0]
    assert len(steady) <= 15 * 8, len(steady)  # ~6 bursts a second and status lines, not 16 steps a second
    assert len(taken) == len(set(taken))  # no sample twice
    assert sorted(taken) == taken and len([t for t in taken if 5.0 <= t < 19.5]) >= 14.5 * 6 - 1  # none lost
    assert_tracks(run.gpu, 0.5, 5.0, 20.0)


def test_one_loop_steps_every_gpu_thread_and_says_why_it_ended() -> None:
    # The filler's loop and the exclusive-mode supervisor's were two copies of the same loop, each deciding "duration
    # reached" or the stop's reason on its own: runtime.run_steps is both.
    import threading

    from forge_load.gpu.clocks import VirtualLoopClock
    from forge_load.gpu.sim import VirtualClock
    from forge_load.service import exclusive, loop
    from forge_load.service.runtime import StopEvent, run_steps

    assert exclusive.run_steps is loop.run_steps is run_steps
    clock = VirtualLoopClock(VirtualClock(), speed=0.0)
    steps: list[float] = []

    def step(now_s: float) -> float:
        steps.append(now_s)
        return now_s + 0.5

    assert run_steps(clock, threading.Event(), threading.Event(), 2.0, step) == "duration reached"
    assert steps == [0.0, 0.5, 1.0, 1.5]
    stop = StopEvent()
    stop.request("signal SIGTERM")
    assert run_steps(clock, stop, threading.Event(), 9.0, step) == "signal SIGTERM"
    assert run_steps(clock, threading.Event(), threading.Event(), 9.0, step, done=lambda: clock.now() >= 3.0) is None
    assert clock.now() == 3.0
