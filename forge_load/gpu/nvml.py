"""The Probe on a real GPU, through NVML, and the host's GPUs as NVML shows them. NVML is asked through its one call
path, nvml_calls.py (the only module that imports pynvml, and where NVML's errors are mapped); MIG devices, GPU
instances and GPM through nvml_mig.py.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from forge_load.control.probe import (
    Activity,
    ComputeMode,
    DeviceInfo,
    GpuFailedError,
    GpuProcess,
    NoGpuError,
    UtilSample,
)
from forge_load.gpu.nvml_calls import (
    _NOT_GIVEN,
    _call,
    _device_count,
    _device_uuid,
    _load_nvml,
    _nvml_init,
    _nvml_shutdown,
    _setup_fail,
    _text,
    _Unavailable,
)
from forge_load.gpu.nvml_mig import gpm_metrics, gpm_supported, mig_identity, mig_mode_refusal, mig_uuids
from forge_load.gpu.nvml_values import MIB, StampClock, boot_clock, merge_processes, sample_value

_NO_SAMPLES: Any = object()  # nvmlDeviceGetSamples answered NOT_FOUND: nothing new in the buffer


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
        compute_mode=_compute_mode(nvml, handle),
        gpm=gpm_supported(nvml, handle),
        **(mig_identity(nvml, handle, name) if uuid.startswith("MIG-") else {}),
    )


# nvmlComputeMode_t (nvml.h): 0 default, 1 exclusive thread ("Support Removed"), 2 prohibited, 3 exclusive process
_COMPUTE_MODES = {0: ComputeMode.DEFAULT, 1: ComputeMode.EXCLUSIVE_THREAD, 2: ComputeMode.PROHIBITED,
                  3: ComputeMode.EXCLUSIVE_PROCESS}


def _compute_mode(nvml: ModuleType, handle: Any) -> ComputeMode:
    """The GPU's compute mode; UNKNOWN where NVML does not say (a MIG instance, an old driver)."""
    try:
        value = _call(nvml, "nvmlDeviceGetComputeMode", handle, fail=_setup_fail)
    except (_Unavailable, NoGpuError):
        return ComputeMode.UNKNOWN
    return _COMPUTE_MODES.get(int(value), ComputeMode.UNKNOWN)


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
    a MIG device's UUID gives itself, once NVML knows it; an index `N` gives GPU N's UUID, `N:M` (MIG device M of
    GPU N, the NVIDIA device plugin's index ids) that MIG device's. Never a MIG device's GPU: a hold on a GPU holds
    every MIG device of it (docs/holds.md), and an assignment of one MIG device holds that one only. Empty when NVML
    does not know the id; NoGpuError when NVML cannot be asked at all. (A GPU UUID needs no NVML: it names itself.)"""
    lib = _load_nvml(nvml)
    _nvml_init(lib)
    try:
        try:
            if device_id.startswith("MIG-"):
                _call(lib, "nvmlDeviceGetHandleByUUID", device_id, fail=_setup_fail, optional=False)
                return (device_id,)
            gpu, colon, mig_index = device_id.partition(":")
            if not gpu.isdigit() or (colon and not mig_index.isdigit()):
                return ()
            handle = _call(lib, "nvmlDeviceGetHandleByIndex", int(gpu), fail=_setup_fail, optional=False)
            if colon:
                handle = _call(lib, "nvmlDeviceGetMigDeviceHandleByIndex", handle, int(mig_index), fail=_setup_fail,
                               optional=False)
            return (_device_uuid(lib, handle),)
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
        boot_clock: Callable[[], float] = boot_clock,
    ) -> None:
        self._nvml: ModuleType = _load_nvml(nvml)
        self._stamps = StampClock(wall_clock, mono_clock, boot_clock)
        self._mono_clock = mono_clock
        self._gpm_previous: tuple[Any, float] | None = None  # the last GPM sample and when it was taken
        self._last_stamp_us = -1
        self._close_lock = threading.Lock()
        self._closed = False
        _nvml_init(self._nvml)
        try:
            self._handle, self.info = self._open(str(gpu).strip())
            if self.info.mig_enabled and not self.info.uuid.startswith("MIG-"):
                raise mig_mode_refusal(self.info.index, self.info.uuid, mig_uuids(self._nvml, self._handle))
            # Power, energy, the power limit and temperature are the board's, which a MIG device shares with its
            # GPU's other MIG devices (docs/design.md §12): they are read from the GPU's handle.
            self._board = self._handle
            if self.info.uuid.startswith("MIG-"):
                with contextlib.suppress(_Unavailable, NoGpuError):
                    self._board = _call(self._nvml, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", self._handle,
                                        fail=_setup_fail)
        except BaseException:
            _nvml_shutdown(self._nvml)  # balance nvmlInit's reference count
            self._closed = True
            raise
        with contextlib.suppress(GpuFailedError):  # the first poll reports a failing GPU
            buffered = self._raw_samples(0)
            if buffered:
                self._stamps.calibrate(stamp_us for stamp_us, _ in buffered)

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

    @property
    def sample_clock(self) -> str:
        """Which clock the sample stamps are on: unix, boot, monotonic, relative (none fits: anchored on the newest
        sample), or pending (no sample seen yet)."""
        return self._stamps.name

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
        return [(int(raw.timeStamp), sample_value(raw.sampleValue, value_type)) for raw in raw_samples]

    def utilization_samples(self, since_s: float) -> list[UtilSample] | None:
        # The cursor is NVML's own stamp of the newest sample returned, never a stamp rebuilt from
        # converted times: a rebuilt one jitters below it, and NVML hands the same sample back.
        since_us = -1
        if self._stamps.name != "pending" and math.isfinite(since_s):
            since_us = math.floor((since_s + self._stamps.offset_s()) * 1e6)
        last_seen_us = max(self._last_stamp_us, since_us, 0)
        raw = self._raw_samples(last_seen_us)
        if raw is None:
            return None
        fresh = [(stamp_us, percent) for stamp_us, percent in raw if stamp_us > self._last_stamp_us]
        if not fresh:
            return []
        if self._stamps.name == "pending":
            self._stamps.calibrate(stamp_us for stamp_us, _ in fresh)
        self._last_stamp_us = max(stamp_us for stamp_us, _ in fresh)
        offset_s = self._stamps.offset_s()
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
        return merge_processes((compute or []), (graphics or []))

    def power_w(self) -> float | None:
        milliwatts = self._query("nvmlDeviceGetPowerUsage", self._board)
        return None if milliwatts is None else float(milliwatts) / 1000.0

    def energy_j(self) -> float | None:
        # Volta and newer: the board's energy since the driver loaded, in mJ (docs/design.md §9).
        millijoules = self._query("nvmlDeviceGetTotalEnergyConsumption", self._board)
        return None if millijoules is None else int(millijoules) / 1000.0

    def power_limit_w(self) -> float | None:
        milliwatts = self._query("nvmlDeviceGetEnforcedPowerLimit", self._board)
        return None if milliwatts is None else float(milliwatts) / 1000.0

    def temperature_c(self) -> float | None:
        celsius = self._query(
            "nvmlDeviceGetTemperature", self._board, getattr(self._nvml, "NVML_TEMPERATURE_GPU", 0)
        )
        return None if celsius is None else float(celsius)

    def activity(self) -> Activity | None:
        """GPM's SM_UTIL and GRAPHICS_UTIL since the previous call (docs/design.md §12); the caller keeps its
        calls 0.1 s or more apart, as NVML asks. None at the first call, where there is no GPM, or where a
        metric did not answer."""
        if not self.info.gpm:
            return None
        sample = self._query("nvmlGpmSampleAlloc")
        if sample is None:
            return None
        taken_s = self._mono_clock()
        try:  # nvml.h 13.4: nvmlGpmSampleGet takes a GPU's handle or a MIG device's
            if self._query("nvmlGpmSampleGet", self._handle, sample) is None:
                raise _Unavailable("nvmlGpmSampleGet")
        except BaseException:
            self._query("nvmlGpmSampleFree", sample)
            raise
        previous, self._gpm_previous = self._gpm_previous, (sample, taken_s)
        if previous is None:
            return None
        before, before_s = previous
        try:
            ratios = gpm_metrics(self._nvml, self._query, before, sample)
        finally:
            self._query("nvmlGpmSampleFree", before)
        return None if ratios is None else Activity(taken_s, taken_s - before_s, *ratios)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._gpm_previous is not None:
            with contextlib.suppress(Exception):
                _call(self._nvml, "nvmlGpmSampleFree", self._gpm_previous[0], fail=self._fail)
            self._gpm_previous = None
        _nvml_shutdown(self._nvml)

    def __enter__(self) -> NvmlProbe:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


