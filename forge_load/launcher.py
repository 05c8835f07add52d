"""The Launcher on a real GPU: our CUDA context, one stream, and the host times of our kernels.

numba-cuda is imported only here (and in kernels.py, which holds the kernel). The timeline arithmetic is
pure (`EventTimeline`), so it is tested without a GPU; the virtual GPU runs the rest (docs/DESIGN.md §3, §8).
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from forge_load.probe import GpuFailedError, NoGpuError
from forge_load.worker import Completed

STACK_BYTES = 1024  # per thread; our kernels use no local memory at all (ptxas proves it in the tests)
ANCHOR_EVERY_S = 1.0  # float32 milliseconds keep ~0.1 µs of precision up to here
CLOSE_WAIT_S = 1.0


@dataclass(eq=False)
class Anchor:
    """An event recorded where nothing waited, so it completed at once: at `host_s` on our clock."""

    event: Any
    host_s: float
    users: int = 0  # kernels in flight timed from it


class EventTimeline:
    """Host times of the kernels on one stream, from one event recorded after each kernel.

    The GPU's event clock is placed on ours by anchors: events recorded on a stream of their own, where
    nothing waits, so they complete at once and the host time of the record call is theirs. A kernel is
    timed from the anchor current at its launch (so the elapsed time is never negative); a fresh anchor
    every `anchor_every_s` keeps the float32 milliseconds of cuEventElapsedTime short and precise, and no
    error accumulates from one anchor to the next. A kernel ends at its event's time after its anchor; it
    starts when the kernel before it ended or when its launch call returned, whichever is later: a start
    event on an idle stream completes before the kernel is even launched, and reads our busy time high.
    """

    def __init__(self, elapsed_ms: Callable[[Any, Any], float], anchor_every_s: float = ANCHOR_EVERY_S) -> None:
        self._elapsed_ms = elapsed_ms
        self._anchor_every_s = anchor_every_s
        self.current: Anchor | None = None
        self._last_end_s = float("-inf")

    def wants_anchor(self, host_s: float) -> bool:
        return self.current is None or host_s - self.current.host_s >= self._anchor_every_s

    def anchor(self, event: Any, host_s: float) -> Anchor | None:
        """`event` was recorded, where nothing waited, at `host_s`. Returns the anchor it replaces if no
        kernel is timed from that one any more (its event can be reused), else None."""
        old, self.current = self.current, Anchor(event, host_s)
        return old if old is not None and old.users == 0 else None

    def launched(self) -> Anchor:
        """A kernel was launched: the anchor it will be timed from."""
        if self.current is None:
            raise RuntimeError("EventTimeline: a launch before any anchor")
        self.current.users += 1
        return self.current

    def finish(self, anchor: Anchor, event: Any, returned_s: float, now_s: float) -> tuple[float, float]:
        """(start, end) host times of the kernel whose end event has completed, seen at `now_s`;
        `returned_s` is when its launch call returned."""
        anchor.users -= 1
        # The event had completed by now_s: a later reading is the anchor's error, never real.
        end_s = min(anchor.host_s + self._elapsed_ms(anchor.event, event) / 1e3, now_s)
        start_s = min(max(self._last_end_s, returned_s), end_s)
        self._last_end_s = end_s
        return start_s, end_s


@dataclass
class _Pending:
    event: Any
    anchor: Anchor
    multiplier: int
    returned_s: float


def _uuid_key(uuid: str) -> str:
    """NVML names GPUs `GPU-…` and MIG instances `MIG-…`; numba-cuda calls every device `GPU-…`."""
    return uuid.split("-", 1)[1].lower() if uuid[:4] in ("GPU-", "MIG-") else uuid.lower()


def prepare_process() -> None:
    """Before CUDA starts in this process: load only the kernels we use (read once, at cuInit)."""
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")


class CudaLauncher:
    """Our CUDA context on the GPU with this UUID: a 4-byte buffer, a stream for the kernels and one for
    clock anchors, and one event per kernel (reused).

    The device is found by UUID, never by index: CUDA numbers devices its own way (CUDA_VISIBLE_DEVICES,
    CUDA_DEVICE_ORDER, MIG), and NVML's index need not be CUDA's.
    """

    def __init__(self, uuid: str, clock: Callable[[], float] = time.monotonic,
                 stack_bytes: int = STACK_BYTES) -> None:
        prepare_process()
        self._clock = clock
        try:
            import numpy as np
            from numba import config as numba_config
            from numba import cuda
        except Exception as error:
            raise NoGpuError(f"numba-cuda cannot start: {error}") from error
        # Our grids are sized on purpose; numba's low-occupancy warning is about beginners' grids.
        numba_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
        device = find_device(cuda, uuid)
        try:
            from forge_load import kernels

            self._cuda = cuda
            self._kernels = kernels
            self._device = device
            cuda.select_device(device.id)
            self.stack_bytes_default, self.stack_bytes = _stack_limit(stack_bytes)
            self._stream = cuda.stream()
            self._clock_stream = cuda.stream()  # anchors only: nothing ever waits on it
            self._out = cuda.to_device(np.zeros(1, dtype=np.float32), stream=self._stream)
            self.sm_count = int(device.MULTIPROCESSOR_COUNT)
            self._timeline = EventTimeline(cuda.event_elapsed_time)
            self._pending: deque[_Pending] = deque()
            self._free: list[Any] = []
            # Compile and load now, so the first real launch is not a long one.
            self._kernels.launch_burn(self._out, self.sm_count, self._stream)
            self._stream.synchronize()
        except Exception as error:
            raise GpuFailedError(f"could not start CUDA on {uuid}: {error}") from error

    def _event(self) -> Any:
        return self._free.pop() if self._free else self._cuda.event(timing=True)

    def launch(self, multiplier: int, now_s: float) -> None:
        before_s = self._clock()
        if self._timeline.wants_anchor(before_s):
            event = self._event()
            event.record(self._clock_stream)
            retired = self._timeline.anchor(event, (before_s + self._clock()) / 2)
            if retired is not None:
                self._free.append(retired.event)
        anchor = self._timeline.launched()
        self._kernels.launch_burn(self._out, multiplier * self.sm_count, self._stream)
        returned_s = self._clock()
        end = self._event()
        end.record(self._stream)
        self._pending.append(_Pending(end, anchor, multiplier, returned_s))

    def poll(self, now_s: float) -> list[Completed]:
        done: list[Completed] = []
        while self._pending and self._pending[0].event.query():
            kernel = self._pending.popleft()
            start_s, end_s = self._timeline.finish(kernel.anchor, kernel.event, kernel.returned_s, self._clock())
            done.append(Completed(start_s, end_s, kernel.multiplier))
            self._free.append(kernel.event)
            if kernel.anchor.users == 0 and kernel.anchor is not self._timeline.current:
                self._free.append(kernel.anchor.event)
        return done

    def describe(self) -> dict[str, object]:
        return {"stack_bytes": self.stack_bytes, "stack_bytes_default": self.stack_bytes_default}

    def close(self) -> None:
        """Let our kernels finish (bounded), then reset this device's context only.

        numba's cuda.close() resets every device when called from the thread numba takes for its main one
        (the first to import it: with FORGE_GPUS, a GPU's thread), so one GPU stopping would break the others.
        """
        deadline_s = self._clock() + CLOSE_WAIT_S
        while self._pending and not self._pending[-1].event.query() and self._clock() < deadline_s:
            time.sleep(0.001)
        self._pending.clear()
        self._free.clear()
        self._timeline = EventTimeline(self._cuda.event_elapsed_time)
        self._out = self._stream = self._clock_stream = None
        from numba.cuda.cudadrv.driver import driver

        while driver.pop_active_context() is not None:
            pass
        self._device.reset()


def find_device(cuda: Any, uuid: str) -> Any:
    """The numba device with this UUID; NoGpuError naming what CUDA does see."""
    try:
        devices = list(cuda.gpus)
    except Exception as error:
        raise NoGpuError(f"CUDA cannot list its devices: {error}") from error
    key = _uuid_key(uuid)
    for device in devices:
        if _uuid_key(device.uuid) == key:
            return device
    seen = ", ".join(f"{d.id} {d.uuid}" for d in devices) or "none"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hint = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    raise NoGpuError(f"CUDA does not see the GPU NVML calls {uuid}{hint}; CUDA sees: {seen}")


def _stack_limit(stack_bytes: int) -> tuple[int | None, int | None]:
    """(the driver's default, the limit now) of the per-thread stack; lowered only where the default is larger.

    Best effort: where the driver refuses, both are what could be read (None where nothing could).
    """
    from numba.cuda.cudadrv import driver as drv

    limit = drv.binding.CUlimit.CU_LIMIT_STACK_SIZE
    try:
        default = int(drv.driver.cuCtxGetLimit(limit))
    except Exception:
        return None, None
    if default <= stack_bytes:
        return default, default
    try:
        drv.driver.cuCtxSetLimit(limit, stack_bytes)
        return default, int(drv.driver.cuCtxGetLimit(limit))
    except Exception:
        return default, default
