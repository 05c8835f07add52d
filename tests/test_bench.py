"""scripts/gpu_bench.py (the bench package): the benchmark on the simulated GPU (short durations), its output
format, the goals our controller must meet there, and the real-GPU path driven end to end against a fake NVML,
with the filler on the simulator and the foreign job on numba's CUDA simulator (so it runs in CI without a GPU);
the cpu scenario on the virtual GPU and on the fakes; docs/benchmarks.md's generated blocks against their results."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from bench import analysis, cli, render, runner
from bench.cpu import CPU_GOALS as GOALS_NOW
from bench.power import render_power_section
from bench.results import judge_goals, q, to_json

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_bench.py"

UNITS = {"s", "ratio", "x", "MiB", "W", "count", "% of one core", "steps/s"}
# Identifiers, not measurements: the only bare numbers results.json may hold.
BARE_NUMBERS = {("schema",), ("settings", "seed"), ("gpu", "index")}
# Short runs; the foreign job as long as the default (20 virtual s): the worst-case throughput bound
# amortises our detection time over the job's run, so a shorter job would judge the goal on another footing.
SIM_ARGS = ["--simulate", "--track-s", "20", "--foreign-s", "20", "--warmup-s", "5", "--resume-after", "2"]


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("sim_bench")
    import contextlib
    import io

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = cli.main(SIM_ARGS + ["--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    return {"code": code, "out": out, "stdout": stdout.getvalue(), "results": results,
            "md": (out / "results.md").read_text()}


# --- the simulated run --------------------------------------------------------------------------------------

def test_sim_run_writes_its_files_and_prints_the_table(sim_run: dict[str, Any]) -> None:
    assert sim_run["code"] == 0
    for name in ("results.json", "results.md", "series.json"):
        assert (sim_run["out"] / name).stat().st_size > 0
    assert "| target | metric | pi | legacy | legacy / pi |" in sim_run["stdout"]
    assert sim_run["stdout"].strip() == sim_run["md"].strip()


def test_results_json_metadata(sim_run: dict[str, Any]) -> None:
    r = sim_run["results"]
    assert r["mode"] == "simulated" and r["complete"] is True
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"])
    assert r["command"].startswith("python scripts/gpu_bench.py --simulate")
    assert r["gpu"]["name"].startswith("Simulated GPU") and r["gpu"]["driver"] == "simulated"
    assert r["software"]["forge_load"]
    # the default scenarios include metric, which the simulated GPU (no GPM) skips, saying so
    assert r["failures"] == [] and [s.split(":")[0] for s in r["skipped"]] == ["metric"], r["skipped"]


def leaves(node: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    if isinstance(node, dict):
        if set(node) >= {"value", "unit"}:
            return [(path, node)]
        return [leaf for k, v in node.items() for leaf in leaves(v, path + (k,))]
    if isinstance(node, list):
        return [leaf for i, v in enumerate(node) for leaf in leaves(v, path + (str(i),))]
    return [(path, node)]


def test_every_number_carries_its_unit(sim_run: dict[str, Any]) -> None:
    quantities = 0
    for path, leaf in leaves(sim_run["results"]):
        if isinstance(leaf, dict):
            quantities += 1
            assert set(leaf) <= {"value", "unit", "note"}, path
            assert leaf["unit"] in UNITS, (path, leaf["unit"])
            value = leaf["value"]
            assert value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                     and math.isfinite(value)), (path, value)
            if value is None:
                assert leaf.get("note"), f"{path}: a missing number must say why"
        elif isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
            assert path in BARE_NUMBERS, f"{path} = {leaf} has no unit"
    assert quantities > 100


def test_tracking_pi_and_legacy_side_by_side(sim_run: dict[str, Any]) -> None:
    tracking = sim_run["results"]["tracking"]
    for target in ("0.3", "0.5", "0.8"):
        for controller in ("pi", "legacy"):
            m = tracking[controller][target]
            assert m["target"] == {"value": float(target), "unit": "ratio"}
            assert m["duration_s"] == {"value": 20.0, "unit": "s"}
            for key, unit in (("settle_s", "s"), ("mae", "ratio"), ("p95_error", "ratio"),
                              ("mae_from_5s", "ratio"), ("p95_error_from_5s", "ratio"), ("power_w", "W")):
                assert m[key]["unit"] == unit
        ratio = tracking["legacy_over_pi"][target]
        assert ratio["mae_from_5s"]["unit"] == "x"
        # The comparison says something: in 20 s the original law is far from the target, ours is on it.
        assert ratio["mae_from_5s"]["value"] > 5
        assert (tracking["legacy"][target]["mae_from_5s"]["value"]
                > tracking["pi"][target]["mae_from_5s"]["value"])


def test_pi_meets_every_goal_the_simulator_can_judge(sim_run: dict[str, Any]) -> None:
    goals = {g["key"]: g for g in sim_run["results"]["goals"]}
    assert set(goals) == {"settle", "mae", "p95", "yield", "foreign", "memory", "cpu", "metric_settle", "metric_mean",
                          "metric_p95"}
    for key in ("settle", "mae", "p95", "yield"):
        assert goals[key]["pass"] is True, goals[key]
        assert goals[key]["measured"]["value"] is not None
    # The foreign job's simulated worst-case bound is ~0.99 by construction in its worst variant: the utilization
    # signal alone takes 0.4 s to see the job, about half of which is ours. Whether it lands just above or just
    # below 0.99 depends on where our bursts fall in those 0.4 s (0.9877-0.9918 over six start phases).
    assert goals["foreign"]["measured"]["value"] >= 0.985, goals["foreign"]
    # footprint cannot be simulated, nor GPM's metrics: said so, not passed
    for key in ("memory", "cpu", "metric_settle", "metric_mean", "metric_p95"):
        assert goals[key]["pass"] is None and goals[key]["note"].startswith("n/a")
    pi = sim_run["results"]["tracking"]["pi"]
    for m in pi.values():
        assert m["settle_s"]["value"] <= 5.0
        assert m["mae"]["value"] <= 0.02 and m["p95_error"]["value"] <= 0.05


def test_yield_scenarios(sim_run: dict[str, Any]) -> None:
    y = sim_run["results"]["yield"]
    assert set(y) == {"pi_visible", "pi_hidden", "pi_no_process_list", "pi_utilization_only",
                      "legacy_visible", "legacy_hidden"}
    for name, m in y.items():
        assert m["detected"] is True, name
        assert m["yields"]["value"] == 1 and m["resumes_while_foreign"]["value"] == 0, name
        assert 0 <= m["yield_s"]["value"] <= 0.5, name
        assert m["resume_s"]["value"] >= m["resume_after_s"]["value"] == 2.0, name
        assert m["foreign_throughput_ratio"]["value"] is None
        assert "n/a (simulated)" in m["foreign_throughput_ratio"]["note"]
        assert 0.9 < m["foreign_worst_case_ratio"]["value"] <= 1.0
    assert "process" in y["pi_visible"]["signals"]
    assert "process" not in y["pi_hidden"]["signals"] and "memory" in y["pi_hidden"]["signals"]
    assert "process" not in y["pi_no_process_list"]["signals"]
    assert y["pi_utilization_only"]["signals"] == "utilization"


def test_footprint_is_labelled_simulated(sim_run: dict[str, Any]) -> None:
    fp = sim_run["results"]["footprint"]
    assert fp["simulated"] is True
    assert "simulated" in fp["filler_process_mib"]["note"]
    assert fp["cpu_pct_one_core"]["value"] is None and "n/a (simulated)" in fp["cpu_pct_one_core"]["note"]
    assert set(fp["power_w"]) == {"0.3", "0.5", "0.8"}
    # The lean shape (the default): the model's idle with a context at every target, a few hundredths of a watt over
    assert all(fp["power_w"][t]["value"] == pytest.approx(fp["idle_power_w"]["value"], abs=0.1) for t in fp["power_w"])
    assert "### Footprint (simulated)" in sim_run["md"]


def test_markdown_tables(sim_run: dict[str, Any]) -> None:
    md = sim_run["md"]
    assert "Simulated GPU, virtual time" in md
    for header in ("### Goals (our controller, pi)", "### Tracking: 1-s NVML readings, 20 s per target",
                   "### Yield: a foreign job starts while the filler runs at 0.5", "### Footprint"):
        assert header in md
    rows = [line for line in md.splitlines() if line.startswith("| 0.")]
    assert len(rows) == 3 * 7  # 3 targets x 7 metrics
    assert len(re.findall(r"^\| (pi|legacy) \| ", md, flags=re.M)) == 6  # yield rows
    verdicts = [g["pass"] for g in sim_run["results"]["goals"]]
    assert md.count("| pass |") == verdicts.count(True) >= 4 and md.count("**FAIL**") == verdicts.count(False)


def test_plots(sim_run: dict[str, Any]) -> None:
    pytest.importorskip("matplotlib")
    plots = sim_run["results"]["plots"]
    assert "tracking.png" in plots and "yield_pi_visible.png" in plots and "tracking_pi_0.5.png" in plots
    for name in plots:
        assert (sim_run["out"] / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_series_behind_the_plots(sim_run: dict[str, Any]) -> None:
    series = json.loads((sim_run["out"] / "series.json").read_text())
    s = series["yield_pi_visible"]
    assert s["target"] == 0.5 and len(s["util"]) > 100 and s["multiplier"]
    assert s["marks"]["foreign"] == [5.0, 25.0] and s["marks"]["resume"] > 25.0


# --- the judging and the pieces of the real path, without a GPU -------------------------------------------

def test_goals_fail_when_the_numbers_miss(sim_run: dict[str, Any]) -> None:
    results = json.loads(json.dumps(sim_run["results"]))
    results["tracking"]["pi"]["0.5"]["settle_s"]["value"] = 9.0
    results["yield"]["pi_visible"]["yield_s"]["value"] = 0.7
    results["tracking"]["pi"]["0.8"]["mae"] = q(None, "ratio", "never settled")
    goals = {g["key"]: g for g in judge_goals(results)}
    assert goals["settle"]["pass"] is False and goals["settle"]["measured"]["value"] == 9.0
    assert goals["yield"]["pass"] is False
    assert goals["mae"]["pass"] is False  # a run that never settled misses the goal
    results["mode"] = "real"
    results["footprint"] = {"over_bare_mib": q(40.0, "MiB"), "cpu_pct_one_core": q(1.0, "% of one core")}
    for m in results["yield"].values():
        m["foreign_throughput_ratio"] = q(0.95, "ratio")
    goals = {g["key"]: g for g in judge_goals(results)}
    assert goals["memory"]["pass"] is False and goals["cpu"]["pass"] is True and goals["foreign"]["pass"] is False
    assert "**FAIL**" in render.render_markdown({**results, "goals": list(goals.values())})


def test_goals_of_a_scenario_that_did_not_run_are_not_run_not_failed() -> None:
    # A run of the yield or announced scenario alone judged tracking, footprint and CPU as failed; a goal with no
    # run behind it is neither passed nor failed, and says why (a run that never settled still fails).
    results = {"mode": "real", "tracking": {}, "yield": {}, "footprint": {}}
    goals = judge_goals(results)
    assert [g["pass"] for g in goals] == [None] * len(goals)
    assert all("not run" in g["note"] for g in goals)
    assert not any("FAIL" in row for row in render.goal_rows(goals))


def test_yield_metrics_from_a_real_log() -> None:
    """Times on the filler's clock: the context at 10.0, our last kernel ended 10.12, the job exited 20.0."""
    events = [
        {"t": 0.0, "event": "start", "wall_time": 1000.0},
        {"t": 10.1, "event": "yield", "signals": "process,memory", "reason": "process 7 on the GPU"},
        {"t": 10.13, "event": "drained", "last_kernel_end_t": 10.12},
        {"t": 23.2, "event": "resume"},
    ]
    m = to_json(analysis.yield_metrics(events, 10.0, 20.0, 3.0, context_begin_t=9.8))
    assert m["detect_s"]["value"] == pytest.approx(0.1) and m["yield_s"]["value"] == pytest.approx(0.12)
    assert m["yield_from_context_begin_s"]["value"] == pytest.approx(0.32)
    assert m["resume_s"]["value"] == pytest.approx(3.2) and m["yields"]["value"] == 1
    assert m["signals"] == "process,memory"
    # Our last kernel ended before the job's context existed: nothing of ours ran into it.
    early = [dict(events[1]), {"t": 10.13, "event": "drained", "last_kernel_end_t": 9.99}]
    assert analysis.yield_metrics(early, 10.0, 20.0, 3.0).yield_s.value == 0.0
    never = to_json(analysis.yield_metrics([events[0]], 10.0, 20.0, 3.0))
    assert never["detected"] is False and never["yield_s"]["value"] is None and never["yield_s"]["note"]


def test_announced_job_from_a_real_log() -> None:
    """The hold placed at 10.0 and answered at 10.15; the filler's last kernel ended 10.08; the job began creating
    its context at 10.4; released at 20.0, resumed at 21.1 (the filler's clock)."""
    events = [
        {"t": 0.0, "event": "start", "wall_time": 1000.0},
        {"t": 10.05, "event": "hold", "holder": "bench"},
        {"t": 10.1, "event": "drained", "last_kernel_end_t": 10.08},
        {"t": 21.1, "event": "resume"},
    ]
    j = to_json(analysis.announced_job(events, 10.0, 10.15, 0, 10.4, 20.0, 0))
    assert j["hold_s"]["value"] == pytest.approx(0.15) and j["acknowledged"] is True
    assert j["lead_s"]["value"] == pytest.approx(0.32) and j["own_kernels_while_held"]["value"] == 0
    assert j["resume_s"]["value"] == pytest.approx(1.1)
    # The wait ran out (exit 1): not acknowledged; a drain after the answer is no acknowledgement either.
    assert analysis.announced_job(events, 10.0, 10.15, 1, 10.4, 20.0, 0).acknowledged is False
    assert analysis.announced_job(events, 10.0, 10.02, 0, 10.4, 20.0, 0).acknowledged is False
    # Our kernel ran into the job's context creation: a negative lead time, as found by NVML.
    assert analysis.announced_job(events, 10.0, 10.15, 0, 10.0, 20.0, None).lead_s.value == pytest.approx(-0.08)
    never = to_json(analysis.announced_job(events[:1], 10.0, 10.15, 0, 10.4, 20.0, None))
    assert never["lead_s"]["value"] is None and never["lead_s"]["note"] == "the filler logged no hold"
    assert never["own_kernels_while_held"]["note"].startswith("n/a")
    # Assigned on the kubelet at 10.0 (no command answers); nobody announced (nvml): the filler's yield line.
    k = to_json(analysis.announced_job(events, 10.0, None, None, 10.4, 20.0, None, path="kubelet",
                                       own_kernels_while_ran=0))
    assert k["acknowledged"] is None and k["hold_s"]["value"] is None and k["lead_s"]["value"] == pytest.approx(0.32)
    assert k["held_after_s"]["value"] == pytest.approx(0.05) and k["own_kernels_while_ran"]["value"] == 0
    found = [{"t": 0.0, "event": "start"}, {"t": 10.5, "event": "yield"},
             {"t": 10.6, "event": "drained", "last_kernel_end_t": 10.55}]
    n = to_json(analysis.announced_job(found, 10.4, None, None, 10.4, 20.0, None, path="nvml",
                                       own_kernels_while_ran=7))
    assert n["lead_s"]["value"] == pytest.approx(-0.15) and n["held_after_s"]["value"] == pytest.approx(0.1)
    assert to_json(analysis.announced_job(events, 10.0, None, None, 10.4, 20.0, None, path="nvml"))["lead_s"][
        "note"] == "the filler logged no yield"


def test_announced_scenario_on_the_virtual_gpu(tmp_path: Path, vgpu_lib_dir: Path,
                                               capfd: pytest.CaptureFixture[str]) -> None:
    """Two jobs announced by `forge-load hold --wait 2`, two assigned their GPU on the test kubelet just before
    their process starts, two given it by a DRA claim there, and one nobody announces (nvml): for the announced
    ones the virtual GPU's record has none of our kernels on their GPU while they ran, and each lead time is > 0;
    nvml is the baseline, not judged."""
    out = tmp_path / "announced"
    code = cli.main(["--vgpu", "--scenarios", "announced", "--announced-by", "hold,kubelet,dra,nvml",
                     "--announced-jobs", "2", "--foreign-s", "2", "--warmup-s", "2", "--resume-after", "1",
                     "--out", str(out), "--foreign-args", "--backend numba --size 256"])
    printed = capfd.readouterr().out  # --vgpu runs the benchmark again in a child, on a fresh virtual GPU
    r = json.loads((out / "results.json").read_text())
    assert r["failures"] == [] and r["virtual_gpu"] is True, r["failures"]
    assert list(r["announced"]) == ["hold", "kubelet", "dra", "nvml"] and r["settings"]["announced_by"] == list(
        r["announced"])
    for path in ("hold", "kubelet", "dra"):
        m = r["announced"][path]
        assert m["announced"] is True and len(m["jobs"]) == 2 and m["every_lead_positive"] is True, m
        assert 0 < m["min_lead_s"]["value"] <= m["median_lead_s"]["value"] <= m["max_lead_s"]["value"]
        assert m["own_kernels_while_ran"]["value"] == 0, m
        for job in m["jobs"]:
            assert job["own_kernels_while_ran"]["value"] == 0 and job["resume_s"]["value"] is not None, job
            assert 0 < job["held_after_s"]["value"] < 2.0, job
    for job in r["announced"]["hold"]["jobs"]:
        assert job["acknowledged"] is True and job["own_kernels_while_held"]["value"] == 0, job
    for job in r["announced"]["kubelet"]["jobs"] + r["announced"]["dra"]["jobs"]:
        assert job["acknowledged"] is None and job["hold_s"]["value"] is None, job  # no command answers
    nvml = r["announced"]["nvml"]
    assert nvml["announced"] is False and len(nvml["jobs"]) == 2 and nvml["min_lead_s"]["value"] is not None
    rows = {line.split("|")[1].strip(): line for line in printed.splitlines()
            if line.startswith("| ") and line.count("|") == 7}
    assert all(rows[path].endswith("| 0 | yes |") for path in ("hold", "kubelet", "dra")), rows
    assert rows["nvml"].endswith("| n/a (not announced) |"), rows
    for path, leaf in leaves(r):
        if isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
            assert path in BARE_NUMBERS, f"{path} = {leaf} has no unit"
    assert code in (0, 1)  # 1: the goals of the scenarios not run are missed


@pytest.mark.docker
def test_announced_by_the_docker_watcher_on_the_virtual_gpu(tmp_path: Path, vgpu_lib_dir: Path) -> None:
    """A container asking for the GPU (`docker run --gpus device=0`) whose driver-API job opens its context 0.5 s
    after the container's first instruction; `forge-load fleet watch` holds the GPU from the create event: lead
    time > 0 and none of our kernels on the GPU while the job ran. Needs the engine of scripts/docker_engine.sh
    (skipped, saying why, without one)."""
    import docker_support

    docker_support.image(docker_support.engine(), os.environ.get("FORGE_BASE_IMAGE", "forge-base:bookworm"))
    out = tmp_path / "announced"
    cli.main(["--vgpu", "--scenarios", "announced", "--announced-by", "docker", "--announced-jobs", "2",
              "--foreign-s", "1", "--warmup-s", "2", "--resume-after", "1", "--out", str(out)])
    r = json.loads((out / "results.json").read_text())
    assert r["failures"] == [] and r["skipped"] == [], (r["failures"], r["skipped"])
    m = r["announced"]["docker"]
    assert len(m["jobs"]) == 2 and m["every_lead_positive"] is True and m["own_kernels_while_ran"]["value"] == 0, m


def test_announced_paths_that_cannot_run_here_are_left_out_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Docker engine: by default the docker path is left out with a note; asked for by name, it is a skip that
    says why. The other paths are planned."""
    from bench import scenarios

    monkeypatch.setenv("VGPU_STATE", "/nonexistent")  # as on the virtual GPU, past the first check
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    for argv, planned in ((["--scenarios", "announced"], ["hold", "kubelet", "dra", "nvml"]),
                          (["--scenarios", "announced", "--announced-by", "docker,nvml"], ["nvml"])):
        args = cli.parse_args(argv)
        results: dict[str, Any] = {"notes": [], "skipped": []}
        plan = scenarios.real_plan(args, None, results)  # type: ignore[arg-type]  # no bench: nothing runs
        assert [what.split()[2].rstrip(",") for what, _, _ in plan] == planned
        why = results["notes"] if "--announced-by" not in argv else results["skipped"]
        assert len(why) == 1 and "docker" in why[0] and "fails" in why[0], results


def test_the_runs_estimate_leaves_out_the_announced_paths_that_cannot_run_here(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first log line's estimate plans the run too: a default path that cannot run here (no Docker engine) is
    left out of it, not a KeyError before anything ran."""
    monkeypatch.setenv("VGPU_STATE", "/nonexistent")
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    args = cli.parse_args(["--scenarios", "announced", "--announced-jobs", "1"])
    assert cli.estimate_s(args) > 0


def test_cpu_percent_and_proc_stat() -> None:
    assert runner.cpu_percent([(0.0, 0), (5.0, 5 * runner.CLK_TCK // 100)], 0.0, 10.0) == pytest.approx(1.0, abs=0.2)
    assert runner.cpu_percent([(0.0, 0)], 0.0, 10.0) is None
    assert isinstance(runner.cpu_ticks(os.getpid()), int)
    assert runner.cpu_ticks(2**22 + 12345) is None


def test_no_gpu_is_a_clear_error_with_exit_3(tmp_path: Path) -> None:
    """Index 99 exists nowhere: exit 3 with a hint, whether or not this machine has a GPU."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--gpu", "99", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 3, proc.stderr
    assert "no usable GPU" in proc.stderr and "--simulate" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_bad_arguments_exit_2() -> None:
    assert cli.main(["--targets", "0.5,2"]) == 2
    assert cli.main(["--simulate", "--variants", "nope"]) == 2
    assert cli.main(["--simulate", "--scenarios", "cpu"]) == 2  # virtual time has no CPU cost
    assert cli.main(["--simulate", "--scenarios", "announced"]) == 2  # holds are files, in real time
    assert cli.main(["--scenarios", "announced", "--announced-jobs", "0"]) == 2
    assert cli.main(["--scenarios", "announced", "--announced-by", "slurm"]) == 2
    assert cli.main(["--scenarios", "announced", "--announced-by", "hold,hold"]) == 2
    assert cli.main(["--scenarios", "cpu", "--cpu-gpus", "1,9"]) == 2
    assert cli.main(["--scenarios", "cpu", "--cpu-s", "3"]) == 2


# --- the real path, end to end, on fakes --------------------------------------------------------------------

class FakeProbe:
    """NVML as the bench reads it: a GPU steady at 0.5, no processes (the filler runs on the simulator)."""

    def __init__(self, gpu: str) -> None:
        from forge_load.control.probe import DeviceInfo

        self.info = DeviceInfo(index=0, uuid="GPU-fake", name="Fake GPU", memory_total_mib=1000.0,
                               driver_version="0.0", mig_enabled=False)
        self.closed = False

    def utilization_samples(self, since_s: float) -> list[Any]:
        from forge_load.control.probe import UtilSample

        now = time.monotonic()
        k = math.floor(max(since_s, now - 2.0) * 6) + 1
        return [UtilSample(i / 6, 0.5) for i in range(k, math.floor(now * 6) + 1)]

    def utilization_ratio(self) -> float:
        return 0.5

    def memory_used_mib(self) -> float:
        return 100.0

    def processes(self) -> list[Any]:
        return []

    def power_w(self) -> float:
        return 150.0

    def close(self) -> None:
        self.closed = True


def processes_with_marker(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def test_real_path_end_to_end_on_fakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from forge_load.gpu import nvml

    monkeypatch.setattr(nvml, "NvmlProbe", FakeProbe)
    monkeypatch.setattr(nvml, "list_devices", lambda: [FakeProbe("0").info])
    marker = f"BENCH_TEST_MARKER={uuid.uuid4().hex}"
    monkeypatch.setenv(*marker.split("="))
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")  # the foreign job's numba backend, on the CPU
    out = tmp_path / "real"
    code = cli.main([
        "--out", str(out), "--track-s", "10", "--targets", "0.5", "--controllers", "pi",
        "--variants", "visible", "--scenarios", "tracking,yield", "--warmup-s", "1", "--foreign-s", "4",
        "--resume-after", "1", "--start-timeout", "60",
        # The simulated filler sees a foreign job of its own from 4.5 s to 9.5 s of its run: after the real
        # foreign job's context (about 1.5-2.5 s in), before that job ends (4 s of training later), so the
        # bench finds a yield inside the job and a resume after it, as on a GPU.
        "--filler-args", "--simulate --sim-speed 1 --sim-foreign 4.5-9.5",
        "--foreign-args", "--backend numba --size 16 --batch 16 --min-steps 1",
    ])
    printed = capsys.readouterr().out
    r = json.loads((out / "results.json").read_text())
    assert code == 0, r["failures"]
    assert r["mode"] == "real" and r["complete"] is True and r["gpu"]["name"] == "Fake GPU"
    m = r["tracking"]["pi"]["0.5"]
    assert m["settle_s"]["value"] == 1.0 and m["mae"]["value"] == 0.0  # the fake NVML reads 0.5 throughout
    assert m["power_w"]["value"] == 150.0
    assert m["cpu_pct_one_core"]["unit"] == "% of one core" and m["cpu_pct_one_core"]["value"] is not None
    assert r["footprint"]["cpu_pct_one_core"] == m["cpu_pct_one_core"]
    assert len(r["foreign_solo"]) == 2 and r["foreign_solo"][0]["backend"].startswith("numba")
    y = r["yield"]["pi_visible"]
    assert y["detected"] is True and y["signals"], y  # the simulated filler's own foreign job
    assert y["yield_s"]["value"] is not None and y["resume_s"]["value"] is not None, y
    assert y["foreign_throughput_ratio"]["value"] > 0 and y["solo_steps_per_s"]["value"] > 0
    assert y["foreign_steps"]["value"] >= 1
    assert r["foreign"]["solo_spread_ratio"]["unit"] == "ratio"
    assert "| pi | hidden" not in printed and "| pi | visible |" in printed
    for path, leaf in leaves(r):
        if isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
            assert path in BARE_NUMBERS, f"{path} = {leaf} has no unit"
    assert runner.CHILDREN.alive == []
    assert processes_with_marker(marker) == [], "a child of the benchmark outlived it"


def test_render_redraws_from_saved_results(sim_run: dict[str, Any], tmp_path: Path) -> None:
    """After a run on a machine without matplotlib: results.md, plots and the benchmark blocks from the files,
    linked relative to the page they go into."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(sim_run["out"], copy)
    for png in copy.glob("*.png"):
        png.unlink()
    section = tmp_path / "section.md"
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["--render", str(copy), "--section", str(section)]) == 0
    assert (copy / "results.md").read_text() == sim_run["md"]
    text = section.read_text()
    assert text.count("<!-- BENCH-TABLE -->") == 1 and text.count("<!-- /BENCH-SECTION -->") == 1
    assert "## The goals, from the latest run" in text and "No real-GPU run yet" in text
    assert "([all results](copy/results.md))" in text
    assert re.search(r"^\| 0\.5 \| 1\.0 / ", text, flags=re.M)
    if importlib.util.find_spec("matplotlib"):
        assert (copy / "tracking.png").exists() and "(copy/tracking.png)" in text
    assert cli.main(["--render", str(tmp_path / "nothing")]) == 2


@pytest.mark.gpu
def test_real_gpu_short_run(tmp_path: Path) -> None:
    """On a GPU machine: a short real run (about a minute) yields the whole result set."""
    out = tmp_path / "gpu"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--track-s", "15", "--targets", "0.5",
         "--controllers", "pi", "--variants", "visible", "--foreign-s", "5", "--start-timeout", "120",
         "--metric-s", "10"],
        capture_output=True, text=True, timeout=400, cwd=REPO)
    r = json.loads((out / "results.json").read_text())
    assert proc.returncode == 0, (proc.stderr[-3000:], r["failures"])
    assert r["mode"] == "real" and r["complete"] is True
    m = r["tracking"]["pi"]["0.5"]
    assert m["settle_s"]["value"] is not None and m["cpu_pct_one_core"]["value"] is not None
    fp = r["footprint"]
    assert fp["bare_context_mib"]["value"] and fp["filler_process_mib"]["value"]
    y = r["yield"]["pi_visible"]
    assert y["detected"] is True and y["yield_s"]["value"] is not None
    assert y["foreign_throughput_ratio"]["value"] is not None
    # the metric scenario: run where the GPU has GPM (Hopper and newer), else skipped with its reason
    if any(s.startswith("metric") for s in r["skipped"]):
        assert r["metric"] == {} and "GPM" in next(s for s in r["skipped"] if s.startswith("metric"))
    else:
        assert list(r["metric"]) == ["sm_activity", "gr_activity"], r["metric"]
        assert all(m["readings"]["value"] and m["read_meanwhile"]["utilization"]["value"] is not None
                   for m in r["metric"].values()), r["metric"]


def test_without_matplotlib_the_rest_is_written_and_it_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = tmp_path / "noplots"
    code = cli.main(["--simulate", "--track-s", "10", "--targets", "0.5", "--controllers", "pi",
                       "--scenarios", "tracking", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0
    r = json.loads((out / "results.json").read_text())
    assert r["plots"] == [] and "matplotlib is not installed" in r["plots_note"]
    assert "matplotlib is not installed" in captured.err and "matplotlib is not installed" in captured.out
    assert not list(out.glob("*.png")) and (out / "series.json").exists()


# --- the cpu scenario ----------------------------------------------------------------------------------------

CPU_UNITS = {"s", "ratio", "count", "% of one core", "launches/s", "us", "MiB", "ms", "calls/s", "wake-ups/s"}
CPU_RUN_KEYS = {"label", "gpus", "target", "duration_s", "cpu_pct_one_core", "cpu_pct_per_gpu", "steady_s",
                "launches_per_s_per_gpu", "cpu_us_per_launch", "startup_s", "startup_to_start_line_s",
                "startup_cpu_s", "settle_s", "mae", "p95_error", "mae_from_5s", "p95_error_from_5s", "mean_util",
                "yields", "tracking_from", "nvml_cost_ms", "repeat", "nvml_calls_per_s_per_gpu",
                "process_list_calls_per_s_per_gpu", "wakeups_per_s", "wakeups_per_s_by_thread", "threads", "rss_mib"}
CPU_GOALS = ["cpu_1gpu_0.5", "cpu_1gpu_0.8", "cpu_8gpus_0.5", "settle", "mae", "p95", "cpu20_1gpu_0.5",
             "cpu20_8gpus_0.5", "cpu20_1gpu_0.5_slow", "proc_lists", "startup_1gpu", "rss_1gpu"]


def check_cpu_results(r: dict[str, Any]) -> None:
    """The shape every cpu.json has: units on every number, a reason for every missing one, the six goals."""
    assert r["schema"] == 1 and r["scenario"] == "cpu" and r["mode"] == "real" and r["complete"] is True
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"]) and r["command"].startswith("python scripts/gpu_bench.py")
    assert r["machine"]["cpu_model"] and r["machine"]["logical_cpus"]["value"] >= 1
    assert r["machine"]["usable_cpus"]["value"] >= 1
    for path, leaf in leaves(r):
        if isinstance(leaf, dict):
            assert set(leaf) <= {"value", "unit", "note"} and leaf["unit"] in CPU_UNITS, (path, leaf)
            if leaf["value"] is None:
                assert leaf.get("note"), f"{path}: a missing number must say why"
        elif isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
            assert path in {("schema",), ("gpu", "index")}, f"{path} = {leaf} has no unit"
    for run in r["runs"]:
        assert set(run) == CPU_RUN_KEYS
        assert run["cpu_pct_one_core"]["unit"] == run["cpu_pct_per_gpu"]["unit"] == "% of one core"
        assert run["cpu_pct_one_core"]["value"] is not None and run["startup_cpu_s"]["value"] is not None
        assert run["cpu_pct_per_gpu"]["value"] == pytest.approx(run["cpu_pct_one_core"]["value"]
                                                                / run["gpus"]["value"], rel=1e-4)
        for key in ("settle_s", "mae", "p95_error"):  # a run may never settle (a busy machine): it says so
            assert run[key]["value"] is not None or run[key]["note"] == "never settled on at least one GPU"
    assert [g["key"] for g in r["goals"]] == CPU_GOALS
    for goal in r["goals"]:
        assert goal["pass"] in (True, False, None) and goal["limit"]["unit"] in CPU_UNITS


def test_cpu_scenario_on_the_virtual_gpu(tmp_path: Path, vgpu_lib_dir: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A short run of 1 GPU and 2 GPUs in one process: the files, their shape and their labels (not the numbers,
    which the benchmark is for)."""
    out = tmp_path / "cpu"
    section = tmp_path / "section.md"
    code = cli.main(["--vgpu", "--scenarios", "cpu", "--cpu-s", "7", "--targets", "0.5", "--cpu-gpus", "1,2",
                     "--cpu-nvml-costs", "0,4.5", "--out", str(out), "--section", str(section)])
    printed = capsys.readouterr()
    r = json.loads((out / "cpu.json").read_text())
    assert code == 0, r["failures"]
    assert not (out / "results.json").exists()  # the cpu scenario alone writes only its own files
    check_cpu_results(r)
    assert r["virtual_gpu"] is True and r["failures"] == [] and r["skipped"] == []
    assert r["gpu"]["name"] == "Virtual GPU (H100-like)" and r["gpu"]["driver"].endswith("-virtual")
    assert [(x["gpus"]["value"], x["target"]["value"], x["label"], x["nvml_cost_ms"]["value"])
            for x in r["runs"]] == [(1, 0.5, "1 GPU", 0.0), (2, 0.5, "2 GPUs in one process", 0.0),
                                    (1, 0.5, "1 GPU", 4.5), (2, 0.5, "2 GPUs in one process", 4.5)]
    for run in r["runs"]:  # the virtual GPU's record gives the first kernel and the launches
        assert run["tracking_from"] == "the virtual GPU's kernel record, 1/6-s windows"
        for key in ("startup_s", "launches_per_s_per_gpu", "cpu_us_per_launch", "wakeups_per_s", "rss_mib",
                    "process_list_calls_per_s_per_gpu"):
            assert run[key]["value"] is not None, (key, run[key])
        assert run["yields"]["value"] == 0
        assert run["nvml_calls_per_s_per_gpu"]["nvmlDeviceGetMemoryInfo_v2"]["value"] > 0  # the virtual GPU counts
        assert run["rss_mib"]["value"] > 10 and run["threads"]["value"] == len(run["wakeups_per_s_by_thread"])
        assert run["wakeups_per_s"]["value"] == pytest.approx(sum(w["value"] for w in run["wakeups_per_s_by_thread"]),
                                                              abs=1e-3)
    goals = {g["key"]: g for g in r["goals"]}
    assert goals["cpu_1gpu_0.5"]["measured"]["value"] == r["runs"][0]["cpu_pct_per_gpu"]["value"]
    assert goals["cpu_1gpu_0.8"]["pass"] is False and goals["cpu_1gpu_0.8"]["note"] == "no run of 1 GPU at 0.8"
    assert goals["cpu_8gpus_0.5"]["pass"] is False  # the virtual GPU has 8: a run left out is a goal missed
    assert goals["cpu20_1gpu_0.5_slow"]["measured"]["value"] == r["runs"][2]["cpu_pct_per_gpu"]["value"]
    assert goals["proc_lists"]["measured"]["value"] == r["runs"][0]["process_list_calls_per_s_per_gpu"]["value"]
    assert goals["startup_1gpu"]["measured"]["value"] == r["runs"][0]["startup_s"]["value"]
    assert goals["rss_1gpu"]["measured"]["value"] == r["runs"][0]["rss_mib"]["value"]
    md = (out / "cpu.md").read_text()
    assert "(virtual GPU)" in md.splitlines()[0] and "Virtual GPU: not a GPU measurement" in md
    assert printed.out.strip() == md.strip()
    assert "virtual GPU" in printed.err
    text = section.read_text()
    assert text.startswith("<!-- BENCH-CPU -->\n<!-- generated by scripts/gpu_bench.py --section from ")
    assert text.rstrip().endswith("<!-- /BENCH-CPU -->") and "<!-- BENCH-TABLE -->" not in text
    assert "on the virtual GPU (Virtual GPU (H100-like)" in text and "not hardware" in text
    for words in (md, text):  # "GPU measurement" only ever as "not a GPU measurement"
        assert words.count("GPU measurement") == words.count("not a GPU measurement") >= 1


def test_cpu_scenario_real_path_on_fakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Real mode without a GPU: NVML is the fake above (steady at 0.5, one GPU), the filler the simulated one in
    a child process. No kernel record there: start-up to the start line, tracking from NVML."""
    from forge_load.gpu import nvml

    monkeypatch.setattr(nvml, "NvmlProbe", FakeProbe)
    monkeypatch.setattr(nvml, "list_devices", lambda: [FakeProbe("0").info])
    out = tmp_path / "real_cpu"
    code = cli.main(["--scenarios", "cpu", "--cpu-s", "7", "--targets", "0.5", "--out", str(out),
                     "--filler-args", "--simulate --sim-speed 1"])
    capsys.readouterr()
    r = json.loads((out / "cpu.json").read_text())
    assert code == 0, r["failures"]
    check_cpu_results(r)
    assert r["virtual_gpu"] is False and r["gpu"]["name"] == "Fake GPU" and r["gpu"]["devices"]["value"] == 1
    [run] = r["runs"]
    assert run["gpus"]["value"] == 1 and run["tracking_from"] == "NVML's samples of GPU 0"
    assert run["settle_s"]["value"] == 1.0 and run["mae"]["value"] == 0.0  # the fake NVML reads 0.5 throughout
    assert run["startup_s"]["value"] is None and run["startup_s"]["note"].startswith("n/a (real GPU)")
    assert run["launches_per_s_per_gpu"]["value"] is None and run["startup_to_start_line_s"]["value"] > 0
    assert r["skipped"] == ["cpu: 8 GPUs in one process at 0.5 (7 s): this machine has 1 GPU(s)"]
    goals = {g["key"]: g for g in r["goals"]}
    assert goals["cpu_8gpus_0.5"]["pass"] is None and goals["cpu_8gpus_0.5"]["note"] == "n/a: this machine has 1 GPU(s)"
    for key in ("cpu20_1gpu_0.5_slow", "proc_lists"):  # a real driver neither takes a cost nor counts calls
        assert goals[key]["pass"] is None and goals[key]["note"].startswith("n/a"), goals[key]
    assert "Virtual GPU" not in (out / "cpu.md").read_text()
    assert runner.CHILDREN.alive == []



def test_the_cpu_block_names_each_saved_goal_as_the_code_does_now() -> None:
    """A run saves its goals' words as they were; the CPU block of docs/benchmarks.md names each by its key as
    bench/cpu.py's CPU_GOALS does now (the limit, the measure and the verdict stay the run's)."""
    out_dir = REPO / "docs" / "benchmarks" / "virtual_2026-11-27_light"
    saved = json.loads((out_dir / "cpu.json").read_text())
    saved["goals"][-1]["goal"] = "words of an older run"
    drawn = render.render_cpu_section(saved, out_dir)
    assert "words of an older run" not in drawn
    verdicts = ("| pass |", "| **FAIL** |", "| n/a |")
    rows = [line for line in drawn.splitlines() if line.startswith("| ") and line.endswith(verdicts)]
    assert [row.split(" | ")[0][2:] for row in rows] == [goal.goal for goal in GOALS_NOW]
    assert rows[-1] == f"| {GOALS_NOW[-1].goal} | ≤ 64.00 MiB | 42.947 MiB | pass |"


def test_the_benchmark_page_is_generated_from_the_committed_results() -> None:
    """Every generated block of docs/benchmarks.md is what --section draws from the results file it names
    (regenerate: python scripts/gpu_bench.py --render DIR --section docs/benchmarks.md)."""
    page = REPO / "docs" / "benchmarks.md"
    text = page.read_text()
    for name in ("BENCH-TABLE", "BENCH-SECTION", "BENCH-CPU", "BENCH-ANNOUNCED", "BENCH-METRIC", "BENCH-POWER"):
        pattern = rf"<!-- {name} -->.*?<!-- /{name} -->"
        block = re.search(pattern, text, re.S)
        assert block is not None, f"docs/benchmarks.md has no {name} block"
        source = re.search(r"--section from (\S+)/(results|cpu)\.json ", block.group(0))
        assert source is not None, block.group(0)[:300]
        out_dir = REPO / source.group(1)
        saved = json.loads((out_dir / f"{source.group(2)}.json").read_text())
        draw = {"BENCH-CPU": render.render_cpu_section, "BENCH-ANNOUNCED": render.render_announced_section,
                "BENCH-METRIC": render.render_metric_section, "BENCH-POWER": render_power_section}
        drawn = draw.get(name, render.render_section)(saved, out_dir, page)
        expected = re.search(pattern, drawn, re.S)
        assert expected is not None and block.group(0) == expected.group(0), name


def test_the_command_as_the_readme_writes_it_draws_with_the_projects_environment(tmp_path: Path) -> None:
    """`python3 scripts/gpu_bench.py` started by an interpreter outside .venv (which has matplotlib) runs in .venv,
    as scripts/vgpu does."""
    repo = Path(__file__).resolve().parents[1]
    venv_python = repo / ".venv" / "bin" / "python"
    outside = Path(sys.base_prefix) / "bin" / "python3"
    if not venv_python.exists() or not outside.exists():
        pytest.skip("needs the project's .venv and the interpreter it was made from")
    has_matplotlib = subprocess.run([str(outside), "-c", "import matplotlib"], capture_output=True).returncode == 0
    if has_matplotlib or subprocess.run([str(venv_python), "-c", "import matplotlib"]).returncode != 0:
        pytest.skip("needs matplotlib in .venv and not outside it")
    run_dir = tmp_path / "run"
    source = repo / "docs" / "benchmarks" / "simulated_2026-11-21"
    run_dir.mkdir()
    for name in ("results.json", "series.json"):
        (run_dir / name).write_bytes((source / name).read_bytes())
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    result = subprocess.run([str(outside), str(repo / "scripts" / "gpu_bench.py"), "--render", str(run_dir)],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "matplotlib is not installed" not in result.stdout + result.stderr
    assert list(run_dir.glob("*.png")), result.stdout[-2000:]

