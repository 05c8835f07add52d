#!/usr/bin/env python3
"""MIG and the metric choice on the virtual GPU: how closely the real filler holds each FORGE_METRIC, and how
each MIG device of a GPU split three ways is held, and yields, with a foreign job on one of them.

    python3 scripts/mig_metric_bench.py [--seconds 20] [--out docs/benchmarks/virtual_<date>_mig]
                                        [--section docs/benchmarks.md] [--render DIR]

Writes results.json and results.md to the output folder. Everything runs on the virtual GPU (scripts/vgpu's
driver-free stand-ins): a model, never a GPU measurement; the results say so, with the machine and the date.

- tracking: one filler per FORGE_METRIC (utilization, sm_activity, gr_activity) at 0.5 on a whole cc-9.0 GPU for
  --seconds; a second process reads GPM (SM_UTIL, GRAPHICS_UTIL) every second and NVML's utilization samples. Per
  run: settle (the first 1-s reading after which every reading of the held metric is within 0.05 of the target),
  mean error and the p95 of |error| of the 1-s readings after settling.
- mig: one filler given the whole GPU (`--gpu 0`), which fills each MIG device in a child process
  (FORGE_METRIC=gr_activity), for --seconds; a foreign job
  (scripts/foreign_job.py) on the second MIG device from a third of the run for a quarter of it. Per MIG device:
  the busy share of each whole second by the kernel record (mean and p95 |error| from 3 s on, outside the job's
  time on the device the job runs on); for the job's device, how long after the job's CUDA context existed our
  last kernel there ended; for the others, their busy share while the job ran.
Exit codes: 0 written; 2 bad arguments; 3 the virtual GPU could not be built.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.metric import METRIC_TARGET as TARGET  # noqa: E402
from bench.metric import held  # noqa: E402
from bench.render import write_section  # noqa: E402
from forge_load.control.scoring import percentile  # noqa: E402
from vgpu import BuildError, Kernel, VirtualGpu  # noqa: E402

PYTHON = ROOT / ".venv" / "bin" / "python"
FORGE_LOAD = ROOT / ".venv" / "bin" / "forge-load"

OBSERVER = r'''
import json, sys, time
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
prev = n.nvmlGpmSampleAlloc(); n.nvmlGpmSampleGet(h, prev)
last_us = int(time.time() * 1e6)
for _ in range(int(sys.argv[1])):
    time.sleep(1.0)
    cur = n.nvmlGpmSampleAlloc(); n.nvmlGpmSampleGet(h, cur)
    g = n.c_nvmlGpmMetricsGet_t()
    g.version, g.numMetrics, g.sample1, g.sample2 = n.NVML_GPM_METRICS_GET_VERSION, 2, prev, cur
    g.metrics[0].metricId, g.metrics[1].metricId = n.NVML_GPM_METRIC_SM_UTIL, n.NVML_GPM_METRIC_GRAPHICS_UTIL
    n.nvmlGpmMetricsGet(g); n.nvmlGpmSampleFree(prev); prev = cur
    try:
        _, samples = n.nvmlDeviceGetSamples(h, n.NVML_GPU_UTILIZATION_SAMPLES, last_us)
    except n.NVMLError_NotFound:
        samples = []
    util = [s.sampleValue.uiVal / 100 for s in samples]
    if samples:
        last_us = samples[-1].timeStamp
    print(json.dumps({"t": time.time(), "sm_activity": g.metrics[0].value / 100,
                      "gr_activity": g.metrics[1].value / 100,
                      "utilization": sum(util) / len(util) if util else None}), flush=True)
'''


def busy_by_second(kernels: list[Kernel], begin_s: float, end_s: float) -> list[tuple[float, float]]:
    """(end of the second, our busy share of it) for each whole second in [begin, end)."""
    out = []
    t = begin_s
    while t + 1.0 <= end_s:
        busy = sum(max(0.0, min(k.end, t + 1.0) - max(k.start, t)) for k in kernels)
        out.append((t + 1.0, busy))
        t += 1.0
    return out


def tracking(seconds: int, tmp: Path) -> list[dict[str, Any]]:
    rows = []
    for metric in ("utilization", "sm_activity", "gr_activity"):
        gpu = VirtualGpu(tmp / f"track_{metric}")
        env = gpu.env({**os.environ, "TMPDIR": str(tmp)})
        observer = subprocess.Popen([str(PYTHON), "-c", OBSERVER, str(seconds + 2)], env=env,
                                    stdout=subprocess.PIPE, text=True)
        filler = subprocess.run([str(FORGE_LOAD), "--metric", metric, "--target", str(TARGET), "--duration",
                                 str(seconds), "--log-format", "json", "--hold-dir", str(tmp / "holds")],
                                env=env, capture_output=True, text=True, timeout=seconds + 120)
        out, _ = observer.communicate(timeout=60)
        start = json.loads(filler.stdout.splitlines()[0])
        start_s = float(start["wall_time"])
        readings = [json.loads(line) for line in out.splitlines()]
        row: dict[str, Any] = {"metric": metric, "exit_code": filler.returncode}
        for key in ("utilization", "sm_activity", "gr_activity"):
            # bench/metric.py's settle and errors, as the real-GPU benchmark's metric scenario computes them
            h = held([(r["t"], r[key]) for r in readings if r[key] is not None], TARGET, start_s, start_s + seconds)
            row[key] = {"settle_s": None if h.settle_s is None else round(h.settle_s, 2), "readings": h.readings,
                        "mean_error": None if h.mean_error_ratio is None else round(h.mean_error_ratio, 4),
                        "p95_abs_error": None if h.p95_abs_error_ratio is None else round(h.p95_abs_error_ratio, 4)}
        rows.append(row)
    return rows


def mig(seconds: int, tmp: Path) -> list[dict[str, Any]]:
    gpu = VirtualGpu(tmp / "mig", mig=3)
    migs = gpu.mig_devices()
    job_at_s, job_for_s = seconds / 3, seconds / 4
    # One filler process given the whole GPU (FORGE_GPU=0, as in a container given it): one child per MIG device
    env = gpu.env({**os.environ, "TMPDIR": str(tmp)})
    env.pop("CUDA_VISIBLE_DEVICES", None)
    filler = subprocess.Popen([str(FORGE_LOAD), "--gpu", "0", "--metric", "gr_activity", "--target", str(TARGET),
                               "--duration", str(seconds), "--resume-after", "3", "--log-format", "json",
                               "--hold-dir", str(tmp / "holds")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    time.sleep(job_at_s)
    job_env = gpu.env({**os.environ, "CUDA_VISIBLE_DEVICES": migs[1].uuid})
    job = subprocess.run([str(PYTHON), str(ROOT / "scripts" / "foreign_job.py"), "--gpu", "0", "--seconds",
                          str(job_for_s), "--backend", "numba"], env=job_env, capture_output=True, text=True,
                         timeout=seconds + 120)
    out = filler.communicate(timeout=seconds + 120)[0]
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    starts = {line["uuid"]: float(line["wall_time"]) for line in lines if line["event"] == "start"}
    # The job's MIG device: its filler's own resume line ends the time it was away (FORGE_RESUME_AFTER after the job
    # left, which the job's exit and the machine's load move), not a guess
    resumes = {line["uuid"]: starts[line["uuid"]] + float(line["t"]) for line in lines
               if line["event"] == "resume" and line["uuid"] in starts}
    events = [json.loads(line) for line in job.stdout.splitlines() if line.startswith("{")]
    context_s = next(e["wall_time"] for e in events if e["event"] == "context")
    done_s = next(e["wall_time"] for e in events if e["event"] == "done")
    kernels = gpu.kernels()
    rows = []
    for i, m in enumerate(migs):
        start_s = starts[m.uuid]
        ours = [k for k in kernels if k.mig == m.gi and k.pid not in {e.get("pid") for e in events}]
        shares = busy_by_second(ours, start_s + 3.0, start_s + seconds)
        back_s = resumes.get(m.uuid, done_s + 4.0) + 1.0  # its first second back is its first burst
        outside = [v for t, v in shares if not (context_s - 1.0 <= t <= back_s)] if i == 1 else \
            [v for _, v in shares]
        during = [v for t, v in shares if context_s + 1.0 <= t <= done_s]
        row: dict[str, Any] = {"mig_device": m.uuid, "gpu_instance": m.gi, "profile": m.profile, "sms": m.sms,
                               "busy_by_second": [[round(t - t0, 2), round(v, 4)] for t, v in shares],
                               "exit_code": filler.returncode,
                               "mean_error": round(sum(outside) / len(outside) - TARGET, 4) if outside else None,
                               "p95_abs_error": round(percentile([abs(v - TARGET) for v in outside], 95), 4)}
        if i == 1:
            last_end = max((k.end for k in ours if k.start <= done_s and k.end >= context_s - 1.0), default=None)
            row["job"] = {"context_s": round(context_s - t0, 2), "done_s": round(done_s - t0, 2),
                          "resumed_s": round(back_s - 1.0 - t0, 2) if m.uuid in resumes else None}
            row["last_kernel_after_context_s"] = None if last_end is None else round(last_end - context_s, 3)
        else:
            row["busy_while_job_ran"] = {"mean_error": round(sum(during) / len(during) - TARGET, 4) if during
                                         else None,
                                         "max_abs_error": round(max(abs(v - TARGET) for v in during), 4)
                                         if during else None}
        rows.append(row)
    return rows


def goals(results: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """(goal, bar, measured, met) for each goal of MIG and the metric choice on the virtual GPU."""
    out: list[tuple[str, str, str, bool]] = []
    sm = next(row["sm_activity"] for row in results["tracking"] if row["metric"] == "sm_activity")
    out.append(("sm_activity held at 0.5: settle", "≤ 3 s", f"{sm['settle_s']} s",
                sm["settle_s"] is not None and sm["settle_s"] <= 3.0))
    out.append(("sm_activity held at 0.5: mean error", "within ±0.02", f"{sm['mean_error']}",
                sm["mean_error"] is not None and abs(sm["mean_error"]) <= 0.02))
    out.append(("sm_activity held at 0.5: p95 of 1-s readings", "within ±0.05", f"{sm['p95_abs_error']}",
                sm["p95_abs_error"] is not None and sm["p95_abs_error"] <= 0.05))
    for row in results["mig"]:
        name = f"MIG device GI {row['gpu_instance']}"
        out.append((f"{name}: busy share, mean", "within ±0.03 of 0.5", f"{row['mean_error']:+}",
                    row["mean_error"] is not None and abs(row["mean_error"]) <= 0.03))
        if "job" in row:
            gap = row["last_kernel_after_context_s"]
            out.append((f"{name} (the job's): our last kernel after the job's context", "≤ 0.2 s",
                        "none near it" if gap is None else f"{gap} s", gap is None or gap <= 0.2))
        else:
            worst = row["busy_while_job_ran"]["max_abs_error"]
            out.append((f"{name}: busy share while the job ran, each second", "within ±0.05", f"{worst}",
                        worst is not None and worst <= 0.05))
    return out


def render(results: dict[str, Any]) -> str:
    lines = [f"# MIG and the metric choice: virtual GPU, {results['date']}", "",
             f"Machine: {results['machine']}. **The virtual GPU** (driver-free stand-ins, a model of a GPU; not a GPU "
             "measurement). `python3 scripts/mig_metric_bench.py --seconds "
             f"{results['seconds']}`.", "", "## Tracking each FORGE_METRIC at 0.5 (whole GPU, cc 9.0)", "",
             "| held | read | settle s | mean error | p95 abs error |", "|---|---|---|---|---|"]
    for row in results["tracking"]:
        for key in ("utilization", "sm_activity", "gr_activity"):
            r = row[key]
            lines.append(f"| {row['metric']} | {key} | {r['settle_s']} | {r['mean_error']} | {r['p95_abs_error']} |")
    lines += ["", "## Three MIG devices of one GPU filled by one process given the whole GPU (`--gpu 0`: a child per "
              "MIG device, gr_activity 0.5), a foreign job on the second",
              "", "Busy share of each second by the kernel record, from 3 s on (the job's device: outside the time "
              "from a second before the job's context to a second after its filler's `resume` line).", "",
              "| MIG device | GI | profile | SMs | mean error | p95 abs error | while the job ran |",
              "|---|---|---|---|---|---|---|"]
    for row in results["mig"]:
        if "job" in row:
            gap = row["last_kernel_after_context_s"]
            when = "no kernel of ours near it" if gap is None else (
                f"{gap} s after" if gap >= 0 else f"{-gap} s before")
            extra = f"the job's device: our last kernel there ended {when} its CUDA context existed"
        else:
            w = row["busy_while_job_ran"]
            extra = f"mean error {w['mean_error']}, max abs error {w['max_abs_error']}"
        lines.append(f"| {row['mig_device'][:13]}… | {row['gpu_instance']} | {row['profile']} | {row['sms']} | "
                     f"{row['mean_error']} | {row['p95_abs_error']} | {extra} |")
    lines += ["", "## The goals (virtual GPU)", "", *goal_table(goals(results))]
    return "\n".join(lines) + "\n"


def goal_table(met: list[tuple[str, str, str, bool]]) -> list[str]:
    """The goals as a markdown table, for results.md and for docs/benchmarks.md's block."""
    return ["| goal | bar | measured | |", "|---|---|---|---|",
            *(f"| {goal} | {bar} | {measured} | {'PASS' if ok else 'FAIL'} |" for goal, bar, measured, ok in met)]


def section(results: dict[str, Any], out: Path) -> str:
    """The BENCH-MIG block of docs/benchmarks.md: the goals and a link to the whole results."""
    link = out.resolve().relative_to(ROOT / "docs").as_posix() if out.resolve().is_relative_to(ROOT / "docs") \
        else out.as_posix()
    met = goals(results)
    lines = ["<!-- BENCH-MIG -->", f"Generated by `python3 scripts/mig_metric_bench.py --seconds {results['seconds']}"
             f" --section docs/benchmarks.md`, {results['date']}, {results['machine']}: **the virtual GPU** (a model, "
             f"not a GPU measurement). {sum(m for *_, m in met)} of {len(met)} goals met; every number: "
             f"[{link}/results.md]({link}/results.md).", "", *goal_table(met)]
    return "\n".join([*lines, "<!-- /BENCH-MIG -->"]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=20, help="each run's length, 10 to 600 (default 20)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default "
                        "docs/benchmarks/virtual_<today>_mig)")
    parser.add_argument("--render", type=Path, metavar="DIR", help="only write DIR/results.md from DIR/results.json")
    parser.add_argument("--section", type=Path, metavar="FILE", help="also write the goals between FILE's BENCH-MIG "
                        "markers (docs/benchmarks.md)")
    args = parser.parse_args(argv)
    if args.render is not None:
        rendered = json.loads((args.render / "results.json").read_text())
        (args.render / "results.md").write_text(render(rendered))
        if args.section is not None:
            write_section(args.section, section(rendered, args.render))
        return 0
    if not 10 <= args.seconds <= 600:
        print(f"mig_metric_bench: --seconds {args.seconds}: expected 10 to 600", file=sys.stderr)
        return 2
    today = datetime.date.today().isoformat()
    out = args.out or ROOT / "docs" / "benchmarks" / f"virtual_{today}_mig"
    try:
        with tempfile.TemporaryDirectory(prefix="mig-bench-") as tmp:
            results = {"date": today, "machine": f"{platform.node() or 'unknown'}, {os.cpu_count()} CPUs, "
                       f"{platform.platform()}", "gpu": "virtual GPU (scripts/vgpu)", "seconds": args.seconds,
                       "tracking": tracking(args.seconds, Path(tmp)), "mig": mig(args.seconds, Path(tmp))}
    except BuildError as error:
        print(f"mig_metric_bench: cannot build the virtual GPU: {error}", file=sys.stderr)
        return 3
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(render(results))
    if args.section is not None:
        write_section(args.section, section(results, out))
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
