"""A fake pynvml module built from a per-device table, for testing forge_load.gpu.nvml without a GPU.

It reuses the installed pynvml's exception classes, constants and ctypes structures (none of which need
the NVML library), so the code under test meets the same `except` clauses and value shapes as on a GPU.

    fake = FakeNvml([FakeDevice(name="NVIDIA H100", uuid="GPU-aaa")])
    probe = NvmlProbe("0", nvml=fake.module)
    fake.devices[0].errors["nvmlDeviceGetPowerUsage"] = pynvml.NVMLError_GpuIsLost

A device's `errors` maps a pynvml function name to an NVMLError subclass (or instance) that the function
raises; `FakeNvml.errors` does the same for the calls that take no device (nvmlInit, nvmlDeviceGetCount,
nvmlSystemGetDriverVersion). `without=` leaves functions or constants out of the module, as an older
pynvml would; `missing_in_driver=` keeps them but makes them raise NVMLError_FunctionNotFound, as an
older driver would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

import pynvml

MIB: int = 1024 * 1024

ErrorSpec = type[pynvml.NVMLError] | pynvml.NVMLError


@dataclass
class FakeProcess:
    pid: int
    usedGpuMemory: int | None  # bytes; None or pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value = unknown


@dataclass
class FakeDevice:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    memory_total_bytes: int = 80 * 1024 * MIB
    memory_used_bytes: int = 0  # v2 semantics: excludes the driver's reservation
    memory_reserved_bytes: int = 512 * MIB  # v1's `used` includes this
    util_percent: int = 0
    samples: list[tuple[int, int]] = field(default_factory=list)  # (timestamp µs, wall clock; percent)
    compute_processes: list[FakeProcess] = field(default_factory=list)
    graphics_processes: list[FakeProcess] = field(default_factory=list)
    power_mw: int = 70_000
    energy_mj: int = 123_456_789  # since the driver loaded
    power_limit_mw: int = 700_000  # the enforced limit
    temperature_c: int = 35
    mig_mode: int | None = None  # None: GetMigMode raises NotSupported (a GPU without MIG)
    migs: list[FakeDevice] = field(default_factory=list)  # its MIG devices (found by UUID, not by GPU index)
    compute_mode: int = 0  # nvmlComputeMode_t: 0 default, 1 exclusive thread, 2 prohibited, 3 exclusive process
    minor: int | None = None  # the N of /dev/nvidiaN; None: GetMinorNumber raises NotSupported (as for a MIG device)
    # A MIG device's GPU instance: (its ID, its profile ID, placement start, placement size); None: not one
    gpu_instance: tuple[int, int, int, int] | None = None
    errors: dict[str, ErrorSpec] = field(default_factory=dict)


class FakeNvml:
    """Holds the device table and the call log; `module` is what NvmlProbe gets as `nvml`."""

    # The pynvml functions nvml.py may call (and the fake implements).
    FUNCTIONS: tuple[str, ...] = (
        "nvmlInit",
        "nvmlShutdown",
        "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetHandleByUUID",
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
        "nvmlDeviceGetMaxMigDeviceCount",
        "nvmlDeviceGetMigDeviceHandleByIndex",
        "nvmlDeviceGetIndex",
        "nvmlDeviceGetName",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetMemoryInfo",
        "nvmlSystemGetDriverVersion",
        "nvmlDeviceGetMigMode",
        "nvmlDeviceGetComputeMode",
        "nvmlDeviceGetSamples",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses",
        "nvmlDeviceGetGraphicsRunningProcesses_v2",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetMinorNumber",
        "nvmlDeviceGetGpuInstanceId",
        "nvmlDeviceGetGpuInstanceById",
        "nvmlGpuInstanceGetInfo",
    )
    CONSTANTS: tuple[str, ...] = (
        "nvmlMemory_v2",
        "NVML_GPU_UTILIZATION_SAMPLES",
        "NVML_TEMPERATURE_GPU",
        "NVML_DEVICE_MIG_ENABLE",
        "NVML_DEVICE_MIG_DISABLE",
        "NVML_VALUE_TYPE_UNSIGNED_INT",
        "NVML_VALUE_NOT_AVAILABLE_ulonglong",
    )

    def __init__(
        self,
        devices: Iterable[FakeDevice],
        *,
        driver_version: str = "550.54.15",
        bytes_strings: bool = False,
        without: Iterable[str] = (),
        missing_in_driver: Iterable[str] = (),
        honor_last_seen: bool = True,
    ) -> None:
        self.devices: list[FakeDevice] = list(devices)
        self.driver_version = driver_version
        self.bytes_strings = bytes_strings  # old pynvml returned bytes for names, UUIDs and versions
        self.missing_in_driver: set[str] = set(missing_in_driver)
        # False: nvmlDeviceGetSamples returns the whole buffer whatever the last-seen timestamp, so the
        # caller's own filtering is what the test sees.
        self.honor_last_seen = honor_last_seen
        self.errors: dict[str, ErrorSpec] = {}
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.init_count = 0
        self.shutdown_count = 0
        self.module: ModuleType = self._build_module(set(without))

    # --- the module object ---

    def _build_module(self, without: set[str]) -> ModuleType:
        module = ModuleType("fake_pynvml")
        for name in dir(pynvml):  # the real exception classes: NVMLError and every NVMLError_* subclass
            value = getattr(pynvml, name)
            if name.startswith("NVMLError") or name == "NVMLLibraryMismatchError":
                setattr(module, name, value)
        for name in self.CONSTANTS:
            setattr(module, name, getattr(pynvml, name))
        for name in self.FUNCTIONS:
            setattr(module, name, self._wrap(name, getattr(self, "_" + name)))
        for name in without:
            if hasattr(module, name):
                delattr(module, name)
        return module

    def _wrap(self, name: str, impl: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            if name in self.missing_in_driver:
                raise pynvml.NVMLError_FunctionNotFound()
            if name in self.errors:
                _raise(self.errors[name])
            if name not in ("nvmlInit", "nvmlShutdown") and self.init_count <= self.shutdown_count:
                raise pynvml.NVMLError_Uninitialized()
            if args and isinstance(args[0], FakeDevice) and name in args[0].errors:
                _raise(args[0].errors[name])
            return impl(*args, **kwargs)

        call.__name__ = name
        return call

    def called(self, name: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """The (args, kwargs) of every call to `name`, in order."""
        return [(args, kwargs) for called_name, args, kwargs in self.calls if called_name == name]

    def _str(self, value: str) -> str | bytes:
        return value.encode() if self.bytes_strings else value

    # --- implementations (errors and init state are handled in _wrap) ---

    def _nvmlInit(self) -> None:
        self.init_count += 1

    def _nvmlShutdown(self) -> None:
        if self.init_count <= self.shutdown_count:
            raise pynvml.NVMLError_Uninitialized()
        self.shutdown_count += 1

    def _nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def _nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        if not 0 <= index < len(self.devices):
            raise pynvml.NVMLError_InvalidArgument()
        return self.devices[index]

    def _nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeDevice:
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for device in self.devices:
            if device.uuid == text:
                return device
            for mig in device.migs:
                if mig.uuid == text:
                    return mig
        raise pynvml.NVMLError_NotFound()

    def _nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: FakeDevice) -> FakeDevice:
        for device in self.devices:
            if handle in device.migs:
                return device
        raise pynvml.NVMLError_InvalidArgument()  # not a MIG device

    def _nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeDevice) -> int:
        return 7 if handle.mig_mode else 0  # an H100's most; zero where MIG is off

    def _nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeDevice, index: int) -> FakeDevice:
        if not 0 <= index < len(handle.migs):
            raise pynvml.NVMLError_NotFound()
        return handle.migs[index]

    def _nvmlDeviceGetIndex(self, handle: FakeDevice) -> int:
        return self.devices.index(handle)

    def _nvmlDeviceGetName(self, handle: FakeDevice) -> str | bytes:
        return self._str(handle.name)

    def _nvmlDeviceGetUUID(self, handle: FakeDevice) -> str | bytes:
        return self._str(handle.uuid)

    def _nvmlDeviceGetMemoryInfo(self, handle: FakeDevice, version: int | None = None) -> Any:
        if version:
            if "nvmlDeviceGetMemoryInfo_v2" in self.missing_in_driver:
                raise pynvml.NVMLError_FunctionNotFound()  # what pynvml raises on a driver without _v2
            memory = pynvml.c_nvmlMemory_v2_t()
            memory.version = version
            memory.reserved = handle.memory_reserved_bytes
            memory.used = handle.memory_used_bytes
        else:
            memory = pynvml.c_nvmlMemory_t()
            memory.used = handle.memory_used_bytes + handle.memory_reserved_bytes
        memory.total = handle.memory_total_bytes
        memory.free = memory.total - handle.memory_used_bytes - handle.memory_reserved_bytes
        return memory

    def _nvmlSystemGetDriverVersion(self) -> str | bytes:
        return self._str(self.driver_version)

    def _nvmlDeviceGetMigMode(self, handle: FakeDevice) -> list[int]:
        if handle.mig_mode is None:
            raise pynvml.NVMLError_NotSupported()
        return [handle.mig_mode, handle.mig_mode]

    def _nvmlDeviceGetComputeMode(self, handle: FakeDevice) -> int:
        return handle.compute_mode

    def _nvmlDeviceGetSamples(self, handle: FakeDevice, sampling_type: int, last_seen_us: int) -> Any:
        assert sampling_type == pynvml.NVML_GPU_UTILIZATION_SAMPLES, sampling_type
        newer = [(ts, pct) for ts, pct in handle.samples if ts > last_seen_us or not self.honor_last_seen]
        if not newer:
            raise pynvml.NVMLError_NotFound()  # what NVML answers when the buffer holds nothing newer
        samples = []
        for ts, pct in newer:
            sample = pynvml.c_nvmlSample_t()
            sample.timeStamp = ts
            sample.sampleValue.uiVal = pct
            samples.append(sample)
        return (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, samples)

    def _nvmlDeviceGetUtilizationRates(self, handle: FakeDevice) -> Any:
        rates = pynvml.c_nvmlUtilization_t()
        rates.gpu = handle.util_percent
        rates.memory = 0
        return rates

    @staticmethod
    def _processes(processes: list[FakeProcess]) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(pid=p.pid, usedGpuMemory=p.usedGpuMemory, gpuInstanceId=0xFFFFFFFF,
                            computeInstanceId=0xFFFFFFFF)
            for p in processes
        ]

    def _nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[SimpleNamespace]:
        return self._processes(handle.compute_processes)

    _nvmlDeviceGetComputeRunningProcesses_v2 = _nvmlDeviceGetComputeRunningProcesses
    _nvmlDeviceGetComputeRunningProcesses_v3 = _nvmlDeviceGetComputeRunningProcesses

    def _nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeDevice) -> list[SimpleNamespace]:
        return self._processes(handle.graphics_processes)

    _nvmlDeviceGetGraphicsRunningProcesses_v2 = _nvmlDeviceGetGraphicsRunningProcesses
    _nvmlDeviceGetGraphicsRunningProcesses_v3 = _nvmlDeviceGetGraphicsRunningProcesses

    def _nvmlDeviceGetPowerUsage(self, handle: FakeDevice) -> int:
        return handle.power_mw

    def _nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeDevice) -> int:
        return handle.energy_mj

    def _nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeDevice) -> int:
        return handle.power_limit_mw

    def _nvmlDeviceGetTemperature(self, handle: FakeDevice, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU, sensor
        return handle.temperature_c


    def _nvmlDeviceGetMinorNumber(self, handle: FakeDevice) -> int:
        if handle.minor is None:
            raise pynvml.NVMLError_NotSupported()
        return handle.minor

    def _nvmlDeviceGetGpuInstanceId(self, handle: FakeDevice) -> int:
        if handle.gpu_instance is None:
            raise pynvml.NVMLError_NotSupported()
        return handle.gpu_instance[0]

    def _nvmlDeviceGetGpuInstanceById(self, handle: FakeDevice, gi_id: int) -> FakeDevice:
        if not handle.mig_mode:
            raise pynvml.NVMLError_NotSupported()
        for mig in handle.migs:
            if mig.gpu_instance is not None and mig.gpu_instance[0] == gi_id:
                return mig  # the GPU instance's handle: here its MIG device (one compute instance each)
        raise pynvml.NVMLError_NotFound()

    def _nvmlGpuInstanceGetInfo(self, instance: FakeDevice) -> Any:
        assert instance.gpu_instance is not None
        gi_id, profile_id, start, size = instance.gpu_instance
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.id, info.profileId = gi_id, profile_id
        info.placement.start, info.placement.size = start, size
        return info


def _raise(spec: ErrorSpec) -> None:
    raise spec() if isinstance(spec, type) else spec
