"""Rendering from the results tree (what results.json and cpu.json hold): results.md and cpu.md, the generated
blocks of docs/benchmarks.md (between <!-- BENCH-... --> markers), and the plots. Nothing here measures anything."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from bench import REPO, log
from bench.cpu import CPU_GOALS, PROCESS_LIST_FUNCTIONS, judge_cpu_goals, summaries
from bench.metric import SETTLE_BAND_RATIO
from bench.results import CONTROLLERS, FOOTPRINT_TARGET, YIELD_TARGET, judge_goals
from forge_load.control.probe import UtilSample
from forge_load.control.scoring import one_second_readings

VIRTUAL_NOTE = ("> **Virtual GPU: not a GPU measurement.** These numbers come from the real filler, numba-cuda and "
                "pynvml running on driver-free stand-ins for libcuda and libnvidia-ml (`scripts/vgpu`, a model of "
                "an H100-like GPU; docs/testing.md, \"The virtual GPU\"). They check our code against the real "
                "libraries; timing, memory and power are the model's, and CPU is this machine's.")


def fmt(quantity: dict[str, Any] | None, digits: int = 3, unit: bool = False) -> str:
    if not quantity or quantity.get("value") is None:
        note = (quantity or {}).get("note", "")
        if note.startswith("n/a"):
            return "n/a"
        return "never" if note.startswith("never") else "—"
    value = quantity["value"]
    text = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    if quantity["unit"] == "x":
        text += "×"
    elif unit and quantity["unit"] not in ("ratio", "count"):
        text += f" {quantity['unit']}"
    return text


def render_markdown(results: dict[str, Any]) -> str:
    simulated = results["mode"] == "simulated"
    gpu = results["gpu"]
    tag = " (simulated)" if simulated and "simulated" not in gpu["name"].lower() else ""
    tag = " (virtual GPU)" if results.get("virtual_gpu") else tag
    out = [f"## forge_load benchmark: {gpu['name']}{tag}, {results['date']}", ""]
    if results.get("virtual_gpu"):
        out += [VIRTUAL_NOTE, ""]
    if simulated:
        out += ["> **Simulated GPU, virtual time.** These numbers come from forge_load's GPU model "
                "(`forge_load/gpu/sim.py`), not from hardware: they check the control loop and the output format. "
                "Footprint and foreign-job slowdown cannot be simulated and are marked n/a or labelled.", ""]
    out += [f"GPU {gpu['name']} · driver {gpu['driver']} · forge_load {results['software']['forge_load']} · "
            f"mode {results['mode']}" + (" on the virtual GPU" if results.get("virtual_gpu") else "")
            + (f" · machine {machine_text(results['machine'])}" if results.get("machine") else "")
            + (" · incomplete run" if not results.get("complete") else ""),
            "", f"`{results['command']}`", ""]

    out += ["### Goals (our controller, pi)", ""] + goal_rows(results["goals"])

    tr = results["tracking"]
    if tr.get("pi") or tr.get("legacy"):
        d = next(iter((tr.get("pi") or tr.get("legacy")).values()))["duration_s"]["value"]
        out += ["", f"### Tracking: 1-s NVML readings, {d:g} s per target", "",
                "| target | metric | pi | legacy | legacy / pi |", "|---|---|---|---|---|"]
        rows = (("settle_s", "settle time (s)", 1), ("mae", "mean abs error after settling", 4),
                ("p95_error", "p95 abs error after settling", 4), ("mae_from_5s", "mean abs error from 5 s", 4),
                ("p95_error_from_5s", "p95 abs error from 5 s", 4), ("mean_util", "mean utilization from 5 s", 3),
                ("yields", "yields (a false alarm if not 0)", 0))
        for target in sorted({t for c in ("pi", "legacy") for t in tr.get(c, {})}, key=float):
            pi, legacy = tr.get("pi", {}).get(target, {}), tr.get("legacy", {}).get(target, {})
            ratio = tr.get("legacy_over_pi", {}).get(target, {})
            for key, label, digits in rows:
                r = ratio.get(key)
                r_text = "" if r is None else (fmt(r, 1) if r.get("value") is not None else "—")
                out.append(f"| {target} | {label} | {fmt(pi.get(key), digits)} | {fmt(legacy.get(key), digits)} "
                           f"| {r_text} |")

    if "metric" in results["settings"]["scenarios"]:
        out += metric_table(results)

    if results["yield"]:
        solo = results.get("foreign", {})
        out += ["", f"### Yield: a foreign job starts while the filler runs at {YIELD_TARGET:g}", "",
                "| controller | foreign job | signals | detected (s) | yield: last kernel ended (s) | "
                "foreign throughput vs solo | resumed after exit (s) | yields |",
                "|---|---|---|---|---|---|---|---|"]
        for m in results["yield"].values():
            if simulated:
                thr = (f"n/a (sim; worst case {fmt(m.get('foreign_worst_case_ratio'), 4)}, "
                       f"{fmt(m.get('foreign_contended_s'), 3)} s shared)")
            else:
                thr = f"{fmt(m.get('foreign_throughput_ratio'), 4)} ({fmt(m.get('foreign_lost_s'), 3)} s lost)"
            out.append(f"| {m['controller']} | {m['label']} | {m['signals'] or '—'} | {fmt(m['detect_s'], 3)} | "
                       f"{fmt(m['yield_s'], 3)} | {thr} | {fmt(m['resume_s'], 2)} | {fmt(m['yields'])} |")
        resume_after = next(iter(results["yield"].values()))["resume_after_s"]["value"]
        out += ["", f"Times from the foreign job's CUDA context; the filler waits {resume_after:g} s "
                "(`--resume-after`) of a quiet GPU before resuming."]
        if "solo_spread_ratio" in solo:
            out.append(f"Solo runs of the foreign job differ by {fmt(solo['solo_spread_ratio'], 4)} "
                       "(run-to-run noise of the throughput ratio).")

    if results.get("announced"):
        out += announced_table(results)

    if "power" in results["settings"]["scenarios"]:
        from bench.power import power_table

        out += ["", "### Power: the board idle, with a context, and the filler by kernel shape", "",
                *power_table(results)]

    fp = results.get("footprint")
    if fp and {"footprint", "tracking"} & set(results["settings"]["scenarios"]):  # else only idle power in it
        lab = " (simulated)" if fp.get("simulated") else ""
        out += ["", f"### Footprint{lab}", "", "| quantity | value |", "|---|---|",
                f"| filler process GPU memory | {fmt(fp.get('filler_process_mib'), 1, True)} |",
                f"| bare CUDA context, same GPU | {fmt(fp.get('bare_context_mib'), 1, True)} |",
                f"| filler over bare context | {fmt(fp.get('over_bare_mib'), 1, True)} "
                f"({fmt(fp.get('over_bare_ratio'), 3)}) |",
                f"| filler host CPU at {FOOTPRINT_TARGET:g} | {fmt(fp.get('cpu_pct_one_core'), 2, True)} |",
                f"| board power, idle | {fmt(fp.get('idle_power_w'), 1, True)} |"]
        for target, power in fp.get("power_w", {}).items():
            out.append(f"| board power at {target} (pi) | {fmt(power, 1, True)} |")
        if fp.get("method"):
            out += ["", f"GPU memory: {fp['method']}."]

    if results.get("plots"):
        out += ["", "### Plots", ""] + [f"![{p}]({p})" for p in results["plots"]]
    elif results.get("plots_note"):
        out += ["", f"Plots: {results['plots_note']}"]
    if results.get("skipped"):
        out += ["", "### Skipped", ""] + [f"- {f}" for f in results["skipped"]]
    if results.get("failures"):
        out += ["", "### Failures", ""] + [f"- {f}" for f in results["failures"]]
    if results.get("notes"):
        out += ["", "### Notes", ""] + [f"- {n}" for n in results["notes"]]
    return "\n".join(out) + "\n"


def machine_text(box: dict[str, Any]) -> str:
    """The machine a run was taken on, as bench.cpu.machine() describes it."""
    return f"{box['cpu_model']}, {box['logical_cpus']['value']} logical CPUs, {box['platform']}"


def relative(out_dir: Path) -> str:
    """The folder as the generated comment names it: relative to the repository root where it is inside."""
    try:
        return out_dir.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return out_dir.as_posix()


def link(target: Path, page: Path | None) -> str:
    """`target` as a link from `page` (the file the blocks go into; None: the repository root)."""
    base = page.resolve().parent if page is not None else REPO
    return Path(os.path.relpath(target.resolve(), base)).as_posix()


def goal_rows(goals: list[dict[str, Any]], names: dict[str, str] | None = None) -> list[str]:
    """The goals table: a note (why a number is missing, what it is a bound of) where a goal was judged. `names`:
    the words for a goal's key where they are to be today's rather than those saved with the run."""
    rows = ["| goal | target | measured | result |", "|---|---|---|---|"]
    for goal in goals:
        name = (names or {}).get(goal.get("key", ""), goal["goal"])
        result = {True: "pass", False: "**FAIL**", None: "n/a"}[goal["pass"]]
        digits = 4 if goal["limit"]["unit"] == "ratio" else 3
        measured = fmt(goal["measured"], digits, True)
        if goal.get("note") and goal["pass"] is not None:
            measured += f" ({goal['note']})"
        rows.append(f"| {name} | {goal['op'].replace('<=', '≤').replace('>=', '≥')} "
                    f"{fmt(goal['limit'], 2, True)} | {measured} | {result} |")
    return rows


def render_section(results: dict[str, Any], out_dir: Path, page: Path | None = None) -> str:
    """docs/benchmarks.md's parts, from one run: the tracking table, pi against legacy (between the
    BENCH-TABLE markers), and the goals with the plots (between the BENCH-SECTION markers). Links are
    relative to `page`, the file they go into."""
    rel = relative(out_dir)
    here = link(out_dir, page)
    method = link(REPO / "docs" / "benchmarks" / "README.md", page)
    simulated = results["mode"] == "simulated"
    gpu = results["gpu"]
    where = (f"{gpu['name']} (virtual time), {results['date']}" if simulated else
             f"{gpu['name']}, driver {gpu['driver']}, {results['date']}")
    if results.get("virtual_gpu"):
        where = f"the virtual GPU ({gpu['name']}, driver {gpu['driver']}; not hardware), {results['date']}"
    generated = (f"<!-- generated by scripts/gpu_bench.py --section from {rel}/results.json (the run: "
                 f"{results['command']}); do not edit by hand -->")
    tr = results["tracking"]
    table = ["| target | settle (s), pi / legacy | mean abs error from 5 s, pi / legacy | legacy / pi "
             "| p95 abs error from 5 s, pi / legacy |", "|---|---|---|---|---|"]
    for target in sorted(tr.get("pi", {}), key=float):
        pi, legacy = tr["pi"][target], tr.get("legacy", {}).get(target, {})
        ratio = tr.get("legacy_over_pi", {}).get(target, {}).get("mae_from_5s")
        table.append(f"| {target} | {fmt(pi['settle_s'], 1)} / {fmt(legacy.get('settle_s'), 1)} "
                     f"| {fmt(pi['mae_from_5s'], 4)} / {fmt(legacy.get('mae_from_5s'), 4)} "
                     f"| {fmt(ratio, 0) if ratio else '—'} "
                     f"| {fmt(pi['p95_error_from_5s'], 4)} / {fmt(legacy.get('p95_error_from_5s'), 4)} |")
    d = next(iter(tr["pi"].values()))["duration_s"]["value"] if tr.get("pi") else 0
    out = ["<!-- BENCH-TABLE -->", generated, "",
           f"From `scripts/gpu_bench.py` on {where}: 1-s NVML readings over {d:g} s per target"
           + (" (simulated: a model of the GPU, not a measurement)." if simulated else "."), "", *table, "",
           "<!-- /BENCH-TABLE -->", "", "<!-- BENCH-SECTION -->", generated, "", "## The goals, from the latest run",
           "",
           "`scripts/gpu_bench.py` measures the claims on one GPU: how closely the target is held "
           "(against the original law, `FORGE_CONTROLLER=legacy`), how fast the filler steps aside when a "
           "real CUDA job starts and how much that job loses, and what the filler costs in GPU memory, CPU and "
           f"power. [docs/benchmarks/README.md]({method}) says how to run it and what each "
           "number means. Every number below comes from the run's `results.json`.", ""]
    if results.get("virtual_gpu"):
        out += [VIRTUAL_NOTE, ""]
    if simulated:
        out += ["> **No real-GPU run yet: these are the simulated GPU's numbers.** They check the control loop "
                "and the benchmark itself; footprint and the foreign job's slowdown cannot be simulated. "
                "On a GPU machine: `python3 scripts/gpu_bench.py --out \"$OUT/bench\" --budget-s 560`.", ""]
    out += [f"**{where}** ([all results]({here}/results.md)).", ""] + goal_rows(results["goals"])
    if "tracking.png" in results.get("plots", []):
        out += ["", f"![Tracking, pi vs legacy]({here}/tracking.png)"]
    if "yield_pi_visible.png" in results.get("plots", []):
        out += ["", f"![A foreign job arrives and leaves]({here}/yield_pi_visible.png)"]
    out += ["", "<!-- /BENCH-SECTION -->"]
    return "\n".join(out) + "\n"


def write_section(path: Path, text: str) -> list[str]:
    """Write the generated blocks in `text` to `path`. Where `path` already holds marked blocks
    (docs/benchmarks.md),
    replace those in place and keep the rest; returns the names of the blocks it has no markers for (not
    written there). A file with none of the markers gets the text as it is."""
    current = path.read_text() if path.exists() else ""
    names = re.findall(r"^<!-- (BENCH-[A-Z]+) -->$", text, flags=re.M)
    present = [n for n in names if f"<!-- {n} -->" in current and f"<!-- /{n} -->" in current]
    if not present:
        path.write_text(text)
        return []
    for name in present:
        block = re.search(rf"<!-- {name} -->.*?<!-- /{name} -->", text, re.S)
        assert block is not None, name
        old = re.search(rf"<!-- {name} -->.*?<!-- /{name} -->", current, re.S)
        assert old is not None, name
        current = current[:old.start()] + block.group(0) + current[old.end():]
    path.write_text(current)
    return [n for n in names if n not in present]


def write_plots(results: dict[str, Any], series: dict[str, Any], out_dir: Path) -> list[str]:
    """One PNG per scenario and a tracking overview; [] (and a note in results) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        results["plots_note"] = ("matplotlib is not installed, so no PNG plots were drawn (`pip install "
                                 "matplotlib`, then rerun); results.json, results.md and series.json are complete")
        log(results["plots_note"])
        return []
    simulated_name = "simulated" in results["gpu"]["name"].lower()
    tag = " (simulated)" if results["mode"] == "simulated" and not simulated_name else ""
    tag = " (virtual GPU)" if results.get("virtual_gpu") else tag
    names: list[str] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        names.append(name)

    def xy(points: list[list[float]]) -> tuple[list[float], list[float]]:
        return [p[0] for p in points], [p[1] for p in points]

    for name, s in series.items():
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True,
                                          gridspec_kw={"height_ratios": [3, 1]})
        if s.get("util"):
            top.plot(*xy(s["util"]), lw=0.6, color="0.6", label="device utilization (NVML samples)")
            ones = one_second_readings([UtilSample(t, u) for t, u in s["util"]], 0.0, s["util"][-1][0] + 1)
            top.plot([t + 0.5 for t, _ in ones], [u for _, u in ones], "o-", ms=2.5, lw=1, color="C0",
                     label="1-s reading")
        for key, color in (("sm_activity", "C5"), ("gr_activity", "C6")):  # the metric scenario's GPM readings
            if s.get(key):  # each at the middle of the second it covers
                top.plot([t - 0.5 for t, _ in s[key]], [v for _, v in s[key]], "s--", ms=2.5, lw=0.8, color=color,
                         label=f"{METRIC_LABELS[key]}: 1-s reading")
        if s.get("own"):
            top.plot(*xy(s["own"]), lw=1, color="C2", label="own share")
        if s.get("foreign"):
            top.plot(*xy(s["foreign"]), lw=1, color="C3", label="foreign share")
        top.axhline(s["target"], ls="--", color="k", lw=1, label=f"target {s['target']:g}")
        m = s.get("marks")
        if m:
            top.axvspan(m["foreign"][0], m["foreign"][1], color="C3", alpha=0.08, label="foreign job")
            for key, style in (("drained", ":"), ("resume", "-.")):
                if m.get(key) is not None:
                    top.axvline(m[key], ls=style, color="C1", lw=1, label=f"{key} {m[key]:.2f} s")
        top.set_ylim(-0.02, 1.05)
        top.set_ylabel("ratio")
        top.set_title(f"{name.replace('_', ' ')} — {results['gpu']['name']}{tag}")
        top.legend(loc="upper right", fontsize=7, ncol=2)
        if s.get("multiplier"):
            bottom.step(*xy(s["multiplier"]), where="post", color="C4")
        bottom.set_ylabel("multiplier")
        bottom.set_xlabel("seconds since the filler started")
        save(fig, f"{name}.png")

    tracking_names = sorted({n.rsplit("_", 1)[1] for n in series if n.startswith("tracking_")}, key=float)
    if tracking_names:
        fig, axes = plt.subplots(len(tracking_names), 1, figsize=(10, 2.6 * len(tracking_names)), sharex=True,
                                 squeeze=False)
        for ax, target in zip(axes[:, 0], tracking_names):
            for i, controller in enumerate(CONTROLLERS):
                s = series.get(f"tracking_{controller}_{target}")
                if not s or not s.get("util"):
                    continue
                ones = one_second_readings([UtilSample(t, u) for t, u in s["util"]], 0.0, s["util"][-1][0] + 1)
                ax.plot([t + 0.5 for t, _ in ones], [u for _, u in ones], "o-", ms=2, lw=1, color=f"C{i}",
                        label=f"{controller}: 1-s NVML reading")
            ax.axhline(float(target), ls="--", color="k", lw=1, label=f"target {target}")
            ax.set_ylim(-0.02, 1.05)
            ax.set_ylabel("utilization")
            ax.legend(loc="lower right", fontsize=7)
        axes[0, 0].set_title(f"Tracking, pi vs legacy — {results['gpu']['name']}{tag}")
        axes[-1, 0].set_xlabel("seconds since the filler started")
        save(fig, "tracking.png")
    return sorted(names)


def write_outputs(results: dict[str, Any], out_dir: Path, final: bool) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    series = results.pop("_series")
    try:
        if final:
            results["plots"] = write_plots(results, series, out_dir)
        results["goals"] = judge_goals(results)
        markdown = render_markdown(results)
        (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        (out_dir / "results.md").write_text(markdown)
        (out_dir / "series.json").write_text(json.dumps(series, separators=(",", ":")) + "\n")
    finally:
        results["_series"] = series
    return markdown


# --- the cpu scenario -------------------------------------------------------------------------------------

VIRTUAL_CPU_NOTE = ("> **Virtual GPU: not a GPU measurement.** The filler ran in real mode (its CUDA and NVML "
                    "libraries, unmodified) on driver-free stand-ins for libcuda and libnvidia-ml (`scripts/vgpu`), "
                    "whose launch calls cost almost nothing. The CPU time is this machine's, spent in our code and "
                    "the real libraries; launch counts and tracking come from the virtual GPU's record of every "
                    "kernel, a model of an H100-like GPU.")


def cpu_where(results: dict[str, Any]) -> str:
    gpu, box = results["gpu"], results["machine"]
    cpus = f"{box['logical_cpus']['value']} logical CPUs"
    if box["usable_cpus"]["value"] != box["logical_cpus"]["value"]:
        cpus += f", {box['usable_cpus']['value']} usable"
    loads = [(box.get(f"load_average_1m_at_{when}") or {}).get("value") for when in ("start", "end")]
    if None not in loads:
        cpus += f"; load average {loads[0]:.1f} at the start, {loads[1]:.1f} at the end"
    where = (f"the virtual GPU ({gpu['name']}, driver {gpu['driver']}; not hardware)" if results["virtual_gpu"]
             else f"{gpu['name']}, driver {gpu['driver']}")
    return f"{where}, {results['date']}, on {box['cpu_model']} ({cpus})"


def cpu_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (GPUs, target, process-list cost), the median of its repeats."""
    return summaries(results)


def cost_label(r: dict[str, Any]) -> str:
    cost = (r.get("nvml_cost_ms") or {}).get("value") or 0
    return f"{cost:g} ms" if cost else "as is"


def nvml_calls_text(r: dict[str, Any]) -> str:
    """NVML calls per s per GPU by function, the process lists summed, the busiest first."""
    calls = {k.removeprefix("nvmlDevice"): v["value"] for k, v in (r.get("nvml_calls_per_s_per_gpu") or {}).items()
             if v.get("value") and k not in PROCESS_LIST_FUNCTIONS}
    lists = (r.get("process_list_calls_per_s_per_gpu") or {}).get("value")
    if lists:
        calls["process lists"] = lists
    if not calls:
        return "n/a"
    return ", ".join(f"{k} {v:.2g}" for k, v in sorted(calls.items(), key=lambda kv: -kv[1]))


def wakeups_text(r: dict[str, Any]) -> str:
    threads = [w["value"] for w in r.get("wakeups_per_s_by_thread") or [] if w.get("value") is not None]
    total = (r.get("wakeups_per_s") or {}).get("value")
    if total is None:
        return "n/a"
    busy = [f"{w:.0f}" for w in threads if w >= 0.5]
    return f"{total:.0f} ({', '.join(busy) if busy else 'none'} by thread; {len(threads)} threads)"


def render_cpu_markdown(results: dict[str, Any]) -> str:
    """cpu.md: the cpu scenario's goals, steady state, tracking and start-up."""
    gpu, box = results["gpu"], results["machine"]
    tag = " (virtual GPU)" if results["virtual_gpu"] else ""
    run_s = results["settings"]["run_s"]["value"]
    steady_from_s = results["settings"]["steady_from_s"]["value"]
    out = [f"## forge_load CPU per GPU: {gpu['name']}{tag}, {results['date']}", ""]
    if results["virtual_gpu"]:
        out += [VIRTUAL_CPU_NOTE, ""]
    loads = [(box.get(f"load_average_1m_at_{when}") or {}).get("value") for when in ("start", "end")]
    load = (f"; load average {loads[0]:.2f} at the start, {loads[1]:.2f} at the end"
            if None not in loads else "")
    out += [f"Machine: {box['cpu_model']}, {box['logical_cpus']['value']} logical CPUs "
            f"({box['usable_cpus']['value']} usable{load}) · "
            f"GPU {gpu['name']} · driver {gpu['driver']} · forge_load {results['software']['forge_load']} · "
            f"Python {results['software']['python']}" + (" · incomplete run" if not results.get("complete") else ""),
            "", f"`{results['command']}`", "", "### Goals", ""]
    out += goal_rows(results["goals"])
    rows = cpu_rows(results)
    if rows:
        out += ["", f"### Steady state: from {steady_from_s:g} s after the start line to the end of each "
                f"{run_s:g}-s run", "",
                "| GPUs | target | process lists cost | runs | CPU per GPU (% of one core) "
                "| whole process (% of one core) "
                "| CPU per launch (µs) | launches/s per GPU | settle (s) | mean abs error | p95 abs error | yields |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            out.append(f"| {r['gpus']['value']} | {r['target']['value']:g} | {cost_label(r)} | {r['repeats']} "
                       f"| {fmt(r['cpu_pct_per_gpu'], 2)} "
                       f"| {fmt(r['cpu_pct_one_core'], 2)} | {fmt(r['cpu_us_per_launch'], 0)} "
                       f"| {fmt(r['launches_per_s_per_gpu'], 0)} | {fmt(r['settle_s'], 1)} | {fmt(r['mae'], 4)} "
                       f"| {fmt(r['p95_error'], 4)} | {fmt(r['yields'])} |")
        sources = sorted({r["tracking_from"] for r in rows})
        out += ["", f"Tracking from {'; '.join(sources)}: 1-s readings from each filler's start, the worst GPU of "
                "each run. CPU is the process's user + system time (every thread) over wall time. Each number is "
                "the median of the runs (cpu.json lists every run)."]
        out += ["", "### NVML, wake-ups and memory (steady state)", "",
                "| GPUs | target | process lists cost | NVML calls per s per GPU | wake-ups per s: process (by thread) "
                "| RSS (MiB) |", "|---|---|---|---|---|---|"]
        for r in rows:
            out.append(f"| {r['gpus']['value']} | {r['target']['value']:g} | {cost_label(r)} | {nvml_calls_text(r)} "
                       f"| {wakeups_text(r)} | {fmt(r.get('rss_mib'), 0)} |")
        out += ["", "NVML calls as the virtual GPU counted them (every C call; a process-list refresh is three: "
                "compute count and fill, graphics count). Wake-ups are voluntary context switches "
                "(/proc/<pid>/task/*/status), threads waking at least every 2 s listed."]
        out += ["", "### Start-up", "",
                "| GPUs | target | process lists cost | to the first kernel (s) | to the start line (s) "
                "| CPU used by then (s) |", "|---|---|---|---|---|---|"]
        for r in rows:
            out.append(f"| {r['gpus']['value']} | {r['target']['value']:g} | {cost_label(r)} "
                       f"| {fmt(r['startup_s'], 2)} "
                       f"| {fmt(r['startup_to_start_line_s'], 2)} | {fmt(r['startup_cpu_s'], 2)} |")
        out += ["", "From the process's start; with several GPUs, to the first kernel on each of them (the last)."]
    for title, key in (("Skipped", "skipped"), ("Failures", "failures"), ("Notes", "notes")):
        if results.get(key):
            out += ["", f"### {title}", ""] + [f"- {f}" for f in results[key]]
    return "\n".join(out) + "\n"


def render_cpu_section(results: dict[str, Any], out_dir: Path, page: Path | None = None) -> str:
    """docs/benchmarks.md's CPU block (between the BENCH-CPU markers), from one run's cpu.json; links relative
    to `page`."""
    rel = relative(out_dir)
    here = link(out_dir, page)
    run_s = results["settings"]["run_s"]["value"]
    steady_from_s = results["settings"]["steady_from_s"]["value"]
    generated = (f"<!-- generated by scripts/gpu_bench.py --section from {rel}/cpu.json (the run: "
                 f"{results['command']}); do not edit by hand -->")
    out = ["<!-- BENCH-CPU -->", generated, "", "### What the filler costs the CPU", "",
           f"From `scripts/gpu_bench.py --scenarios cpu` on {cpu_where(results)}: the filler process's CPU time "
           f"over wall time, from {steady_from_s:g} s after its start line to the end of a {run_s:g}-s run, in % "
           "of one core; start-up is from the process's start to its first kernel.", ""]
    if results["virtual_gpu"]:
        out += [VIRTUAL_CPU_NOTE, ""]
    out += ["| GPUs in the process | target | process lists cost | CPU per GPU | whole process "
            "| process-list calls/s per GPU | wake-ups/s | RSS | launches/s per GPU "
            "| start-up to the first kernel | CPU used by then |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in cpu_rows(results):
        out.append(f"| {r['gpus']['value']} | {r['target']['value']:g} | {cost_label(r)} "
                   f"| {fmt(r['cpu_pct_per_gpu'], 2)} % | {fmt(r['cpu_pct_one_core'], 2)} % "
                   f"| {fmt(r.get('process_list_calls_per_s_per_gpu'), 1)} | {fmt(r.get('wakeups_per_s'), 0)} "
                   f"| {fmt(r.get('rss_mib'), 0)} MiB | {fmt(r['launches_per_s_per_gpu'], 0)} "
                   f"| {fmt(r['startup_s'], 2)} s | {fmt(r['startup_cpu_s'], 2)} s |")
    # Each goal as CPU_GOALS words it now, by its key: a run saved its goals' words as they were then.
    out += [""] + goal_rows(results["goals"], {goal.key: goal.goal for goal in CPU_GOALS})
    out += ["", f"All numbers, tracking and start-up: [{rel}/cpu.md]({here}/cpu.md).", "", "<!-- /BENCH-CPU -->"]
    return "\n".join(out) + "\n"


def write_cpu_outputs(results: dict[str, Any], out_dir: Path) -> str:
    """cpu.json and cpu.md (the goals judged first); returns the Markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results["goals"] = judge_cpu_goals(results)
    markdown = render_cpu_markdown(results)
    (out_dir / "cpu.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "cpu.md").write_text(markdown)
    return markdown


METRIC_LABELS = {"utilization": "NVML utilization", "sm_activity": "GPM SM_UTIL",
                 "gr_activity": "GPM GRAPHICS_UTIL"}


def metric_table(results: dict[str, Any]) -> list[str]:
    """The metric scenario in results.md (and docs/benchmarks.md's block): one row per held metric."""
    runs = results.get("metric") or {}
    settings = results["settings"]
    target, d = settings["metric_target"]["value"], settings["metric_s"]["value"]
    out = ["", f"### Holding a GPM metric: FORGE_METRIC at {target:g}, {d:g} s each", ""]
    skipped = [s for s in results.get("skipped", []) if s.startswith("metric")]
    if not runs:
        return out + [f"Not run: {s}." for s in skipped or ["metric: no run finished (see Failures)"]]
    reads = list(METRIC_LABELS)
    out += ["| held (FORGE_METRIC) | settle (s) | mean error (ratio) | p95 abs 1-s error (ratio) | 1-s readings "
            "(count) | " + " | ".join(f"{METRIC_LABELS[k]} meanwhile (ratio)" for k in reads) + " | yields |",
            "|---|---|---|---|---|" + "---|" * len(reads) + "---|"]
    for m in runs.values():
        meanwhile = m["read_meanwhile"]
        out.append(f"| {m['metric']} | {fmt(m['settle_s'], 2)} | {fmt(m['mean_error'], 4)} "
                   f"| {fmt(m['p95_abs_error'], 4)} | {fmt(m['readings'])} | "
                   + " | ".join(fmt(meanwhile.get(k), 3) for k in reads) + f" | {fmt(m.get('yields'))} |")
    out += ["", f"Read by the benchmark itself, once a second: GPM's SM_UTIL and GRAPHICS_UTIL from its own "
            "`nvmlGpmSampleGet` pairs, and NVML's utilization samples averaged over each second. Settle: from the "
            "filler's start to the first reading of the held metric after which every one stays within "
            f"±{SETTLE_BAND_RATIO:g} of the target; the errors are over the readings from there on (signed mean, "
            "p95 of the absolute error). Meanwhile: each metric's mean 1-s reading over the same span (from 5 s "
            "where the held metric never settled)."]
    out += [f"Not run: {s}." for s in skipped]
    return out


def render_metric_section(results: dict[str, Any], out_dir: Path, page: Path | None = None) -> str:
    """docs/benchmarks.md's metric block (between the BENCH-METRIC markers), from one run; links relative to
    `page`."""
    rel = relative(out_dir)
    here = link(out_dir, page)
    gpu = results["gpu"]
    where = (f"the virtual GPU ({gpu['name']}, driver {gpu['driver']}; not hardware), {results['date']}"
             if results.get("virtual_gpu") else f"{gpu['name']}, driver {gpu['driver']}, {results['date']}")
    if results.get("machine"):
        where += f", machine {machine_text(results['machine'])}"
    generated = (f"<!-- generated by scripts/gpu_bench.py --section from {rel}/results.json (the run: "
                 f"{results['command']}); do not edit by hand -->")
    metric_goals = [g for g in results["goals"] if g["key"].startswith("metric")]
    out = ["<!-- BENCH-METRIC -->", generated, "", "### SM activity and graphics activity (GPM)", "",
           f"From `scripts/gpu_bench.py --scenarios metric` on {where}: the filler holding each GPM metric in turn, "
           "read each second by the benchmark itself."]
    if results.get("virtual_gpu"):
        out += ["", VIRTUAL_NOTE]
    out += ["", *metric_table(results)[3:], "", *goal_rows(metric_goals), "",
            f"All numbers: [{rel}/results.md]({here}/results.md).", "", "<!-- /BENCH-METRIC -->"]
    return "\n".join(out) + "\n"


def render_announced_section(results: dict[str, Any], out_dir: Path, page: Path | None = None) -> str:
    """docs/benchmarks.md's announced block (between the BENCH-ANNOUNCED markers), from one run; links relative
    to `page`."""
    rel = relative(out_dir)
    here = link(out_dir, page)
    gpu = results["gpu"]
    where = (f"the virtual GPU ({gpu['name']}, driver {gpu['driver']}; not hardware), {results['date']}"
             if results.get("virtual_gpu") else f"{gpu['name']}, driver {gpu['driver']}, {results['date']}")
    generated = (f"<!-- generated by scripts/gpu_bench.py --section from {rel}/results.json (the run: "
                 f"{results['command']}); do not edit by hand -->")
    out = ["<!-- BENCH-ANNOUNCED -->", generated, "", "### Announced before the job starts",
           "", f"From `scripts/gpu_bench.py --scenarios announced` on {where}: on each path the filler fills at "
           f"{YIELD_TARGET:g}, a foreign CUDA job is announced (or, nvml, not), runs and ends, and the filler "
           "resumes; again for each job."]
    if results.get("virtual_gpu"):
        out += ["", VIRTUAL_NOTE]
    out += ["", *announced_paths_table(results), "", announced_note(results)]
    for note in results.get("skipped", []) + [n for n in results.get("notes", []) if n.startswith("announced:")]:
        out += ["", f"Not run: {note}."]
    out += ["", f"Every job, and the hold command's answer: [{rel}/results.md]({here}/results.md).", "",
            "<!-- /BENCH-ANNOUNCED -->"]
    return "\n".join(out) + "\n"


def announced_table(results: dict[str, Any]) -> list[str]:
    """The announced scenario in results.md: per path, then each job."""
    out = ["", f"### Announced jobs against reactive detection (filler at {YIELD_TARGET:g})", "",
           *announced_paths_table(results), "",
           "| path | job | announced → filler's hold (s) | hold command answered (s) | acknowledged | "
           "lead time (s) | our kernels while it ran | resumed after release (s) |",
           "|---|---|---|---|---|---|---|---|"]
    for m in results["announced"].values():
        for i, j in enumerate(m["jobs"], 1):
            ack = j.get("acknowledged")
            out.append(f"| {m.get('path', 'hold')} | {i} | {fmt(j.get('held_after_s'), 3)} | {fmt(j['hold_s'], 3)} | "
                       f"{'n/a' if ack is None else 'yes' if ack else 'no'} | {fmt(j['lead_s'], 3)} | "
                       f"{fmt(j.get('own_kernels_while_ran'))} | {fmt(j['resume_s'], 2)} |")
    out += ["", announced_note(results)]
    found = results.get("yield", {}).get("pi_visible", {}).get("yield_from_context_begin_s")
    if found is not None and found.get("value") is not None:
        out.append(f"Found by NVML instead (yield, pi, visible): our last kernel ended {fmt(found, 3)} s "
                   "after the job began creating its context (a lead time of minus that).")
    return out


def announced_paths_table(results: dict[str, Any]) -> list[str]:
    """Per path: its jobs' lead times and our kernels on their GPU while they ran. Results of runs before the
    paths (keyed by controller) read as path hold."""
    out = ["| path | announced by | jobs | lead time min / median / max (s) | our kernels on the job's GPU while "
           "it ran | lead time > 0 for every job |", "|---|---|---|---|---|---|"]
    for key, m in results["announced"].items():
        goal = (("yes" if m["every_lead_positive"] else "**NO**") if m.get("announced", True)
                else "n/a (not announced)")
        out.append(f"| {m.get('path', 'hold')} | {m.get('label') or key} | {len(m['jobs'])} | "
                   f"{fmt(m['min_lead_s'], 3)} / {fmt(m.get('median_lead_s'), 3)} / {fmt(m.get('max_lead_s'), 3)} | "
                   f"{fmt(m.get('own_kernels_while_ran'))} | {goal} |")
    return out


def announced_note(results: dict[str, Any]) -> str:
    announced = [m for m in results["announced"].values() if m.get("announced", True)]
    verdict = ("met" if all(m["every_lead_positive"] for m in announced) else "NOT met") if announced else \
        "not judged (no announced path ran)"
    return ("Lead time: the job's CUDA context creation began, minus the end of our last kernel on its GPU (the "
            "filler's `drained` line after its `hold` line; after its `yield` line for nvml): > 0 means the GPU "
            "was ours no more when the job touched it; < 0, our kernels ran into it. Our kernels while it ran: "
            "from the virtual GPU's record of every kernel (n/a on a real GPU). Goal, lead time > 0 for every "
            f"announced job: {verdict}.")
