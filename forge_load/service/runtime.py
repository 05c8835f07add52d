"""One GPU's filler wired from the config (build, open_runtime), its start and stop lines, and what every layer of
the service shares: the stop request and its reason (the exit codes: forge_load/exits.py), the limit on open files."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from forge_load import __version__
from forge_load.clock import clock_minus_monotonic_s
from forge_load.config.settings import Config, describe
from forge_load.control.controller import make_controller
from forge_load.control.detectors import Thresholds
from forge_load.control.energy import EnergyMeter
from forge_load.control.filler import NO_CONTROLS, Controls, Filler, Timing, line_fields
from forge_load.control.lines import LineGate
from forge_load.control.monitor import Monitor
from forge_load.control.policy import Policy
from forge_load.control.powercap import PowerCap
from forge_load.control.probe import DeviceInfo, NoGpuError, Probe
from forge_load.control.quantity import NEEDS_GPM, quantity_for
from forge_load.control.reasons import Reasons
from forge_load.control.worker import BusyLog, Launcher, Worker
from forge_load.gpu.backend import Backend
from forge_load.gpu.clocks import LoopClock
from forge_load.log import EventLog, say
from forge_load.steering.filler_status import StatusWriter
from forge_load.steering.hold_watch import FillerHolds, jobs_announced
from forge_load.steering.pause import Pauses
from forge_load.steering.schedule import local_zone

DRAIN_LIMIT_S = 0.5


class GpuTakenError(Exception):
    """Another filler of this user on this host fills the GPU already: this one leaves it (exit 2)."""


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
    clock: LoopClock  # the clock the filler runs on (virtual when simulated), from the backend

    def now(self) -> float:
        return self.clock.now()


def build(config: Config, probe: Probe, launcher: Launcher, clock: LoopClock, stream: TextIO,
          baseline_mem_mib: float, own_mem_context_mib: float, start_s: float,
          controls: Controls = NO_CONTROLS) -> Runtime:
    """The active hours, the pause file's and the holds' times are read against the clock's Unix time."""
    now, wall_clock = clock.now, clock.wall_s
    busy_log = BusyLog()
    sm_ratio = launcher.shape.sm_ratio  # how much of the GPU our kernels cover: our own share of SM activity
    monitor = Monitor(probe, busy_log, own_pid=os.getpid(), baseline_mem_mib=baseline_mem_mib,
                      own_mem_context_mib=own_mem_context_mib, thresholds=Thresholds.from_config(config),
                      poll_interval_s=config.poll_interval_s, start_s=start_s, own_sm_ratio=sm_ratio)
    worker = Worker(launcher, busy_log)
    log = EventLog(config.log_format, stream, clock=now, start_s=start_s,
                   static={"gpu": probe.info.index, "uuid": probe.info.uuid}, wall_clock=wall_clock)
    power_cap = PowerCap(config.max_power_w, probe.power_limit_w()) if config.max_power_w is not None else None
    pauses = pauses_for(config, controls, wall_clock)
    holds = None  # hold_dir "" only in the exclusive mode's child (FORGE_HOLD_DIR refuses it): holds are its parent's
    if config.hold_dir:
        holds = FillerHolds(config.hold_dir, probe.info.uuid, os.getpid(), wall_clock, config.hold_idle_age_out_s,
                            controls.board, whole_gpu_uuid=probe.info.gpu_uuid)  # a MIG device: its GPU's too
    reasons = Reasons(config.resume_after_s, pauses, holds, power_cap)
    policy = Policy(config.target_ratio, config.boost_target_ratio, config.resume_after_s,
                    config.boost_after_s, now_s=start_s, reasons=reasons)
    timing = Timing(start_s, config.log_interval_s, stale_after_s=max(2.0, 10 * config.poll_interval_s))
    # The status file beside the holds (`forge-load status`); the exclusive mode's child has none: its parent writes it.
    report = (StatusWriter(config.hold_dir, probe.info.uuid, probe.info.index, os.getpid(), config.simulate,
                           runtime_dir=config.runtime_dir) if config.hold_dir else None)
    quantity = quantity_for(config.metric, sm_ratio)
    filler = Filler(monitor, worker, make_controller(config.controller, quantity), policy, LineGate(log, start_s),
                    timing, controls, quantity=quantity, report=report)
    return Runtime(config, probe.info, probe, launcher, monitor, worker, filler, log, start_s, clock)


def pauses_for(config: Config, controls: Controls, wall_clock: Callable[[], float] = time.time) -> Pauses | None:
    """Every reason to pause that is configured; None when none is."""
    if controls.switch is None and config.pause_file is None and config.active_hours is None:
        return None
    return Pauses(controls.switch, config.pause_file, config.active_hours, wall_clock, tz=local_zone(config.time_zone),
                  on_host_error=lambda why: say(f"forge-load: warning: {why}"))


def metric_refusal(metric: str, info: DeviceInfo) -> str:
    """Why a GPM metric cannot be held on this GPU: one line (exit 3)."""
    return (f"FORGE_METRIC={metric} needs NVML's GPM, which GPU {info.index} ({info.uuid}, {info.name}) does not "
            "offer (GPM needs compute capability 9.0, Hopper, or newer, and a driver with it; before that only "
            "DCGM's profiling module measures SM activity): use FORGE_METRIC=utilization on this GPU")


# The start line's fields a person reads first (gpu and uuid come with every line), in this order; in key=value the
# rest goes on a `settings` line after it (docs/operating.md, Reading the log). `signals` stays here: checks read it.
START_ESSENTIALS = ("state", "target", "gpu_mem_mib", "gpu_name", "controller", "metric", "shape", "resume_after_s",
                    "signals", "wall_time", "version", "simulated")


def log_start(rt: Runtime, extra: dict[str, object]) -> None:
    """The first poll happens before any launch, so a foreign job already there is seen first."""
    # the unix time of t=0, for lining logs up (t=0 is a parent's start where the log is offset to its timeline)
    wall_start_s = clock_minus_monotonic_s(rt.clock.wall_s, rt.now) + rt.start_s - rt.log.t_offset_s
    rt.monitor.step(rt.start_s)
    reading = rt.monitor.latest()
    if rt.config.metric in NEEDS_GPM and not rt.info.gpm:
        raise NoGpuError(metric_refusal(rt.config.metric, rt.info))
    if rt.config.max_power_w is not None and (reading is None or reading.power_w is None):
        raise NoGpuError(f"GPU {rt.info.index} ({rt.info.uuid}) reports no board power through NVML, so "
                         f"FORGE_MAX_POWER_W={rt.config.max_power_w:g} cannot be held: unset it for this GPU")
    seeing, blind = rt.monitor.sight()
    said = "; ".join(f"{name}: {why}" for name, why in blind.items())
    announced = rt.filler.holds is not None and jobs_announced(rt.config.hold_dir, rt.filler.holds.watch.board)
    if blind and not seeing and not announced:
        # Nothing could ever make this filler step aside: it would fill beside every job. Before any launch.
        raise NoGpuError(f"GPU {rt.info.index} ({rt.info.uuid}): no foreign job can be seen on it ({said}), and no "
                         f"hold directory (FORGE_HOLD_DIR={rt.config.hold_dir} does not exist) or kubelet "
                         "(FORGE_KUBELET_SOCKET) announces jobs: it is not filled; make the hold directory and "
                         "announce every job through holds (docs/holds.md) to fill it")
    fields: dict[str, object] = dict(describe(rt.config))
    fields["gpu_requested"] = fields.pop("gpu")  # `gpu` is the index every line carries
    fields.update(state=rt.filler.state.value, gpu_mem_mib=reading.own_mem_mib if reading else None,
                  gpu_mem_context_mib=round(rt.monitor.own_mem_context_mib, 1),
                  gpu_mem_process_mib=reading.own_mem_process_mib if reading else None,
                  wall_time=round(wall_start_s, 6), version=__version__, gpu_name=rt.info.name,
                  driver=rt.info.driver_version, sm_count=rt.launcher.sm_count,
                  nvml_clock=rt.probe.sample_clock, energy_source=EnergyMeter.source_of(reading),
                  compute_mode=rt.info.compute_mode.value, shape_layout=rt.launcher.shape.describe(),
                  **rt.launcher.describe(), **extra)
    if rt.filler.power_cap is not None:
        fields["power_limit_w"] = rt.filler.power_cap.board_limit_w
    fields["signals"] = ",".join(seeing)  # the foreign-job signals that work on this GPU
    first = {name: fields[name] for name in START_ESSENTIALS if name in fields}
    others = {name: value for name, value in fields.items() if name not in first}
    if rt.log.fmt == "json":
        rt.log.emit("start", t=0.0, **first, **others)  # machines read it: one line, every field
    else:
        # People read it: what runs where, and how, on one short line; every other setting on the next.
        rt.log.emit("start", t=0.0, **first)
        rt.log.emit("settings", t=0.0, **others)
    if blind:
        rest = (f"foreign jobs are seen only by {','.join(seeing)}" if seeing
                else "no foreign job can be seen on this GPU: the filler steps aside only for jobs announced by holds")
        rt.log.emit("warning", t=0.0, blind=",".join(blind), reason=f"blind foreign-job signals ({said}); {rest}")


def log_stop(rt: Runtime, now_s: float, reason: str) -> None:
    rt.filler.lines.flush(now_s)  # a line held back by a signal storm comes before the stop line
    status = rt.filler.status(now_s)
    rt.log.emit("stop", t=now_s - rt.start_s, **line_fields(status), reason=reason, yields=status.yields,
                yielding_s=round(status.yielding_s, 3), own_busy_s=round(status.own_busy_s, 3),
                energy_j=round(status.energy_j, 1), energy_source=rt.filler.energy.source)
    if rt.filler.holds is not None:
        rt.filler.holds.close()
    if rt.filler.report is not None:
        rt.filler.report.close()


def open_runtime(config: Config, backend: Backend, probe: Probe, clock: LoopClock, stream: TextIO,
                 controls: Controls = NO_CONTROLS) -> Runtime:
    """Our context on the probe's GPU, and its filler wired; the memory it took is measured on the way."""
    baseline_mib = probe.memory_used_mib() or 0.0  # before our context exists
    launcher = backend.open_launcher(probe, config.shape, config.metric)
    own_mib = max((probe.memory_used_mib() or baseline_mib) - baseline_mib, 0.0)
    return build(config, probe, launcher, clock, stream, baseline_mib, own_mib, start_s=clock.now(),
                 controls=controls)


class StopEvent(threading.Event):
    """A stop, and why: the first reason given is the one logged (a second signal changes nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.reason = "signal"
        self._lock = threading.Lock()

    def request(self, reason: str) -> None:
        with self._lock:
            if not self.is_set():
                self.reason = reason
                self.set()


def stop_reason(stop: threading.Event) -> str:
    """Why `stop` was set: its reason where it is a StopEvent (a plain Event, as tests pass, says "signal")."""
    return stop.reason if isinstance(stop, StopEvent) else "signal"


def run_steps(clock: LoopClock, stop: threading.Event, wake: threading.Event, end_s: float,
              step: Callable[[float], float], done: Callable[[], bool] | None = None) -> str | None:
    """The loop of every GPU's thread, a filler's (service/loop.py) and an exclusive-mode supervisor's
    (service/exclusive.py): step(now), which says when to step again, waited for on `clock` (or less: a reading or
    a signal wakes it), until `stop`, the end of the duration (`end_s`) or `done()`. Why it ended: the stop's reason,
    "duration reached", or None for done()."""
    while True:
        if stop.is_set():
            return stop_reason(stop)
        if clock.now() >= end_s:
            return "duration reached"
        if done is not None and done():
            return None
        clock.wait(min(step(clock.now()), end_s), stop, wake)


def request_stop(stop: StopEvent, wake: threading.Event, reason: str) -> None:
    """Stop every filler, and wake the thread that waits for them."""
    stop.request(reason)
    wake.set()


def open_files_limit() -> int | None:
    """The process's soft limit on open descriptors (RLIMIT_NOFILE); None where there is none."""
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)
