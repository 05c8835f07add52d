"""The kernels: the lean one, a warp that sleeps (the default shape), and the burn one, register-only float32 work.

This is the only module with CUDA kernels, and the only one that imports numba. The filler does not import
it: scripts/build_kernels.py compiles the kernels here, when the package is built, into the images burn_image.py
loads; at run time only a GPU that none of them fits, with the `jit` extra installed, compiles one here
(jit_cubin). Importing it creates no CUDA context (``cuda.jit`` on a bare function compiles lazily, at the first
launch), so it imports on machines without a GPU and under ``NUMBA_ENABLE_CUDASIM=1``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import config, cuda

from forge_load.gpu.burn_image import (
    BURN,
    BURN_ITERS,
    BURN_SIGNATURE,
    LEAN,
    LEAN_SIGNATURE,
    LEAN_THREADS_PER_BLOCK,
    PTX_CC,
    SLEEP_QUANTUM_NS,
    THREADS_PER_BLOCK,
    UNREACHABLE_SENTINEL,
)

__all__ = ["BURN_ITERS", "BURN_SIGNATURE", "LEAN_SIGNATURE", "THREADS_PER_BLOCK", "UNREACHABLE_SENTINEL", "burn",
           "burn_py", "compile_ptx", "jit_cubin", "lean", "lean_py", "link_cubin", "launch_burn", "launch_lean",
           "numba_launch_arguments", "numba_lean_launch_arguments", "reference_value"]

if config.ENABLE_CUDASIM:  # pragma: no cover - only in the simulator's own process
    # numba's CUDA simulator has no nanosleep: a host sleep of the same request stands in for it, so the lean kernel
    # runs there too (tests/test_kernels.py counts its calls).
    from numba.cuda.simulator import kernelapi

    if not hasattr(kernelapi.FakeCUDAModule, "nanosleep"):
        kernelapi.FakeCUDAModule.nanosleep = staticmethod(lambda ns: time.sleep(int(ns) / 1e9))

# float32 constants: a Python float literal would promote the arithmetic to
# float64. The multiplier is a power of two so the product is exact: then an
# FFMA (hardware), a multiply-then-add (simulator) and numpy all round once,
# identically, and reference_value() is bit-exact everywhere.
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)


def burn_py(out: Any, iters: int, sentinel: float) -> None:
    """Run ``iters`` dependent FMAs per thread; write ``out[0]`` only if the
    result equals ``sentinel`` (never, in production), so the compiler must
    keep the work yet the kernel touches 4 bytes of memory at most."""
    seed = np.float32(cuda.grid(1))
    x = seed
    y = seed  # a counter in float, so x depends on every iteration
    for _ in range(iters):
        x = cuda.fma(x, _HALF, y)
        y = y + _ONE
    if x == sentinel:
        out[0] = x


burn = cuda.jit(burn_py)


def lean_py(quanta: int, quantum_ns: int) -> None:
    """Sleep `quanta` times `quantum_ns` (each thread, so each warp): resident and idle, no arithmetic, no memory.

    nanosleep sleeps between 0 and twice its request and is not reliable above ~1 ms (docs/design.md §15), so the
    length comes from the count of short sleeps; the Worker learns what a quantum really lasts from its timings."""
    for _ in range(quanta):
        cuda.nanosleep(quantum_ns)


lean = cuda.jit(lean_py)


def launch_burn(
    out: Any,
    blocks: int,
    stream: Any = 0,
    iters: int = BURN_ITERS,
    sentinel: float = UNREACHABLE_SENTINEL,
) -> None:
    """Queue ``blocks`` x THREADS_PER_BLOCK burn threads on ``stream``; returns at once.

    Casts the scalars so every launch uses the BURN_SIGNATURE specialization.
    """
    burn[blocks, THREADS_PER_BLOCK, stream](out, np.int32(iters), np.float32(sentinel))


def launch_lean(blocks: int, quanta: int, stream: Any = 0, quantum_ns: int = SLEEP_QUANTUM_NS) -> None:
    """Queue `blocks` warps that each sleep `quanta` quanta on ``stream``; returns at once."""
    lean[blocks, LEAN_THREADS_PER_BLOCK, stream](np.int32(quanta), np.uint32(quantum_ns))


# Each kernel's Python function and the one signature compiled, shipped and launched, by image name.
SOURCES: dict[str, tuple[Callable[..., None], str]] = {BURN: (burn_py, BURN_SIGNATURE), LEAN: (lean_py, LEAN_SIGNATURE)}


def compile_ptx(cc: tuple[int, int] = PTX_CC, kernel: str = BURN) -> tuple[str, str]:
    """(the PTX of the kernel's signature for `cc`, the entry's mangled name), compiled by numba with its own ABI, so
    the kernel takes its arguments as numba's launch passes them (burn_image's argument layouts)."""
    pyfunc, signature = SOURCES[kernel]
    ptx, _ = cuda.compile(pyfunc, signature, device=False, abi="numba", cc=cc, output="ptx")
    entries = re.findall(r"\.entry\s+([A-Za-z0-9_$]+)\s*\(", ptx)
    if len(entries) != 1:
        raise RuntimeError(f"expected one .entry in the {kernel} kernel's PTX, found {entries}")
    return ptx, entries[0]


def link_cubin(ptx: str, arch: int) -> bytes:
    """The cubin for sm_`arch`, linked from `ptx` by cuda.core's Linker (nvJitLink where installed)."""
    from cuda.core import Linker, LinkerOptions, ObjectCode

    linker = Linker(ObjectCode.from_ptx(ptx.encode()), options=LinkerOptions(arch=f"sm_{arch}"))
    return bytes(linker.link("cubin").code)


def jit_cubin(cc: tuple[int, int], kernel: str = BURN) -> tuple[bytes, str]:
    """The `jit` extra's fallback, at the filler's start: (a cubin of the kernel for this GPU, its entry's name)."""
    ptx, entry = compile_ptx(cc, kernel)
    return link_cubin(ptx, cc[0] * 10 + cc[1]), entry


def numba_launch_arguments(out: Any, iters: int = BURN_ITERS, sentinel: float = UNREACHABLE_SENTINEL) -> list[Any]:
    """What numba's own launch of BURN_SIGNATURE passes for these arguments, field by field (each a ctypes value
    or a plain int): the reference burn_image.ARGUMENT_LAYOUT is tested against."""
    return _expanded(burn, BURN_SIGNATURE, (out, np.int32(iters), np.float32(sentinel)))


def numba_lean_launch_arguments(quanta: int, quantum_ns: int = SLEEP_QUANTUM_NS) -> list[Any]:
    """The same for LEAN_SIGNATURE: the reference of burn_image.LEAN_ARGUMENT_LAYOUT."""
    return _expanded(lean, LEAN_SIGNATURE, (np.int32(quanta), np.uint32(quantum_ns)))


def _expanded(dispatcher: Any, signature: str, values: tuple[Any, ...]) -> list[Any]:
    kernel = dispatcher.compile(signature)
    expanded: list[Any] = []
    for arg_type, value in zip(kernel.argument_types, values):
        kernel._prepare_args(arg_type, value, 0, [], expanded)
    return expanded


def reference_value(thread_index: int, iters: int) -> float:
    """The value thread ``thread_index`` (global index) computes, in numpy float32."""
    x = y = np.float32(thread_index)
    for _ in range(iters):
        x = np.float32(x * _HALF + y)  # exact product: same single rounding as FFMA
        y = np.float32(y + _ONE)
    return float(x)
