"""The simulated GPU with NVML's GPM, for the tests of the held metric: a whole Hopper-like GPU (GPM beside NVML's
utilization) or one MIG device of it (GPM only: NVML reports no utilization there, docs/design.md §12). A stand-in
over gpu/sim.py's model, in virtual time, as the virtual GPU models GPM: GRAPHICS_UTIL is the share of the span any
kernel ran, ours or foreign; SM_UTIL is that less SM_TAIL_RATIO of our own busy share (a last wave's tail leaves SMs
idle), so that holding SM activity asks the controller's integral to learn a bias, as on the virtual GPU."""

from __future__ import annotations

import dataclasses
import io
import json
import threading
from collections.abc import Callable

from forge_load.config.load import load_config
from forge_load.config.settings import Config
from forge_load.control.probe import Activity, UtilSample
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

    def __init__(self, gpu: SimGpu, mig: bool) -> None:
        super().__init__(gpu)
        self.mig = mig
        info = dataclasses.replace(gpu.info, gpm=True)
        if mig:
            info = dataclasses.replace(info, uuid=mig_uuid(gpu.info.uuid), name=f"{gpu.info.name} MIG {MIG_PROFILE}",
                                       mig_enabled=True, gpu_instance=MIG_INSTANCE, mig_profile=MIG_PROFILE,
                                       gpu_uuid=gpu.info.uuid)
        self.info = info
        self._last_s: float | None = None

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
        return Activity(now_s, span_s, max(gr_ratio - SM_TAIL_RATIO * own_ratio, 0.0), gr_ratio)


class GpmSimBackend(SimBackend):
    """The simulated GPUs, each with GPM (`mig`: each a MIG device of its GPU)."""

    def __init__(self, config: Config, mig: bool = False) -> None:
        super().__init__(config.sim, keep_history=True)
        self.mig = mig

    def open_probe(self, selector: str) -> GpmSimProbe:
        return GpmSimProbe(super().open_probe(selector).gpu, self.mig)


def run_with_gpm(flags: str, mig: bool = False, on_start: Callable[[Runtime], None] | None = None
                 ) -> tuple[Runtime, list[dict[str, object]]]:
    """A whole run on the simulated GPU with GPM, in virtual time, with JSON lines: the runtime and the lines."""
    config = load_config(f"--simulate --sim-speed 0 --log-format json {flags}".split(), env={})
    out = io.StringIO()
    rt = run_loop(config, GpmSimBackend(config, mig), out, threading.Event(), threading.Event(), on_start=on_start)
    assert rt is not None
    return rt, [json.loads(line) for line in out.getvalue().splitlines()]
