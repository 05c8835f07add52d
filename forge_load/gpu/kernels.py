"""The burn kernel: register-only float32 work that keeps the GPU busy.

This is the only module with CUDA kernels. Importing it creates no CUDA
context (``cuda.jit`` on a bare function compiles lazily, at the first
launch), so it imports on machines without a GPU and under
``NUMBA_ENABLE_CUDASIM=1``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda

THREADS_PER_BLOCK: int = 256

# 4096 iterations: each one is a dependent FFMA (~4 cycles latency), so a
# lone block runs ~10 us; a full SM (8 resident blocks of 256) is throughput
# bound at ~0.1 ms. Small enough that launches of a few ms (docs/design.md §6)
# are sized in fine steps by the grid, large enough that launch overhead
# (~5 us) is not most of the kernel.
BURN_ITERS: int = 4096

# The one signature launched and checked by ptxas in the tests. Launch via
# launch_burn(): Python int/float scalars would make numba compile an
# int64/float64 variant that the test does not cover.
BURN_SIGNATURE: str = "void(float32[::1], int32, float32)"

# Architectures whose PTX is checked for zero local memory by the tests.
SUPPORTED_CC: tuple[tuple[int, int], ...] = ((7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0))

# Every value a thread computes is >= 0, so a negative sentinel never
# matches and the kernel never writes to memory.
UNREACHABLE_SENTINEL: float = -1.0

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


@dataclass(frozen=True)
class BoundBurn:
    """The burn kernel bound once: its function in the current context and its arguments packed for
    cuLaunchKernel, so a launch is one driver call instead of numba's dispatch (docs/design.md §8)."""

    function: Any  # cuda.bindings CUfunction
    params: Any  # ctypes void*[]: the address of each argument, as kernelParams wants
    values: tuple[Any, ...]  # the ctypes values `params` points at (kept alive with it)

    @property
    def params_address(self) -> int:
        return ctypes.addressof(self.params)


def bind_burn(out: Any, iters: int = BURN_ITERS, sentinel: float = UNREACHABLE_SENTINEL) -> BoundBurn:
    """Bind the BURN_SIGNATURE specialization in the current context, with these arguments.

    The arguments are what numba's own launch passes: numba expands them (an array becomes its data
    model's fields), and each plain int goes as an intptr_t, as cuda.core packs it for numba.
    """
    from cuda.bindings import driver

    kernel = burn.compile(BURN_SIGNATURE)  # compiled here (or found, if launched before) and loaded below
    expanded: list[Any] = []
    for arg_type, value in zip(kernel.argument_types, (out, np.int32(iters), np.float32(sentinel))):
        kernel._prepare_args(arg_type, value, 0, [], expanded)
    values = tuple(ctypes.c_ssize_t(v) if isinstance(v, int) else v for v in expanded)
    for value in values:
        if not isinstance(value, ctypes._SimpleCData):  # a numba that packs arguments differently
            raise TypeError(f"cannot bind an argument of type {type(value).__name__}")
    params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    handle = kernel._codelibrary.get_cufunc().handle
    if isinstance(handle, driver.CUkernel):  # a library kernel: its function in the current context
        err, function = driver.cuKernelGetFunction(handle)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuKernelGetFunction failed: {err.name}")
    else:
        function = handle
    return BoundBurn(function, params, values)


def reference_value(thread_index: int, iters: int) -> float:
    """The value thread ``thread_index`` (global index) computes, in numpy float32."""
    x = y = np.float32(thread_index)
    for _ in range(iters):
        x = np.float32(x * _HALF + y)  # exact product: same single rounding as FFMA
        y = np.float32(y + _ONE)
    return float(x)
