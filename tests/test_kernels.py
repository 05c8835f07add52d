"""The burn kernel computes what it claims (CUDA simulator) and, for every
supported architecture, compiles to code with no local memory (real NVVM and
ptxas from the cu12 wheels). Neither needs a GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from forge_load.gpu import kernels

REPO_ROOT = Path(__file__).resolve().parents[1]

# --- simulator ---------------------------------------------------------------

SIM_ITERS = 16
SIM_BLOCKS = 2
SIM_THREADS = 32
UNTOUCHED = 12345.0  # out[0] before the launch; no thread can produce it

# Runs in its own interpreter: NUMBA_ENABLE_CUDASIM must be set before numba
# is first imported, and this pytest process imports numba without it.
_SIM_SCRIPT = """
import json, sys
import numpy as np
from numba import config, cuda
assert config.ENABLE_CUDASIM, "simulator not enabled"
from forge_load.gpu import kernels
iters, blocks, threads = (int(a) for a in sys.argv[1:4])
untouched = float(sys.argv[4])
results = {}
for name, sentinel in json.loads(sys.argv[5]).items():
    out = cuda.to_device(np.full(1, untouched, dtype=np.float32))
    if name.startswith("launch_burn"):  # the worker's entry point: 1 block of THREADS_PER_BLOCK
        kernels.launch_burn(out, 1, iters=iters, sentinel=sentinel)
    else:
        kernels.burn[blocks, threads](out, np.int32(iters), np.float32(sentinel))
    results[name] = float(out.copy_to_host()[0])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def sim_sentinels() -> dict[str, float]:
    last_thread = SIM_BLOCKS * SIM_THREADS - 1
    return {
        "thread0": kernels.reference_value(0, SIM_ITERS),
        "last_thread": kernels.reference_value(last_thread, SIM_ITERS),
        "one_more_iter": kernels.reference_value(0, SIM_ITERS + 1),
        "unreachable": kernels.UNREACHABLE_SENTINEL,
        "launch_burn_last_thread": kernels.reference_value(kernels.THREADS_PER_BLOCK - 1, SIM_ITERS),
        "launch_burn_unreachable": kernels.UNREACHABLE_SENTINEL,
    }


@pytest.fixture(scope="module")
def sim_results(sim_sentinels: dict[str, float]) -> dict[str, float]:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    args = [str(SIM_ITERS), str(SIM_BLOCKS), str(SIM_THREADS), str(UNTOUCHED), json.dumps(sim_sentinels)]
    proc = subprocess.run(
        [sys.executable, "-c", _SIM_SCRIPT, *args],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"simulator run failed:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sim_writes_when_thread0_hits_sentinel(sim_results, sim_sentinels) -> None:
    assert sim_results["thread0"] == sim_sentinels["thread0"]


def test_sim_seeds_from_global_thread_index(sim_results, sim_sentinels) -> None:
    # The last thread of the second block: proves blockIdx enters the seed.
    assert sim_results["last_thread"] == sim_sentinels["last_thread"]


def test_sim_runs_exactly_iters_iterations(sim_results, sim_sentinels) -> None:
    grid_values = {kernels.reference_value(t, SIM_ITERS) for t in range(SIM_BLOCKS * SIM_THREADS)}
    assert sim_sentinels["one_more_iter"] not in grid_values  # else the check proves nothing
    assert sim_results["one_more_iter"] == UNTOUCHED


def test_sim_never_writes_with_unreachable_sentinel(sim_results) -> None:
    assert sim_results["unreachable"] == UNTOUCHED


def test_sim_launch_burn_runs_threads_per_block(sim_results, sim_sentinels) -> None:
    assert sim_results["launch_burn_last_thread"] == sim_sentinels["launch_burn_last_thread"]
    assert sim_results["launch_burn_unreachable"] == UNTOUCHED


def test_reference_values_are_non_negative() -> None:
    # Why UNREACHABLE_SENTINEL (negative) can never match, production size included.
    values = [kernels.reference_value(t, n) for t in (0, 1, 255, 10**6) for n in (0, 1, kernels.BURN_ITERS)]
    assert kernels.UNREACHABLE_SENTINEL < 0
    assert min(values) >= 0


def test_reference_value_depends_on_iters_and_thread() -> None:
    assert kernels.reference_value(0, 8) != kernels.reference_value(0, 9)
    assert kernels.reference_value(0, 8) != kernels.reference_value(1, 8)


# --- real compile: PTX for every supported cc, checked by ptxas ---------------

MAX_REGISTERS = 64  # 65536 registers per SM / 1024 threads: full occupancy still possible

_PROPS_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS_RE = re.compile(r"Used (\d+) registers")


def _find_ptxas() -> Path | None:
    try:
        import nvidia  # namespace package of the NVIDIA cu12 wheels
    except ImportError:
        return None
    for base in getattr(nvidia, "__path__", []):
        candidate = Path(base) / "cuda_nvcc" / "bin" / "ptxas"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.mark.parametrize("cc", kernels.SUPPORTED_CC, ids=lambda cc: f"sm_{cc[0]}{cc[1]}")
def test_burn_uses_no_local_memory(cc: tuple[int, int], tmp_path: Path) -> None:
    from numba import config, cuda

    if config.ENABLE_CUDASIM:
        pytest.skip("NUMBA_ENABLE_CUDASIM is set in this process: no real compiler")
    ptxas = _find_ptxas()
    if ptxas is None:
        pytest.skip("ptxas not found under nvidia/cuda_nvcc/bin: install numba-cuda[cu12]")

    ptx, _ = cuda.compile_ptx(kernels.burn_py, kernels.BURN_SIGNATURE, cc=cc)
    # float32 only: float64 runs at 1/64 rate on most GPUs, a different burn.
    assert ".f64" not in ptx, "burn kernel uses float64 arithmetic"
    ptx_file = tmp_path / "burn.ptx"
    ptx_file.write_text(ptx)
    arch = f"sm_{cc[0]}{cc[1]}"
    proc = subprocess.run(
        [str(ptxas), f"-arch={arch}", "-v", "-o", os.devnull, str(ptx_file)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"ptxas failed for {arch}:\n{report}"

    assert f"for '{arch}'" in report, report
    props = _PROPS_RE.findall(report)
    regs = _REGS_RE.findall(report)
    assert len(props) == 1 and len(regs) == 1, f"expected one entry function:\n{report}"
    stack, spill_stores, spill_loads = (int(v) for v in props[0])
    assert (stack, spill_stores, spill_loads) == (0, 0, 0), report
    assert int(regs[0]) <= MAX_REGISTERS, report
