"""Quick successions of stop-filling/start-filling on the simulated GPU, in virtual time: whatever the transitions,
our busy share over any second stays within the plan's duty (under the power cap's limit), and a stop still acts
at once.

The storms: SIGUSR1/SIGUSR2 by turns every 10 ms (and with a pause file there: every pause acts at the step it is
seen, and the log coalesces the lines); a hold placed and released by turns at every 10-ms poll; the signal storm
again under FORGE_MAX_POWER_W; short jobs resumed from 50 ms after each."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from forge_load.config.load import load_config
from forge_load.control.filler import Controls
from forge_load.control.worker import QUEUE_S
from forge_load.gpu.sim import IDLE_POWER_W, MAX_POWER_W, SimGpu
from forge_load.service.loop import open_simulated
from forge_load.service.runtime import log_stop
from forge_load.steering import holds
from forge_load.steering.pause import PauseSwitch
from tests.simrun import drive_storm, simulate

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
        """The largest 1-s mean board power the simulated GPU reports (no foreign job: ours alone; the burn shape's
        kernels draw the board's limit while they run)."""
        return IDLE_POWER_W + (MAX_POWER_W - IDLE_POWER_W) * self.peak_share()


def storm(flags: str, env: dict[str, str], toggle: Callable[[PauseSwitch, int], None]) -> Storm:
    """Step the loop every 10 ms for STORM_S; `toggle(switch, i)` stops filling at odd steps, starts at even ones.
    At each step that stopped filling: no launch, and what was queued ends within QUEUE_S."""
    config = load_config(f"--simulate --log-format json --log-interval 5 {flags}".split(), env)
    switch = PauseSwitch()
    run = open_simulated(config, io.StringIO(), keep_history=True, controls=Controls(switch), wall_start_s=0.0)
    rt = run.runtime
    most_duty, stops, launched = 0.0, 0, 0

    def act(i: int, _now_s: float) -> None:
        nonlocal launched
        toggle(switch, i)
        launched = len(run.gpu._ends)

    def check(i: int, now_s: float) -> None:
        nonlocal most_duty, stops
        most_duty = max(most_duty, rt.worker.plan.duty_ratio)
        if i % 2 == 1 and rt.filler.state.value in ("paused", "held"):
            stops += 1
            assert rt.worker.plan.duty_ratio == 0 and len(run.gpu._ends) == launched, f"launched at {now_s:.2f} s"
            assert not launched or run.gpu._ends[-1] <= now_s + QUEUE_S + 1e-3, f"queued past {now_s:.2f} s"

    drive_storm(run, STORM_S, STEP_S, act, check)
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


@pytest.mark.parametrize("pause_file", [True, False], ids=["pause file there", "no pause file"])
def test_a_signal_storm_pauses_at_once_and_coalesces_its_lines(tmp_path: Path, pause_file: bool) -> None:
    """SIGUSR1 and SIGUSR2 by turns every 10 ms for 20 virtual seconds (as a `while true; do docker kill -s USR1
    ...; docker kill -s USR2 ...; done` would): every pause takes effect at the step it is seen, the log holds about
    a pause line a second, and its last pause line says the state the storm left."""
    path = tmp_path / "pause"
    if pause_file:
        path.touch()
    config = load_config(["--simulate", "--log-format", "json", "--log-interval", "5", "--pause-file", str(path)], {})
    switch = PauseSwitch()
    out = io.StringIO()
    run = open_simulated(config, out, controls=Controls(switch))
    rt, clock = run.runtime, run.clock
    storm_s = 20.0

    def check(_i: int, now_s: float) -> None:
        paused = pause_file or switch.by is not None
        assert (rt.filler.state.value == "paused") == paused, (now_s, rt.filler.state)
        if paused:
            assert rt.worker.plan.duty_ratio == 0, f"still launching at {now_s:.2f} s while paused"

    drive_storm(run, storm_s, STEP_S, lambda i, _now_s: signals(switch, i), check)
    switch.set(True, "SIGUSR1")  # the storm ends paused by the signal (and the file, where there is one)
    end_s = storm_s + 0.05
    clock.advance_to(end_s)
    rt.filler.step(end_s)
    assert rt.worker.plan.duty_ratio == 0
    while rt.worker.in_flight:
        clock.advance_to(rt.worker.drain(clock.now()))
    log_stop(rt, clock.now(), "signal SIGTERM")
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    changes = [e for e in events if e["event"] in ("pause", "unpause")]
    assert len(changes) <= storm_s + 3, f"{len(changes)} pause lines in {storm_s:g} s"
    assert len(events) <= 2 * storm_s + 10, f"{len(events)} lines in {storm_s:g} s"
    assert sum(int(e.get("coalesced", 0)) for e in changes) > 1000  # the lines say how many changes they stand for
    last = changes[-1]
    assert last["event"] == "pause" and last["state"] == "paused", last
    assert last["reason"].startswith("SIGUSR1 (SIGUSR2 resumes)"), last
    assert ("pause file" in last["reason"]) == pause_file, last
    assert events[-1]["event"] == "stop" and events[-1]["state"] == "paused"


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
    s = storm("--target 0.8 --shape burn", {"FORGE_MAX_POWER_W": "400"}, signals)  # burn: where a cap binds
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
