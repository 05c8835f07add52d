"""The Probe on a real GPU, through NVML. The only module in forge_load that imports pynvml.

pynvml is NVIDIA's `nvidia-ml-py` package (not the deprecated `pynvml` package). It is imported lazily,
and the module can be passed in, so forge_load imports (and its tests run) where it is missing.

Errors: every query goes through `_call`, which maps NVML's errors in one place:
  - not supported / no permission / function missing in this driver -> the query returns None;
  - GPU lost, driver gone, unknown error -> GpuFailedError ("GPU 0 (GPU-...) was lost: ..."), exit 4;
  - any other NVMLError during a query -> GpuFailedError with NVML's message (never swallowed);
  - any NVML error while opening the GPU -> NoGpuError with a hint, exit 3.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any, cast

from forge_load.control.probe import DeviceInfo, GpuFailedError, GpuProcess, NoGpuError, UtilSample

MIB: int = 1024 * 1024

# NVML's "not available" value for 64-bit fields (e.g. usedGpuMemory under WDDM or without permission).
# Current pynvml already turns it into None; older ones pass it through.
NVML_VALUE_NOT_AVAILABLE_ULL: int = 2**64 - 1

INIT_HINT: str = (
    "is the NVIDIA driver installed and loaded (does `nvidia-smi` work)? "
    "In Docker, start the container with `--gpus device=N` (or `--gpus all`) and the NVIDIA container "
    "toolkit installed; or run with --simulate to try forge_load without a GPU"
)
INSTALL_HINT: str = (
    "the NVML Python bindings are missing: `pip install nvidia-ml-py` (module pynvml), "
    "or run with --simulate to try forge_load without a GPU"
)
# A sample stamp is on a clock when it is at most this far behind it (an idle GPU may add no samples for a
# long while) and at most this far ahead of it (clock reads race the driver).
STAMP_MAX_AGE_S: float = 7 * 86400.0
STAMP_AHEAD_S: float = 1.0


# sampleValType -> the field of the c_nvmlValue_t union that holds the value (nvmlValueType_t).
_UNION_FIELD_BY_VALUE_TYPE: dict[int, str] = {
    0: "dVal",
    1: "uiVal",
    2: "ulVal",
    3: "ullVal",
    4: "sllVal",
    5: "siVal",
    6: "usVal",
}


class _Unavailable(Exception):
    """Internal: this GPU/driver does not offer the query (NotSupported, NoPermission, missing function)."""


class _NeverRaised(Exception):
    """Stands in for an NVMLError subclass that an older pynvml does not define, so `except` never matches."""


_NOT_GIVEN: Any = object()  # `_call` without a value for NOT_FOUND: NOT_FOUND is an error
_NO_SAMPLES: Any = object()  # nvmlDeviceGetSamples answered NOT_FOUND: nothing new in the buffer


def _boot_clock() -> float:
    """Seconds since boot, suspend included (Linux); elsewhere the monotonic clock stands in."""
    return time.clock_gettime(getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC))


def _load_nvml(nvml: ModuleType | None) -> ModuleType:
    if nvml is not None:
        return nvml
    try:
        import pynvml  # the only import of pynvml in the project
    except ImportError as err:
        raise NoGpuError(f"cannot import pynvml ({err}): {INSTALL_HINT}") from err
    module: ModuleType = pynvml
    return module


def _err_class(nvml: ModuleType, name: str) -> type[BaseException]:
    cls = getattr(nvml, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else _NeverRaised


def _err_text(err: BaseException) -> str:
    # NVMLError.__str__ may need the library for unknown codes; never let the message itself fail.
    try:
        text = str(err)
    except Exception:  # noqa: BLE001 - a message is all we want here
        text = ""
    return text or type(err).__name__


def _text(value: str | bytes) -> str:
    """Older pynvml returns bytes for names, UUIDs and versions."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _call(
    nvml: ModuleType,
    names: str | tuple[str, ...],
    *args: Any,
    fail: Callable[[str, bool], Exception],
    optional: bool = True,
    not_found: Any = _NOT_GIVEN,
    **kwargs: Any,
) -> Any:
    """Run one NVML query and map its errors; the one place where NVMLErrors are interpreted.

    `names` are tried in order: a name the pynvml module lacks (AttributeError) or whose C symbol the driver
    lacks (NVMLError_FunctionNotFound) moves on to the next, for the _v3 -> _v2 -> plain fallbacks.
    Returns the value, or `not_found` where NVML says NOT_FOUND and a value is given for it.
    Raises _Unavailable where the query is not offered (only when `optional`), else `fail(message, lost)`.
    """
    error_base = _err_class(nvml, "NVMLError")
    function_missing = (
        _err_class(nvml, "NVMLError_FunctionNotFound"),
        # pynvml's unversioned wrappers turn FunctionNotFound into this (not an NVMLError).
        _err_class(nvml, "NVMLLibraryMismatchError"),
    )
    unsupported = (
        _err_class(nvml, "NVMLError_NotSupported"),
        _err_class(nvml, "NVMLError_NoPermission"),
        # A struct version this driver does not know (e.g. nvmlMemory_v2 on an old driver).
        _err_class(nvml, "NVMLError_ArgumentVersionMismatch"),
    )
    lost = (
        _err_class(nvml, "NVMLError_GpuIsLost"),
        _err_class(nvml, "NVMLError_Unknown"),
        _err_class(nvml, "NVMLError_DriverNotLoaded"),
        _err_class(nvml, "NVMLError_ResetRequired"),
    )
    not_found_cls = _err_class(nvml, "NVMLError_NotFound")

    chain = (names,) if isinstance(names, str) else names
    for name in chain:
        fn = getattr(nvml, name, None)
        if fn is None:
            continue
        try:
            return fn(*args, **kwargs)
        except function_missing:
            continue
        except unsupported as err:
            if optional:
                raise _Unavailable(name) from err
            raise fail(f"{name} is not available: {_err_text(err)}", False) from err
        except not_found_cls as err:
            if not_found is not _NOT_GIVEN:
                return not_found
            raise fail(f"{name} failed: {_err_text(err)}", False) from err
        except lost as err:
            raise fail(f"{_err_text(err)} ({name})", True) from err
        except error_base as err:
            raise fail(f"{name} failed: {_err_text(err)}", False) from err
    if optional:
        raise _Unavailable(chain[-1])
    raise fail(f"{' / '.join(chain)} is missing from this pynvml or NVIDIA driver", False)


def _nvml_init(nvml: ModuleType) -> None:
    try:
        nvml.nvmlInit()
    except _err_class(nvml, "NVMLError") as err:
        raise NoGpuError(f"NVML could not start ({_err_text(err)}): {INIT_HINT}") from err


def _nvml_shutdown(nvml: ModuleType) -> None:
    try:
        nvml.nvmlShutdown()
    except _err_class(nvml, "NVMLError"):
        pass  # nothing useful to do when the driver is already gone


def _setup_fail(message: str, lost: bool) -> Exception:
    # While opening the GPU, any failure means "no usable GPU" (exit 3), not "the GPU failed" (exit 4).
    return NoGpuError(f"cannot use the GPU: {message}")


def _device_count(nvml: ModuleType) -> int:
    return int(_call(nvml, "nvmlDeviceGetCount", fail=_setup_fail, optional=False))


def _device_uuid(nvml: ModuleType, handle: Any) -> str:
    return _text(_call(nvml, "nvmlDeviceGetUUID", handle, fail=_setup_fail, optional=False))


def _describe(nvml: ModuleType, handle: Any, index: int) -> DeviceInfo:
    """DeviceInfo for an open handle; setup errors become NoGpuError."""
    name = _text(_call(nvml, "nvmlDeviceGetName", handle, fail=_setup_fail, optional=False))
    uuid = _device_uuid(nvml, handle)
    memory = _call(nvml, "nvmlDeviceGetMemoryInfo", handle, fail=_setup_fail, optional=False)
    try:
        driver = _text(_call(nvml, "nvmlSystemGetDriverVersion", fail=_setup_fail))
    except _Unavailable:
        driver = "unknown"
    # A MIG instance handle (UUID "MIG-...") is a MIG device whatever GetMigMode says about it.
    mig_enabled = uuid.startswith("MIG-")
    try:
        current_mode, _pending_mode = _call(nvml, "nvmlDeviceGetMigMode", handle, fail=_setup_fail)
        mig_enabled = mig_enabled or int(current_mode) == int(getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1))
    except (_Unavailable, NoGpuError):
        pass  # GPUs without MIG answer NotSupported (or InvalidArgument on a MIG handle): not enabled
    return DeviceInfo(
        index=index,
        uuid=uuid,
        name=name,
        memory_total_mib=int(memory.total) / MIB,
        driver_version=driver,
        mig_enabled=mig_enabled,
    )


def _index_of(nvml: ModuleType, handle: Any, uuid: str, count: int) -> int:
    """The NVML index of a handle opened by UUID (-1 where it has none, e.g. a MIG instance w/o parent)."""
    try:
        return int(_call(nvml, "nvmlDeviceGetIndex", handle, fail=_setup_fail))
    except (_Unavailable, NoGpuError):
        pass
    try:  # a MIG instance: report its parent GPU's index
        parent = _call(nvml, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle, fail=_setup_fail)
        return int(_call(nvml, "nvmlDeviceGetIndex", parent, fail=_setup_fail))
    except (_Unavailable, NoGpuError):
        pass
    for index in range(count):
        candidate = _call(nvml, "nvmlDeviceGetHandleByIndex", index, fail=_setup_fail, optional=False)
        if _device_uuid(nvml, candidate) == uuid:
            return index
    return -1


def _visible(nvml: ModuleType, count: int) -> str:
    """'2 GPUs are visible: 0 GPU-..., 1 GPU-...' for error messages."""
    if count == 0:
        return "no GPU is visible to this process"
    uuids: list[str] = []
    for index in range(count):
        try:
            handle = _call(nvml, "nvmlDeviceGetHandleByIndex", index, fail=_setup_fail, optional=False)
            uuids.append(f"{index} {_device_uuid(nvml, handle)}")
        except NoGpuError:
            uuids.append(f"{index} (unreadable)")
    plural = "GPU is" if count == 1 else "GPUs are"
    return f"{count} {plural} visible to this process: {', '.join(uuids)}"


def list_devices(nvml: ModuleType | None = None) -> list[DeviceInfo]:
    """Every GPU NVML shows this process, in index order (for the fleet script and multi-GPU mode)."""
    lib = _load_nvml(nvml)
    _nvml_init(lib)
    try:
        infos: list[DeviceInfo] = []
        for index in range(_device_count(lib)):
            handle = _call(lib, "nvmlDeviceGetHandleByIndex", index, fail=_setup_fail, optional=False)
            infos.append(_describe(lib, handle, index))
        return infos
    finally:
        _nvml_shutdown(lib)


def device_uuids(nvml: ModuleType | None = None) -> list[str]:
    """The UUID of every GPU NVML shows this process, in index order; NoGpuError without NVML. Only UUIDs: the
    hold command resolves an index with it in a Slurm prolog, where every call counts."""
    lib = _load_nvml(nvml)
    _nvml_init(lib)
    try:
        return [_device_uuid(lib, _call(lib, "nvmlDeviceGetHandleByIndex", index, fail=_setup_fail, optional=False))
                for index in range(_device_count(lib))]
    finally:
        _nvml_shutdown(lib)


def device_id_uuids(device_id: str, nvml: ModuleType | None = None) -> tuple[str, ...]:
    """The UUIDs a device plugin's device id names, for holding what the kubelet assigned (service/kubelet.py):
    a MIG device's UUID gives itself and its GPU's; an index `N` gives GPU N's UUID, `N:M` (MIG device M of GPU N,
    the NVIDIA device plugin's index ids) GPU N's and that MIG device's. Empty when NVML does not know the id;
    NoGpuError when NVML cannot be asked at all. (A GPU UUID needs no NVML: it names itself.)"""
    lib = _load_nvml(nvml)
    _nvml_init(lib)
    try:
        try:
            if device_id.startswith("MIG-"):
                mig = _call(lib, "nvmlDeviceGetHandleByUUID", device_id, fail=_setup_fail, optional=False)
                parent = _call(lib, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", mig, fail=_setup_fail,
                               optional=False)
                return (device_id, _device_uuid(lib, parent))
            gpu, colon, mig_index = device_id.partition(":")
            if not gpu.isdigit() or (colon and not mig_index.isdigit()):
                return ()
            handle = _call(lib, "nvmlDeviceGetHandleByIndex", int(gpu), fail=_setup_fail, optional=False)
            uuids: tuple[str, ...] = (_device_uuid(lib, handle),)
            if colon:
                mig = _call(lib, "nvmlDeviceGetMigDeviceHandleByIndex", handle, int(mig_index), fail=_setup_fail,
                            optional=False)
                uuids += (_device_uuid(lib, mig),)
            return uuids
        except NoGpuError:
            return ()  # NVML answered, but not with a device for this id
    finally:
        _nvml_shutdown(lib)


class NvmlProbe:
    """The Probe protocol for one GPU through NVML.

    `gpu` is an NVML index ("0") or a UUID ("GPU-..." / "MIG-..."). Inside a container started with
    `--gpus device=N`, the one visible GPU is index 0. The clocks are arguments so tests can fix them:
    NVML stamps samples with the CPU wall clock, while the rest of forge_load runs on time.monotonic().
    """

    info: DeviceInfo

    def __init__(
        self,
        gpu: str,
        nvml: ModuleType | None = None,
        *,
        wall_clock: Callable[[], float] = time.time,
        mono_clock: Callable[[], float] = time.monotonic,
        boot_clock: Callable[[], float] = _boot_clock,
    ) -> None:
        self._nvml: ModuleType = _load_nvml(nvml)
        self._mono_clock = mono_clock
        # The clocks NVML may stamp samples with, in the order preferred when two fit equally well.
        self._stamp_clocks: dict[str, Callable[[], float]] = {
            "unix": wall_clock, "boot": boot_clock, "monotonic": mono_clock}
        self._stamp_clock: Callable[[], float] | None = None
        self._relative_offset_s = 0.0
        self._last_stamp_us = -1
        # Which clock the sample stamps are on: unix, boot, monotonic, relative (none fits: anchored on
        # the newest sample), or pending (no sample seen yet).
        self.sample_clock = "pending"
        self._close_lock = threading.Lock()
        self._closed = False
        _nvml_init(self._nvml)
        try:
            self._handle, self.info = self._open(str(gpu).strip())
        except BaseException:
            _nvml_shutdown(self._nvml)  # balance nvmlInit's reference count
            self._closed = True
            raise
        with contextlib.suppress(GpuFailedError):  # the first poll reports a failing GPU
            buffered = self._raw_samples(0)
            if buffered:
                self._calibrate(stamp_us for stamp_us, _ in buffered)

    def _open(self, gpu: str) -> tuple[Any, DeviceInfo]:
        lib = self._nvml
        count = _device_count(lib)
        if gpu.isdigit():
            index = int(gpu)
            if index >= count:
                raise NoGpuError(
                    f"GPU index {index} does not exist: {_visible(lib, count)} "
                    "(inside a container started with --gpus device=N, the GPU is index 0)"
                )
            handle = _call(lib, "nvmlDeviceGetHandleByIndex", index, fail=_setup_fail, optional=False)
        elif gpu.startswith(("GPU-", "MIG-")):
            try:
                handle = _call(lib, "nvmlDeviceGetHandleByUUID", gpu, fail=_setup_fail, optional=False)
            except NoGpuError as err:
                raise NoGpuError(f"no GPU with UUID {gpu}: {_visible(lib, count)}") from err
            index = _index_of(lib, handle, gpu, count)
        else:
            raise NoGpuError(f"GPU {gpu!r} is neither an index (0, 1, ...) nor a UUID (GPU-..., MIG-...)")
        return handle, _describe(lib, handle, index)

    # --- the one error-mapping path for every query ---

    def _fail(self, message: str, lost: bool) -> Exception:
        what = "was lost" if lost else "failed"
        return GpuFailedError(f"GPU {self.info.index} ({self.info.uuid}) {what}: {message}")

    def _query(
        self, names: str | tuple[str, ...], *args: Any, not_found: Any = _NOT_GIVEN, **kwargs: Any
    ) -> Any:
        """The value, or None where this GPU/driver does not offer it; GpuFailedError when the GPU fails."""
        if self._closed:
            raise RuntimeError("NvmlProbe is closed")
        try:
            return _call(self._nvml, names, *args, fail=self._fail, not_found=not_found, **kwargs)
        except _Unavailable:
            return None

    # --- Probe ---

    def _stamp_offset_s(self) -> float:
        """Seconds to subtract from a sample stamp to land on the monotonic clock.

        Recomputed per call: the wall clock can be stepped (NTP) while monotonic time cannot.
        """
        if self._stamp_clock is None:
            return self._relative_offset_s
        return self._stamp_clock() - self._mono_clock()

    def _calibrate(self, stamps_us: Iterable[int]) -> None:
        """Find which CPU clock NVML stamps its samples with (docs/design.md §2): the one the newest stamp is
        a little behind of. Where none fits, anchor the newest sample at now."""
        newest_s = max(stamps_us) / 1e6
        ages = {name: clock() - newest_s for name, clock in self._stamp_clocks.items()}
        fitting = [(age_s, name) for name, age_s in ages.items() if -STAMP_AHEAD_S <= age_s <= STAMP_MAX_AGE_S]
        if fitting:
            self.sample_clock = min(fitting)[1]
            self._stamp_clock = self._stamp_clocks[self.sample_clock]
        else:
            self.sample_clock = "relative"
            self._relative_offset_s = newest_s - self._mono_clock()

    def _raw_samples(self, last_seen_us: int) -> list[tuple[int, float]] | None:
        """(stamp in µs, percent) of the buffered samples stamped after `last_seen_us`; None: unsupported."""
        result = self._query(
            "nvmlDeviceGetSamples",
            self._handle,
            getattr(self._nvml, "NVML_GPU_UTILIZATION_SAMPLES", 1),
            last_seen_us,
            not_found=_NO_SAMPLES,  # NOT_FOUND: no new samples in the buffer (normal when idle)
        )
        if result is None:
            return None
        if result is _NO_SAMPLES:
            return []
        value_type, raw_samples = result
        return [(int(raw.timeStamp), _sample_value(raw.sampleValue, value_type)) for raw in raw_samples]

    def utilization_samples(self, since_s: float) -> list[UtilSample] | None:
        # The cursor is NVML's own stamp of the newest sample returned, never a stamp rebuilt from
        # converted times: a rebuilt one jitters below it, and NVML hands the same sample back.
        since_us = -1
        if self.sample_clock != "pending" and math.isfinite(since_s):
            since_us = math.floor((since_s + self._stamp_offset_s()) * 1e6)
        last_seen_us = max(self._last_stamp_us, since_us, 0)
        raw = self._raw_samples(last_seen_us)
        if raw is None:
            return None
        fresh = [(stamp_us, percent) for stamp_us, percent in raw if stamp_us > self._last_stamp_us]
        if not fresh:
            return []
        if self.sample_clock == "pending":
            self._calibrate(stamp_us for stamp_us, _ in fresh)
        self._last_stamp_us = max(stamp_us for stamp_us, _ in fresh)
        offset_s = self._stamp_offset_s()
        samples = [UtilSample(t_s=stamp_us / 1e6 - offset_s, ratio=min(1.0, max(0.0, percent / 100.0)))
                   for stamp_us, percent in fresh]
        return sorted((s for s in samples if s.t_s > since_s), key=lambda s: s.t_s)

    def utilization_ratio(self) -> float | None:
        rates = self._query("nvmlDeviceGetUtilizationRates", self._handle)
        if rates is None:
            return None
        return min(1.0, max(0.0, float(rates.gpu) / 100.0))

    def memory_used_mib(self) -> float | None:
        # v2's `used` excludes the memory the driver reserves, so it moves only with contexts and allocations.
        version_v2 = getattr(self._nvml, "nvmlMemory_v2", None)
        if version_v2 is not None:
            try:
                memory = self._query("nvmlDeviceGetMemoryInfo", self._handle, version=version_v2)
            except TypeError:
                memory = None  # an old pynvml whose nvmlDeviceGetMemoryInfo takes no version
            if memory is not None:
                return int(memory.used) / MIB
            # else: a driver without the v2 struct; v1's `used` includes the reserved memory
        memory = self._query("nvmlDeviceGetMemoryInfo", self._handle)
        return None if memory is None else int(memory.used) / MIB

    def processes(self) -> list[GpuProcess] | None:
        # Only processes in this PID namespace are listed (drivers 535.113+ drop the others), so an empty
        # list inside a container without --pid=host does not mean the GPU is free.
        compute = self._query(
            (
                "nvmlDeviceGetComputeRunningProcesses_v3",
                "nvmlDeviceGetComputeRunningProcesses_v2",
                "nvmlDeviceGetComputeRunningProcesses",
            ),
            self._handle,
        )
        graphics = self._query(
            (
                "nvmlDeviceGetGraphicsRunningProcesses_v3",
                "nvmlDeviceGetGraphicsRunningProcesses_v2",
                "nvmlDeviceGetGraphicsRunningProcesses",
            ),
            self._handle,
        )
        if compute is None and graphics is None:
            return None
        return _merge_processes((compute or []), (graphics or []))

    def power_w(self) -> float | None:
        milliwatts = self._query("nvmlDeviceGetPowerUsage", self._handle)
        return None if milliwatts is None else float(milliwatts) / 1000.0

    def energy_j(self) -> float | None:
        # Volta and newer: the board's energy since the driver loaded, in mJ (docs/design.md §9).
        millijoules = self._query("nvmlDeviceGetTotalEnergyConsumption", self._handle)
        return None if millijoules is None else int(millijoules) / 1000.0

    def power_limit_w(self) -> float | None:
        milliwatts = self._query("nvmlDeviceGetEnforcedPowerLimit", self._handle)
        return None if milliwatts is None else float(milliwatts) / 1000.0

    def temperature_c(self) -> float | None:
        celsius = self._query(
            "nvmlDeviceGetTemperature", self._handle, getattr(self._nvml, "NVML_TEMPERATURE_GPU", 0)
        )
        return None if celsius is None else float(celsius)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        _nvml_shutdown(self._nvml)

    def __enter__(self) -> NvmlProbe:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _sample_value(value: Any, value_type: int) -> float:
    """The number in a c_nvmlValue_t union, read through the field that sampleValType names."""
    if isinstance(value, (int, float)):
        return float(value)
    field = _UNION_FIELD_BY_VALUE_TYPE.get(int(value_type), "uiVal")
    number = getattr(value, field, None)
    if number is None:
        number = getattr(value, "uiVal", 0)  # utilization samples are unsigned ints on every driver seen
    return float(cast(float, number))


def _used_mib(used_bytes: int | None) -> float | None:
    if used_bytes is None or int(used_bytes) == NVML_VALUE_NOT_AVAILABLE_ULL:
        return None
    return int(used_bytes) / MIB


def _merge_processes(*lists: Iterable[Any]) -> list[GpuProcess]:
    """One entry per pid; a process in both lists (compute + graphics) keeps the larger known memory."""
    by_pid: dict[int, float | None] = {}
    for processes in lists:
        for process in processes:
            pid = int(process.pid)
            used = _used_mib(getattr(process, "usedGpuMemory", None))
            if pid not in by_pid:
                by_pid[pid] = used
            elif used is not None:
                known = by_pid[pid]
                by_pid[pid] = used if known is None else max(known, used)
    return [GpuProcess(pid=pid, used_mib=used) for pid, used in sorted(by_pid.items())]
