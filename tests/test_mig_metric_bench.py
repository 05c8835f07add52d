"""scripts/mig_metric_bench.py's verdicts and the block it writes into docs/benchmarks.md, on made-up results."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mig_metric_bench", ROOT / "scripts" / "mig_metric_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _results(job_mean_error: float, gap_s: float | None) -> dict[str, Any]:
    held = {"settle_s": 1.5, "mean_error": 0.001, "p95_abs_error": 0.01}
    return {"date": "2026-11-27", "machine": "test", "seconds": 20,
            "tracking": [{"metric": "sm_activity", "utilization": held, "sm_activity": held, "gr_activity": held}],
            "mig": [{"gpu_instance": 3, "mean_error": 0.0, "busy_while_job_ran": {"max_abs_error": 0.06}},
                    {"gpu_instance": 4, "mean_error": job_mean_error, "job": {}, "last_kernel_after_context_s": gap_s}]}


def test_each_goal_is_judged_against_its_bar() -> None:
    verdicts = {goal: met for goal, _, _, met in _bench().goals(_results(0.04, 0.25))}
    assert verdicts["sm_activity held at 0.5: settle"] and verdicts["sm_activity held at 0.5: mean error"]
    assert not verdicts["MIG device GI 3: busy share while the job ran, each second"]  # 0.06 > 0.05
    assert not verdicts["MIG device GI 4: busy share, mean"]  # 0.04 > 0.03
    assert not verdicts["MIG device GI 4 (the job's): our last kernel after the job's context"]  # 0.25 > 0.2
    assert _bench().goals(_results(0.0, -0.03))[-1][3]  # ended before the job's context: met


def test_the_section_is_one_marked_block_that_says_virtual_gpu(tmp_path: Path) -> None:
    text = _bench().section(_results(0.0, 0.1), tmp_path)
    assert text.startswith("<!-- BENCH-MIG -->") and text.rstrip().endswith("<!-- /BENCH-MIG -->")
    assert "**the virtual GPU**" in text and "not a GPU measurement" in text
    assert "6 of 7 goals met" in text  # GI 3 moved 0.06 while the job ran
