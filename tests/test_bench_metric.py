"""The benchmark's metric scenario (bench/metric.py): its numbers from synthetic 1-s readings, its goals, its skip on
a device without GPM, its place in the real-GPU default run, the sampler's own GPM readings, and a short run on the
virtual GPU."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import threading
from pathlib import Path
from typing import Any

import pytest

from bench import REPO, cli, metric, scenarios
from bench.results import judge_goals, to_json
from bench.sampler import Sampler
from forge_load.control.probe import Activity, DeviceInfo

START_S = 1000.0


def info(gpm: bool) -> DeviceInfo:
    return DeviceInfo(index=0, uuid="GPU-fake", name="Fake GPU", memory_total_mib=1000.0, driver_version="0.0",
                      mig_enabled=False, gpm=gpm)


def seconds(values: list[float]) -> list[tuple[float, float]]:
    """1-s readings from the run's start: the i-th ends i + 1 s in."""
    return [(START_S + i + 1.0, v) for i, v in enumerate(values)]


# --- the computation ----------------------------------------------------------------------------------------

def test_held_settles_at_the_first_reading_after_which_all_stay_in_the_band() -> None:
    values = [0.2, 0.4, 0.56, 0.47, 0.52, 0.5, 0.49, 0.51, 0.53, 0.5]
    h = metric.held(seconds(values), 0.5, START_S, START_S + len(values))
    assert h.settle_s == 4.0  # 0.56 is out of the band: from the 4th reading (0.47, ending 4 s in) on, all are in
    after = values[3:]
    assert h.readings == len(values) and h.after == tuple(after)
    assert h.mean_error_ratio == pytest.approx(sum(after) / len(after) - 0.5)
    errors = sorted(abs(v - 0.5) for v in after)
    assert errors[-2] <= h.p95_abs_error_ratio <= errors[-1]  # p95 of 7 values: between the top two


def test_held_never_settles_when_the_last_reading_is_out_of_the_band() -> None:
    h = metric.held(seconds([0.5] * 9 + [0.6]), 0.5, START_S, START_S + 10)
    assert h.settle_s is None and h.mean_error_ratio is None and h.p95_abs_error_ratio is None and h.after == ()


def test_held_leaves_out_readings_outside_the_run() -> None:
    # a reading ending in the first second began before the filler did; one after the end is another run's
    readings = [(START_S + 0.5, 0.0), *seconds([0.5] * 5), (START_S + 7.0, 0.0)]
    h = metric.held(readings, 0.5, START_S, START_S + 5)
    assert h.readings == 5 and h.settle_s == 1.0 and h.mean_error_ratio == pytest.approx(0.0)


def test_metric_run_reports_what_the_other_metrics_read_meanwhile() -> None:
    readings = {"sm_activity": seconds([0.1, 0.5, 0.5, 0.51, 0.49]),
                "gr_activity": seconds([0.3, 0.8, 0.8, 0.8, 0.8]),
                "utilization": seconds([0.3, 0.9, 0.95, 0.95, 0.9])}
    m = to_json(metric.metric_run("sm_activity", 0.5, START_S, START_S + 5, readings))
    assert m["metric"] == "sm_activity" and m["settle_s"] == {"value": 2.0, "unit": "s"}
    assert m["mean_error"]["unit"] == "ratio" and m["mean_error"]["value"] == pytest.approx(0.0)
    meanwhile = {k: v["value"] for k, v in m["read_meanwhile"].items()}
    assert meanwhile == pytest.approx({"sm_activity": 0.5, "gr_activity": 0.8, "utilization": 0.925})
    assert m["read_from"] == "settled"


def test_metric_run_that_never_settles_says_so() -> None:
    readings = {"sm_activity": seconds([0.2] * 10), "utilization": seconds([0.4] * 10)}
    m = to_json(metric.metric_run("sm_activity", 0.5, START_S, START_S + 10, readings))
    assert m["settle_s"]["value"] is None and m["settle_s"]["note"].startswith("never")
    assert m["read_from"].startswith("from 5 s") and m["read_meanwhile"]["utilization"]["value"] == 0.4
    assert m["read_meanwhile"]["gr_activity"] == {"value": None, "unit": "ratio", "note": "no readings"}


def test_mig_metric_bench_uses_the_bench_packages_computation() -> None:
    spec = importlib.util.spec_from_file_location("mig_metric_bench", REPO / "scripts" / "mig_metric_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.held is metric.held and module.TARGET == metric.METRIC_TARGET


# --- goals --------------------------------------------------------------------------------------------------

def results_with(runs: dict[str, Any], skipped: list[str] | None = None) -> dict[str, Any]:
    return {"mode": "real", "settings": {"scenarios": ["metric"]}, "tracking": {}, "yield": {}, "footprint": {},
            "metric": runs, "skipped": skipped or []}


def goals_of(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["key"]: g for g in judge_goals(results) if g["key"].startswith("metric")}


def test_metric_goals_pass_and_fail_on_the_worst_metric() -> None:
    good = to_json(metric.metric_run("sm_activity", 0.5, START_S, START_S + 10,
                                     {"sm_activity": seconds([0.5, 0.51, 0.49] * 3 + [0.5])}))
    biased = to_json(metric.metric_run("gr_activity", 0.5, START_S, START_S + 10,
                                       {"gr_activity": seconds([0.3, 0.2, 0.2, 0.2] + [0.54] * 6)}))
    goals = goals_of(results_with({"sm_activity": good}))
    assert [g["pass"] for g in goals.values()] == [True, True, True], goals
    goals = goals_of(results_with({"sm_activity": good, "gr_activity": biased}))
    assert goals["metric_settle"]["pass"] is False and goals["metric_settle"]["measured"]["value"] == 5.0
    assert goals["metric_mean"]["pass"] is False and goals["metric_mean"]["measured"]["value"] == pytest.approx(0.04)
    assert goals["metric_p95"]["pass"] is True
    assert goals["metric_mean"]["over"] == "sm_activity, gr_activity"


def test_metric_goals_are_only_judged_where_the_run_asked_for_the_scenario() -> None:
    old = results_with({})
    old["settings"]["scenarios"] = ["tracking", "yield", "footprint"]
    assert goals_of(old) == {}


# --- the skip where there is no GPM -------------------------------------------------------------------------

class FakeBench:
    def __init__(self, gpm: bool) -> None:
        self.probe = type("Probe", (), {"info": info(gpm)})()


def plan_names(gpm: bool) -> tuple[list[str], dict[str, Any]]:
    args = cli.parse_args([])
    results: dict[str, Any] = {"skipped": [], "notes": []}
    steps = scenarios.real_plan(args, FakeBench(gpm), results)  # type: ignore[arg-type]  # only .probe is read
    return [what for what, _, _ in steps], results


def test_without_gpm_the_metric_runs_are_left_out_with_one_reason() -> None:
    names, results = plan_names(gpm=False)
    assert not any(n.startswith("metric") for n in names), names
    assert len([s for s in results["skipped"] if s.startswith("metric")]) == 1, results["skipped"]
    assert "Fake GPU has no NVML GPM" in results["skipped"][0]
    goals = goals_of(results_with({}, results["skipped"]))
    assert all(g["pass"] is None and "no NVML GPM" in g["note"] for g in goals.values()), goals


def test_with_gpm_both_metrics_run_after_our_controllers_tracking() -> None:
    names, results = plan_names(gpm=True)
    metric_at = [i for i, n in enumerate(names) if n.startswith("metric")]
    assert [names[i].split()[1] for i in metric_at] == list(metric.HELD_METRICS) and results["skipped"] == []
    pi = [i for i, n in enumerate(names) if n.startswith("tracking pi")]
    legacy = [i for i, n in enumerate(names) if n.startswith("tracking legacy")]
    assert max(pi) < min(metric_at) and max(metric_at) < min(legacy), names


def test_the_simulated_gpu_skips_the_metric_scenario_saying_why(tmp_path: Path) -> None:
    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        code = cli.main(["--simulate", "--scenarios", "metric", "--out", str(tmp_path)])
    r = json.loads((tmp_path / "results.json").read_text())
    assert code == 0 and r["metric"] == {}, r["failures"]
    reasons = [s for s in r["skipped"] if s.startswith("metric")]
    assert len(reasons) == 1 and "simulated GPU models no GPM" in reasons[0]
    assert stdout.getvalue().count("Not run: metric: the simulated GPU models no GPM") == 1
    assert all(g["pass"] is None for g in r["goals"] if g["key"].startswith("metric"))


# --- the real-GPU default run -------------------------------------------------------------------------------

def test_the_metric_scenario_is_in_the_real_gpu_default_run_within_its_budget() -> None:
    """`gpu_bench.py --out "$OUT/bench" --budget-s 560` (docs/benchmarks/README.md): the metric runs are asked for
    and start early enough that the budget, by the plan's own estimates, never cuts them."""
    args = cli.parse_args(["--out", "/tmp/unused", "--budget-s", "560"])
    assert "metric" in args.scenarios
    steps = scenarios.real_plan(args, FakeBench(gpm=True), {"skipped": [], "notes": []})  # type: ignore[arg-type]
    elapsed_s = 5.0 + 15.0  # idle and the bare context come first (scenarios.run_real_bench)
    ran = []
    for what, estimate_s, _ in steps:
        if elapsed_s + estimate_s <= args.budget_s:  # run_real_bench's rule: skip what would end after it
            elapsed_s += estimate_s
            ran.append(what)
    assert [w for w in ran if w.startswith("metric")] == [w for w, _, _ in steps if w.startswith("metric")]


# --- the sampler's own GPM readings -------------------------------------------------------------------------

class GpmProbe:
    """NVML with GPM as the sampler reads it: activity() answers from its second call on."""

    def __init__(self, stop: threading.Event) -> None:
        self.info = info(gpm=True)
        self.calls = 0
        self.stop = stop

    def utilization_samples(self, since_s: float) -> list[Any]:
        return []

    def utilization_ratio(self) -> float | None:
        return None

    def memory_used_mib(self) -> float | None:
        return None

    def power_w(self) -> float | None:
        return None

    def processes(self) -> list[Any]:
        return []

    def activity(self) -> Activity | None:
        self.calls += 1
        if self.calls == 3:
            self.stop.set()
        return None if self.calls == 1 else Activity(100.0 + self.calls, 1.0, 0.25, 0.75)


def test_the_sampler_takes_its_own_gpm_readings_where_the_gpu_has_gpm() -> None:
    stop = threading.Event()
    probe = GpmProbe(stop)
    sampler = Sampler(probe, interval_s=0.0)  # type: ignore[arg-type]  # the Probe's methods the sampler reads
    sampler.stop_event = stop
    sampler.run()  # in this thread: it returns once the third reading set the stop event
    assert sampler.failure is None and probe.calls == 3
    assert [(span, sm, gr) for _, span, sm, gr in sampler.gpm] == [(1.0, 0.25, 0.75)] * 2
    assert all(math.isfinite(t) and t > 1e9 for t, *_ in sampler.gpm)  # on the wall clock


def test_the_sampler_reads_no_gpm_where_the_gpu_has_none() -> None:
    probe = GpmProbe(threading.Event())
    probe.info = info(gpm=False)
    sampler = Sampler(probe)  # type: ignore[arg-type]
    assert sampler.read_gpm is False


# --- on the virtual GPU (cc 9.0: GPM) -----------------------------------------------------------------------

def test_metric_scenario_on_the_virtual_gpu(tmp_path: Path, vgpu_lib_dir: Path,
                                            capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "metric"
    code = cli.main(["--vgpu", "--scenarios", "metric", "--metric-s", "8", "--out", str(out)])
    printed = capfd.readouterr().out  # --vgpu runs the benchmark again in a child, on a fresh virtual GPU
    r = json.loads((out / "results.json").read_text())
    assert r["failures"] == [] and r["virtual_gpu"] is True and r["complete"] is True, r["failures"]
    assert list(r["metric"]) == list(metric.HELD_METRICS) and r["skipped"] == []
    for m in r["metric"].values():
        assert m["readings"]["value"] >= 4 and m["settle_s"]["value"] is not None, m
        assert set(m["read_meanwhile"]) == set(metric.READ_METRICS)
        assert all(v["value"] is not None for v in m["read_meanwhile"].values()), m
    assert "| sm_activity |" in printed and "| gr_activity |" in printed and "(virtual GPU)" in printed
    assert code in (0, 1)  # 1 only where a goal was missed
