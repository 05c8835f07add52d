"""The benchmark's power scenario (bench/power.py): what it refuses, its goals on made-up results, and a short run on
the virtual GPU, whose power is a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import cli
from bench.results import q


@pytest.mark.parametrize(("argv", "message"), [
    (["--simulate", "--scenarios", "power"], "--scenarios power: needs real mode"),
    (["--scenarios", "power", "--power-s", "30"], "--power-s 30: expected 60 to 3600 seconds on a real GPU"),
    (["--scenarios", "power", "--power-shapes", "lean,fma"], "--power-shapes: expected some of lean, burn"),
    (["--scenarios", "power", "--power-targets", "0.5,1.5"], "--power-targets: each must be in (0, 1]"),
])
def test_the_power_scenario_refuses_what_it_cannot_measure(argv: list[str], message: str,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("VGPU_STATE", raising=False)
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def _window(energy_w: float, util: float | None = None) -> dict[str, Any]:
    return {"energy_mean_w": q(energy_w, "W"), "utilization": q(util, "ratio")}


def test_the_power_goals_judge_lean_at_half_against_the_contexts_idle_and_the_limit() -> None:
    from bench.power import judge_power_goals

    results: dict[str, Any] = {"gpu": {"power_limit_w": q(700.0, "W")}, "virtual_gpu": False, "power": {
        "idle_context": _window(70.0),
        "lean_0.5": {**_window(132.9, 0.52), "shape": "lean", "tracking_error": q(0.02, "ratio"),
                     "warps_per_sm": q(None, "count", "n/a (only the virtual GPU keeps a record of every kernel)")},
        "lean_0.25": {**_window(71.0, 0.21), "shape": "lean", "tracking_error": q(-0.04, "ratio")},
        "burn_0.5": {**_window(385.0, 0.5), "shape": "burn", "tracking_error": q(0.0, "ratio")}}}
    goals = {g["key"]: g for g in judge_power_goals(results)}
    assert goals["power_lean"]["limit"]["value"] == 133.0 and goals["power_lean"]["pass"] is True  # 70 + 0.1 x 630
    assert goals["power_tracking"]["measured"]["value"] == 0.04 and goals["power_tracking"]["pass"] is False
    assert goals["power_warps"]["pass"] is None  # a real GPU keeps no kernel record
    del results["power"]["idle_context"]
    assert {g["key"]: g for g in judge_power_goals(results)}["power_lean"]["pass"] is None  # nothing to judge by


def test_power_scenario_on_the_virtual_gpu(tmp_path: Path, vgpu_lib_dir: Path) -> None:
    """Short windows on the virtual GPU: the board bare and with a context, the lean kernel holding utilization and
    SM activity; every watt the model's (docs/design.md §15)."""
    out = tmp_path / "power"
    code = cli.main(["--vgpu", "--scenarios", "power", "--power-s", "5", "--power-settle-s", "3", "--power-targets",
                     "0.5", "--power-shapes", "lean", "--out", str(out)])
    r = json.loads((out / "results.json").read_text())
    assert code == 0 and r["failures"] == [] and r["virtual_gpu"] is True, r["failures"]
    power = r["power"]
    assert list(power) == ["idle_no_context", "idle_context", "lean_0.5", "lean_sm_activity_0.5"]
    assert power["idle_no_context"]["energy_mean_w"]["value"] == pytest.approx(32.0, abs=0.5)
    assert power["idle_context"]["energy_mean_w"]["value"] == pytest.approx(70.0, abs=0.5)
    lean, per_sm = power["lean_0.5"], power["lean_sm_activity_0.5"]
    assert lean["energy_mean_w"]["value"] == pytest.approx(70.0, abs=0.5)
    assert per_sm["energy_mean_w"]["value"] == pytest.approx(70.0 + 0.5 * 132 * 1.97 / 80, abs=0.5)
    assert lean["utilization"]["value"] == pytest.approx(0.5, abs=0.03)
    assert per_sm["sm_util"]["value"] == pytest.approx(0.5, abs=0.03)
    assert lean["sm_util"]["value"] == pytest.approx(0.5 / 132, abs=0.002)
    assert lean["warps_per_sm"]["value"] == per_sm["warps_per_sm"]["value"] == 1
    assert lean["sm_clock_mhz"]["value"] is None and "NVMLError" in lean["sm_clock_mhz"]["note"]  # not offered
    assert {g["key"]: g["pass"] for g in r["goals"] if g["key"].startswith("power")} == {
        "power_lean": True, "power_tracking": True, "power_warps": True}
    assert "### Power" in (out / "results.md").read_text()
