"""main(): configuration, wiring, the run loop, signals, logging to stdout, exit codes.

Exit codes: 0 stopped normally; 1 internal error (a bug: the line says so); 2 bad configuration;
3 no usable GPU or NVML (with a hint); 4 the GPU failed while running.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, TextIO

from forge_load import __version__, health
from forge_load.config import Config, ConfigError, describe, load_config
from forge_load.controller import make_controller
from forge_load.filler import Filler
from forge_load.log import EventLog
from forge_load.monitor import Monitor
from forge_load.policy import Policy
from forge_load.probe import DeviceInfo, GpuFailedError, NoGpuError, Probe
from forge_load.sim import SimGpu, SimLauncher, SimProbe, VirtualClock
from forge_load.worker import BusyLog, Launcher, Worker

EXIT_OK, EXIT_INTERNAL, EXIT_CONFIG, EXIT_NO_GPU, EXIT_GPU_FAILED = 0, 1, 2, 3, 4
DRAIN_LIMIT_S = 0.5


@dataclass
class Runtime:
    """One GPU's filler, wired: what a run loop steps, and what tests and the benchmark inspect."""

    config: Config
    info: DeviceInfo
    probe: Probe
    launcher: Launcher
    monitor: Monitor
    worker: Worker
    filler: Filler
    log: EventLog
    start_s: float


def build(config: Config, probe: Probe, launcher: Launcher, now: Callable[[], float], stream: TextIO,
          baseline_mem_mib: float, own_mem_fallback_mib: float, start_s: float,
          on_reading: Callable[[], None] | None = None,
          heartbeat: Callable[[], None] | None = None) -> Runtime:
    busy_log = BusyLog()
    monitor = Monitor(probe, busy_log, own_pid=os.getpid(), baseline_mem_mib=baseline_mem_mib,
                      own_mem_fallback_mib=own_mem_fallback_mib, poll_interval_s=config.poll_interval_s,
                      foreign_mem_mib=config.foreign_mem_mib, foreign_util_ratio=config.foreign_util_ratio,
                      foreign_util_samples=config.foreign_util_samples,
                      use_process_list=config.use_process_list, on_reading=on_reading)
    worker = Worker(launcher, busy_log)
    policy = Policy(config.target_ratio, config.boost_target_ratio, config.resume_after_s,
                    config.boost_after_s, now_s=start_s)
    log = EventLog(config.log_format, stream, clock=now, start_s=start_s,
                   static={"gpu": probe.info.index, "uuid": probe.info.uuid})
    filler = Filler(monitor, worker, make_controller(config.controller), policy, log, start_s=start_s,
                    log_interval_s=config.log_interval_s, stale_after_s=max(2.0, 10 * config.poll_interval_s),
                    heartbeat=heartbeat)
    return Runtime(config, probe.info, probe, launcher, monitor, worker, filler, log, start_s)


def log_start(rt: Runtime, extra: dict[str, object]) -> None:
    """The first poll happens before any launch, so a foreign job already there is seen first."""
    rt.monitor.step(rt.start_s)
    reading = rt.monitor.latest()
    fields: dict[str, object] = dict(describe(rt.config))
    fields["gpu_requested"] = fields.pop("gpu")  # `gpu` is the index every line carries
    fields.update(state=rt.filler.state.value, gpu_mem_mib=reading.own_mem_mib if reading else None,
                  wall_time=round(time.time(), 3), version=__version__, gpu_name=rt.info.name, driver=rt.info.driver_version,
                  sm_count=rt.launcher.sm_count, **extra)
    rt.log.emit("start", t=0.0, **fields)


def log_stop(rt: Runtime, now_s: float, reason: str) -> None:
    fields = rt.filler._fields()
    fields.update(reason=reason, yields=rt.filler.yields,
                  yielding_s=round(rt.filler.seconds_yielding(now_s), 3),
                  own_busy_s=round(rt.worker.busy_log.total_busy_s, 3))
    rt.log.emit("stop", t=now_s - rt.start_s, **fields)


# --- the simulated GPU, in virtual time ------------------------------------------------------------------

@dataclass
class SimRun:
    runtime: Runtime
    gpu: SimGpu
    clock: VirtualClock


def open_simulated(config: Config, stream: TextIO, heartbeat: Callable[[], None] | None = None) -> SimRun:
    clock = VirtualClock()
    gpu = SimGpu(config.sim, clock)
    probe = SimProbe(gpu)
    baseline_mib = probe.memory_used_mib() or 0.0
    launcher = SimLauncher(gpu)
    own_mib = (probe.memory_used_mib() or 0.0) - baseline_mib
    rt = build(config, probe, launcher, clock.now, stream, baseline_mib, own_mib, start_s=0.0,
               heartbeat=heartbeat)
    return SimRun(rt, gpu, clock)


def run_simulated(config: Config, stream: TextIO, stop: threading.Event | None = None,
                  heartbeat: Callable[[], None] | None = None) -> SimRun:
    """Run the filler against the simulated GPU until `duration_s` (virtual) or `stop`.

    Monitor and filler are stepped in one thread in virtual time, in the order a real run would see
    them; `speed` > 0 paces virtual time against the wall clock.
    """
    run = open_simulated(config, stream, heartbeat)
    rt, clock = run.runtime, run.clock
    stop = stop or threading.Event()
    log_start(rt, {"simulated": True})
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
            if delay_s > 0 and stop.wait(delay_s):
                reason = "signal"
                break
        elif stop.is_set():
            reason = "signal"
            break
        clock.advance_to(due_s)
        if due_s >= end_s:
            break
        if monitor_due_s <= due_s:
            monitor_due_s = rt.monitor.step(due_s)
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

def open_nvml(config: Config) -> Probe:
    from forge_load.nvml import NvmlProbe

    return NvmlProbe(config.gpu)


def open_cuda(info: DeviceInfo) -> Launcher:
    from forge_load.worker import CudaLauncher

    return CudaLauncher(info.index)


def run_real(config: Config, stream: TextIO, stop: threading.Event, wake: threading.Event,
             heartbeat: Callable[[], None] | None = None,
             open_probe: Callable[[Config], Probe] = open_nvml,
             open_launcher: Callable[[DeviceInfo], Launcher] = open_cuda) -> None:
    """Run on a GPU in wall-clock time: the Monitor polls in its own thread, this thread drives the Worker."""
    from forge_load.nvml import mig_note

    probe = open_probe(config)
    launcher: Launcher | None = None
    try:
        baseline_mib = probe.memory_used_mib() or 0.0
        launcher = open_launcher(probe.info)
        own_mib = max((probe.memory_used_mib() or baseline_mib) - baseline_mib, 0.0)
        start_s = time.monotonic()
        rt = build(config, probe, launcher, time.monotonic, stream, baseline_mib, own_mib, start_s,
                   on_reading=wake.set, heartbeat=heartbeat)
        note = mig_note(probe.info)
        log_start(rt, {"note": note} if note else {})
        thread = threading.Thread(target=rt.monitor.run, args=(time.monotonic, stop), name="monitor",
                                  daemon=True)
        thread.start()
        end_s = start_s + config.duration_s if config.duration_s > 0 else float("inf")
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
        thread.join(timeout=1.0)
        log_stop(rt, time.monotonic(), reason)
    finally:
        if launcher is not None:
            launcher.close()
        probe.close()


# --- the process --------------------------------------------------------------------------------------------

_SIGNAL_NAMES: dict[int, str] = {}


def stop_reason(stop: threading.Event) -> str:
    return getattr(stop, "reason", "signal")


def install_signals(stop: threading.Event, wake: threading.Event) -> None:
    def handle(signum: int, _frame: object) -> None:
        stop.reason = f"signal {signal.Signals(signum).name}"  # type: ignore[attr-defined]
        stop.set()
        wake.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handle)


def main(argv: list[str] | None = None, stream: TextIO | None = None) -> int:
    out = stream or sys.stdout
    try:
        config = load_config(argv)
    except ConfigError as error:
        print(f"forge-load: {error}", file=sys.stderr)
        return EXIT_CONFIG
    stop, wake = threading.Event(), threading.Event()
    install_signals(stop, wake)
    beat = health.Heartbeat(health.heartbeat_path())
    error_log = EventLog(config.log_format, out, clock=time.monotonic, start_s=time.monotonic())
    try:
        if config.simulate:
            run_simulated(config, out, stop, heartbeat=beat)
        else:
            run_real(config, out, stop, wake, heartbeat=beat)
    except NoGpuError as error:
        print(f"forge-load: no usable GPU: {error}", file=sys.stderr)
        return EXIT_NO_GPU
    except GpuFailedError as error:
        error_log.emit("error", reason=str(error), exit_code=EXIT_GPU_FAILED)
        return EXIT_GPU_FAILED
    except Exception as error:  # a bug: say so in one line, keep the traceback out of docker logs
        error_log.emit("error", reason=f"internal error, please report: {type(error).__name__}: {error}",
                       exit_code=EXIT_INTERNAL)
        return EXIT_INTERNAL
    finally:
        beat.clear()
    return EXIT_OK
