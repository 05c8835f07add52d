"""The run loop of one GPU's filler (run_loop): one loop for every backend, on the clock the backend supplies
(gpu/clocks.py): wall-clock time with the Monitor in a thread of its own on a real GPU, virtual time in one thread
on the simulated one. run_simulated and open_simulated are the simulated GPU's shorthands (tools, tests)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from forge_load.config.settings import Config
from forge_load.control.filler import NO_CONTROLS, Controls
from forge_load.control.probe import ComputeMode, Probe
from forge_load.gpu.backend import Backend, SimBackend
from forge_load.gpu.clocks import VirtualLoopClock
from forge_load.gpu.sim import SimGpu, SimProbe, VirtualClock
from forge_load.service import health
from forge_load.service.exclusive import prohibited_error
from forge_load.service.runtime import (
    DRAIN_LIMIT_S,
    GpuTakenError,
    Runtime,
    log_start,
    log_stop,
    open_runtime,
    run_steps,
)


def run_loop(config: Config, backend: Backend, stream: TextIO, stop: threading.Event, wake: threading.Event,
             controls: Controls = NO_CONTROLS, exclusive: Callable[[Probe], None] | None = None,
             on_start: Callable[[Runtime], None] | None = None) -> Runtime | None:
    """Fill the GPU `config.gpu` names until `stop` or the duration; the runtime it ran (None: it was handed on).

    A GPU in an exclusive compute mode is handed to `exclusive` (docs/exclusive.md) with its probe, before any
    context exists; without it (the exclusive mode's own child) it is filled here as any other. `on_start` is told
    of the filler once it is built, before its start line (tools and tests look inside)."""
    # A pause signal is acted on at once, not at the next poll, and so is a hold the kubelet gave.
    listened = [source for source in (controls.switch, controls.board) if source is not None]
    for source in listened:
        source.listeners.add(wake.set)
    try:
        return _run(config, backend, stream, stop, wake, controls, exclusive, on_start)
    finally:
        for source in listened:
            source.listeners.remove(wake.set)


def handed_on(probe: Probe, exclusive: Callable[[Probe], None] | None) -> bool:
    """Whether the GPU is not ours to hold a context on at will, its probe then closed: in PROHIBITED compute mode
    (NoGpuError), or, given `exclusive`, in an exclusive one, which it is handed to (docs/exclusive.md)."""
    mode = probe.info.compute_mode
    if mode is not ComputeMode.PROHIBITED and (exclusive is None or not mode.exclusive):
        return False
    try:
        if mode is ComputeMode.PROHIBITED:
            raise prohibited_error(probe.info)
        assert exclusive is not None
        exclusive(probe)
    finally:
        with contextlib.suppress(Exception):
            probe.close()
    return True


def _run(config: Config, backend: Backend, stream: TextIO, stop: threading.Event, wake: threading.Event,
         controls: Controls, exclusive: Callable[[Probe], None] | None,
         on_start: Callable[[Runtime], None] | None) -> Runtime | None:
    probe = backend.open_probe(config.gpu)
    if handed_on(probe, exclusive):
        return None
    clock = backend.open_clock(probe)
    rt: Runtime | None = None
    claim_fd: int | None = None
    try:
        if backend.claims_gpus:
            # Before our context exists: a second filler of one GPU would only yield to the first, and it to us.
            claim_fd, holder = health.claim_gpu(probe.info.uuid)
            if holder is not None:
                raise GpuTakenError(
                    f"GPU {probe.info.index} ({probe.info.uuid}) is already filled by another forge-load of this "
                    f"user (pid {holder}): two fillers on one GPU only yield to each other; stop that one, or leave "
                    "this GPU out of FORGE_GPU/FORGE_GPUS")
        rt = open_runtime(config, backend, probe, clock, stream, controls)
        if on_start is not None:
            on_start(rt)
        log_start(rt, backend.start_fields(probe.info))
        clock.start_monitor(rt.monitor, stop, wake)
        end_s = rt.start_s + config.duration_s if config.duration_s > 0 else float("inf")
        try:
            reason = run_steps(clock, stop, wake, end_s, rt.filler.step)
        finally:
            stop.set()
            deadline_s = clock.now() + DRAIN_LIMIT_S
            while rt.worker.in_flight and clock.now() < deadline_s:
                clock.sleep(min(rt.worker.drain(clock.now()), deadline_s))
        clock.stop_monitor()
        log_stop(rt, clock.now(), reason or "")
        return rt
    finally:
        # The Monitor may be inside an NVML call: NVML is shut down only once it has stopped.
        stop.set()
        clock.stop_monitor()
        # After a GPU failure these may fail too; the first error is the one to report.
        with contextlib.suppress(Exception):
            if rt is not None:
                rt.launcher.close()
        if rt is not None and rt.filler.report is not None:
            rt.filler.report.close()  # a failed GPU's too: `forge-load status` shows no filler that has ended
        with contextlib.suppress(Exception):
            probe.close()
        if claim_fd is not None:
            health.release_lock(claim_fd, health.gpu_lock_path(probe.info.uuid))


# --- the simulated GPU's shorthands ----------------------------------------------------------------------------

@dataclass
class SimRun:
    runtime: Runtime
    gpu: SimGpu
    clock: VirtualClock
    backend: SimBackend  # the one that opened the GPU (its start fields)


def _sim_controls(controls: Controls, heartbeat: Callable[[], None] | None) -> Controls:
    return dataclasses.replace(controls, heartbeat=heartbeat or controls.heartbeat)


def open_simulated(config: Config, stream: TextIO, heartbeat: Callable[[], None] | None = None,
                   keep_history: bool = False, controls: Controls = NO_CONTROLS,
                   wall_start_s: float | None = None) -> SimRun:
    """The simulated GPU's filler wired but not run: for a caller that steps it itself."""
    backend = SimBackend(config.sim, keep_history, wall_start_s)
    probe = backend.open_probe(config.gpu)
    clock = backend.open_clock(probe)
    rt = open_runtime(config, backend, probe, clock, stream, _sim_controls(controls, heartbeat))
    return SimRun(rt, probe.gpu, clock.clock, backend)


def run_simulated(config: Config, stream: TextIO, stop: threading.Event | None = None,
                  heartbeat: Callable[[], None] | None = None,
                  on_start: Callable[[Runtime], None] | None = None, keep_history: bool = False,
                  controls: Controls = NO_CONTROLS, wall_start_s: float | None = None) -> SimRun:
    """Run the filler against the simulated GPU until `duration_s` (virtual) or `stop`: run_loop on a SimBackend.

    `speed` > 0 paces virtual time against the wall clock. `keep_history` keeps every kernel, for scoring the run
    afterwards (memory grows with the run). The active hours and the pause file's times are read on a wall clock
    that starts at `wall_start_s` (default: now) and moves with virtual time.
    """
    backend = SimBackend(config.sim, keep_history, wall_start_s)
    rt = run_loop(config, backend, stream, stop or threading.Event(), threading.Event(),
                  _sim_controls(controls, heartbeat), on_start=on_start)
    # a simulated GPU is never in an exclusive compute mode: it is always run here
    assert rt is not None and isinstance(rt.probe, SimProbe) and isinstance(rt.clock, VirtualLoopClock)
    return SimRun(rt, rt.probe.gpu, rt.clock.clock, backend)
