"""forge_load's benchmark (`scripts/gpu_bench.py` is its command): tracking, yield, footprint and CPU, on a real
GPU, the virtual GPU or the simulated GPU. It imports forge_load, never the reverse, and is not part of the
shipped package or the image. What every number means: docs/benchmarks/README.md.

  cli.py        the command line and main(): mode, output folder, exit codes, --render
  results.py    numbers with units, the typed records of each scenario, goals and their judging
  analysis.py   numbers from the filler's JSON log and from utilization samples (tracking, yield)
  runner.py     child processes (own process group, timeouts, all ended on exit) and their CPU time
  sampler.py    the NVML sampling thread of a real run, reading samples as the Monitor does
  scenarios.py  tracking, yield and footprint, on the simulated GPU and on a real one
  kubelet.py    a test kubelet (the pod-resources API on a unix socket): the announced scenario's and the tests'
  cpu.py        the cpu scenario: the filler's CPU per GPU, start-up and tracking (virtual or real GPU)
  render.py     results.md, the generated blocks of docs/benchmarks.md, the plots
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_GPU, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def log(message: str) -> None:
    print(f"[gpu_bench] {message}", file=sys.stderr, flush=True)


class BenchError(Exception):
    """A scenario could not be run or measured; the message says why."""


class NoGpu(Exception):
    pass


class Interrupted(Exception):
    pass
