#!/usr/bin/env python3
"""A foreign CUDA job for the benchmark (scripts/gpu_bench.py): a training-like matmul loop.

Each step is the forward and backward pass of a two-layer MLP plus an SGD update, written as six matrix
multiplies and a few element-wise kernels, and ends by reading the loss back to the host (as a training
loop's `loss.item()` does), so every step waits for the GPU and any time our filler takes from it shows up
in the step rate. The backend is PyTorch if importable, else CuPy, else numba (its own tiled matmul).

It prints one JSON object per line on stdout:
  {"event": "backend", "backend": "torch", "version": ..., "size": ..., "batch": ..., "dtype": ...}
  {"event": "ready", "pid": ...}      with --wait only: imports done, waiting for a line on stdin
  {"event": "context", "wall_time_begin": ..., "wall_time": ..., "pid": ...}   unix seconds around the
      creation of its CUDA context (`wall_time` = the context exists)
  {"event": "done", "steps": N, "elapsed_s": ..., "steps_per_s": ..., "steady_steps_per_s": ..., "wall_time": ...}
      `steps_per_s` is over the whole run, from the context existing to the last step finishing (setup and
      library initialisation included, as a real job pays them); `steady_steps_per_s` leaves out step 1.
Exit codes: 0 done; 2 bad arguments; 3 no backend or no GPU (the line says which).

    python scripts/foreign_job.py --gpu 0 --seconds 10
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

BACKENDS = ("torch", "cupy", "numba")
DEFAULT_SIZE = {"torch": 4096, "cupy": 4096, "numba": 1024}
LEARNING_RATE = 1e-4


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}, separators=(",", ":")), flush=True)


class Job:
    """One backend: `open_context()` creates the CUDA context, `setup()` the weights, `step()` one step."""

    name = ""
    version = ""

    def open_context(self) -> None: ...

    def setup(self, size: int, batch: int) -> None: ...

    def step(self) -> float: ...


class TorchJob(Job):
    name = "torch"

    def __init__(self, gpu: int) -> None:
        import torch

        self.torch = torch
        self.version = torch.__version__
        self.device = torch.device(f"cuda:{gpu}")

    def open_context(self) -> None:
        torch = self.torch
        torch.cuda.set_device(self.device)
        torch.zeros(1, device=self.device)
        torch.cuda.synchronize(self.device)

    def setup(self, size: int, batch: int) -> None:
        torch = self.torch
        gen = torch.Generator(device=self.device).manual_seed(0)
        scale = 1.0 / math.sqrt(size)
        self.x = torch.randn(batch, size, device=self.device, generator=gen)
        self.t = torch.randn(batch, size, device=self.device, generator=gen)
        self.w1 = torch.randn(size, size, device=self.device, generator=gen) * scale
        self.w2 = torch.randn(size, size, device=self.device, generator=gen) * scale
        self.inv_batch = 1.0 / batch

    def step(self) -> float:
        h = self.x @ self.w1
        a = self.torch.relu(h)
        y = a @ self.w2
        d = (y - self.t) * self.inv_batch
        loss = (d * d).sum()
        g2 = a.T @ d
        dh = (d @ self.w2.T) * (h > 0)
        g1 = self.x.T @ dh
        self.w1 -= LEARNING_RATE * g1
        self.w2 -= LEARNING_RATE * g2
        return float(loss.item())


class CupyJob(Job):
    name = "cupy"

    def __init__(self, gpu: int) -> None:
        import cupy

        self.cp = cupy
        self.version = cupy.__version__
        self.gpu = gpu

    def open_context(self) -> None:
        self.cp.cuda.Device(self.gpu).use()
        self.cp.zeros(1, dtype=self.cp.float32)
        self.cp.cuda.Device(self.gpu).synchronize()

    def setup(self, size: int, batch: int) -> None:
        cp = self.cp
        rng = cp.random.default_rng(0)
        scale = cp.float32(1.0 / math.sqrt(size))
        self.x = rng.standard_normal((batch, size), dtype=cp.float32)
        self.t = rng.standard_normal((batch, size), dtype=cp.float32)
        self.w1 = rng.standard_normal((size, size), dtype=cp.float32) * scale
        self.w2 = rng.standard_normal((size, size), dtype=cp.float32) * scale
        self.inv_batch = cp.float32(1.0 / batch)
        self.lr = cp.float32(LEARNING_RATE)

    def step(self) -> float:
        cp = self.cp
        h = self.x @ self.w1
        a = cp.maximum(h, 0)
        y = a @ self.w2
        d = (y - self.t) * self.inv_batch
        loss = (d * d).sum()
        g2 = a.T @ d
        dh = (d @ self.w2.T) * (h > 0)
        g1 = self.x.T @ dh
        self.w1 -= self.lr * g1
        self.w2 -= self.lr * g2
        return float(loss)


class NumbaJob(Job):
    """The same step with numba kernels: a 16x16 shared-memory tiled matmul and element-wise kernels."""

    name = "numba"
    TILE = 16

    def __init__(self, gpu: int) -> None:
        import numba
        import numpy as np

        self.np = np
        self.version = numba.__version__
        self.gpu = gpu
        kernels = _numba_kernels()
        self.cuda = kernels["cuda"]
        self.k_matmul, self.k_relu, self.k_relu_grad = kernels["matmul"], kernels["relu"], kernels["relu_grad"]
        self.k_residual, self.k_sgd = kernels["residual"], kernels["sgd"]

    def open_context(self) -> None:
        self.cuda.select_device(self.gpu)
        self.cuda.synchronize()

    def setup(self, size: int, batch: int) -> None:
        np, cuda = self.np, self.cuda
        rng = np.random.default_rng(0)
        scale = np.float32(1.0 / math.sqrt(size))

        def dev(shape: tuple[int, int], s: float = 1.0) -> Any:
            return cuda.to_device((rng.standard_normal(shape) * s).astype(np.float32))

        self.x, self.t = dev((batch, size)), dev((batch, size))
        self.w1, self.w2 = dev((size, size), scale), dev((size, size), scale)
        self.h = cuda.device_array((batch, size), np.float32)
        self.a = cuda.device_array((batch, size), np.float32)
        self.y = cuda.device_array((batch, size), np.float32)
        self.d = cuda.device_array((batch, size), np.float32)
        self.dh = cuda.device_array((batch, size), np.float32)
        self.g1 = cuda.device_array((size, size), np.float32)
        self.g2 = cuda.device_array((size, size), np.float32)
        self.scale = np.float32(1.0 / batch)
        self.lr = np.float32(LEARNING_RATE)

    def _grid(self, shape: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
        t = self.TILE
        return ((shape[1] + t - 1) // t, (shape[0] + t - 1) // t), (t, t)

    def _mm(self, a: Any, b: Any, c: Any, ta: bool = False, tb: bool = False) -> None:
        blocks, threads = self._grid(c.shape)
        self.k_matmul[blocks, threads](a, b, c, ta, tb)

    def _ew(self, kernel: Any, shape: tuple[int, int], *args: Any) -> None:
        t = self.TILE
        blocks = ((shape[0] + t - 1) // t, (shape[1] + t - 1) // t)
        kernel[blocks, (t, t)](*args)

    def step(self) -> float:
        self._mm(self.x, self.w1, self.h)
        self._ew(self.k_relu, self.h.shape, self.h, self.a)
        self._mm(self.a, self.w2, self.y)
        self._ew(self.k_residual, self.y.shape, self.y, self.t, self.d, self.scale)
        self._mm(self.a, self.d, self.g2, ta=True)
        self._mm(self.d, self.w2, self.dh, tb=True)
        self._ew(self.k_relu_grad, self.h.shape, self.dh, self.h)
        self._mm(self.x, self.dh, self.g1, ta=True)
        self._ew(self.k_sgd, self.w1.shape, self.w1, self.g1, self.lr)
        self._ew(self.k_sgd, self.w2.shape, self.w2, self.g2, self.lr)
        return float(self.d[0:1, 0:1].copy_to_host()[0, 0])  # waits for the step, like loss.item()


def _numba_kernels() -> dict[str, Any]:
    """numba's kernels, built on first use. `cuda` and `float32` are made module globals here because the
    CUDA simulator (NUMBA_ENABLE_CUDASIM=1, used by the tests) swaps a kernel's *global* `cuda` for its own."""
    global cuda, float32
    from numba import cuda, float32  # noqa: F811

    tile = NumbaJob.TILE

    @cuda.jit
    def matmul(a, b, c, ta, tb):  # c = op(a) @ op(b), op = transpose where the flag is set
        sa = cuda.shared.array((16, 16), float32)
        sb = cuda.shared.array((16, 16), float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        row = cuda.blockIdx.y * 16 + ty
        col = cuda.blockIdx.x * 16 + tx
        m = c.shape[0]
        n = c.shape[1]
        k_total = a.shape[0] if ta else a.shape[1]
        acc = float32(0.0)
        for k0 in range(0, k_total, 16):
            ka = k0 + tx
            if row < m and ka < k_total:
                sa[ty, tx] = a[ka, row] if ta else a[row, ka]
            else:
                sa[ty, tx] = float32(0.0)
            kb = k0 + ty
            if kb < k_total and col < n:
                sb[ty, tx] = b[col, kb] if tb else b[kb, col]
            else:
                sb[ty, tx] = float32(0.0)
            cuda.syncthreads()
            for k in range(16):
                acc += sa[ty, k] * sb[k, tx]
            cuda.syncthreads()
        if row < m and col < n:
            c[row, col] = acc

    @cuda.jit
    def relu(h, a):
        i, j = cuda.grid(2)
        if i < h.shape[0] and j < h.shape[1]:
            a[i, j] = h[i, j] if h[i, j] > 0 else float32(0.0)

    @cuda.jit
    def relu_grad(dx, h):
        i, j = cuda.grid(2)
        if i < h.shape[0] and j < h.shape[1] and h[i, j] <= 0:
            dx[i, j] = float32(0.0)

    @cuda.jit
    def residual(y, t, d, scale):
        i, j = cuda.grid(2)
        if i < y.shape[0] and j < y.shape[1]:
            d[i, j] = (y[i, j] - t[i, j]) * scale

    @cuda.jit
    def sgd(w, g, lr):
        i, j = cuda.grid(2)
        if i < w.shape[0] and j < w.shape[1]:
            w[i, j] -= lr * g[i, j]

    assert tile == 16  # the shared arrays above are sized with the literal
    return {"cuda": cuda, "matmul": matmul, "relu": relu, "relu_grad": relu_grad, "residual": residual,
            "sgd": sgd}


_FACTORIES: dict[str, Callable[[int], Job]] = {"torch": TorchJob, "cupy": CupyJob, "numba": NumbaJob}


def pick_backend(wanted: str, gpu: int) -> Job:
    order = BACKENDS if wanted == "auto" else (wanted,)
    errors: list[str] = []
    for name in order:
        try:
            return _FACTORIES[name](gpu)
        except ImportError as error:
            errors.append(f"{name}: {error}")
    raise RuntimeError("no usable backend (" + "; ".join(errors) + ")")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", type=int, default=0, help="CUDA device index (PCI bus order); default 0")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to train; default 10")
    parser.add_argument("--min-steps", type=int, default=3, help="run at least this many steps; default 3")
    parser.add_argument("--backend", choices=("auto",) + BACKENDS, default="auto")
    parser.add_argument("--size", type=int, default=0, help="layer width; default 4096 (numba: 1024)")
    parser.add_argument("--batch", type=int, default=0, help="batch size; default = size")
    parser.add_argument("--wait", action="store_true",
                        help="after the imports, print a `ready` line and wait for a line on stdin before "
                             "creating the CUDA context (the benchmark times the start this way); EOF = quit")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.size < 0 or args.batch < 0:
        parser.error("--seconds must be > 0, --size and --batch >= 0")
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # number devices as NVML does
    try:
        job = pick_backend(args.backend, args.gpu)
    except RuntimeError as error:
        print(f"foreign_job: {error}", file=sys.stderr)
        return 3
    size = args.size or DEFAULT_SIZE[job.name]
    batch = args.batch or size
    emit("backend", backend=job.name, version=job.version, size=size, batch=batch, dtype="float32",
         pid=os.getpid())
    if args.wait:
        emit("ready", pid=os.getpid())
        if not sys.stdin.readline():
            return 0  # the benchmark went away before saying go: never touch the GPU
    begin = time.time()
    try:
        job.open_context()
    except Exception as error:  # noqa: BLE001 - one line for the benchmark's log
        print(f"foreign_job: cannot create a CUDA context on GPU {args.gpu}: {type(error).__name__}: {error}",
              file=sys.stderr)
        return 3
    ready = time.time()
    start = time.perf_counter()  # the whole run is timed from here: the context exists
    emit("context", wall_time_begin=round(begin, 4), wall_time=round(ready, 4), pid=os.getpid())
    job.setup(size, batch)
    steps = 0
    first_end = None
    loss = 0.0
    while True:
        loss = job.step()
        steps += 1
        now = time.perf_counter()
        if first_end is None:
            first_end = now
        if now - start >= args.seconds and steps >= args.min_steps:
            break
    elapsed = time.perf_counter() - start
    steady = (steps - 1) / (now - first_end) if steps > 1 and now > first_end else None
    emit("done", steps=steps, elapsed_s=round(elapsed, 4), steps_per_s=round(steps / elapsed, 4),
         steady_steps_per_s=round(steady, 4) if steady is not None else None,
         loss=loss if math.isfinite(loss) else None, wall_time=round(time.time(), 4))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
