"""The simulated GPU over long runs: its memory stays flat, its cost does not grow with the number of foreign
jobs, the stop signal is seen even when the loop runs behind schedule, and a soak with job churn and a lost
GPU keeps its counters exact. All in virtual time; memory is judged by list lengths and allocated blocks,
never by wall-clock timings (scripts/sim_soak.py is the long version, with a table)."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
import threading
from pathlib import Path

import pytest

from forge_load.config.load import load_config
from forge_load.config.settings import describe
from forge_load.config.sim import SimConfig
from forge_load.config.values import ConfigError
from forge_load.gpu import sim
from forge_load.gpu.sim import SimGpu, SimProbe, VirtualClock
from forge_load.service.loop import run_simulated

REPO = Path(__file__).resolve().parents[1]


def config(flags: str):  # type: ignore[no-untyped-def]
    return load_config(f"--simulate --sim-speed 0 --log-format json {flags}".split(), env={})


def test_kernel_history_stays_bounded_over_a_long_run() -> None:
    # Five virtual minutes is 17 times the history any query can reach with 1/6-s windows.
    lengths: list[int] = []
    run_box: list[object] = []

    def beat() -> None:  # once per virtual second
        if run_box:
            lengths.append(len(run_box[0].probe.gpu._starts))  # type: ignore[attr-defined]

    run = run_simulated(config("--duration 300 --target 0.3 --log-interval 60"), io.StringIO(), heartbeat=beat,
                        on_start=run_box.append)
    history_s = (sim.BUFFERED_SAMPLES + 1) * run.gpu.window_s + 1.0
    # The lists are cut in halves: at most twice the history, of kernels at least 1 ms long (ours are ~2 ms).
    bound = int(2 * history_s / 0.001)
    # A heartbeat comes at the first step a second or more after the last: at least one per 1.1 s of polls.
    assert len(lengths) >= 270 and max(lengths) <= bound, (len(lengths), max(lengths), bound)
    assert max(lengths[150:]) <= 1.2 * max(lengths[40:150]), (max(lengths[40:150]), max(lengths[150:]))
    assert len(run.gpu._ends) == len(run.gpu._starts) == len(run.gpu._busy_before) - 1


def test_pruning_the_history_changes_no_answer() -> None:
    # The same run with the whole history kept logs exactly the same lines.
    flags = "--duration 150 --log-interval 5 --sim-window 1 --sim-foreign 40-60,100-110 --resume-after 10"
    pruned, full = io.StringIO(), io.StringIO()
    run_simulated(config(flags), pruned)
    run = run_simulated(config(flags), full, keep_history=True)
    assert run.gpu._starts[0] < 1.0  # the whole history is there
    # Every line but its ts, on each run's own wall clock; the start line has wall_time too.
    def lines(out: io.StringIO) -> list[dict[str, object]]:
        return [{k: v for k, v in json.loads(line).items() if k != "ts"} for line in out.getvalue().splitlines()[1:]]
    assert lines(pruned) == lines(full)


def test_the_nvml_buffer_and_the_power_window_reach_no_further_than_the_history() -> None:
    for window_s in (1 / 6, 1.0):
        gpu = SimGpu(SimConfig(window_s=window_s, speed=0), VirtualClock())
        assert gpu.history_s >= sim.BUFFERED_SAMPLES * window_s + window_s  # the oldest buffered sample's window
        assert gpu.history_s >= sim.POWER_WINDOW_S


def test_foreign_jobs_are_found_without_walking_them_all() -> None:
    spans = tuple((10.0 * i, 10.0 * i + 1.0 + (i % 7)) for i in range(20_000))  # jobs of 1 to 7 s, 10 s apart
    clock = VirtualClock()
    gpu = SimGpu(SimConfig(foreign_s=spans, foreign_mem_mib=100.0), clock)
    probe = SimProbe(gpu, own_pid=1)
    gpu.context_open = True
    assert len(gpu.timeline.near(0.0, 200_000.0)) == 20_000
    for t_s in (0.5, 12.0, 105_003.5, 105_009.0, 199_995.0):
        clock.advance_to(t_s)
        active = [job for job in gpu.jobs if job.start_s <= t_s < job.end_s]
        assert len(gpu.timeline.near(t_s - 1.0, t_s)) <= 2  # only the jobs near the query are looked at
        assert [p.pid for p in probe.processes() or [] if p.pid != 1] == [job.pid for job in active]
        assert probe.memory_used_mib() == 100.0 * len(active) + 512.0
        reference = sum(min(job.end_s, t_s) - max(job.start_s, t_s - 1.0) > 0 for job in gpu.jobs)
        assert len([j for j in gpu.timeline.near(t_s - 1.0, t_s) if j.end_s > t_s - 1.0]) == reference


def test_a_hidden_job_is_left_out_of_the_process_list_only() -> None:
    scenario = config("--duration 80 --sim-foreign 10-20 --sim-foreign-hidden 40-50 --resume-after 5")
    out = io.StringIO()
    run = run_simulated(scenario, out)
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    yields = [e for e in events if e["event"] == "yield"]
    assert [(round(e["t"]), e["signals"]) for e in yields] == [(10, "process,memory"), (40, "memory")]
    assert len([e for e in events if e["event"] == "resume"]) == 2
    assert sorted(job.pid for job in run.gpu.jobs) == [40000, 40001]


def test_hidden_jobs_are_a_setting_checked_like_the_others() -> None:
    sim_config = config("--sim-foreign 10-20 --sim-foreign-hidden 30-40,0-5").sim
    assert sim_config.foreign_hidden_s == ((0.0, 5.0), (30.0, 40.0))
    env = {"FORGE_SIMULATE": "1", "FORGE_SIM_FOREIGN": "10-20", "FORGE_SIM_FOREIGN_HIDDEN": "15-25"}
    with pytest.raises(ConfigError) as info:
        load_config([], env=env)
    message = str(info.value)
    assert "FORGE_SIM_FOREIGN_HIDDEN='15-25' overlaps FORGE_SIM_FOREIGN='10-20'" in message and "\n" not in message
    with pytest.raises(ConfigError, match="FORGE_SIM_FOREIGN_HIDDEN='5-1'"):
        load_config([], env={"FORGE_SIM_FOREIGN_HIDDEN": "5-1"})
    assert describe(config("--sim-foreign-hidden 1-2"))["sim_foreign_hidden_s"] == "1-2"


def test_stop_is_seen_while_the_loop_runs_behind_schedule() -> None:
    # A speed no machine keeps up with: the loop is always behind and never sleeps, yet it must see `stop`.
    stop = threading.Event()
    beats: list[int] = []

    def beat() -> None:  # once per virtual second of the loop
        beats.append(1)
        stop.set()

    out = io.StringIO()
    run = run_simulated(config("--sim-speed 1e9 --duration 120"), out, stop=stop, heartbeat=beat)
    assert run.clock.now() < 1.0 and len(beats) == 1, (run.clock.now(), len(beats))
    last = json.loads(out.getvalue().splitlines()[-1])
    assert (last["event"], last["reason"]) == ("stop", "signal")


def load_soak():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("sim_soak", REPO / "scripts" / "sim_soak.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["sim_soak"] = module
    spec.loader.exec_module(module)
    return module


def test_soak_with_job_churn_and_a_lost_gpu() -> None:
    # The short version of scripts/sim_soak.py: one virtual hour, two GPUs, GPU 1 lost at 600 s, jobs of 2 s
    # to 5 min, some hidden from the process list. Memory by list lengths and allocated blocks, not timings.
    soak_script = load_soak()
    soak = soak_script.run_soak(hours=1.0, target=0.2, trace=False, period_s=600.0, longest_s=300.0,
                                longest_gap_s=20.0)
    jobs = soak.jobs
    assert len(jobs) >= 20 and 0 < sum(j.hidden for j in jobs) < len(jobs)
    assert soak.exit_code == 4
    (error,) = soak.of(1, "error")
    assert "was lost" in error.reason and error.t == pytest.approx(600.0, abs=0.2)
    # Every job is one yield and one resume on the GPU still running; its stop line counts them.
    assert len(soak.of(0, "yield")) == len(soak.of(0, "resume")) == len(jobs)
    (stop,) = soak.of(0, "stop")
    assert stop.reason == "duration reached" and stop.yields == len(jobs)
    assert stop.own_busy_s == pytest.approx(0.2 * soak.filling_s(), rel=0.1)  # it kept filling between jobs
    longest = max(max(row.kernels_kept_max) for row in soak.rows)
    assert 0 < longest <= soak_script.kernel_bound(soak.history_s)
    assert soak_script.verify(soak) == []  # the same, and the yield and resume times, and flat memory
