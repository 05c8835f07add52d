"""MIG devices, their GPU instances, and GPM, through NVML's one call path (nvml_calls.py): a MIG device's identity
and its GPU's other MIG devices, the GPUs by minor number with their MIG devices by GPU instance profile and
placement (how NVIDIA's DRA driver names them), and GPM's support and metrics (docs/design.md §12, §13)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from forge_load.control.probe import MigModeError, NoGpuError
from forge_load.gpu.nvml_calls import (
    _call,
    _device_count,
    _device_uuid,
    _load_nvml,
    _nvml_init,
    _nvml_shutdown,
    _setup_fail,
    _Unavailable,
)
from forge_load.gpu.nvml_values import GpuInstance, MinorGpu


def mig_identity(nvml: ModuleType, handle: Any, name: str) -> dict[str, Any]:
    """A MIG device's GPU instance ID, profile and GPU UUID, as far as NVML says (docs/design.md §12). The
    profile is the end of its name ("NVIDIA H100 80GB HBM3 MIG 2g.20gb"), as nvidia-smi -L shows it."""
    out: dict[str, Any] = {"mig_profile": name.rsplit(" MIG ", 1)[1] if " MIG " in name else ""}
    with contextlib.suppress(_Unavailable, NoGpuError):
        out["gpu_instance"] = int(_call(nvml, "nvmlDeviceGetGpuInstanceId", handle, fail=_setup_fail))
    with contextlib.suppress(_Unavailable, NoGpuError):
        parent = _call(nvml, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle, fail=_setup_fail)
        out["gpu_uuid"] = _device_uuid(nvml, parent)
    return out


def gpm_supported(nvml: ModuleType, handle: Any) -> bool:
    """Whether NVML's GPM answers for this GPU or MIG device (Hopper and newer, docs/design.md §12)."""
    try:
        support = _call(nvml, "nvmlGpmQueryDeviceSupport", handle, fail=_setup_fail)
    except (_Unavailable, NoGpuError):
        return False  # an older driver or pynvml, or a GPU before Hopper
    return bool(support.isSupportedDevice)


def mig_uuids(nvml: ModuleType, handle: Any) -> list[str]:
    """The UUIDs of a GPU's MIG devices (none where MIG is off or NVML does not say)."""
    try:
        slots = int(_call(nvml, "nvmlDeviceGetMaxMigDeviceCount", handle, fail=_setup_fail))
    except (_Unavailable, NoGpuError):
        return []
    uuids = []
    for slot in range(slots):
        try:
            mig = _call(nvml, "nvmlDeviceGetMigDeviceHandleByIndex", handle, slot, fail=_setup_fail, not_found=None)
        except (_Unavailable, NoGpuError):
            continue
        if mig is not None:  # NOT_FOUND: no MIG device in that slot
            uuids.append(_device_uuid(nvml, mig))
    return uuids


def mig_mode_refusal(index: int, uuid: str, migs: list[str]) -> MigModeError:
    """A GPU in MIG mode runs CUDA only on its MIG devices, and a process sees one of them (docs/design.md §12): the
    filler fills each MIG device instead (gpu_threads); this message is for a GPU with none made yet."""
    which = ", ".join(migs) if migs else "none is made yet (nvidia-smi mig -cgi ... -C)"
    return MigModeError(f"GPU {index} ({uuid}) is in MIG mode: CUDA runs only on its MIG devices, one per process; "
                        f"its MIG devices: {which}", index, uuid, migs)


def mig_device_uuids(gpu_uuid: str, nvml: ModuleType | None = None) -> list[str]:
    """The UUIDs of the MIG devices of the GPU in MIG mode `gpu_uuid` names (none made yet: empty), in NVML's order;
    `--gpus all` fills each one (docs/operating.md, MIG)."""
    lib = _load_nvml(nvml)
    _nvml_init(lib)
    try:
        return mig_uuids(lib, _call(lib, "nvmlDeviceGetHandleByUUID", gpu_uuid, fail=_setup_fail,
                                            optional=False))
    finally:
        _nvml_shutdown(lib)


def gpus_by_minor(nvml: ModuleType | None = None) -> list[MinorGpu]:
    """Every GPU NVML shows by its minor number, with its MIG devices by GPU instance profile and placement: what
    NVIDIA's DRA driver names devices by (service/kubelet.py, docs/design.md §13). A GPU whose minor NVML does not
    say is left out; a MIG device whose GPU instance it does not say (NVML asks privileges for it) too: a name of
    it then matches nothing, and the kubelet's holds fall back to its GPU. NoGpuError when NVML cannot be asked."""
    lib = _load_nvml(nvml)
    _nvml_init(lib)
    try:
        found: list[MinorGpu] = []
        for index in range(_device_count(lib)):
            handle = _call(lib, "nvmlDeviceGetHandleByIndex", index, fail=_setup_fail, optional=False)
            try:
                minor = int(_call(lib, "nvmlDeviceGetMinorNumber", handle, fail=_setup_fail))
            except (_Unavailable, NoGpuError):
                continue
            found.append(MinorGpu(minor, _device_uuid(lib, handle), tuple(_gpu_instances(lib, handle))))
        return found
    finally:
        _nvml_shutdown(lib)


def _gpu_instances(nvml: ModuleType, handle: Any) -> list[GpuInstance]:
    """The MIG devices of a GPU in MIG mode with their GPU instances' profile IDs and placements."""
    out = []
    try:
        slots = int(_call(nvml, "nvmlDeviceGetMaxMigDeviceCount", handle, fail=_setup_fail))
    except (_Unavailable, NoGpuError):
        return []
    for slot in range(slots):
        try:
            mig = _call(nvml, "nvmlDeviceGetMigDeviceHandleByIndex", handle, slot, fail=_setup_fail, not_found=None)
            if mig is None:
                continue  # NOT_FOUND: no MIG device in that slot
            gi_id = int(_call(nvml, "nvmlDeviceGetGpuInstanceId", mig, fail=_setup_fail))
            gi = _call(nvml, "nvmlDeviceGetGpuInstanceById", handle, gi_id, fail=_setup_fail)
            info = _call(nvml, "nvmlGpuInstanceGetInfo", gi, fail=_setup_fail)
            out.append(GpuInstance(int(info.profileId), int(info.placement.start), int(info.placement.size),
                                   _device_uuid(nvml, mig)))
        except (_Unavailable, NoGpuError):
            continue
    return out


# GPM's metrics between two samples, as the Probe's activity() reads them: SM_UTIL and GRAPHICS_UTIL.
def gpm_metrics(nvml: ModuleType, query: Callable[..., Any], before: Any, after: Any) -> tuple[float, float] | None:
    """SM_UTIL and GRAPHICS_UTIL, as ratios, between two GPM samples (`query`: the caller's NVML query, None where
    not offered); None where the call or either metric did not answer."""
    get = nvml.c_nvmlGpmMetricsGet_t()
    get.version = nvml.NVML_GPM_METRICS_GET_VERSION
    get.numMetrics = 2
    get.sample1, get.sample2 = before, after
    get.metrics[0].metricId = nvml.NVML_GPM_METRIC_SM_UTIL
    get.metrics[1].metricId = nvml.NVML_GPM_METRIC_GRAPHICS_UTIL
    if query("nvmlGpmMetricsGet", get) is None:
        return None
    # each metric answers for itself: the call can succeed while one of them did not
    if get.metrics[0].nvmlReturn != 0 or get.metrics[1].nvmlReturn != 0:
        return None
    return min(max(get.metrics[0].value / 100.0, 0.0), 1.0), min(max(get.metrics[1].value / 100.0, 0.0), 1.0)
