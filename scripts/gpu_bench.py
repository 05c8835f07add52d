#!/usr/bin/env python3
"""forge_load's benchmark: tracking, yield, footprint and CPU on one GPU, on the virtual GPU (--vgpu) or on the
simulated GPU (--simulate). The benchmark itself is the `bench` package at the repository root; this is its
command.

Writes into an output folder (default docs/benchmarks/<gpu-name>_<YYYY-MM-DD>/, or
docs/benchmarks/simulated_<YYYY-MM-DD>/ with --simulate, or docs/benchmarks/virtual_<YYYY-MM-DD>/ on the virtual
GPU: --vgpu, or run under scripts/vgpu; every result from there says "virtual GPU"):
  results.json  every number with its unit ({"value": ..., "unit": ...}), the GPU, driver, date, command, mode
  results.md    the Markdown tables (goals, tracking pi vs legacy, yield, footprint); also printed on stdout
  series.json   the time series behind the plots
  *.png         plots of utilization, own and foreign share and multiplier over time (needs matplotlib)
  cpu.json, cpu.md  the cpu scenario (--scenarios cpu): the filler's CPU per GPU, start-up, tracking
Nothing in them is typed by hand. What every number means: docs/benchmarks/README.md.

    python3 scripts/gpu_bench.py --out "$OUT/bench" --budget-s 560   # the real GPU 0 (under 10 minutes)
    python3 scripts/gpu_bench.py --simulate                          # the simulated GPU (seconds)
    python3 scripts/gpu_bench.py --vgpu --budget-s 300               # real mode on the virtual GPU
    python3 scripts/gpu_bench.py --vgpu --scenarios cpu              # CPU per GPU, 1 and 8 virtual GPUs
    python3 scripts/gpu_bench.py --render DIR --section FILE         # redraw plots/tables from DIR

Started by an interpreter other than the project's .venv/bin/python, it runs itself there (when .venv exists; not
with GPU_BENCH_NO_VENV=1).

Exit codes: 0 done; 1 a scenario failed (or, with --strict, a goal was missed); 2 bad arguments;
3 no usable GPU / NVML (with a hint); 130 interrupted (the results so far are written).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_VENV_PYTHON = REPO / ".venv" / "bin" / "python"
# The project's environment has what the benchmark needs (numba-cuda, matplotlib for the plots): run there when
# started by another interpreter (`python3 scripts/gpu_bench.py`), as scripts/vgpu does.
if _VENV_PYTHON.exists() and Path(sys.prefix).resolve() != (REPO / ".venv").resolve() \
        and not os.environ.get("GPU_BENCH_NO_VENV"):
    os.execv(str(_VENV_PYTHON), [str(_VENV_PYTHON), __file__, *sys.argv[1:]])
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
