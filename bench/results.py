"""The results: numbers with their units, the typed records each scenario fills, the goals and their judging.

Scenarios build typed records (`Quantity`, `TrackingMetrics`, `YieldMetrics`, ...) and store them in the results
tree as JSON (`to_json`), which is what results.json holds and what rendering reads, so that `--render` from a
saved run and a fresh run draw from the same thing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

SCHEMA = 1
TARGETS = (0.3, 0.5, 0.8)
CONTROLLERS = ("pi", "legacy")
YIELD_TARGET = 0.5
FOOTPRINT_TARGET = 0.5
JUDGE_FROM_S = 5.0  # the "from 5 s" errors: readings from the settle goal on, whether or not it settled

Json = dict[str, Any]


@dataclass(frozen=True)
class Quantity:
    """A number with its unit; a missing one (None) says why in `note`."""

    value: float | int | None
    unit: str
    note: str | None = None

    @classmethod
    def of(cls, value: float | int | None, unit: str, note: str | None = None) -> Quantity:
        """NaN and inf become None (JSON has neither), floats are rounded to 6 places, and a missing number
        without a note is "not measured"."""
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        if isinstance(value, float):
            value = round(value, 6)
        if value is None and not note:
            note = "not measured"
        return cls(value, unit, note)

    def to_json(self) -> Json:
        out: Json = {"value": self.value, "unit": self.unit}
        if self.note:
            out["note"] = self.note
        return out


def measured(value: float | int | None, unit: str, why_missing: str) -> Quantity:
    """A number whose note only says why it is missing (a note on a present number describes it)."""
    return Quantity.of(value, unit, why_missing if value is None else None)


def q(value: float | int | None, unit: str, note: str | None = None) -> Json:
    """A number with its unit, as results.json holds it: {"value", "unit"[, "note"]}."""
    return Quantity.of(value, unit, note).to_json()


def val(quantity: Json | None) -> Any:
    return None if quantity is None else quantity.get("value")


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "gpu"


def optional(json_name: str | None = None) -> Any:
    """A field some modes leave out: absent from the JSON while None."""
    return field(default=None, metadata={"json": json_name} if json_name else {})


def to_json(record: Any) -> Any:
    """A record as results.json holds it: its fields in order, optional ones left out while None."""
    if isinstance(record, Quantity):
        return record.to_json()
    if is_dataclass(record) and not isinstance(record, type):
        out: Json = {}
        for f in fields(record):
            value = getattr(record, f.name)
            if value is None and f.default is None:
                continue
            out[f.metadata.get("json") or f.name] = to_json(value)
        return out
    if isinstance(record, dict):
        return {k: to_json(v) for k, v in record.items()}
    if isinstance(record, (list, tuple)):
        return [to_json(v) for v in record]
    return record


# --- the scenarios' records ---------------------------------------------------------------------------------

@dataclass
class TrackingMetrics:
    """How one run held its target, from 1-s readings; what the mode adds after the scoring is optional."""

    target: Quantity
    duration_s: Quantity
    settle_s: Quantity
    mae: Quantity
    p95_error: Quantity
    within_005: Quantity = field(metadata={"json": "within_0.05"})
    seconds_judged: Quantity
    mae_from_5s: Quantity
    p95_error_from_5s: Quantity
    mean_util: Quantity
    power_w: Quantity | None = optional()
    yields: Quantity | None = optional()
    gpu_mem_mib: Quantity | None = optional()
    gpu_mem_mib_logged: Quantity | None = optional()  # real GPU: what the start line said
    device_mem_used_mib: Quantity | None = optional()
    cpu_pct_one_core: Quantity | None = optional()
    warning: str | None = optional()


@dataclass
class YieldMetrics:
    """One foreign job against the filler, on the filler's clock. The simulated GPU adds the worst-case bound;
    a real GPU the foreign job's own throughput."""

    foreign_start_t: Quantity
    foreign_end_t: Quantity
    detected: bool
    signals: str
    reason: str
    detect_s: Quantity
    yield_s: Quantity
    resume_s: Quantity
    resume_after_s: Quantity
    yields: Quantity
    resumes_while_foreign: Quantity
    yield_from_context_begin_s: Quantity | None = optional()
    foreign_steps_per_s: Quantity | None = optional()
    foreign_steps: Quantity | None = optional()
    solo_steps_per_s: Quantity | None = optional()
    foreign_throughput_ratio: Quantity | None = optional()
    foreign_lost_s: Quantity | None = optional()
    foreign_elapsed_s: Quantity | None = optional()
    foreign_contended_s: Quantity | None = optional()
    foreign_busy_s: Quantity | None = optional()
    foreign_worst_case_ratio: Quantity | None = optional()
    controller: str | None = optional()
    variant: str | None = optional()
    label: str | None = optional()
    target: Quantity | None = optional()


@dataclass
class MetricRun:
    """The filler holding one GPM metric (FORGE_METRIC) at its target, judged by the benchmark's own 1-s GPM
    readings (bench/metric.py); `read_meanwhile` is the mean 1-s reading of every metric read, the held one
    included, from `read_from` on."""

    metric: str
    target: Quantity
    duration_s: Quantity
    readings: Quantity
    settle_s: Quantity
    mean_error: Quantity  # signed: mean reading - target
    p95_abs_error: Quantity
    read_meanwhile: dict[str, Quantity]
    read_from: str
    yields: Quantity | None = optional()
    warning: str | None = optional()


# The announced scenario's paths: how a job's GPU is announced to the filler before the job runs, and `nvml`,
# the baseline nobody announces (the filler finds the job by its NVML signals).
ANNOUNCED_PATHS = ("hold", "kubelet", "dra", "docker", "nvml")
ANNOUNCED_LABELS = {
    "hold": "`forge-load hold --wait 2` (the Slurm prolog's call)",
    "kubelet": "the kubelet's pod-resources List (a test kubelet assigns the GPU just before the job's process "
               "starts; the filler polls it)",
    "dra": "a DRA claim in the kubelet's pod-resources List (a test kubelet lists a claim of NVIDIA's driver naming "
           "the GPU by its minor number just before the job's process starts; the filler polls it and finds the GPU "
           "through NVML)",
    "docker": "`forge-load fleet watch`, from the container's create event (the job opens its context 0.5 s after "
              "the container's first instruction)",
    "nvml": "not announced: found by the filler's NVML signals",
}


@dataclass
class AnnouncedJob:
    """One foreign job, announced by its path (or by none, `nvml`), on wall time."""

    hold_s: Quantity  # the hold command, from its start to its exit: what a prolog pays for it (path hold)
    acknowledged: bool | None  # exit 0 with the drain acknowledged (path hold); None where nothing answers
    held_after_s: Quantity  # from the announcement to the filler's hold line (its yield line for nvml)
    lead_s: Quantity  # the job's context creation began, minus the end of our last kernel before it
    own_kernels_while_held: Quantity  # ours on the GPU from the hold's answer to the release (virtual GPU)
    own_kernels_while_ran: Quantity  # ours on the job's GPU from its context creation to its exit (virtual GPU)
    resume_s: Quantity  # from the release (the job's end where nothing is released) to the filler's resume line


@dataclass
class AnnouncedMetrics:
    """Jobs on one path against the filler at the yield target; for an announced path each job's lead time
    should be > 0 and none of our kernels should run on its GPU while it runs."""

    jobs: list[AnnouncedJob]
    min_lead_s: Quantity
    every_lead_positive: bool
    mean_hold_s: Quantity
    path: str = "hold"
    label: str | None = optional()
    announced: bool = True  # False for nvml: the goal is not judged on it
    median_lead_s: Quantity | None = optional()
    max_lead_s: Quantity | None = optional()
    own_kernels_while_ran: Quantity | None = optional()  # the sum over its jobs
    controller: str | None = optional()
    target: Quantity | None = optional()


@dataclass
class Scenario:
    """One run's numbers and the series to plot."""

    name: str
    metrics: Any  # a record (TrackingMetrics, YieldMetrics) or its JSON
    series: dict[str, Any] = field(default_factory=dict)


def add_tracking(results: Json, scenario: Scenario) -> None:
    metrics = to_json(scenario.metrics)
    controller = scenario.name.split("_")[1]
    target = val(metrics["target"])
    results["tracking"].setdefault(controller, {})[f"{target:g}"] = metrics
    results["_series"][scenario.name] = scenario.series
    pi, legacy = results["tracking"].get("pi", {}), results["tracking"].get("legacy", {})
    for key in pi:
        if key in legacy:
            results["tracking"].setdefault("legacy_over_pi", {})[key] = legacy_over_pi(pi[key], legacy[key])


def add_scenario(results: Json, kind: str, scenario: Scenario) -> None:
    results[kind][scenario.name.split("_", 1)[1]] = to_json(scenario.metrics)
    results["_series"][scenario.name] = scenario.series


def legacy_over_pi(pi: Json, legacy: Json) -> Json:
    """legacy / pi for each error and the settle time: how many times worse the original law is."""
    out: Json = {}
    for key in ("settle_s", "mae", "p95_error", "mae_from_5s", "p95_error_from_5s"):
        a, b = val(pi.get(key)), val(legacy.get(key))
        if a is None or b is None:
            out[key] = q(None, "x", "legacy never settled" if b is None else "pi never settled")
        elif a == 0:
            out[key] = q(None, "x", "pi's value is 0")
        else:
            out[key] = q(b / a, "x")
    return out


# --- goals --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Goal:
    key: str
    goal: str
    op: str  # "<=" or ">="
    limit: float
    unit: str


# The goals of tracking, yield and footprint, judged on our controller's (pi's) numbers.
GOALS = (
    Goal("settle", "settle time (worst target)", "<=", 5.0, "s"),
    Goal("mae", "mean abs error after settling (worst target)", "<=", 0.02, "ratio"),
    Goal("p95", "p95 abs error after settling (worst target)", "<=", 0.05, "ratio"),
    Goal("yield", "yield: foreign context to our last kernel (worst variant)", "<=", 0.5, "s"),
    Goal("foreign", "foreign job throughput vs solo (worst variant)", ">=", 0.99, "ratio"),
    Goal("memory", "filler GPU memory over a bare context", "<=", 16.0, "MiB"),
    Goal("cpu", "filler host CPU at 0.5", "<=", 5.0, "% of one core"),
)


# The metric scenario's goals, judged over the GPM metrics held; only where the run asked for the scenario, so
# that the results of runs from before it read as they did.
METRIC_GOALS = (
    Goal("metric_settle", "GPM metric held at 0.5: settle time (worst metric)", "<=", 3.0, "s"),
    Goal("metric_mean", "GPM metric held at 0.5: mean error after settling, absolute (worst metric)", "<=", 0.02,
         "ratio"),
    Goal("metric_p95", "GPM metric held at 0.5: p95 abs 1-s error after settling (worst metric)", "<=", 0.05,
         "ratio"),
)


def worst(values: list[float | None], higher_is_worse: bool) -> float | None:
    if not values or any(v is None for v in values):
        return None  # a missing number (never settled, never yielded) fails the goal
    present = [v for v in values if v is not None]
    return max(present) if higher_is_worse else min(present)


def judge(goal: Goal, value: float | None, over: str, note: str | None) -> Json:
    """One goal's entry: pass True/False, or None where the mode cannot measure it (a note "n/a ...")."""
    if note and note.startswith("n/a"):
        ok = None
    elif value is None:
        ok = False
        note = note or "not measured, or never reached"
    else:
        ok = value <= goal.limit if goal.op == "<=" else value >= goal.limit
    entry: Json = {"key": goal.key, "goal": goal.goal, "limit": q(goal.limit, goal.unit), "op": goal.op,
                   "measured": q(value, goal.unit, note if value is None else None), "over": over, "pass": ok}
    if note:
        entry["note"] = note
    return entry


def judge_goals(results: Json) -> list[Json]:
    """Each of GOALS (tracking, yield, footprint) against our controller's (pi's) numbers: pass True/False, or
    None where the mode cannot measure it (footprint on the simulated GPU); then the metric and power scenarios'
    goals where the run asked for them."""
    simulated = results["mode"] == "simulated"
    pi = results["tracking"].get("pi", {})
    pi_yields = {k: v for k, v in results["yield"].items() if v.get("controller") == "pi"}
    footprint = results.get("footprint", {})
    measured: dict[str, tuple[float | None, str, str | None]] = {
        "settle": (worst([val(m["settle_s"]) for m in pi.values()], True), "pi at " + ", ".join(pi), None),
        "mae": (worst([val(m["mae"]) for m in pi.values()], True), "pi at " + ", ".join(pi), None),
        "p95": (worst([val(m["p95_error"]) for m in pi.values()], True), "pi at " + ", ".join(pi), None),
        "yield": (worst([val(m["yield_s"]) for m in pi_yields.values()], True), ", ".join(pi_yields), None),
    }
    if simulated:
        measured["foreign"] = (worst([val(m["foreign_worst_case_ratio"]) for m in pi_yields.values()], False),
                               ", ".join(pi_yields), "simulated worst-case bound: 1 - contended / foreign busy")
        measured["memory"] = (None, "", "n/a (simulated)")
        measured["cpu"] = (None, "", "n/a (simulated)")
    else:
        measured["foreign"] = (worst([val(m["foreign_throughput_ratio"]) for m in pi_yields.values()], False),
                               ", ".join(pi_yields), None)
        measured["memory"] = (val(footprint.get("over_bare_mib")), "filler at 0.5 vs bare context", None)
        measured["cpu"] = (val(footprint.get("cpu_pct_one_core")), "filler at 0.5", None)
    asked = results.get("settings", {}).get("scenarios", ())

    def no_footprint(key: str) -> bool:
        # A run that did not ask for the footprint (--scenarios metric, say) still reads idle power: not a footprint.
        return not simulated and (not footprint or ("footprint" not in asked and val(footprint.get(key)) is None))

    not_run = {"settle": not pi, "mae": not pi, "p95": not pi, "yield": not pi_yields, "foreign": not pi_yields,
               "memory": no_footprint("over_bare_mib"), "cpu": no_footprint("cpu_pct_one_core")}
    scenario = {"settle": "tracking", "mae": "tracking", "p95": "tracking", "yield": "yield", "foreign": "yield",
                "memory": "footprint", "cpu": "footprint"}
    for key, missing in not_run.items():
        if missing:  # no run behind the goal: neither passed nor failed
            measured[key] = (None, "", f"n/a (the {scenario[key]} scenario was not run)")
    goals = [judge(goal, *measured[goal.key]) for goal in GOALS]
    if "metric" in asked:
        goals += judge_metric_goals(results)
    if "power" in asked:
        from bench.power import judge_power_goals  # it builds on this module

        goals += judge_power_goals(results)
    return goals


def judge_metric_goals(results: Json) -> list[Json]:
    runs = results.get("metric", {})
    over = ", ".join(runs)
    settles = [val(m["settle_s"]) for m in runs.values()]
    means = [val(m["mean_error"]) for m in runs.values()]
    p95s = [val(m["p95_abs_error"]) for m in runs.values()]
    measured: dict[str, tuple[float | None, str, str | None]] = {
        "metric_settle": (worst(settles, True), over, None),
        "metric_mean": (worst([None if v is None else abs(v) for v in means], True), over, None),
        "metric_p95": (worst(p95s, True), over, None),
    }
    if not runs:  # no GPM here (the reason is under skipped), the budget left it out, or it failed
        why = next((s.split(": ", 1)[1] for s in results.get("skipped", []) if s.startswith("metric")),
                   "the metric scenario was not run")
        measured = {key: (None, "", f"n/a ({why})") for key in measured}
    return [judge(goal, *measured[goal.key]) for goal in METRIC_GOALS]
