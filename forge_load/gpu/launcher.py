"""The Launcher on a real GPU: our CUDA context, one stream, and the host times of our kernels.

Only the driver API, through cuda-bindings (`cuda.bindings.driver`), imported only here: the kernel comes compiled
(burn_image.py reads the images numba made when the package was built), so the filler loads it and carries no
compiler: no numba, llvmlite, NVVM, NVRTC or nvJitLink. Only where no image loads and the `jit` extra is installed
does numba compile it at start (kernels.jit_cubin). Which kernel, and how each launch is laid out, is the shape's
(control/shape.py). The timeline arithmetic is pure (`EventTimeline`), so it is
tested without a GPU; the virtual GPU runs the rest (docs/design.md §3, §8).
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
from forge_load.control.shape import LEAN, Shape
from forge_load.control.worker import BlockRate, Completed
from forge_load.gpu import burn_image

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
    it, so the two events measure their length exactly (`rate_s`, seconds per unit of the multiplier: a block per SM
    of the burn kernel, a sleep quantum of the lean one, whose real length nanosleep does not promise). A burst queued
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
        """Measured seconds of kernel per unit of the multiplier; None until a burst of two kernels was timed."""
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
    """NVML names GPUs `GPU-…` and MIG instances `MIG-…`; CUDA gives a device's UUID as 16 bytes (uuid_text)."""
    return uuid.split("-", 1)[1].lower() if uuid[:4] in ("GPU-", "MIG-") else uuid.lower()


def uuid_text(raw: bytes) -> str:
    """CUDA's 16 UUID bytes as NVML writes a GPU's: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx."""
    h = bytes(raw[:16]).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def prepare_process() -> None:
    """Before CUDA starts in this process: load only the kernels we use (read once, at cuInit)."""
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")


class DriverError(RuntimeError):
    """A driver call failed: `result` is its CUresult's name."""

    def __init__(self, call: str, result: str) -> None:
        super().__init__(f"{call} failed: {result}")
        self.result = result


class CudaLauncher:
    """Our CUDA context on the GPU with this UUID: a stream for the kernels and one for clock anchors, the shape's
    kernel loaded once with its arguments packed (the burn kernel's 4-byte buffer too; the lean kernel takes no
    memory at all), and a ring of reused events (two per burst).

    The kernel is loaded at open, without launching it: the first kernel waits until the filler may fill (a pause
    or a foreign job at start launches nothing). Which image: the cubin for the GPU's architecture, else the PTX
    (burn_image.images_for), else, with the `jit` extra, one numba compiles now. Every launch is one cuLaunchKernel
    with the arguments packed once, and events are recorded and queried with the driver API too (docs/design.md
    §8).

    The device is found by UUID, never by index: CUDA numbers devices its own way (CUDA_VISIBLE_DEVICES,
    CUDA_DEVICE_ORDER, MIG), and NVML's index need not be CUDA's.
    """

    def __init__(self, uuid: str, clock: Callable[[], float] = time.monotonic,
                 stack_bytes: int = STACK_BYTES, shape: str = LEAN, metric: str = "utilization") -> None:
        prepare_process()
        self._clock = clock
        self._shape_name, self._metric = shape, metric
        try:
            from cuda.bindings import driver as cu
        except Exception as error:
            raise NoGpuError(f"cuda-bindings cannot start: {error}") from error
        self._cu = cu
        self._events: list[Any] = []  # every event we created, destroyed at close
        self._free: list[Any] = []
        self._pending: deque[_Pending] = deque()
        self._context: Any = None
        self._device: Any = None
        self._pushed = False
        self._out: Any = None
        self._module: Any = None
        self._streams: list[Any] = []
        self._timeline = EventTimeline(self._elapsed_ms)
        # GPU threads (FORGE_GPUS) open one at a time: cuInit and the primary contexts' first retains then never
        # race, and a failure names its own GPU.
        with _OPEN_LOCK:
            try:
                self._open(uuid, stack_bytes)
            except BaseException:
                self._release()
                raise

    def _call(self, result: tuple[Any, ...], name: str) -> Any:
        if result[0] != self._cu.CUresult.CUDA_SUCCESS:
            raise DriverError(name, result[0].name)
        return result[1] if len(result) > 1 else None

    def _open(self, uuid: str, stack_bytes: int) -> None:
        cu = self._cu
        init = cu.cuInit(0)[0]
        if init != cu.CUresult.CUDA_SUCCESS:
            raise NoGpuError(f"CUDA cannot start: cuInit failed: {init.name}")
        ordinal = find_device(cuda_devices(cu), uuid)
        try:
            self._device = self._call(cu.cuDeviceGet(ordinal), "cuDeviceGet")
            self._context = self._call(cu.cuDevicePrimaryCtxRetain(self._device), "cuDevicePrimaryCtxRetain")
            self._call(cu.cuCtxPushCurrent(self._context), "cuCtxPushCurrent")
            self._pushed = True
            self.stack_bytes_default, self.stack_bytes = self._stack_limit(stack_bytes)
            self._stream = self._call(cu.cuStreamCreate(0), "cuStreamCreate")
            self._streams.append(self._stream)
            self._clock_stream = self._call(cu.cuStreamCreate(0), "cuStreamCreate")  # anchors: nothing waits on it
            self._streams.append(self._clock_stream)
            attribute = cu.CUdevice_attribute
            self.sm_count = int(self._call(
                cu.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self._device),
                "cuDeviceGetAttribute"))
            self.shape = Shape.for_metric(self._shape_name, self._metric, self.sm_count)
            cc = tuple(int(self._call(cu.cuDeviceGetAttribute(a, self._device), "cuDeviceGetAttribute")) for a in
                       (attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                        attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
            self.cc = (cc[0], cc[1])
            if self.shape.lean:
                self._args = burn_image.pack_lean_arguments()
                self._threads = burn_image.LEAN_THREADS_PER_BLOCK
            else:
                self._out = self._call(cu.cuMemAlloc(burn_image.OUT_ITEMS * burn_image.OUT_ITEMSIZE), "cuMemAlloc")
                self._call(cu.cuMemsetD32(self._out, 0, burn_image.OUT_ITEMS), "cuMemsetD32")
                self._args = burn_image.pack_arguments(int(self._out))
                self._threads = burn_image.THREADS_PER_BLOCK
        except DriverError as error:
            raise GpuFailedError(f"could not start CUDA on {uuid}: {error}") from error
        # Load now, without launching: the first kernel waits until the filler may fill.
        self._function, self.kernel_image = self._load(uuid)

    def _load(self, uuid: str) -> tuple[Any, str]:
        """(the shape's kernel's function, the name of the image it came from); NoGpuError in one line where none
        loads."""
        cu = self._cu
        if self.shape.lean and self.cc < burn_image.LEAN_MIN_CC:
            raise NoGpuError(
                f"GPU {uuid} (sm_{self.cc[0]}{self.cc[1]}) cannot run the lean kernel: the lean kernel sleeps with "
                f"nanosleep, which needs compute capability {burn_image.LEAN_MIN_CC[0]}.{burn_image.LEAN_MIN_CC[1]} "
                "(Volta) or newer; set FORGE_SHAPE=burn (--shape burn) for this GPU, with the forge-load[jit] extra "
                "that compiles the burn kernel for it")
        try:
            manifest = burn_image.load_manifest(kernel=self.shape.name)
            images = burn_image.images_for(self.cc, manifest)
        except (OSError, ValueError, KeyError) as error:
            raise NoGpuError(f"the kernel images of this install cannot be read: {error}; reinstall forge-load") \
                from error
        tried = []
        for image in images:
            result = cu.cuModuleLoadData(image.data)
            if result[0] == cu.CUresult.CUDA_SUCCESS:
                self._module = result[1]
                return self._call(cu.cuModuleGetFunction(self._module, manifest.entry.encode()),
                                  "cuModuleGetFunction"), image.name
            tried.append(f"{image.name} {result[0].name}")
        try:
            jitted = self._jit()
        except Exception as error:  # noqa: BLE001 - any compiler failure: said in the one line below
            tried.append(f"jit {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            jitted = None
        if jitted is not None:
            return jitted
        driver = int(self._call(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
        arch = f"sm_{self.cc[0]}{self.cc[1]}"
        cubins = ", ".join(f"sm_{a}" for a in manifest.cubin_arches)
        needs = burn_image.cuda_version_text(manifest.ptx_min_cuda_version)
        if self.cc[0] * 10 + self.cc[1] < int(manifest.ptx_target.removeprefix("sm_")):
            what = (f"this GPU is older than every image ({manifest.ptx_target} and newer): install forge-load[jit] "
                    "to compile the kernel for it at start")
        else:
            what = (f"its PTX {manifest.ptx_version} needs a driver of CUDA {needs} or newer: update the driver, or "
                    "install forge-load[jit] to compile the kernel for this GPU at start")
        raise NoGpuError(
            f"no kernel image loads on GPU {uuid} ({arch}, driver CUDA {burn_image.cuda_version_text(driver)}): "
            f"{'; '.join(tried)}; this forge-load has cubins for {cubins} and {what}")

    def _jit(self) -> tuple[Any, str] | None:
        """With the `jit` extra: numba compiles the kernel for this GPU now (nvJitLink links it, so an older driver
        runs it too). None without it."""
        try:
            from forge_load.gpu import kernels
        except ImportError:
            return None
        data, entry = kernels.jit_cubin(self.cc, self.shape.name)
        self._module = self._call(self._cu.cuModuleLoadData(data), "cuModuleLoadData")
        function = self._call(self._cu.cuModuleGetFunction(self._module, entry.encode()), "cuModuleGetFunction")
        return function, f"jit sm_{self.cc[0]}{self.cc[1]}"

    def _stack_limit(self, stack_bytes: int) -> tuple[int | None, int | None]:
        """(the driver's default, the limit now) of the per-thread stack; lowered only where the default is larger.

        Best effort: where the driver refuses, both are what could be read (None where nothing could).
        """
        cu = self._cu
        limit = cu.CUlimit.CU_LIMIT_STACK_SIZE
        err, default = cu.cuCtxGetLimit(limit)
        if err != cu.CUresult.CUDA_SUCCESS:
            return None, None
        if default <= stack_bytes:
            return int(default), int(default)
        if cu.cuCtxSetLimit(limit, stack_bytes)[0] != cu.CUresult.CUDA_SUCCESS:
            return int(default), int(default)
        err, now = cu.cuCtxGetLimit(limit)
        return int(default), int(now) if err == cu.CUresult.CUDA_SUCCESS else int(default)

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
            self._check(self._cu.cuEventRecord(event, self._clock_stream), "cuEventRecord")
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
        launch, function, params = self._cu.cuLaunchKernel, self._function, self._args.address
        lean, grid, threads, stream = self.shape.lean, self.shape.blocks(multiplier), self._threads, self._stream
        if lean:
            self._args.set(0, multiplier)  # the lean kernel's length, in sleep quanta
        called_s = self._clock()
        self._check(launch(function, grid, 1, 1, threads, 1, 1, 0, stream, params, 0), "cuLaunchKernel")
        returned_s = self._clock()
        first = None
        if count > 1:
            # The burst's other kernels as one kernel of their work together (burn: their blocks; lean: their
            # quanta): the same work back to back, in one driver call instead of count - 1 (its length is count - 1
            # kernels', so the two events still time one kernel of `multiplier` exactly; a foreign kernel waits
            # behind the burst either way).
            first = self._record(stream)
            if lean:
                self._args.set(0, multiplier * (count - 1))
            rest = grid if lean else grid * (count - 1)
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
        return {"stack_bytes": self.stack_bytes, "stack_bytes_default": self.stack_bytes_default,
                "kernel_image": self.kernel_image}

    def close(self) -> None:
        """Let our kernels finish (bounded), then free what we made, leave this thread's context stack and release
        our retain of the primary context (the driver destroys it with the last; another GPU's is not touched)."""
        deadline_s = self._clock() + CLOSE_WAIT_S
        not_ready = self._cu.CUresult.CUDA_ERROR_NOT_READY
        while (self._pending and self._cu.cuEventQuery(self._pending[-1].last)[0] == not_ready
               and self._clock() < deadline_s):
            time.sleep(0.001)
        self._release()

    def _release(self) -> None:
        """Free whatever was made so far; after a GPU failure these calls fail too, and nothing is left to free."""
        cu = self._cu
        self._pending.clear()
        self._free.clear()
        for event in self._events:
            cu.cuEventDestroy(event)
        self._events.clear()
        self._timeline = EventTimeline(self._elapsed_ms)
        for stream in self._streams:
            cu.cuStreamDestroy(stream)
        self._streams.clear()
        if self._out is not None:
            cu.cuMemFree(self._out)
            self._out = None
        if self._module is not None:
            cu.cuModuleUnload(self._module)
            self._module = None
        if self._pushed:
            cu.cuCtxPopCurrent()
            self._pushed = False
        if self._context is not None:
            cu.cuDevicePrimaryCtxRelease(self._device)
            self._context = None


def cuda_devices(cu: Any) -> list[tuple[int, str]]:
    """(CUDA ordinal, UUID as NVML writes it) of every device CUDA sees; NoGpuError when it cannot list them."""
    try:
        count = cu.cuDeviceGetCount()
        if count[0] != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuDeviceGetCount failed: {count[0].name}")
        devices = []
        for ordinal in range(int(count[1])):
            err, device = cu.cuDeviceGet(ordinal)
            if err != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuDeviceGet failed: {err.name}")
            err, uuid = cu.cuDeviceGetUuid_v2(device)
            if err != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuDeviceGetUuid_v2 failed: {err.name}")
            devices.append((ordinal, uuid_text(bytes(uuid.bytes))))
    except RuntimeError as error:
        raise NoGpuError(f"CUDA cannot list its devices: {error}") from error
    return devices


def find_device(devices: list[tuple[int, str]], uuid: str) -> int:
    """The CUDA ordinal of the device with this UUID among `devices` (cuda_devices); NoGpuError naming what CUDA
    does see."""
    key = _uuid_key(uuid)
    for ordinal, device_uuid in devices:
        if _uuid_key(device_uuid) == key:
            return ordinal
    seen = ", ".join(f"{ordinal} {device_uuid}" for ordinal, device_uuid in devices) or "none"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hint = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    raise NoGpuError(f"CUDA does not see the GPU NVML calls {uuid}{hint}; CUDA sees: {seen}")
