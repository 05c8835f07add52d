#!/usr/bin/env python3
"""How long `forge-load plot` takes, and how much memory, end to end as a user runs it: a fresh interpreter,
matplotlib's import, the log read, the picture written.

    .venv/bin/python scripts/plot_bench.py [--minutes 30] [--log-interval 1] [--repeats 5] [--big-mb 200]
                                           [--out docs/benchmarks/plot_<date>]

Two cases, each for a JSON and a key=value log:
- 30 minutes of a one-second log, drawn as PNG and SVG, `repeats` times: median and slowest seconds (goal: 5 s).
- a log of `--big-mb` MB (days of status lines from two GPUs), drawn as PNG once: seconds and the peak resident
  memory of the `forge-load plot` process (goal: 15 s and 300 MB for 200 MB; 0 leaves this case out).

The logs are a simulated run's (the simulated GPU, `--sim-speed 0`: virtual time, not a GPU measurement), with two
foreign jobs so that the yielding spans are drawn too; the big one is an hour of two simulated GPUs repeated with
its times moved on, so it reads as one long run. The peak memory is the process's maximum resident set
(getrusage's ru_maxrss, from wait4). Prints a table, and with --out writes results.md and results.json there,
with the machine, its load before and after, the command and the date."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.cpu import machine  # noqa: E402
from forge_load.config.load import load_config  # noqa: E402
from forge_load.service.loop import run_simulated  # noqa: E402

GOALS = {"small_s": 5.0, "big_s": 15.0, "big_peak_mb": 300.0, "big_mb": 200.0}
_TEXT_T_RE = re.compile(r"^t=([0-9.]+) ")
_JSON_T_RE = re.compile(r'^\{"t":([0-9.eE+-]+),')


def simulated_log(minutes: float, log_interval_s: float, fmt: str, gpus: int = 1) -> str:
    """A simulated run's log: one GPU in this process, several as the command line runs them (a thread each)."""
    duration_s = minutes * 60
    jobs = f"{duration_s * 0.2:g}-{duration_s * 0.3:g},{duration_s * 0.6:g}-{duration_s * 0.65:g}"
    flags = ["--simulate", "--sim-speed", "0", "--duration", f"{duration_s:g}", "--sim-foreign", jobs,
             "--log-interval", f"{log_interval_s:g}", "--resume-after", "30"]
    if gpus > 1:
        with tempfile.TemporaryDirectory() as tmp:  # a heartbeat of its own: no other filler of the host is met
            done = subprocess.run([sys.executable, "-m", "forge_load", *flags, "--gpus", "all", "--sim-gpus",
                                   str(gpus), "--log-format", fmt, "--heartbeat-file", f"{tmp}/heartbeat"],
                                  cwd=REPO, capture_output=True, text=True, check=True)
        return done.stdout
    out = io.StringIO()
    run_simulated(load_config(flags, env={"FORGE_LOG_FORMAT": fmt}), out)
    return out.getvalue()


def big_log(path: Path, fmt: str, megabytes: float) -> int:
    """An hour of two simulated GPUs, its middle repeated with its times moved on until the file holds
    `megabytes` MB: one start, days of status lines, yields and resumes, one stop. Returns its lines."""
    lines = simulated_log(60, 1.0, fmt, gpus=2).splitlines()
    pattern = _JSON_T_RE if fmt == "json" else _TEXT_T_RE
    head = [line for line in lines if json_or_text_event(line) in ("start", "settings")]
    body = [line for line in lines if json_or_text_event(line) not in ("start", "settings", "stop")]
    tail = [line for line in lines if json_or_text_event(line) == "stop"]
    period_s = 3600.0
    count = 0
    with path.open("w") as out:
        out.write("\n".join(head) + "\n")
        count += len(head)
        turn = 0
        while out.tell() < megabytes * 1e6:
            shift_s = turn * period_s
            out.write("\n".join(moved(line, pattern, shift_s, fmt) for line in body) + "\n")
            count += len(body)
            turn += 1
        out.write("\n".join(moved(line, pattern, (turn - 1) * period_s, fmt) for line in tail) + "\n")
        count += len(tail)
    return count


def json_or_text_event(line: str) -> str:
    match = re.search(r'"event":"(\w+)"|event=(\w+)', line)
    return (match.group(1) or match.group(2)) if match else ""


def moved(line: str, pattern: re.Pattern[str], shift_s: float, fmt: str) -> str:
    match = pattern.match(line)
    if match is None or shift_s == 0:
        return line
    t = float(match.group(1)) + shift_s
    start = f'{{"t":{t:.3f},' if fmt == "json" else f"t={t:.2f} "
    return start + line[match.end():]


def plot_run(log: Path, out: Path) -> tuple[float, float]:
    """`forge-load plot LOG -o OUT` in a fresh interpreter: its wall seconds and peak resident MB (10^6 bytes)."""
    begin_s = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "forge_load", "plot", str(log), "-o", str(out)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall_s = time.perf_counter() - begin_s
    stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"forge-load plot {log} failed: {stderr[-2000:]}")
    return wall_s, usage.ru_maxrss * 1024 / 1e6  # Linux: KiB; the goal is in MB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--log-interval", type=float, default=1.0, help="seconds between status lines")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--big-mb", type=float, default=GOALS["big_mb"], help="the big log's size; 0: none")
    parser.add_argument("--out", type=Path, default=None, help="write results.md and results.json here")
    args = parser.parse_args(argv)
    box = machine()
    began = datetime.now(timezone.utc)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("json", "text"):
            text = simulated_log(args.minutes, args.log_interval, fmt)
            log = Path(tmp) / f"run-{fmt}.log"
            log.write_text(text)
            for suffix in ("png", "svg"):
                runs = [plot_run(log, Path(tmp) / f"out.{suffix}") for _ in range(args.repeats)]
                times_s = [wall_s for wall_s, _ in runs]
                rows.append({"case": "30 min", "log": fmt, "picture": suffix, "lines": text.count("\n"),
                             "megabytes": round(len(text.encode()) / 1e6, 2), "runs": args.repeats,
                             "median_s": round(statistics.median(times_s), 2), "slowest_s": round(max(times_s), 2),
                             "peak_mb": round(max(mb for _, mb in runs), 1)})
                print(row_text(rows[-1]), flush=True)
        if args.big_mb > 0:
            for fmt in ("json", "text"):
                log = Path(tmp) / f"big-{fmt}.log"
                lines = big_log(log, fmt, args.big_mb)
                wall_s, peak_mb = plot_run(log, Path(tmp) / "big.png")
                rows.append({"case": f"{args.big_mb:g} MB", "log": fmt, "picture": "png", "lines": lines,
                             "megabytes": round(log.stat().st_size / 1e6, 1), "runs": 1, "median_s": round(wall_s, 2),
                             "slowest_s": round(wall_s, 2), "peak_mb": round(peak_mb, 1)})
                print(row_text(rows[-1]), flush=True)
                log.unlink()
    results = {"command": shlex.join(["python", "scripts/plot_bench.py", *(argv or sys.argv[1:])]),
               "date": began.strftime("%Y-%m-%d"), "began": began.isoformat(timespec="seconds"),
               "machine": box, "load_average_1m_at_end": os.getloadavg()[0], "goals": GOALS, "rows": rows,
               "gpu": "none: the logs are the simulated GPU's (virtual time); the drawing is what is measured"}
    table = markdown(results)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        (args.out / "results.md").write_text(table)
    return 0


def row_text(row: dict[str, Any]) -> str:
    return (f"{row['case']:>7} {row['log']:4} -> {row['picture']}: {row['lines']} lines, {row['megabytes']} MB: "
            f"median {row['median_s']:.2f} s, slowest {row['slowest_s']:.2f} s of {row['runs']}, "
            f"peak {row['peak_mb']:.0f} MB")


def markdown(results: dict[str, Any]) -> str:
    box = results["machine"]
    goals = results["goals"]
    out = [f"# forge-load plot: time and memory, {results['date']}", "",
           f"`{results['command']}` on {box['cpu_model']}, {box['logical_cpus']['value']} logical CPUs, "
           f"{box['platform']}; load average {box['load_average_1m_at_start']['value']:.2f} at the start, "
           f"{results['load_average_1m_at_end']:.2f} at the end. The logs are the simulated GPU's (virtual time): "
           "the drawing is measured, not a GPU.", "",
           "| log | picture | lines | MB | runs | median (s) | slowest (s) | peak memory (MB) | goal |",
           "|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        if row["case"] == "30 min":
            met = row["slowest_s"] <= goals["small_s"]
            goal = f"≤ {goals['small_s']:g} s: {'met' if met else 'not met'}"
        else:
            met = row["slowest_s"] <= goals["big_s"] and row["peak_mb"] <= goals["big_peak_mb"]
            goal = f"≤ {goals['big_s']:g} s and ≤ {goals['big_peak_mb']:g} MB: {'met' if met else 'not met'}"
        name = "JSON" if row["log"] == "json" else "key=value"
        out.append(f"| {name}, {row['case']} | {row['picture'].upper()} | {row['lines']:,} | {row['megabytes']} | "
                   f"{row['runs']} | {row['median_s']:.2f} | {row['slowest_s']:.2f} | {row['peak_mb']:.0f} | {goal} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
