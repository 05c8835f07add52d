"""What an operator steers, on the simulated GPU in virtual time: the power cap, the energy counter, and every
pause route (the pause file, the active hours, SIGUSR1/SIGUSR2's switch), judged by the model's own record."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from forge_load.config.load import load_config
from forge_load.control.filler import NO_CONTROLS, Controls
from forge_load.control.powercap import MARGIN_RATIO
from forge_load.gpu.sim import CONTEXT_POWER_W, IDLE_POWER_W, LIGHT_SM_W, MAX_POWER_W, SimGpu, SimProbe
from forge_load.service.loop import SimRun, run_simulated
from forge_load.service.runtime import Runtime
from forge_load.steering.pause import PauseSwitch

BERLIN = ZoneInfo("Europe/Berlin")
SPAN_W = MAX_POWER_W - IDLE_POWER_W
AIM_RATIO = 1.0 - MARGIN_RATIO  # the cap aims this share of its watts


@dataclass
class Run:
    run: SimRun
    events: list[dict[str, object]]

    @property
    def gpu(self) -> SimGpu:
        return self.run.gpu

    @property
    def rt(self) -> Runtime:
        return self.run.runtime

    def of(self, event: str) -> list[dict[str, object]]:
        return [e for e in self.events if e["event"] == event]

    def t(self, event: str, index: int = 0) -> float:
        found = self.of(event)
        assert len(found) > index, f"no {event!r} #{index} in {[(e['event'], e['t']) for e in self.events]}"
        return float(found[index]["t"])  # type: ignore[arg-type]

    def kernel_starts(self, a_s: float, b_s: float) -> list[float]:
        return [s for s in self.gpu._starts if a_s <= s < b_s]

    def power_1s(self, t_s: float) -> float:
        """The model's board power at t: its 1-s mean, as its NVML reports it."""
        return self.gpu.energy_in_j(t_s - 1.0, t_s)


def simulate(flags: str, env: dict[str, str] | None = None, at: dict[float, Callable[[], None]] | None = None,
             controls: Controls = NO_CONTROLS, wall_start_s: float | None = None) -> Run:
    """Run the filler in virtual time; `at` maps virtual seconds to actions taken at the first heartbeat (about
    once a virtual second) at or after them."""
    config = load_config(f"--simulate --sim-speed 0 --log-format json {flags}".split(), env=env or {})
    out = io.StringIO()
    pending = dict(sorted((at or {}).items()))
    runtime: list[Runtime] = []

    def beat() -> None:
        now_s = runtime[0].now()
        for t_s in [t for t in pending if t <= now_s]:
            pending.pop(t_s)()

    run = run_simulated(config, out, heartbeat=beat, on_start=runtime.append, keep_history=True,
                        controls=controls, wall_start_s=wall_start_s)
    assert not pending, f"actions never taken: {list(pending)}"
    return Run(run, [json.loads(line) for line in out.getvalue().splitlines()])


# --- the power cap: with the burn shape (the lean one's few watts never reach a cap above the context's idle) -----


def test_the_cap_holds_board_power_binds_and_is_released() -> None:
    # 0.4 draws ~322 W; boosted to 0.8 after 20 s it would draw ~574 W: the 400-W cap binds. A job at 40 s ends
    # the boost (and the binding); back to 0.4 after it, the cap does not bind.
    run = simulate("--duration 64 --target 0.4 --boost-target 0.8 --boost-after 20 --max-power-w 400 "
                   "--sim-foreign 40-45 --resume-after 5 --shape burn")
    capped = run.of("power_capped")
    assert [(e["capped"], e["state"]) for e in capped] == [(True, "boosted"), (False, "yielding")]
    assert 20.0 <= float(capped[0]["t"]) <= run.t("boost") + 0.2  # binds the moment the boost asks for more
    assert capped[0]["max_power_w"] == 400.0 and float(capped[0]["duty_limit"]) < 0.8
    assert float(capped[1]["t"]) == run.t("yield")
    filling = [(0.0, run.t("yield")), (run.t("resume"), 64.0)]
    for a_s, b_s in filling:  # the model's own 1-s mean, every 0.1 s of filling
        worst_w = max(run.power_1s(a_s + 1.0 + 0.1 * k) for k in range(int((b_s - a_s - 1.0) / 0.1)))
        assert worst_w <= 400.0, (a_s, b_s, worst_w)
    # The cap, not the target, set the duty while boosted; after the resume the target does again.
    assert run.gpu.busy_ratio(30.0, 40.0) == pytest.approx((400.0 * AIM_RATIO - IDLE_POWER_W) / SPAN_W, abs=0.02)
    assert run.power_1s(40.0) >= 400.0 * (AIM_RATIO - 0.02)  # held just under the cap, not far below it
    assert run.gpu.busy_ratio(54.0, 64.0) == pytest.approx(0.4, abs=0.02)
    stop = run.of("stop")[0]
    assert run.of("start")[0]["max_power_w"] == 400.0 and run.of("start")[0]["power_limit_w"] == MAX_POWER_W
    assert not run.rt.filler.power_cap.binding and stop["state"] == "filling"  # type: ignore[union-attr]


@pytest.mark.parametrize("cap_w", [150.0, 300.0, 650.0])
def test_the_cap_holds_from_the_first_second_at_any_target(cap_w: float) -> None:
    run = simulate(f"--duration 30 --target 1 --max-power-w {cap_w:g} --shape burn")
    assert max(run.power_1s(1.0 + 0.1 * k) for k in range(290)) <= cap_w
    expected = min((cap_w * AIM_RATIO - IDLE_POWER_W) / SPAN_W, 1.0)
    assert run.gpu.busy_ratio(20.0, 30.0) == pytest.approx(expected, abs=0.02)
    assert [e["capped"] for e in run.of("power_capped")] == [True]


def test_the_legacy_law_is_held_under_the_cap_too() -> None:
    run = simulate("--duration 40 --controller legacy --max-power-w 300 --shape burn")  # alone: ~700 W
    assert max(run.power_1s(1.0 + 0.1 * k) for k in range(390)) <= 300.0
    assert run.gpu.busy_ratio(20.0, 40.0) == pytest.approx((300.0 * AIM_RATIO - IDLE_POWER_W) / SPAN_W, abs=0.02)


@pytest.mark.parametrize("shape", ["lean", "burn"])
def test_a_cap_under_idle_power_launches_nothing_and_says_so(shape: str) -> None:
    # Under the context's idle (70 W in the model), though over the bare board's before our context (32 W).
    run = simulate(f"--duration 10 --max-power-w 50 --shape {shape}")
    assert run.kernel_starts(0.0, 10.0) == []
    assert [(e["capped"], e["duty_limit"]) for e in run.of("power_capped")] == [(True, 0.0)]


def test_with_the_lean_shape_a_cap_over_the_contexts_idle_lets_the_target_be_held() -> None:
    # 30 W over the context's idle: the cap's first duty (30/630) is under what it learns from, and the lean kernel
    # draws next to nothing over idle; the slope comes down reading by reading until the target holds.
    run = simulate("--duration 40 --max-power-w 100")
    assert run.gpu.busy_ratio(30.0, 40.0) == pytest.approx(0.5, abs=0.02)
    assert max(run.power_1s(2.0 + 0.1 * k) for k in range(380)) <= 100.0
    assert not run.rt.filler.power_cap.binding  # type: ignore[union-attr]


# --- the energy counter --------------------------------------------------------------------------------------


def model_energy_j(gpu: SimGpu, spans: list[tuple[float, float]]) -> float:
    """The model's own integral over these spans (gpu/sim.py's power model)."""
    return sum(gpu.energy_in_j(a, b) for a, b in spans)


def test_the_energy_counter_is_the_devices_energy_while_filling() -> None:
    run = simulate("--duration 60 --sim-foreign 20-30 --resume-after 5")
    last_reading_s = run.rt.monitor.latest().t_s  # type: ignore[union-attr]
    filling = [(0.0, run.t("yield")), (run.t("resume"), last_reading_s)]  # counted from reading to reading
    expected_j = model_energy_j(run.gpu, filling)
    assert run.rt.filler.energy.energy_j == pytest.approx(expected_j, rel=1e-9)
    assert expected_j == pytest.approx(45 * (IDLE_POWER_W + 0.5 * LIGHT_SM_W), rel=0.02)  # a sanity check of spans
    stop = run.of("stop")[0]
    assert stop["energy_j"] == round(expected_j, 1) and stop["energy_source"] == "counter"
    assert run.of("start")[0]["energy_source"] == "counter"
    # The time yielding is not ours: the job's energy there is not in the counter.
    assert run.rt.filler.energy.energy_j < model_energy_j(run.gpu, [(0.0, last_reading_s)]) - 10 * IDLE_POWER_W


def test_without_an_energy_counter_the_power_readings_are_integrated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SimProbe, "energy_j", lambda self: None)
    run = simulate("--duration 60 --sim-foreign 20-30 --resume-after 5 --shape burn")  # steps of hundreds of watts
    last_reading_s = run.rt.monitor.latest().t_s  # type: ignore[union-attr]
    expected_j = model_energy_j(run.gpu, [(0.0, run.t("yield")), (run.t("resume"), last_reading_s)])
    # A 1-s mean lags a step in power by half a second: at each start of filling (the start and the resume) the
    # integral misses about half a second of the filler's ~315 W (at the start also of our context's 38 W); a yield
    # after steady filling loses nothing.
    missed_j = expected_j - run.rt.filler.energy.energy_j
    assert 2 * 0.4 * 0.5 * SPAN_W <= missed_j <= 2 * 0.6 * 0.5 * SPAN_W + 0.5 * CONTEXT_POWER_W
    assert run.of("stop")[0]["energy_source"] == "power" and run.of("start")[0]["energy_source"] == "power"


def test_the_energy_counter_survives_a_counter_that_goes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    real = SimProbe.energy_j
    read_at: list[float] = []

    def reloaded(self: SimProbe) -> float | None:  # the driver reloaded at 10 s: the counter starts again
        value = real(self)
        read_at.append(self.gpu.clock.now())
        return value if read_at[-1] < 10.0 or value is None else value - 5000.0

    monkeypatch.setattr(SimProbe, "energy_j", reloaded)
    run = simulate("--duration 20")
    expected_j = model_energy_j(run.gpu, [(0.0, run.rt.monitor.latest().t_s)])  # type: ignore[union-attr]
    after = next(i for i, t_s in enumerate(read_at) if t_s >= 10.0)
    lost_j = model_energy_j(run.gpu, [(read_at[after - 1], read_at[after])])  # the one poll interval across it
    assert read_at[after] - read_at[after - 1] == pytest.approx(0.1)
    assert run.rt.filler.energy.energy_j == pytest.approx(expected_j - lost_j, rel=1e-9)


# --- pauses ---------------------------------------------------------------------------------------------------


def assert_paused_between(run: Run, pause_s: float, unpause_s: float) -> None:
    """As complete as a yield: what was queued at the pause line (at most the Worker's queue limit) ends, a drained
    line says when, and no kernel of ours starts from then until the unpause line."""
    drained = [e for e in run.of("drained") if float(e["t"]) >= pause_s]  # type: ignore[arg-type]
    assert drained
    last_end_s = float(drained[0]["last_kernel_end_t"])  # type: ignore[arg-type]
    assert last_end_s <= pause_s + run.rt.worker.queue_s + 1e-6
    assert run.kernel_starts(last_end_s, unpause_s) == []


def test_the_pause_file_pauses_until_its_time_and_the_counter_stops(tmp_path: Path) -> None:
    pause = tmp_path / "pause"
    wall0 = 1_800_000_000.0
    run = simulate(f"--duration 40 --pause-file {pause}", wall_start_s=wall0,
                   at={10.0: lambda: pause.write_text(f"{wall0 + 25:.0f}\n")})
    paused, unpaused = run.of("pause")[0], run.of("unpause")[0]
    assert 10.0 <= float(paused["t"]) <= 11.2 and paused["state"] == "paused"  # type: ignore[arg-type]
    assert str(paused["reason"]).startswith(f"pause file {pause}: paused until ")
    assert 25.0 <= float(unpaused["t"]) <= 25.1 and unpaused["state"] == "filling"  # type: ignore[arg-type]
    assert str(unpaused["reason"]).startswith("pause file's time ") and "reached" in str(unpaused["reason"])
    assert_paused_between(run, float(paused["t"]), float(unpaused["t"]))  # type: ignore[arg-type]
    assert run.gpu.busy_ratio(30.0, 40.0) == pytest.approx(0.5, abs=0.02)  # filling again
    last_s = run.rt.monitor.latest().t_s  # type: ignore[union-attr]
    expected_j = model_energy_j(run.gpu, [(0.0, float(paused["t"])), (float(unpaused["t"]), last_s)])
    assert run.rt.filler.energy.energy_j == pytest.approx(expected_j, rel=1e-9)  # type: ignore[arg-type]
    assert run.rt.filler.status(run.rt.now()).yields == 0  # a pause is no yield


def test_a_pause_file_without_a_readable_time_pauses_until_it_is_removed(tmp_path: Path) -> None:
    pause = tmp_path / "pause"
    pause.write_text("after the job\n")
    run = simulate(f"--duration 30 --pause-file {pause}", at={20.0: pause.unlink})
    assert [(e["event"], e["t"]) for e in run.events if e["event"] in ("pause", "unpause")] == [
        ("pause", 0.0), ("unpause", run.t("unpause"))]
    assert "neither an ISO 8601 time nor a Unix time: paused until it is removed" in str(run.of("pause")[0]["reason"])
    assert run.of("unpause")[0]["reason"] == "pause file removed"
    assert run.kernel_starts(0.0, run.t("unpause")) == []  # paused from the very first moment: nothing ran at all
    assert 20.0 <= run.t("unpause") <= 21.2


def test_outside_the_active_hours_it_is_paused_and_inside_it_fills() -> None:
    evening = datetime(2026, 11, 16, 19, 59, 30, tzinfo=BERLIN).timestamp()  # a Monday, 30 s before the hours
    run = simulate("--duration 60", env={"FORGE_ACTIVE_HOURS": "Mon-Fri 20:00-08:00", "TZ": "Europe/Berlin"},
                   wall_start_s=evening)
    assert run.of("pause")[0]["t"] == 0.0
    assert run.of("pause")[0]["reason"] == "outside FORGE_ACTIVE_HOURS (Mon-Fri 20:00-08:00)"
    assert 30.0 <= run.t("unpause") <= 30.1 and run.of("unpause")[0]["reason"] == (
        "inside FORGE_ACTIVE_HOURS (Mon-Fri 20:00-08:00)")
    assert run.kernel_starts(0.0, run.t("unpause")) == []
    assert run.gpu.busy_ratio(40.0, 60.0) == pytest.approx(0.5, abs=0.02)
    morning = datetime(2026, 11, 17, 7, 59, 30, tzinfo=BERLIN).timestamp()  # Tuesday, 30 s before the hours end
    run = simulate("--duration 60", env={"FORGE_ACTIVE_HOURS": "Mon-Fri 20:00-08:00", "TZ": "Europe/Berlin"},
                   wall_start_s=morning)
    assert [e["event"] for e in run.events if e["event"] in ("pause", "unpause")] == ["pause"]
    assert 30.0 <= run.t("pause") <= 30.1
    assert_paused_between(run, run.t("pause"), 60.0)


def test_the_signal_switch_pauses_and_resumes() -> None:
    switch = PauseSwitch()
    run = simulate("--duration 40", controls=Controls(switch),
                   at={10.0: lambda: switch.set(True, "SIGUSR1"), 20.0: lambda: switch.set(False, "SIGUSR2")})
    assert run.of("pause")[0]["reason"] == "SIGUSR1 (SIGUSR2 resumes)"
    assert run.of("unpause")[0]["reason"] == "SIGUSR2"
    # The switch is acted on at the filler's next step, not at the next poll.
    assert_paused_between(run, run.t("pause"), run.t("unpause"))
    assert run.gpu.busy_ratio(30.0, 40.0) == pytest.approx(0.5, abs=0.02)


def test_a_foreign_job_during_a_pause_still_counts_for_the_resume_wait() -> None:
    switch = PauseSwitch()
    run = simulate("--duration 60 --sim-foreign 15-25 --resume-after 10", controls=Controls(switch),
                   at={10.0: lambda: switch.set(True, "SIGUSR1"), 30.0: lambda: switch.set(False, "SIGUSR2")})
    assert run.of("yield") == []  # nothing of ours ran to step aside from
    unpaused = run.of("unpause")[0]
    assert unpaused["state"] == "yielding" and "foreign activity" in str(unpaused["reason"])
    assert run.t("resume") >= 25.0 + 10.0
    assert_paused_between(run, run.t("pause"), run.t("resume"))


def test_reasons_add_up_and_sigusr2_does_not_lift_the_pause_file(tmp_path: Path) -> None:
    switch, pause = PauseSwitch(), tmp_path / "pause"
    run = simulate(f"--duration 40 --pause-file {pause}", controls=Controls(switch),
                   at={5.0: lambda: switch.set(True, "SIGUSR1"), 10.0: lambda: pause.write_text(""),
                       15.0: lambda: switch.set(False, "SIGUSR2"), 20.0: pause.unlink})
    lines = [(e["event"], e["reason"]) for e in run.events if e["event"] in ("pause", "unpause")]
    assert lines == [
        ("pause", "SIGUSR1 (SIGUSR2 resumes)"),
        ("pause", f"SIGUSR1 (SIGUSR2 resumes); pause file {pause}: paused until it is removed"),
        ("pause", f"pause file {pause}: paused until it is removed"),
        ("unpause", "pause file removed"),
    ]
    assert_paused_between(run, run.t("pause"), run.t("unpause"))


def test_the_readme_log_example_script_shows_the_cap_settling_at_its_aim() -> None:
    """scripts/log_example.py makes docs/operating.md's power-cap example from a run: its lines are those of the run,
    and it says where the cap settled, which is where the power cap aims (the share was once typed by hand)."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "log_example.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True)
    *lines, summary = result.stdout.splitlines()
    assert [line.split()[1] for line in lines] == ["event=power_capped", "event=status", "event=pause",
                                                  "event=power_capped", "event=drained", "event=unpause"]
    assert f"{round(100 * AIM_RATIO)} % of the 300-W cap" in summary, summary


def test_the_docs_show_exactly_what_the_log_example_script_prints() -> None:
    """docs/operating.md's power-cap example is the script's output, every line (it drifted by hand once)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, str(root / "scripts" / "log_example.py")], capture_output=True,
                            text=True, timeout=120, check=True)
    doc = (root / "docs" / "operating.md").read_text()
    after = doc[doc.index("(`python3 scripts/log_example.py` runs it and prints these lines):"):]
    block = after.split("```\n", 2)[1]
    assert block.splitlines() == result.stdout.splitlines()
