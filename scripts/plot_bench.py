#!/usr/bin/env python3
"""How long `forge-load plot` takes to draw 30 minutes of log (issue goal: under 5 s), end to end as a user runs it:
a fresh interpreter, matplotlib's import, the log read, the picture written.

    .venv/bin/python scripts/plot_bench.py [--minutes 30] [--log-interval 1] [--repeats 5]

The log is a simulated run's (the simulated GPU, `--sim-speed 0`: virtual time, not a GPU measurement), with two
foreign jobs so that the yielding spans are drawn too; one JSON and one key=value copy, each drawn as PNG and SVG.
Prints one line per case: lines, median and slowest seconds of `repeats` runs."""

from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from forge_load.config.load import load_config  # noqa: E402
from forge_load.service.loop import run_simulated  # noqa: E402


def simulated_log(minutes: float, log_interval_s: float, fmt: str) -> str:
    duration_s = minutes * 60
    jobs = f"{duration_s * 0.2:g}-{duration_s * 0.3:g},{duration_s * 0.6:g}-{duration_s * 0.65:g}"
    config = load_config(["--simulate", "--sim-speed", "0", "--duration", f"{duration_s:g}", "--sim-foreign", jobs,
                          "--log-interval", f"{log_interval_s:g}", "--resume-after", "30"],
                         env={"FORGE_LOG_FORMAT": fmt})
    out = io.StringIO()
    run_simulated(config, out)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--log-interval", type=float, default=1.0, help="seconds between status lines")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("json", "text"):
            made_s = time.perf_counter()
            text = simulated_log(args.minutes, args.log_interval, fmt)
            made_s = time.perf_counter() - made_s
            log = Path(tmp) / f"run-{fmt}.log"
            log.write_text(text)
            for suffix in ("png", "svg"):
                times_s = []
                for _ in range(args.repeats):
                    begin_s = time.perf_counter()
                    subprocess.run([sys.executable, "-m", "forge_load", "plot", str(log), "-o",
                                    str(Path(tmp) / f"out.{suffix}")], check=True, cwd=REPO, capture_output=True)
                    times_s.append(time.perf_counter() - begin_s)
                median_s = statistics.median(times_s)
                print(f"{fmt:4} -> {suffix}: {text.count(chr(10))} lines ({args.minutes:g} min, a line per "
                      f"{args.log_interval:g} s; simulated in {made_s:.1f} s): median {median_s:.2f} s, "
                      f"slowest {max(times_s):.2f} s of {args.repeats}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
