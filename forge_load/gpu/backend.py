"""Where GPUs come from: the machine's own, through NVML and CUDA, or the simulated GPU; chosen in one place.

A backend lists the devices, opens a GPU's probe, and opens its launcher once the probe has read the device's
memory before our context exists. The virtual GPU (vgpu/) stands in for the driver's libraries, so to
forge_load it is simply the machine's own GPU. A backend also supplies the clock its GPUs' loop runs on (clocks.py):
wall-clock time with a Monitor thread for a real GPU, virtual time in one thread for the simulated one; the loop
itself (service/loop.py) is one for both.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Protocol

from forge_load.config.settings import Config
from forge_load.config.sim import SimConfig
from forge_load.control.probe import DeviceInfo, NoGpuError, Probe
from forge_load.control.worker import Launcher
from forge_load.gpu.clocks import LoopClock, VirtualLoopClock, WallLoopClock
from forge_load.gpu.sim import SimGpu, SimLauncher, SimProbe, VirtualClock

MIG_NOTE: str = (
    "NVML utilization is not supported on MIG instances: forge_load cannot measure this GPU's "
    "utilization, and foreign-job detection falls back to processes and memory"
)
MIG_GPM_NOTE: str = (
    "NVML utilization is not supported on MIG instances: GPM's GRAPHICS_UTIL (the time any kernel ran) "
    "stands in for it in the utilization signal (docs/design.md, section 12)"  # ASCII: the log escapes the rest
)


def show_cuda_the_mig_device(uuid: str, environ: MutableMapping[str, str]) -> None:
    """A CUDA process sees one MIG device only, the first CUDA_VISIBLE_DEVICES names (docs/design.md §12): where the
    variable is unset, name this MIG device in it before CUDA starts. A value already there is the operator's (or
    the container's), and is left alone: the launcher then says what CUDA sees if it is not this device."""
    if uuid.startswith("MIG-") and "CUDA_VISIBLE_DEVICES" not in environ:
        environ["CUDA_VISIBLE_DEVICES"] = uuid


class Backend(Protocol):
    # Whether another process on this host can fill the same GPU: a real GPU is claimed by one filler of a user
    # (service/health.py); each process's simulated GPUs are its own.
    claims_gpus: bool

    def devices(self) -> list[DeviceInfo]:
        """Every GPU this process can fill, in index order."""

    def mig_devices(self, gpu_uuid: str) -> list[str]:
        """The UUIDs of the MIG devices of a GPU in MIG mode (devices() says which are)."""

    def open_probe(self, selector: str) -> Probe:
        """The GPU an index or UUID names; NoGpuError (exit 3) if there is none."""

    def open_launcher(self, probe: Probe, shape: str, metric: str) -> Launcher:
        """Our context on the probe's GPU, launching kernels of `shape` (FORGE_SHAPE) laid out for `metric`."""

    def open_clock(self, probe: Probe) -> LoopClock:
        """The clock the probe's GPU's loop runs on, and how it waits."""

    def start_fields(self, info: DeviceInfo) -> dict[str, object]:
        """What the start line adds for this backend."""


class NvidiaBackend:
    """The machine's GPUs: NVML (nvml.py, nvml_mig.py) and the CUDA driver (launcher.py), imported only when used."""

    claims_gpus = True

    def devices(self) -> list[DeviceInfo]:
        from forge_load.gpu import nvml

        return nvml.list_devices()

    def mig_devices(self, gpu_uuid: str) -> list[str]:
        from forge_load.gpu import nvml_mig

        return nvml_mig.mig_device_uuids(gpu_uuid)

    def open_probe(self, selector: str) -> Probe:
        from forge_load.gpu import nvml

        return nvml.NvmlProbe(selector)

    def open_launcher(self, probe: Probe, shape: str, metric: str) -> Launcher:
        from forge_load.gpu import launcher

        show_cuda_the_mig_device(probe.info.uuid, os.environ)
        return launcher.CudaLauncher(probe.info.uuid, shape=shape, metric=metric)

    def open_clock(self, probe: Probe) -> WallLoopClock:
        return WallLoopClock()

    def start_fields(self, info: DeviceInfo) -> dict[str, object]:
        if not info.mig_enabled:
            return {}
        fields: dict[str, object] = {}
        if info.gpu_instance is not None:  # dcgm-exporter's GPU_I_ID and GPU_I_PROFILE, and the GPU's UUID
            fields = {"gpu_instance": info.gpu_instance, "mig_profile": info.mig_profile, "gpu_uuid": info.gpu_uuid}
        return {**fields, "note": f"GPU {info.index} ({info.uuid}): {MIG_GPM_NOTE if info.gpm else MIG_NOTE}"}


class SimBackend:
    """The simulated GPUs (`--sim-gpus` of them), each on a virtual clock of its own. Their Unix time starts at
    `wall_start_s` (default: when a GPU's loop starts) and moves with virtual time."""

    claims_gpus = False

    def __init__(self, config: SimConfig, keep_history: bool = False, wall_start_s: float | None = None) -> None:
        self.config = config
        self.keep_history = keep_history
        self.wall_start_s = wall_start_s

    def devices(self) -> list[DeviceInfo]:
        return [SimGpu(self.config, VirtualClock(), i).info for i in range(self.config.gpus)]

    def mig_devices(self, gpu_uuid: str) -> list[str]:
        return []  # the simulated GPU has no MIG mode

    def open_probe(self, selector: str) -> SimProbe:
        uuids = [info.uuid for info in self.devices()]
        index = int(selector) if selector.isdigit() else uuids.index(selector) if selector in uuids else -1
        if not 0 <= index < self.config.gpus:
            visible = ", ".join(f"{i} {u}" for i, u in enumerate(uuids))
            raise NoGpuError(f"GPU {selector} does not exist: {self.config.gpus} simulated (--sim-gpus): {visible}")
        return SimProbe(SimGpu(self.config, VirtualClock(), index, keep_history=self.keep_history))

    def open_launcher(self, probe: Probe, shape: str, metric: str) -> SimLauncher:
        if not isinstance(probe, SimProbe):
            raise TypeError(f"the simulated GPU launches only beside its own probe, not {type(probe).__name__}")
        return SimLauncher(probe.gpu, shape, metric)

    def open_clock(self, probe: Probe) -> VirtualLoopClock:
        if not isinstance(probe, SimProbe) or not isinstance(probe.gpu.clock, VirtualClock):
            raise TypeError("the simulated GPU's loop steps the virtual clock of its own probe")
        return VirtualLoopClock(probe.gpu.clock, self.config.speed, self.wall_start_s)

    def start_fields(self, info: DeviceInfo) -> dict[str, object]:
        return {"simulated": True}


def backend_for(config: Config, keep_history: bool = False) -> NvidiaBackend | SimBackend:
    """The one place the backend is chosen from the config."""
    return SimBackend(config.sim, keep_history) if config.simulate else NvidiaBackend()
