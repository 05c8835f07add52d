"""The power scenario (`--scenarios power`, real mode only): what the filler costs in watts, for each kernel shape
(FORGE_SHAPE: lean, burn) at each target (0.25, 0.5 and 1.0 by default), beside the idle board without a CUDA
context and with one (scripts/bare_context.py --hold-s). Each is a window of at least 60 s on a real GPU (NVML's
power readings sample a fraction of the time on A100/H100, docs/design.md §15: the energy counter over a long window
is the number), shorter on the virtual GPU, whose power is a model.

Read by the benchmark itself, in its own process (PowerReader, pynvml directly, beside bench/sampler.py's utilization
samples): NVML's total energy counter at the window's ends, its power readings, the SM and memory clocks and the
performance state, and GPM's SM_UTIL and SM_OCCUPANCY from its own 1-s sample pairs where the GPU has GPM. A reading
NVML does not offer on this GPU is left out and said so. On the virtual GPU the kernel record shows how many warps
each launch put on an SM."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench import REPO
from bench.analysis import first, status_series
from bench.real import RealBench
from bench.results import Goal, Json, judge, mean, q, val
from bench.runner import Child

POWER_SHAPES = ("lean", "burn")
POWER_TARGETS = (0.25, 0.5, 1.0)
POWER_S = 60.0  # the window on a real GPU, at least
POWER_SETTLE_S = 10.0  # filling before the window opens
READ_EVERY_S = 0.25
GPM_EVERY_S = 1.0
IDLE_KEYS = ("idle_no_context", "idle_context")
LEAN_BUDGET_RATIO = 0.1  # the goal: lean at 0.5 within the context's idle + this share of the span to the limit
TRACK_TOLERANCE_RATIO = 0.03  # the goal: NVML utilization's mean over the window within this of the target


class PowerReader(threading.Thread):
    """NVML's readings for the power scenario, every READ_EVERY_S (GPM every GPM_EVERY_S): (wall time, value) per
    kind. What NVML answers with an error on this GPU is read no more, and `missing` says why."""

    def __init__(self, gpu: int) -> None:
        super().__init__(daemon=True, name="power-reader")
        import pynvml

        self.n = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.readings: dict[str, list[tuple[float, float]]] = {
            k: [] for k in ("power_w", "sm_clock_mhz", "mem_clock_mhz", "pstate", "sm_util", "sm_occupancy")}
        self.missing: dict[str, str] = {}
        n = pynvml
        self.queries = {
            "power_w": lambda: n.nvmlDeviceGetPowerUsage(self.handle) / 1e3,
            "sm_clock_mhz": lambda: float(n.nvmlDeviceGetClockInfo(self.handle, n.NVML_CLOCK_SM)),
            "mem_clock_mhz": lambda: float(n.nvmlDeviceGetClockInfo(self.handle, n.NVML_CLOCK_MEM)),
            "pstate": lambda: float(n.nvmlDeviceGetPerformanceState(self.handle)),
        }
        self.gpm = self._ask("gpm", lambda: n.nvmlGpmQueryDeviceSupport(self.handle).isSupportedDevice)
        if self.gpm is not None and not self.gpm:
            self.missing["gpm"] = "the GPU has no NVML GPM (Hopper and newer)"

    def _ask(self, kind: str, query: Any) -> Any:
        try:
            return query()
        except self.n.NVMLError as error:
            self.missing[kind] = f"NVML answers {type(error).__name__}: {error}"
            return None

    def energy_j(self) -> float | None:
        if "energy" in self.missing:
            return None
        got = self._ask("energy", lambda: self.n.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        return None if got is None else got / 1e3

    def limit_w(self) -> float | None:
        got = self._ask("limit", lambda: self.n.nvmlDeviceGetEnforcedPowerLimit(self.handle))
        return None if got is None else got / 1e3

    def run(self) -> None:
        gpm_due, previous = 0.0, None
        while not self.stop_event.is_set():
            now, mono = time.time(), time.monotonic()
            got = {kind: self._ask(kind, query) for kind, query in self.queries.items() if kind not in self.missing}
            if self.gpm and mono >= gpm_due:
                gpm_due = mono + GPM_EVERY_S
                previous, sm = self._gpm(previous)
                if sm is not None:
                    got["sm_util"], got["sm_occupancy"] = sm
            with self.lock:
                for kind, value in got.items():
                    if value is not None:
                        self.readings[kind].append((now, float(value)))
            self.stop_event.wait(READ_EVERY_S)
        if previous is not None:
            self.n.nvmlGpmSampleFree(previous)

    def _gpm(self, previous: Any) -> tuple[Any, tuple[float, float] | None]:
        """A new sample, and SM_UTIL and SM_OCCUPANCY (ratios) since the previous one."""
        n = self.n
        sample = n.nvmlGpmSampleAlloc()
        n.nvmlGpmSampleGet(self.handle, sample)
        if previous is None:
            return sample, None
        get = n.c_nvmlGpmMetricsGet_t()
        get.version, get.numMetrics, get.sample1, get.sample2 = n.NVML_GPM_METRICS_GET_VERSION, 2, previous, sample
        get.metrics[0].metricId, get.metrics[1].metricId = n.NVML_GPM_METRIC_SM_UTIL, n.NVML_GPM_METRIC_SM_OCCUPANCY
        n.nvmlGpmMetricsGet(get)
        n.nvmlGpmSampleFree(previous)
        if get.metrics[0].nvmlReturn != 0 or get.metrics[1].nvmlReturn != 0:
            return sample, None
        return sample, (get.metrics[0].value / 100, get.metrics[1].value / 100)

    def between(self, kind: str, a: float, b: float) -> list[float]:
        with self.lock:
            return [v for t, v in self.readings[kind] if a <= t <= b]

    def close(self) -> None:
        self.stop_event.set()
        self.join(timeout=2.0)
        self.n.nvmlShutdown()


def window(bench: RealBench, reader: PowerReader, seconds: float) -> Json:
    """Everything read over the next `seconds`: the energy counter's mean power above all."""
    e0, a = reader.energy_j(), time.time()
    time.sleep(seconds)
    e1, b = reader.energy_j(), time.time()
    time.sleep(2 * READ_EVERY_S)  # the readings of the window's last moments
    missing = reader.missing
    why = "NVML gives no total energy on this GPU" if e0 is None or e1 is None else None
    energy = None if e0 is None or e1 is None else e1 - e0
    util = [s.ratio for s in bench.sampler.between("util", a, b)]
    out: Json = {
        "window_s": q(b - a, "s"),
        "energy_j": q(energy, "J", why),
        "energy_mean_w": q(energy / (b - a) if energy is not None else None, "W", why),
        "power_mean_w": _mean(reader, "power_w", a, b, "W", missing),
        "utilization": q(mean(util), "ratio", None if util else "NVML gave no utilization sample"),
        "sm_util": _mean(reader, "sm_util", a, b, "ratio", missing, "gpm"),
        "sm_occupancy": _mean(reader, "sm_occupancy", a, b, "ratio", missing, "gpm"),
        "sm_clock_mhz": _mean(reader, "sm_clock_mhz", a, b, "MHz", missing),
        "mem_clock_mhz": _mean(reader, "mem_clock_mhz", a, b, "MHz", missing),
    }
    states = reader.between("pstate", a, b)
    out["pstate"] = q(max(set(states), key=states.count) if states else None, "P",
                      None if states else missing.get("pstate", "not read"))
    out["wall"] = [round(a, 3), round(b, 3)]
    return out


def _mean(reader: PowerReader, kind: str, a: float, b: float, unit: str, missing: dict[str, str],
          missing_key: str | None = None) -> Json:
    values = reader.between(kind, a, b)
    why = missing.get(missing_key or kind, "no reading in the window")
    return q(mean(values), unit, None if values else why)


def idle_without_context(bench: RealBench, reader: PowerReader) -> Json:
    bench.wait_idle()
    time.sleep(1.5)  # NVML's 1-s mean: nothing of the last scenario in it
    return {"what": "idle, no CUDA context on the GPU", **window(bench, reader, bench.args.power_s)}


def idle_with_context(bench: RealBench, reader: PowerReader) -> Json:
    bench.wait_idle()
    hold_s = bench.args.power_s + 10.0
    child = Child("bare context (held)", [sys.executable, str(REPO / "scripts" / "bare_context.py"), "--gpu",
                                          bench.gpu, "--hold-s", f"{hold_s:g}"], bench.env())
    try:
        child.wait_for(lambda e: e.get("event") == "bare_context", bench.args.start_timeout, "its line")
        time.sleep(1.5)  # the context open for a whole second of NVML's mean
        measured = window(bench, reader, bench.args.power_s)
    finally:
        child.stop(grace_s=5.0)
    return {"what": "idle, a bare CUDA context open (scripts/bare_context.py)", **measured}


def filled(bench: RealBench, reader: PowerReader, shape: str, target: float, metric: str = "utilization") -> Json:
    """The filler at `target` of `metric` with kernels of `shape`: a window once it has filled for a while."""
    bench.wait_idle()
    args = bench.args
    duration_s = args.power_settle_s + args.power_s + 2.0
    child = bench.start_filler(target, "pi", duration_s, env_extra={"FORGE_SHAPE": shape, "FORGE_METRIC": metric})
    try:
        start = first(child.events, "start") or {}
        time.sleep(args.power_settle_s)
        measured = window(bench, reader, args.power_s)
    finally:
        run = bench.finish(child, duration_s + 60.0)
    multipliers = [m for t, m in status_series(run.events, "multiplier") if t >= args.power_settle_s]
    out: Json = {"what": f"the filler, {shape} shape, {metric} at {target:g}", "shape": shape, "metric": metric,
                 "target": q(target, "ratio"), "shape_layout": start.get("shape_layout"),
                 "kernel_image": start.get("kernel_image"),
                 "multiplier": q(mean(multipliers), "count"), **measured,
                 "tracking_error": q(None if val(measured["utilization"]) is None
                                     else val(measured["utilization"]) - target, "ratio")}
    out["warps_per_sm"] = q(*kernel_warps_per_sm(run.pid, int(start.get("sm_count") or 0)), )
    return out


THREADS_PER_SM = 2048  # resident threads per SM, Volta to Blackwell (and the virtual GPU's)


def kernel_warps_per_sm(pid: int, sm_count: int) -> tuple[float | None, str, str | None]:
    """The most warps a launch of the filler kept resident on an SM at once, from the virtual GPU's kernel record
    (blocks spread over the SMs before they stack, as many at once as an SM's threads hold); not measured on a real
    GPU, which keeps no such record."""
    state = os.environ.get("VGPU_STATE")
    if not state:
        return None, "count", "n/a (only the virtual GPU keeps a record of every kernel)"
    most = 0
    for line in (Path(state) / "kernels.jsonl").read_text().splitlines():
        k = json.loads(line)
        if k["pid"] != pid or not sm_count:
            continue
        blocks = min(math.ceil(k["grid"] / sm_count), max(THREADS_PER_SM // k["block"], 1))
        most = max(most, blocks * math.ceil(k["block"] / 32))
    return most or None, "count", None if most else "no kernel of the filler in the record"


def power_plan(bench: RealBench | None, args: argparse.Namespace, results: Json,
               overhead_s: float) -> list[tuple[str, float, Any]]:
    """(what, estimated seconds, run) of the power scenario, in order: idle without and with a context, then each
    shape at each target (lean at 0.5 first: the goal's number)."""
    each = args.power_settle_s + args.power_s + overhead_s
    box: dict[str, PowerReader] = {}

    def reader() -> PowerReader:
        if "reader" not in box:
            assert bench is not None
            box["reader"] = PowerReader(int(args.gpu))
            box["reader"].start()
            bench.closers.append(box["reader"].close)
            results["gpu"]["power_limit_w"] = q(box["reader"].limit_w(), "W",
                                                box["reader"].missing.get("limit"))
        return box["reader"]

    def store(key: str, fn: Any) -> Any:
        def run() -> None:
            results.setdefault("power", {})[key] = fn()
        return run

    steps: list[tuple[str, float, Any]] = [
        (f"power: idle, no context ({args.power_s:g} s)", args.power_s + 5.0,
         store("idle_no_context", lambda: idle_without_context(bench, reader()))),  # type: ignore[arg-type]
        (f"power: idle with a bare context ({args.power_s:g} s)", args.power_s + overhead_s,
         store("idle_context", lambda: idle_with_context(bench, reader()))),  # type: ignore[arg-type]
    ]
    # (shape, metric, target), the goal's numbers first: each shape at 0.5, and where GPM is, the lean shape's warp on
    # every SM (held SM activity) at 0.5, what lean draws the most; then the other targets.
    runs = [(s, "utilization", t) for s in args.power_shapes for t in args.power_targets]
    if "lean" in args.power_shapes and 0.5 in args.power_targets:
        why = None if bench is None or bench.probe.info.gpm else "the GPU has no NVML GPM to hold SM activity by"
        if why is None:
            runs.append(("lean", "sm_activity", 0.5))
        else:
            results.setdefault("skipped", []).append(f"power: lean holding sm_activity at 0.5: {why}")
    listed = list(runs)
    runs.sort(key=lambda run: (run[2] != 0.5, listed.index(run)))
    for shape, metric, target in runs:
        key = f"{shape}_{target:g}" if metric == "utilization" else f"{shape}_{metric}_{target:g}"
        held = "" if metric == "utilization" else f" holding {metric}"
        steps.append((f"power: {shape}{held} at {target:g} ({args.power_settle_s:g} + {args.power_s:g} s)", each,
                      store(key, lambda s=shape, m=metric, t=target:
                            filled(bench, reader(), s, t, m))))  # type: ignore[arg-type]
    return steps


# --- goals and tables ---------------------------------------------------------------------------------------------

def judge_power_goals(results: Json) -> list[Json]:
    """The power scenario's goals: lean at 0.5 within the context's idle plus a tenth of the span to the board's
    limit (by the energy counter), and NVML's utilization held within TRACK_TOLERANCE_RATIO (worst lean target); on
    the virtual GPU, at most one warp per SM per launch."""
    power = results.get("power") or {}
    idle = val((power.get("idle_context") or {}).get("energy_mean_w"))
    limit = val(results.get("gpu", {}).get("power_limit_w"))
    budget = idle + LEAN_BUDGET_RATIO * (limit - idle) if idle is not None and limit is not None else None
    lean_half = power.get("lean_0.5")
    name = (f"board power, lean at 0.5 (energy counter): the context's idle + {LEAN_BUDGET_RATIO:g} of the span to "
            "the limit")
    why = ("n/a (no lean run at 0.5)" if lean_half is None else
           "n/a (no idle-with-context window, or no power limit)" if budget is None else None)
    goals = [judge(Goal("power_lean", name, "<=", round(budget or 0.0, 1), "W"),
                   val((lean_half or {}).get("energy_mean_w")), "lean at 0.5", why)]
    lean = {k: v for k, v in power.items() if v.get("shape") == "lean"}
    errors: list[float | None] = [None if val(v.get("tracking_error")) is None else abs(val(v["tracking_error"]))
                                  for v in lean.values()]
    worst_error = max(e for e in errors if e is not None) if errors and None not in errors else None
    goals.append(judge(Goal("power_tracking", "lean: NVML utilization's mean over the window, off the target "
                            "(worst target)", "<=", TRACK_TOLERANCE_RATIO, "ratio"), worst_error, ", ".join(lean),
                       None if lean else "n/a (no lean run)"))
    warps = [val(v.get("warps_per_sm")) for v in lean.values()]
    virtual = results.get("virtual_gpu")
    goals.append(judge(Goal("power_warps", "lean: warps resident per SM (the virtual GPU's kernel record)", "<=",
                            1.0, "count"), max(warps) if warps and None not in warps else None, ", ".join(lean),
                       None if lean and virtual else "n/a (only the virtual GPU keeps a kernel record)"))
    return goals


ROWS = (("energy_mean_w", "board power, energy counter (W)", 1), ("power_mean_w", "board power, mean reading (W)", 1),
        ("utilization", "NVML utilization", 3), ("sm_util", "GPM SM_UTIL", 4), ("sm_occupancy", "GPM SM_OCCUPANCY", 4),
        ("sm_clock_mhz", "SM clock (MHz)", 0), ("mem_clock_mhz", "memory clock (MHz)", 0), ("pstate", "P-state", 0),
        ("multiplier", "multiplier (mean)", 0), ("warps_per_sm", "warps resident per SM (most)", 0))


def power_table(results: Json) -> list[str]:
    """The power scenario in results.md and docs/benchmarks.md: one column per window."""
    from bench.render import fmt

    power = results.get("power") or {}
    if not power:
        return ["Not run: no window finished (see Failures)."]
    keys = [k for k in IDLE_KEYS if k in power] + [k for k in power if k not in IDLE_KEYS]
    names = {"idle_no_context": "idle, no context", "idle_context": "idle, context"}

    def name(key: str) -> str:
        run = power[key]
        if key in names or "shape" not in run:
            return names.get(key, key)
        held = "" if run.get("metric", "utilization") == "utilization" else f" ({run['metric']})"
        return f"{run['shape']}{held} at {val(run['target']):g}"

    out = ["| | " + " | ".join(name(k) for k in keys) + " |",
           "|---|" + "---|" * len(keys)]
    for key, label, digits in ROWS:
        cells = [fmt(power[k].get(key), digits) if key in power[k] else "" for k in keys]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    window = next(iter(power.values()))["window_s"]
    settle_s = results["settings"]["power_settle_s"]["value"]
    out += ["", f"Each column a window of {fmt(window, 1)} s (the filler's after {settle_s:g} s of filling). "
            "Board power from NVML's total energy counter over the window (its mean) and the mean of its power "
            "readings every 0.25 s; NVML utilization from its samples; GPM from the benchmark's own 1-s "
            "sample pairs. A dash: not offered by NVML on this GPU, or not measured (results.json says which)."]
    return out


def render_power_section(results: Json, out_dir: Path, page: Path | None = None) -> str:
    """docs/benchmarks.md's power block (between the BENCH-POWER markers), from one run; links relative to `page`."""
    from bench.render import VIRTUAL_NOTE, goal_rows, link, machine_text, relative

    rel, here = relative(out_dir), link(out_dir, page)
    gpu = results["gpu"]
    where = (f"the virtual GPU ({gpu['name']}, driver {gpu['driver']}; not hardware: its power is a model), "
             f"{results['date']}" if results.get("virtual_gpu") else
             f"{gpu['name']}, driver {gpu['driver']}, {results['date']}")
    if results.get("machine"):
        where += f", machine {machine_text(results['machine'])}"
    generated = (f"<!-- generated by scripts/gpu_bench.py --section from {rel}/results.json (the run: "
                 f"{results['command']}); do not edit by hand -->")
    out = ["<!-- BENCH-POWER -->", generated, "", "### Power", "",
           f"From `scripts/gpu_bench.py --scenarios power` on {where}: the board idle without a CUDA context and "
           "with one, and the filler with each kernel shape at each target."]
    if results.get("virtual_gpu"):
        out += ["", VIRTUAL_NOTE, "", "> **Every watt here is the virtual GPU's power model** (docs/design.md §15), "
                "not a measurement: no GPU has run this scenario yet."]
    power_goals = [g for g in results["goals"] if g["key"].startswith("power")]
    out += ["", *power_table(results), "", *goal_rows(power_goals), "",
            f"All numbers: [{rel}/results.md]({here}/results.md).", "", "<!-- /BENCH-POWER -->"]
    return "\n".join(out) + "\n"
