"""The run loops: one GPU's filler stepped on the simulated GPU in virtual time (run_simulated), or on a real GPU
in wall-clock time with the Monitor in a thread of its own (run_real)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from forge_load.config.settings import Config
from forge_load.control.probe import ComputeMode, Probe
from forge_load.gpu.backend import Backend, NvidiaBackend, SimBackend
from forge_load.gpu.sim import SimGpu, VirtualClock
from forge_load.service import health
from forge_load.service.exclusive import prohibited_error
from forge_load.service.runtime import (
    DRAIN_LIMIT_S,
    MONITOR_JOIN_S,
    NO_CONTROLS,
    Controls,
    GpuTakenError,
    Runtime,
    log_start,
    log_stop,
    open_runtime,
    stop_reason,
)

# --- the simulated GPU, in virtual time ------------------------------------------------------------------

@dataclass
class SimRun:
    runtime: Runtime
    gpu: SimGpu
    clock: VirtualClock
    backend: SimBackend  # the one that opened the GPU (its start fields)


def open_simulated(config: Config, stream: TextIO, heartbeat: Callable[[], None] | None = None,
                   keep_history: bool = False, controls: Controls = NO_CONTROLS,
                   wall_start_s: float | None = None) -> SimRun:
    backend = SimBackend(config.sim, keep_history)
    probe = backend.open_probe(config.gpu)
    clock = probe.gpu.clock
    if not isinstance(clock, VirtualClock):
        raise TypeError("the simulated run loop steps a virtual clock")
    wall0_s = time.time() if wall_start_s is None else wall_start_s
    rt = open_runtime(config, backend, probe, clock.now, stream, heartbeat=heartbeat, controls=controls,
                      wall_clock=lambda: wall0_s + clock.now())
    return SimRun(rt, probe.gpu, clock, backend)


def run_simulated(config: Config, stream: TextIO, stop: threading.Event | None = None,
                  heartbeat: Callable[[], None] | None = None,
                  on_start: Callable[[Runtime], None] | None = None, keep_history: bool = False,
                  controls: Controls = NO_CONTROLS, wall_start_s: float | None = None) -> SimRun:
    """Run the filler against the simulated GPU until `duration_s` (virtual) or `stop`.

    Monitor and filler are stepped in one thread in virtual time, in the order a real run would see
    them; `speed` > 0 paces virtual time against the wall clock. `keep_history` keeps every kernel, for
    scoring the run afterwards (memory grows with the run). The active hours and the pause file's times are
    read on a wall clock that starts at `wall_start_s` (default: now) and moves with virtual time.
    """
    run = open_simulated(config, stream, heartbeat, keep_history, controls, wall_start_s)
    rt, clock = run.runtime, run.clock
    if on_start is not None:
        on_start(rt)
    stop = stop or threading.Event()
    log_start(rt, run.backend.start_fields(rt.info))
    speed = config.sim.speed
    end_s = config.duration_s if config.duration_s > 0 else float("inf")
    monitor_due_s = rt.monitor.step(0.0)
    filler_due_s = 0.0
    wall_origin_s = time.monotonic()
    reason = "duration reached"
    while True:
        due_s = min(monitor_due_s, filler_due_s, end_s)
        if speed > 0:
            delay_s = wall_origin_s + due_s / speed - time.monotonic()
            if delay_s > 0:
                stop.wait(delay_s)
        if stop.is_set():  # every step, also when behind schedule and never waiting
            reason = "signal"
            break
        clock.advance_to(due_s)
        if due_s >= end_s:
            break
        if monitor_due_s <= due_s:
            monitor_due_s = rt.monitor.step(due_s)
            if rt.monitor.woke:
                filler_due_s = due_s  # react to the new reading at once
        if filler_due_s <= due_s:
            filler_due_s = rt.filler.step(due_s)
    now_s = clock.now()
    while rt.worker.in_flight:
        clock.advance_to(rt.worker.drain(clock.now()))
    log_stop(rt, now_s, reason if reason != "signal" else stop_reason(stop))
    rt.launcher.close()
    return run


# --- a real GPU -------------------------------------------------------------------------------------------

def run_real(config: Config, stream: TextIO, stop: threading.Event, wake: threading.Event,
             heartbeat: Callable[[], None] | None = None, backend: Backend | None = None,
             on_start: Callable[[Runtime], None] | None = None, controls: Controls = NO_CONTROLS,
             exclusive: Callable[[Probe], None] | None = None) -> None:
    """Run on a GPU in wall-clock time: the Monitor polls in its own thread, this thread drives the Worker.

    A GPU in an exclusive compute mode is handed to `exclusive` (docs/exclusive.md) with its probe, before any
    context exists; without it (the exclusive mode's own child) it is filled here as any other."""
    backend = backend or NvidiaBackend()
    if controls.switch is not None:
        controls.switch.add_listener(wake.set)  # a pause signal is acted on at once, not at the next poll
    if controls.board is not None:
        controls.board.add_listener(wake.set)  # and so is a hold the kubelet gave
    probe = backend.open_probe(config.gpu)
    mode = probe.info.compute_mode
    if mode is ComputeMode.PROHIBITED or (exclusive is not None and mode.exclusive):
        try:
            if mode is ComputeMode.PROHIBITED:
                raise prohibited_error(probe.info)
            assert exclusive is not None
            exclusive(probe)
        finally:
            with contextlib.suppress(Exception):
                probe.close()
        return
    rt: Runtime | None = None
    monitor_thread: threading.Thread | None = None
    claim_fd: int | None = None
    try:
        # Before our context exists: a second filler of one GPU would only yield to the first, and it to us.
        claim_fd, holder = health.claim_gpu(probe.info.uuid)
        if holder is not None:
            raise GpuTakenError(
                f"GPU {probe.info.index} ({probe.info.uuid}) is already filled by another forge-load of this user "
                f"(pid {holder}): two fillers on one GPU only yield to each other; stop that one, or leave this GPU "
                "out of FORGE_GPU/FORGE_GPUS")
        rt = open_runtime(config, backend, probe, time.monotonic, stream, on_reading=wake.set, heartbeat=heartbeat,
                          controls=controls)
        if on_start is not None:
            on_start(rt)
        log_start(rt, backend.start_fields(probe.info))
        monitor_thread = threading.Thread(target=rt.monitor.run, args=(time.monotonic, stop), name="monitor",
                                          daemon=True)
        monitor_thread.start()
        end_s = rt.start_s + config.duration_s if config.duration_s > 0 else float("inf")
        reason = "duration reached"
        try:
            while True:
                now_s = time.monotonic()
                if stop.is_set():
                    reason = stop_reason(stop)
                    break
                if now_s >= end_s:
                    break
                due_s = min(rt.filler.step(now_s), end_s)
                wake.wait(max(due_s - time.monotonic(), 0.0))
                wake.clear()
        finally:
            stop.set()
            deadline_s = time.monotonic() + DRAIN_LIMIT_S
            while rt.worker.in_flight and time.monotonic() < deadline_s:
                due_s = rt.worker.drain(time.monotonic())
                time.sleep(max(min(due_s, deadline_s) - time.monotonic(), 0.0))
        monitor_thread.join(timeout=MONITOR_JOIN_S)
        log_stop(rt, time.monotonic(), reason)
    finally:
        # The Monitor may be inside an NVML call: NVML is shut down only once it has stopped.
        stop.set()
        if controls.board is not None:
            controls.board.remove_listener(wake.set)
        if monitor_thread is not None:
            monitor_thread.join(timeout=MONITOR_JOIN_S)
        # After a GPU failure these may fail too; the first error is the one to report.
        with contextlib.suppress(Exception):
            if rt is not None:
                rt.launcher.close()
        with contextlib.suppress(Exception):
            probe.close()
        if claim_fd is not None:
            os.close(claim_fd)


