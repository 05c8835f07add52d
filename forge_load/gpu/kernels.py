"""The burn kernel: register-only float32 work that keeps the GPU busy.

This is the only module with CUDA kernels, and the only one that imports numba. The filler does not import
it: scripts/build_kernels.py compiles the kernel here, when the package is built, into the images burn_image.py
loads; at run time only a GPU that none of them fits, with the `jit` extra installed, compiles it here
(jit_cubin). Importing it creates no CUDA context (``cuda.jit`` on a bare function compiles lazily, at the first
launch), so it imports on machines without a GPU and under ``NUMBA_ENABLE_CUDASIM=1``.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from numba import cuda

from forge_load.gpu.burn_image import (
    BURN_ITERS,
    BURN_SIGNATURE,
    PTX_CC,
    THREADS_PER_BLOCK,
    UNREACHABLE_SENTINEL,
)

__all__ = ["BURN_ITERS", "BURN_SIGNATURE", "THREADS_PER_BLOCK", "UNREACHABLE_SENTINEL", "burn", "burn_py",
           "compile_ptx", "jit_cubin", "link_cubin", "launch_burn", "numba_launch_arguments", "reference_value"]

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


def compile_ptx(cc: tuple[int, int] = PTX_CC) -> tuple[str, str]:
    """(the PTX of BURN_SIGNATURE for `cc`, the entry's mangled name), compiled by numba with its own ABI, so the
    kernel takes its arguments as numba's launch passes them (burn_image.ARGUMENT_LAYOUT)."""
    ptx, _ = cuda.compile(burn_py, BURN_SIGNATURE, device=False, abi="numba", cc=cc, output="ptx")
    entries = re.findall(r"\.entry\s+([A-Za-z0-9_$]+)\s*\(", ptx)
    if len(entries) != 1:
        raise RuntimeError(f"expected one .entry in the burn kernel's PTX, found {entries}")
    return ptx, entries[0]


def link_cubin(ptx: str, arch: int) -> bytes:
    """The cubin for sm_`arch`, linked from `ptx` by cuda.core's Linker (nvJitLink where installed)."""
    from cuda.core import Linker, LinkerOptions, ObjectCode

    linker = Linker(ObjectCode.from_ptx(ptx.encode()), options=LinkerOptions(arch=f"sm_{arch}"))
    return bytes(linker.link("cubin").code)


def jit_cubin(cc: tuple[int, int]) -> tuple[bytes, str]:
    """The `jit` extra's fallback, at the filler's start: (a cubin for this GPU, its entry's name)."""
    ptx, entry = compile_ptx(cc)
    return link_cubin(ptx, cc[0] * 10 + cc[1]), entry


def numba_launch_arguments(out: Any, iters: int = BURN_ITERS, sentinel: float = UNREACHABLE_SENTINEL) -> list[Any]:
    """What numba's own launch of BURN_SIGNATURE passes for these arguments, field by field (each a ctypes value
    or a plain int): the reference burn_image.ARGUMENT_LAYOUT is tested against."""
    kernel = burn.compile(BURN_SIGNATURE)
    expanded: list[Any] = []
    for arg_type, value in zip(kernel.argument_types, (out, np.int32(iters), np.float32(sentinel))):
        kernel._prepare_args(arg_type, value, 0, [], expanded)
    return expanded


def reference_value(thread_index: int, iters: int) -> float:
    """The value thread ``thread_index`` (global index) computes, in numpy float32."""
    x = y = np.float32(thread_index)
    for _ in range(iters):
        x = np.float32(x * _HALF + y)  # exact product: same single rounding as FFMA
        y = np.float32(y + _ONE)
    return float(x)
