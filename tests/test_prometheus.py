"""A real Prometheus server scrapes a simulated three-GPU filler on localhost; PromQL over what it scraped
shows every GPU with its state (one filling, one yielding to a foreign job, one lost), every query on the
Grafana dashboard evaluates there, and the shipped rules load and evaluate on it (the lost GPU's filler is
down; the one yielding is not busy beside the foreign job).

Needs Debian's `prometheus` (scripts/install_test_tools.sh); skipped, saying so, without it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.prometheus_harness import (
    EXPECTED_STATES,
    SCENARIO_FLAGS,
    SCRAPE_INTERVAL_S,
    Filler,
    Prometheus,
    health,
    prometheus_binary,
    states_by_gpu,
    wait_for,
)

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "forge_load_dashboard.json"
RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "forge_load_rules.yaml"
BINARY = prometheus_binary()
pytestmark = pytest.mark.skipif(BINARY is None, reason="needs Debian's `prometheus` binary on PATH "
                                                        "(scripts/install_test_tools.sh installs it)")


@pytest.fixture(scope="module")
def scraped() -> Iterator[tuple[Filler, Prometheus]]:
    assert BINARY is not None
    with Filler(*SCENARIO_FLAGS) as filler, \
            Prometheus(BINARY, [f"127.0.0.1:{filler.port}"], rule_files=(RULES,)) as prometheus:
        # The failure is at 3 s and the yield at 1 s of the filler's clock; give Prometheus a few scrapes.
        wait_for("GPUs 0, 1, 2 filling, yielding and failed in Prometheus",
                 lambda: states_by_gpu(prometheus) == EXPECTED_STATES or None, timeout_s=30)
        wait_for("5 scrapes after the failure",
                 lambda: len(prometheus.query('forge_load_up{gpu="2"}[10s]')[0]["values"]) >= 5 or None,
                 timeout_s=20)
        yield filler, prometheus


def by_gpu(results: list[dict[str, object]]) -> dict[str, float]:
    return {r["metric"]["gpu"]: float(r["value"][1]) for r in results}  # type: ignore[index]


def test_promql_shows_every_gpu_and_its_state(scraped: tuple[Filler, Prometheus]) -> None:
    _, prometheus = scraped
    results = prometheus.query("forge_load_state == 1")
    assert sorted((r["metric"]["gpu"], r["metric"]["state"]) for r in results) == sorted(EXPECTED_STATES.items())
    uuids = {r["metric"]["gpu"]: r["metric"]["UUID"] for r in results}
    assert uuids == {g: f"GPU-51a00000-0000-4000-8000-00000000000{g}" for g in "012"}
    assert by_gpu(prometheus.query("forge_load_yields_total")) == {"0": 0.0, "1": 1.0, "2": 0.0}
    assert by_gpu(prometheus.query("forge_load_up")) == {"0": 1.0, "1": 1.0, "2": 0.0}
    assert by_gpu(prometheus.query("forge_load_target_ratio")) == {"0": 0.5, "1": 0.0}  # none for a lost GPU
    assert by_gpu(prometheus.query('count by (gpu) (forge_load_state{state="yielding"} == 1)')) == {"1": 1.0}


def test_the_other_gpus_go_on_after_one_is_lost(scraped: tuple[Filler, Prometheus]) -> None:
    filler, prometheus = scraped
    # Over the last 4 s (all after the failure), GPU 0's own busy time grew by about half of it; GPU 2's not at all.
    grown = by_gpu(prometheus.query("delta(forge_load_own_busy_seconds_total[4s])"))
    assert grown["2"] == 0.0
    assert grown["0"] > 0.8, grown
    assert by_gpu(prometheus.query("min_over_time(forge_load_own_utilization_ratio[4s])"))["0"] > 0.4
    assert by_gpu(prometheus.query("max_over_time(forge_load_foreign_utilization_ratio[4s])"))["1"] > 0.5
    status, body = health(filler.port)
    assert status == 503 and "gpu 2 GPU-51a00000-0000-4000-8000-000000000002: failed" in body


def test_prometheus_scrapes_the_exposition_cleanly(scraped: tuple[Filler, Prometheus]) -> None:
    _, prometheus = scraped
    (target,) = prometheus.targets()
    assert target["health"] == "up" and target["lastError"] == ""
    assert prometheus.query('up{job="forge_load"}')[0]["value"][1] == "1"
    # Counters arrive as counters: rate() over them is never negative and the names keep _total. Five per GPU:
    # yields, seconds yielding, our busy seconds, the device's energy while filling, and holds begun.
    assert prometheus.query('count({__name__=~"forge_load_.*_total"})')[0]["value"][1] == str(3 * 5)
    assert prometheus.query('count(forge_load_energy_joules_total > 0)')[0]["value"][1] == "3"


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    return exprs


def test_every_dashboard_query_evaluates_on_the_scraped_series(scraped: tuple[Filler, Prometheus]) -> None:
    _, prometheus = scraped
    queries = dashboard_queries()
    assert len(queries) >= 10
    for expr in queries:
        concrete = expr.replace("$UUID", ".*").replace("$__rate_interval", f"{4 * SCRAPE_INTERVAL_S}s")
        results = prometheus.query(concrete)  # a PromQL syntax error fails here
        if "DCGM_FI_" in expr or ":forge_load_" in expr or "changes(forge_load_yields_total" in expr:
            continue  # no dcgm-exporter here, nor the split recorded from it; no yield in the last minute
        assert results, f"no series for dashboard query {expr!r}"
        for result in results:
            if "gpu" in result["metric"] and "group_left(hostname)" in expr:
                assert result["metric"].get("hostname"), (expr, result)  # the join with forge_load_gpu_info held


def test_the_rules_load_and_evaluate_on_the_scraped_series(scraped: tuple[Filler, Prometheus]) -> None:
    filler, prometheus = scraped
    rules = prometheus.rules()
    assert {r["group"] for r in rules} == {"forge_load.split", "forge_load.alerts"}
    assert all(r["health"] == "ok" and not r.get("lastError") for r in rules), rules
    # GPU 2 was lost: its filler is down (pending: `for` is 5 minutes). GPU 1 stepped aside: nothing else.
    alerts = wait_for("ForgeLoadDown pending for GPU 2",
                      lambda: [a for a in prometheus.alerts() if a["labels"]["alertname"] == "ForgeLoadDown"] or None,
                      timeout_s=10)
    assert [(a["labels"]["gpu"], a["labels"]["UUID"], a["state"]) for a in alerts] == [
        ("2", "GPU-51a00000-0000-4000-8000-000000000002", "pending")]
    assert {a["labels"]["alertname"] for a in prometheus.alerts()} == {"ForgeLoadDown"}
    assert alerts[0]["annotations"]["summary"] == (
        f"forge_load is down on GPU 2 (GPU-51a00000-0000-4000-8000-000000000002) at 127.0.0.1:{filler.port}")


def test_the_state_panel_encodes_each_gpus_state(scraped: tuple[Filler, Prometheus]) -> None:
    _, prometheus = scraped
    (expr,) = [e for e in dashboard_queries() if 'state="filling"' in e and "ignoring(state)" in e]
    codes = by_gpu(prometheus.query(expr.replace("$UUID", ".*")))
    assert codes == {"0": 1.0, "1": 3.0, "2": 4.0}  # filling, yielding, failed in the panel's value mappings
    mappings = json.loads(DASHBOARD.read_text())
    panel = next(p for p in mappings["panels"] if p["type"] == "state-timeline")
    texts = {k: v["text"] for m in panel["fieldConfig"]["defaults"]["mappings"] for k, v in m["options"].items()}
    assert {texts[str(int(v))] for v in codes.values()} == {"filling", "yielding", "failed"}
    assert re.search(r"\b1 \* forge_load_state", expr)


def test_stopping_the_filler_exits_4_after_a_lost_gpu(scraped: tuple[Filler, Prometheus]) -> None:
    # Last in this module: it ends the filler the fixture shares.
    filler, _ = scraped
    assert filler.stop() == 4
    stops = {e["gpu"]: e["reason"] for e in filler.lines if e["event"] == "stop"}
    assert stops == {0: "signal SIGTERM", 1: "signal SIGTERM"}
