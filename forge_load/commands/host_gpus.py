"""The host's GPUs by NVML index, for the commands that take indices or hold every GPU (hold, status, fleet
watch): NVML's answer, or the driver's /proc files without it. No CUDA, no numba: NVML (pynvml) only through
forge_load.gpu.nvml."""

from __future__ import annotations

import os

from forge_load.steering import holds

PROC_GPUS = "/proc/driver/nvidia/gpus"


def proc_uuids(root: str = PROC_GPUS) -> list[str]:
    """The GPUs' UUIDs from the driver's /proc files, in NVML's default order (by PCI bus id: the directories are
    named after it); [] without the driver."""
    try:
        buses = sorted(os.listdir(root))
    except OSError:
        return []
    uuids: list[str] = []
    for bus in buses:
        try:
            with open(os.path.join(root, bus, "information"), encoding="utf-8", errors="replace") as file:
                text = file.read(65536)
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "GPU UUID" and holds.valid_gpu_uuid(value.strip()):
                uuids.append(value.strip())
    return uuids


def host_uuids() -> list[str]:
    """Every GPU of the host, in NVML's index order: NVML's answer, or the driver's /proc files without it."""
    try:
        from forge_load.control.probe import NoGpuError
        from forge_load.gpu.nvml import device_uuids  # pynvml only

        try:
            return device_uuids()
        except NoGpuError:
            pass
    except ImportError:
        pass
    return proc_uuids()
