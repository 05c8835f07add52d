"""The Launcher on a real GPU: our CUDA context, one stream, and the host times of our kernels.

numba-cuda and cuda-bindings are imported only here (and in kernels.py, which holds the kernel). The timeline
arithmetic is pure (`EventTimeline`), so it is tested without a GPU; the virtual GPU runs the rest
(docs/design.md §3, §8).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from forge_load.control.probe import GpuFailedError, NoGpuError
from forge_load.control.worker import BlockRate, Completed

STACK_BYTES = 1024  # per thread; our kernels use no local memory at all (ptxas proves it in the tests)
ANCHOR_EVERY_S = 1.0  # float32 milliseconds keep ~0.1 µs of precision up to here
ANCHOR_BRACKET_S = 50e-6  # an anchor's record call must fit between two clock reads this close to be trusted
ANCHOR_TRIES = 4
CLOSE_WAIT_S = 1.0
_OPEN_LOCK = threading.Lock()


@dataclass(eq=False)
class Anchor:
    """An event recorded where nothing waited, so it completed at once: at `host_s` on our clock."""

    event: Any
    host_s: float
    users: int = 0  # kernels in flight timed from it


class EventTimeline:
    """Host times of the launches on one stream, each a burst of kernels back to back, from the events
    recorded after the first kernel of a burst and after its last.

    The GPU's event clock is placed on ours by anchors: events recorded on a stream of their own, where
    nothing waits, so they complete at once and the host time of the record call is theirs. A burst is
    timed from the anchor current at its launch (so the elapsed time is never negative); a fresh anchor
    every `anchor_every_s` keeps the float32 milliseconds of cuEventElapsedTime short and precise, and no
    error accumulates from one anchor to the next.

    A burst ends at its last event's time after its anchor. Its kernels after the first are queued behind
    it, so the two events measure their length exactly (`rate_s`, seconds per block per SM). A burst queued
    behind the one before starts exactly when that one ended. A burst launched on an idle stream started at
    some moment inside its first launch call: its first kernel is given the length just measured for its
    size (or, for a burst of one kernel, the measured rate times its size), never an earlier start than the
    call's, and before anything was measured the call's return. A start event would not do: on an idle
    stream it completes before the kernel is even launched, and reads our busy time high.
    """

    def __init__(self, elapsed_ms: Callable[[Any, Any], float], anchor_every_s: float = ANCHOR_EVERY_S,
                 rate_weight: float = 0.2) -> None:
        self._elapsed_ms = elapsed_ms
        self._anchor_every_s = anchor_every_s
        self._rate = BlockRate(rate_weight)
        self.current: Anchor | None = None
        self._last_end_s = float("-inf")

    @property
    def rate_s(self) -> float | None:
        """Measured seconds of kernel per block per SM; None until a burst of two kernels was timed."""
        return self._rate.rate_s

    def wants_anchor(self, host_s: float) -> bool:
        return self.current is None or host_s - self.current.host_s >= self._anchor_every_s

    def anchor(self, event: Any, host_s: float) -> Anchor | None:
        """`event` was recorded, where nothing waited, at `host_s`. Returns the anchor it replaces if no
        kernel is timed from that one any more (its event can be reused), else None."""
        old, self.current = self.current, Anchor(event, host_s)
        return old if old is not None and old.users == 0 else None

    def launched(self) -> Anchor:
        """A burst was launched: the anchor it will be timed from."""
        if self.current is None:
            raise RuntimeError("EventTimeline: a launch before any anchor")
        self.current.users += 1
        return self.current

    def _at(self, anchor: Anchor, event: Any) -> float:
        return anchor.host_s + self._elapsed_ms(anchor.event, event) / 1e3

    def finish(self, anchor: Anchor, first_event: Any | None, last_event: Any, multiplier: int, count: int,
               called_s: float, returned_s: float, now_s: float) -> tuple[float, float, float | None]:
        """(start, end) host times of the burst whose last event has completed, seen at `now_s`, and the length
        of one of its kernels where measured exactly (else None): `count` kernels of `multiplier`, the first
        launch call from `called_s` to `returned_s`; `first_event` was recorded after the first kernel (None
        for a burst of one)."""
        anchor.users -= 1
        # The event had completed by now_s: a later reading is the anchor's error, never real.
        end_s = min(self._at(anchor, last_event), now_s)
        first_end_s = end_s
        length_s: float | None = None  # of one kernel of this burst
        measured_s: float | None = None
        if first_event is not None and count > 1:
            # The anchor's error cancels in the difference of two events timed from it.
            measured_s = self._elapsed_ms(first_event, last_event) / 1e3 / (count - 1)
            first_end_s = min(self._at(anchor, first_event), end_s)
            length_s = measured_s
            self._rate.add(length_s, multiplier)
        elif self.rate_s is not None:
            length_s = self.rate_s * multiplier
        if self._last_end_s >= returned_s:  # queued behind the burst before
            start_s = min(self._last_end_s, end_s)
        else:
            start_s = returned_s if length_s is None else max(first_end_s - length_s, called_s)
            start_s = min(max(start_s, self._last_end_s), end_s)
        self._last_end_s = end_s
        return start_s, end_s, measured_s


@dataclass
class _Pending:
    first: Any | None  # the event after the first kernel (bursts of two or more)
    last: Any  # the event after the last kernel
    anchor: Anchor
    multiplier: int
    count: int
    called_s: float
    returned_s: float


def _uuid_key(uuid: str) -> str:
    """NVML names GPUs `GPU-…` and MIG instances `MIG-…`; numba-cuda calls every device `GPU-…`."""
    return uuid.split("-", 1)[1].lower() if uuid[:4] in ("GPU-", "MIG-") else uuid.lower()


def prepare_process() -> None:
    """Before CUDA starts in this process: load only the kernels we use (read once, at cuInit)."""
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")


class CudaLauncher:
    """Our CUDA context on the GPU with this UUID: a 4-byte buffer, a stream for the kernels and one for
    clock anchors, the burn kernel bound once, and a ring of reused events (two per burst).

    numba compiles and loads the kernel at open, without launching it: the first kernel waits until the filler
    may fill (a pause or a foreign job at start launches nothing). Every launch is one cuLaunchKernel through
    cuda-bindings with the arguments packed once, and events are recorded and queried there too: numba's
    dispatch cost ~10x the driver call (docs/design.md §8).

    The device is found by UUID, never by index: CUDA numbers devices its own way (CUDA_VISIBLE_DEVICES,
    CUDA_DEVICE_ORDER, MIG), and NVML's index need not be CUDA's.
    """

    def __init__(self, uuid: str, clock: Callable[[], float] = time.monotonic,
                 stack_bytes: int = STACK_BYTES) -> None:
        prepare_process()
        self._clock = clock
        try:
            import numpy as np
            from cuda.bindings import driver as cu
            from numba import config as numba_config
            from numba import cuda
        except Exception as error:
            raise NoGpuError(f"numba-cuda cannot start: {error}") from error
        # Our grids are sized on purpose; numba's low-occupancy warning is about beginners' grids.
        numba_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
        # numba's driver and device list start lazily and not thread-safely: with FORGE_GPUS, GPU threads
        # opening at once got CUDA_ERROR_NOT_INITIALIZED. One at a time, then.
        with _OPEN_LOCK:
            self._open(cuda, cu, np, uuid, stack_bytes)

    def _open(self, cuda: Any, cu: Any, np: Any, uuid: str, stack_bytes: int) -> None:
        device = find_device(cuda, uuid)
        try:
            from forge_load.gpu import kernels

            self._cuda = cuda
            self._cu = cu
            self._kernels = kernels
            self._device = device
            self._events: list[Any] = []  # every event we created, destroyed at close
            self._free: list[Any] = []
            self._pending: deque[_Pending] = deque()
            cuda.select_device(device.id)
            self.stack_bytes_default, self.stack_bytes = _stack_limit(stack_bytes)
            self._stream = cuda.stream()
            self._clock_stream = cuda.stream()  # anchors only: nothing ever waits on it
            self._out = cuda.to_device(np.zeros(1, dtype=np.float32), stream=self._stream)
            self.sm_count = int(device.MULTIPROCESSOR_COUNT)
            self._hstream = self._stream.handle
            self._hclock = self._clock_stream.handle
            self._timeline = EventTimeline(self._elapsed_ms)
            # Compile and load now, without launching: the first kernel waits until the filler may fill.
            self._burn = self._kernels.bind_burn(self._out)
        except Exception as error:
            raise GpuFailedError(f"could not start CUDA on {uuid}: {error}") from error

    def _check(self, result: tuple[Any, ...], name: str) -> Any:
        if result[0] != self._cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{name} failed: {result[0].name}")
        return result[1] if len(result) > 1 else None

    def _elapsed_ms(self, start: Any, end: Any) -> float:
        return float(self._check(self._cu.cuEventElapsedTime(start, end), "cuEventElapsedTime"))

    def _event(self) -> Any:
        if self._free:
            return self._free.pop()
        event = self._check(self._cu.cuEventCreate(self._cu.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate")
        self._events.append(event)
        return event

    def _record(self, stream: Any) -> Any:
        event = self._event()
        self._check(self._cu.cuEventRecord(event, stream), "cuEventRecord")
        return event

    def _anchor(self) -> None:
        """Record a fresh anchor, bracketed by two clock reads; one whose bracket is wide (the thread was held
        up around the call: preempted, or waiting to take the GIL back) is not trusted and tried again, now
        or, while the current anchor is still good, at the next launch."""
        best: tuple[float, Any, float] | None = None  # (bracket, event, host time)
        for _ in range(ANCHOR_TRIES):
            event = self._event()
            before_s = self._clock()
            self._check(self._cu.cuEventRecord(event, self._hclock), "cuEventRecord")
            bracket_s = self._clock() - before_s
            if best is not None:
                self._free.append(best[1] if bracket_s < best[0] else event)
            if best is None or bracket_s < best[0]:
                best = (bracket_s, event, before_s)
            if bracket_s <= ANCHOR_BRACKET_S:
                break
        assert best is not None
        if best[0] > ANCHOR_BRACKET_S and self._timeline.current is not None:
            self._free.append(best[1])
            return
        retired = self._timeline.anchor(best[1], best[2])
        if retired is not None:
            self._free.append(retired.event)

    def launch(self, multiplier: int, now_s: float, count: int = 1) -> None:
        if self._timeline.wants_anchor(self._clock()):
            self._anchor()
        anchor = self._timeline.launched()
        launch, function, params = self._cu.cuLaunchKernel, self._burn.function, self._burn.params_address
        grid, threads, stream = multiplier * self.sm_count, self._kernels.THREADS_PER_BLOCK, self._hstream
        called_s = self._clock()
        self._check(launch(function, grid, 1, 1, threads, 1, 1, 0, stream, params, 0), "cuLaunchKernel")
        returned_s = self._clock()
        first = None
        if count > 1:
            # The burst's other kernels as one kernel of their blocks together: the same work back to back, in
            # one driver call instead of count - 1 (its length is count - 1 kernels', so the two events still
            # time one kernel of `multiplier` exactly; a foreign kernel waits behind the burst either way).
            first = self._record(stream)
            rest = grid * (count - 1)
            self._check(launch(function, rest, 1, 1, threads, 1, 1, 0, stream, params, 0), "cuLaunchKernel")
        last = self._record(stream)
        self._pending.append(_Pending(first, last, anchor, multiplier, count, called_s, returned_s))

    def poll(self, now_s: float) -> list[Completed]:
        done: list[Completed] = []
        not_ready = self._cu.CUresult.CUDA_ERROR_NOT_READY
        while self._pending:
            burst = self._pending[0]
            result = self._cu.cuEventQuery(burst.last)
            if result[0] == not_ready:
                break
            self._check(result, "cuEventQuery")
            self._pending.popleft()
            start_s, end_s, kernel_s = self._timeline.finish(
                burst.anchor, burst.first, burst.last, burst.multiplier, burst.count, burst.called_s,
                burst.returned_s, self._clock())
            done.append(Completed(start_s, end_s, burst.multiplier, burst.count, kernel_s))
            self._free.append(burst.last)
            if burst.first is not None:
                self._free.append(burst.first)
            if burst.anchor.users == 0 and burst.anchor is not self._timeline.current:
                self._free.append(burst.anchor.event)
        return done

    def describe(self) -> dict[str, object]:
        return {"stack_bytes": self.stack_bytes, "stack_bytes_default": self.stack_bytes_default}

    def close(self) -> None:
        """Let our kernels finish (bounded), free what we allocated, and leave this thread's context stack.

        The primary context itself stays until the process exits, when the driver frees it. Resetting it
        here would break other users of the device in this process, and numba's cuda.close() resets every
        device when called from the thread numba takes for its main one (the first to import it: with
        FORGE_GPUS, a GPU's thread), so one GPU stopping would break the others (docs/design.md §8).
        """
        deadline_s = self._clock() + CLOSE_WAIT_S
        not_ready = self._cu.CUresult.CUDA_ERROR_NOT_READY
        while (self._pending and self._cu.cuEventQuery(self._pending[-1].last)[0] == not_ready
               and self._clock() < deadline_s):
            time.sleep(0.001)
        self._pending.clear()
        self._free.clear()
        for event in self._events:  # after a GPU failure these fail too; nothing is left to free then
            self._cu.cuEventDestroy(event)
        self._events.clear()
        self._timeline = EventTimeline(self._elapsed_ms)
        self._out = self._stream = self._clock_stream = self._hstream = self._hclock = None
        from numba.cuda.cudadrv.driver import driver

        while driver.pop_active_context() is not None:
            pass


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
    except Exception:  # noqa: BLE001 - best effort: a driver that refuses keeps its default
        return None, None
    if default <= stack_bytes:
        return default, default
    try:
        drv.driver.cuCtxSetLimit(limit, stack_bytes)
        return default, int(drv.driver.cuCtxGetLimit(limit))
    except Exception:  # noqa: BLE001 - best effort, as above
        return default, default
