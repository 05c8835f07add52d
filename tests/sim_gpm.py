"""The simulated GPU with NVML's GPM, for the tests of the held metric: a whole Hopper-like GPU (GPM beside NVML's
utilization) or one MIG device of it (GPM only: NVML reports no utilization there, docs/design.md §12). A stand-in
over gpu/sim.py's model, in virtual time, as the virtual GPU models GPM: GRAPHICS_UTIL is the share of the span any
kernel ran, ours or foreign; SM_UTIL is the foreign jobs' share (full waves) and our own busy share times the share of
the SMs our kernels' shape holds (control/shape.py: one warp on one SM of the lean shape's for utilization), less
SM_TAIL_RATIO of it (a tail leaves SMs idle), so that holding SM activity asks the controller's integral to learn a
bias, as on the virtual GPU."""

from __future__ import annotations

import dataclasses
import io
import json
import threading
from collections.abc import Callable

from forge_load.config.load import load_config
from forge_load.config.settings import Config
from forge_load.control.probe import Activity, UtilSample
from forge_load.control.shape import Shape
from forge_load.gpu.backend import SimBackend
from forge_load.gpu.sim import SimGpu, SimProbe
from forge_load.service.loop import run_loop
from forge_load.service.runtime import Runtime

SM_TAIL_RATIO = 0.03
MIG_PROFILE = "3g.40gb"
MIG_INSTANCE = 2


def mig_uuid(gpu_uuid: str) -> str:
    return "MIG-" + gpu_uuid.removeprefix("GPU-")


class GpmSimProbe(SimProbe):
    """A simulated GPU's probe that answers GPM; as a MIG device, NVML's utilization queries answer None."""

    def __init__(self, gpu: SimGpu, mig: bool, sm_ratio: float = 1.0) -> None:
        super().__init__(gpu)
        self.mig = mig
        info = dataclasses.replace(gpu.info, gpm=True)
        if mig:
            info = dataclasses.replace(info, uuid=mig_uuid(gpu.info.uuid), name=f"{gpu.info.name} MIG {MIG_PROFILE}",
                                       mig_enabled=True, gpu_instance=MIG_INSTANCE, mig_profile=MIG_PROFILE,
                                       gpu_uuid=gpu.info.uuid)
        self.info = info
        self._last_s: float | None = None
        self.sm_ratio = sm_ratio  # the share of the SMs our kernels hold while they run

    def utilization_samples(self, since_s: float) -> list[UtilSample] | None:
        return None if self.mig else super().utilization_samples(since_s)

    def utilization_ratio(self) -> float | None:
        return None if self.mig else super().utilization_ratio()

    def activity(self) -> Activity | None:
        now_s = self.gpu.clock.now()
        before_s, self._last_s = self._last_s, now_s
        if before_s is None or now_s <= before_s:
            return None
        span_s = now_s - before_s
        gr_ratio = self.gpu.busy_ratio(before_s, now_s)
        own_ratio = self.gpu.own_busy_s(before_s, now_s) / span_s
        foreign_ratio = self.gpu.foreign_busy_s(before_s, now_s) / span_s
        own_sm_ratio = own_ratio * self.sm_ratio * (1.0 - SM_TAIL_RATIO)
        return Activity(now_s, span_s, min(max(foreign_ratio, own_sm_ratio), 1.0), gr_ratio)


class GpmSimBackend(SimBackend):
    """The simulated GPUs, each with GPM (`mig`: each a MIG device of its GPU)."""

    def __init__(self, config: Config, mig: bool = False) -> None:
        super().__init__(config.sim, keep_history=True)
        self.mig = mig
        self.settings = config  # the filler's (the parent keeps its SimConfig as self.config)

    def open_probe(self, selector: str) -> GpmSimProbe:
        probe = super().open_probe(selector)
        shape = Shape.for_metric(self.settings.shape, self.settings.metric, probe.gpu.config.sms)
        return GpmSimProbe(probe.gpu, self.mig, shape.sm_ratio)


def run_with_gpm(flags: str, mig: bool = False, on_start: Callable[[Runtime], None] | None = None
                 ) -> tuple[Runtime, list[dict[str, object]]]:
    """A whole run on the simulated GPU with GPM, in virtual time, with JSON lines: the runtime and the lines."""
    config = load_config(f"--simulate --sim-speed 0 --log-format json {flags}".split(), env={})
    out = io.StringIO()
    rt = run_loop(config, GpmSimBackend(config, mig), out, threading.Event(), threading.Event(), on_start=on_start)
    assert rt is not None
    return rt, [json.loads(line) for line in out.getvalue().splitlines()]
