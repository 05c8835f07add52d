"""Quick successions of stop-filling/start-filling on the simulated GPU, in virtual time: whatever the transitions,
our busy share over any second stays within the plan's duty (under the power cap's limit), and a stop still acts
at once.

The storms: SIGUSR1/SIGUSR2 by turns every 10 ms; a hold placed and released by turns at every 10-ms poll; the
signal storm again under FORGE_MAX_POWER_W; short jobs resumed from 50 ms after each."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from forge_load.config.load import load_config
from forge_load.control.worker import QUEUE_S
from forge_load.gpu.sim import IDLE_POWER_W, MAX_POWER_W, SimGpu
from forge_load.operators import holds
from forge_load.operators.pause import PauseSwitch
from forge_load.service.loop import open_simulated
from forge_load.service.runtime import Controls, log_start
from tests.simrun import simulate

UUID = "GPU-51a00000-0000-4000-8000-000000000000"  # the simulated GPU 0, seed 0
STEP_S = 0.01
STORM_S = 12.0


@dataclass
class Storm:
    gpu: SimGpu
    most_duty: float  # the largest duty any plan gave the Worker during the storm
    stops: int

    def share(self, a_s: float) -> float:
        return self.gpu.own_busy_s(a_s, a_s + 1.0)

    def peak_share(self) -> float:
        """Our largest busy share over any second of the storm (sliding by 10 ms)."""
        return max(self.share(i * STEP_S) for i in range(int((STORM_S - 1.0) / STEP_S) + 1))

    def longest_kernel_s(self) -> float:
        return max(end_s - start_s for start_s, end_s in zip(self.gpu._starts, self.gpu._ends))

    def peak_power_w(self) -> float:
        """The largest 1-s mean board power the simulated GPU reports (no foreign job: ours alone)."""
        return IDLE_POWER_W + (MAX_POWER_W - IDLE_POWER_W) * self.peak_share()


def storm(flags: str, env: dict[str, str], toggle: Callable[[PauseSwitch, int], None]) -> Storm:
    """Step the loop every 10 ms for STORM_S; `toggle(switch, i)` stops filling at odd steps, starts at even ones.
    At each step that stopped filling: no launch, and what was queued ends within QUEUE_S."""
    config = load_config(f"--simulate --log-format json --log-interval 5 {flags}".split(), env)
    switch = PauseSwitch()
    run = open_simulated(config, io.StringIO(), keep_history=True, controls=Controls(switch), wall_start_s=0.0)
    rt, clock = run.runtime, run.clock
    log_start(rt, {})
    monitor_due_s = rt.monitor.step(0.0)
    most_duty, stops = 0.0, 0
    for i in range(1, round(STORM_S / STEP_S) + 1):
        now_s = i * STEP_S
        clock.advance_to(now_s)
        if monitor_due_s <= now_s:
            monitor_due_s = rt.monitor.step(now_s)
        toggle(switch, i)
        launched = len(run.gpu._ends)
        rt.filler.step(now_s)
        most_duty = max(most_duty, rt.worker.plan.duty_ratio)
        if i % 2 == 1 and rt.filler.state.value in ("paused", "held"):
            stops += 1
            assert rt.worker.plan.duty_ratio == 0 and len(run.gpu._ends) == launched, f"launched at {now_s:.2f} s"
            assert not launched or run.gpu._ends[-1] <= now_s + QUEUE_S + 1e-3, f"queued past {now_s:.2f} s"
    return Storm(run.gpu, most_duty, stops)


def signals(switch: PauseSwitch, i: int) -> None:
    switch.set(i % 2 == 1, "SIGUSR1" if i % 2 == 1 else "SIGUSR2")


@pytest.mark.parametrize("target", [0.5, 0.8])
def test_a_signal_storm_never_runs_more_than_the_duty(target: float) -> None:
    s = storm(f"--target {target}", {}, signals)
    assert s.stops == STORM_S / STEP_S / 2
    assert 0 < s.most_duty <= target + 0.05
    assert s.peak_share() <= s.most_duty + 0.01, (s.peak_share(), s.most_duty)
    # Each start sizes kernels as the steady state does (PI's 10-ms slice, within its dead band).
    assert s.longest_kernel_s() <= 0.015, s.longest_kernel_s()


def test_a_hold_release_storm_never_runs_more_than_the_duty(tmp_path: Path) -> None:
    def hold(_switch: PauseSwitch, i: int) -> None:
        if i % 2 == 1:
            holds.place(str(tmp_path), holds.Hold(UUID, "slurm-42", "job 42", i * STEP_S))
        else:
            holds.release(str(tmp_path), UUID, "slurm-42")

    s = storm(f"--target 0.5 --poll-interval {STEP_S} --hold-dir {tmp_path}", {}, hold)
    assert s.stops == STORM_S / STEP_S / 2
    assert 0 < s.most_duty <= 0.55
    assert s.peak_share() <= s.most_duty + 0.01, (s.peak_share(), s.most_duty)


def test_a_power_capped_signal_storm_stays_under_the_cap() -> None:
    s = storm("--target 0.8", {"FORGE_MAX_POWER_W": "400"}, signals)
    assert 0 < s.most_duty < 0.8  # the cap's limit, not the target, sets the duty
    assert s.peak_share() <= s.most_duty + 0.01, (s.peak_share(), s.most_duty)
    assert s.peak_power_w() <= 400.0, s.peak_power_w()


def test_a_storm_of_short_yields_never_runs_more_than_the_target() -> None:
    """Thirty 50-ms jobs 0.3 s apart, seen at 10-ms polls and resumed from 50 ms after each: every resume is a
    start."""
    jobs = ",".join(f"{2 + 0.3 * k:.2f}-{2.05 + 0.3 * k:.2f}" for k in range(30))
    s = simulate(f"--duration 14 --target 0.5 --poll-interval 0.01 --resume-after 0.05 --sim-foreign {jobs}")
    assert len(s.of("yield")) == 30
    peak = max(s.run.gpu.own_busy_s(i * STEP_S, i * STEP_S + 1.0) for i in range(150, 1200))
    assert peak <= 0.5 + 0.01, peak
