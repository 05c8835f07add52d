"""forge_load's benchmark (`scripts/gpu_bench.py` is its command): tracking, yield, footprint and CPU, on a real
GPU, the virtual GPU or the simulated GPU. It imports forge_load, never the reverse, and is not part of the
shipped package or the image. What every number means: docs/benchmarks/README.md.

Its modules, one per scenario beside what they share: the map in docs/design.md, "The benchmark: `bench/`"
(tests/test_layers.py checks that it lists every one).
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
