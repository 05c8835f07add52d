"""main(): configuration, wiring, the run loop, signals, logging to stdout, exit codes.

Exit codes: 0 stopped normally (a signal, or FORGE_DURATION); 1 internal error (a bug: the line says so);
2 bad configuration (a setting, or the host's limit on open files below MIN_OPEN_FILES: `ulimit -n`); 3 no
usable GPU or NVML (with a hint); 4 the GPU failed while running; 5 the log could not be written (stdout closed
or full): the fillers stopped as for a signal, and stderr says so in one line.

With FORGE_GPUS (several GPUs), each GPU runs its own filler in its own thread and a failing GPU stops only
its own: the others keep filling and /health reports it. The process exits when every filler has ended:
3 if no GPU could be opened at all, 4 if any GPU failed (1 if that was a bug), 2 if the only ones that did not run
are GPUs another filler of this user on this host fills already (one filler per GPU: service/health.py), else 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO, cast

from forge_load import __version__
from forge_load.config import Config, ConfigError, describe, load_config, unknown_variables
from forge_load.control.controller import make_controller
from forge_load.control.detectors import Thresholds
from forge_load.control.filler import Filler, line_fields
from forge_load.control.monitor import Monitor
from forge_load.control.policy import Policy
from forge_load.control.powercap import PowerCap
from forge_load.control.probe import DeviceInfo, GpuFailedError, NoGpuError, Probe
from forge_load.control.status import Fleet, GpuSlot
from forge_load.control.worker import BusyLog, Launcher, Worker
from forge_load.gpu.backend import Backend, NvidiaBackend, SimBackend, backend_for
from forge_load.gpu.sim import SimGpu, VirtualClock
from forge_load.log import EventLog, LogStream, escape_controls
from forge_load.operators.holds import FillerHolds, HoldBoard
from forge_load.operators.pause import Pauses, PauseSwitch
from forge_load.operators.schedule import local_zone
from forge_load.service import health, metrics
from forge_load.service.title import ProcessTitle
from forge_load.service.title import describe as describe_title
from forge_load.service.unix_signals import StopSignals

EXIT_OK, EXIT_INTERNAL, EXIT_CONFIG, EXIT_NO_GPU, EXIT_GPU_FAILED, EXIT_LOG_LOST = 0, 1, 2, 3, 4, 5
DRAIN_LIMIT_S = 0.5
MONITOR_JOIN_S = 1.0  # one poll's NVML calls take milliseconds; a hung driver call is not waited out
# The open files the filler needs at least: a GPU's CUDA start took 16 on the virtual GPU (numba's sources, the
# libraries); the rest is room for the driver's device files, the pause file, the heartbeat and the metrics server.
MIN_OPEN_FILES = 64


class GpuTakenError(Exception):
    """Another filler of this user on this host fills the GPU already: this one leaves it (exit 2)."""


@dataclass(frozen=True)
class Controls:
    """What steers every GPU's filler from outside at run time: the signals' pause switch (SIGUSR1, SIGUSR2), who is
    told when a filler changes state (the process title), and the holds kept in this process (the kubelet's)."""

    switch: PauseSwitch | None = None
    on_transition: Callable[[], None] | None = None
    board: HoldBoard | None = None


NO_CONTROLS = Controls()


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
    now: Callable[[], float] = time.monotonic  # the clock the filler runs on (virtual when simulated)


def build(config: Config, probe: Probe, launcher: Launcher, now: Callable[[], float], stream: TextIO,
          baseline_mem_mib: float, own_mem_context_mib: float, start_s: float,
          on_reading: Callable[[], None] | None = None,
          heartbeat: Callable[[], None] | None = None, controls: Controls = NO_CONTROLS,
          wall_clock: Callable[[], float] = time.time) -> Runtime:
    """`wall_clock` is the Unix time the active hours, the pause file's and the holds' times are read against."""
    busy_log = BusyLog()
    monitor = Monitor(probe, busy_log, own_pid=os.getpid(), baseline_mem_mib=baseline_mem_mib,
                      own_mem_context_mib=own_mem_context_mib, thresholds=Thresholds.from_config(config),
                      poll_interval_s=config.poll_interval_s, start_s=start_s, on_reading=on_reading)
    worker = Worker(launcher, busy_log)
    policy = Policy(config.target_ratio, config.boost_target_ratio, config.resume_after_s,
                    config.boost_after_s, now_s=start_s)
    log = EventLog(config.log_format, stream, clock=now, start_s=start_s,
                   static={"gpu": probe.info.index, "uuid": probe.info.uuid})
    power_cap = PowerCap(config.max_power_w, probe.power_limit_w()) if config.max_power_w is not None else None
    pauses = None
    if controls.switch is not None or config.pause_file is not None or config.active_hours is not None:
        pauses = Pauses(controls.switch, config.pause_file, config.active_hours, wall_clock,
                        tz=local_zone(config.time_zone), on_host_error=lambda why: say(f"forge-load: warning: {why}"))
    holds = FillerHolds(config.hold_dir, probe.info.uuid, os.getpid(), wall_clock, config.hold_idle_age_out_s,
                        controls.board)
    filler = Filler(monitor, worker, make_controller(config.controller), policy, log, start_s=start_s,
                    log_interval_s=config.log_interval_s, stale_after_s=max(2.0, 10 * config.poll_interval_s),
                    heartbeat=heartbeat, power_cap=power_cap, pauses=pauses, on_transition=controls.on_transition,
                    holds=holds)
    return Runtime(config, probe.info, probe, launcher, monitor, worker, filler, log, start_s, now)


def log_start(rt: Runtime, extra: dict[str, object]) -> None:
    """The first poll happens before any launch, so a foreign job already there is seen first."""
    wall_start_s = time.time() - (rt.now() - rt.start_s)  # the unix time of t=0, for lining logs up
    rt.monitor.step(rt.start_s)
    reading = rt.monitor.latest()
    if rt.config.max_power_w is not None and (reading is None or reading.power_w is None):
        raise NoGpuError(f"GPU {rt.info.index} ({rt.info.uuid}) reports no board power through NVML, so "
                         f"FORGE_MAX_POWER_W={rt.config.max_power_w:g} cannot be held: unset it for this GPU")
    seeing, blind = rt.monitor.sight()
    fields: dict[str, object] = dict(describe(rt.config))
    fields["gpu_requested"] = fields.pop("gpu")  # `gpu` is the index every line carries
    fields.update(state=rt.filler.state.value, gpu_mem_mib=reading.own_mem_mib if reading else None,
                  gpu_mem_context_mib=round(rt.monitor.own_mem_context_mib, 1),
                  gpu_mem_process_mib=reading.own_mem_process_mib if reading else None,
                  wall_time=round(wall_start_s, 6), version=__version__, gpu_name=rt.info.name,
                  driver=rt.info.driver_version, sm_count=rt.launcher.sm_count,
                  nvml_clock=rt.probe.sample_clock, energy_source=rt.filler.energy_source_of(reading),
                  **rt.launcher.describe(), **extra)
    if rt.filler.power_cap is not None:
        fields["power_limit_w"] = rt.filler.power_cap.board_limit_w
    fields["signals"] = ",".join(seeing)  # the foreign-job signals that work on this GPU
    rt.log.emit("start", t=0.0, **fields)
    if blind:
        rest = (f"foreign jobs are seen only by {','.join(seeing)}" if seeing
                else "no foreign job can be seen on this GPU: the filler will not step aside for one")
        said = "; ".join(f"{name}: {why}" for name, why in blind.items())
        rt.log.emit("warning", t=0.0, blind=",".join(blind), reason=f"blind foreign-job signals ({said}); {rest}")


def log_stop(rt: Runtime, now_s: float, reason: str) -> None:
    rt.filler.flush_lines(now_s)  # a line held back by a signal storm comes before the stop line
    status = rt.filler.status(now_s)
    rt.log.emit("stop", t=now_s - rt.start_s, **line_fields(status), reason=reason, yields=status.yields,
                yielding_s=round(status.yielding_s, 3), own_busy_s=round(status.own_busy_s, 3),
                energy_j=round(status.energy_j, 1), energy_source=rt.filler.energy_source)
    if rt.filler.holds is not None:
        rt.filler.holds.close()


def open_runtime(config: Config, backend: Backend, probe: Probe, now: Callable[[], float], stream: TextIO,
                 on_reading: Callable[[], None] | None = None,
                 heartbeat: Callable[[], None] | None = None, controls: Controls = NO_CONTROLS,
                 wall_clock: Callable[[], float] = time.time) -> Runtime:
    """Our context on the probe's GPU, and its filler wired; the memory it took is measured on the way."""
    baseline_mib = probe.memory_used_mib() or 0.0  # before our context exists
    launcher = backend.open_launcher(probe)
    own_mib = max((probe.memory_used_mib() or baseline_mib) - baseline_mib, 0.0)
    return build(config, probe, launcher, now, stream, baseline_mib, own_mib, start_s=now(),
                 on_reading=on_reading, heartbeat=heartbeat, controls=controls, wall_clock=wall_clock)


# --- the simulated GPU, in virtual time ------------------------------------------------------------------

@dataclass
class SimRun:
    runtime: Runtime
    gpu: SimGpu
    clock: VirtualClock


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
    return SimRun(rt, probe.gpu, clock)


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
    log_start(rt, SimBackend(config.sim).start_fields(rt.info))
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
             on_start: Callable[[Runtime], None] | None = None, controls: Controls = NO_CONTROLS) -> None:
    """Run on a GPU in wall-clock time: the Monitor polls in its own thread, this thread drives the Worker."""
    backend = backend or NvidiaBackend()
    if controls.switch is not None:
        controls.switch.add_listener(wake.set)  # a pause signal is acted on at once, not at the next poll
    if controls.board is not None:
        controls.board.add_listener(wake.set)  # and so is a hold the kubelet gave
    probe = backend.open_probe(config.gpu)
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


# --- several GPUs in one process -------------------------------------------------------------------------------

class LockedStream:
    """One line per write from several GPU threads, never two interleaved."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            return self._stream.write(text)

    def flush(self) -> None:
        with self._lock:
            self._stream.flush()


def gpu_selectors(config: Config, backend: Backend) -> list[str]:
    """The GPUs FORGE_GPUS names: `all` is every GPU the backend shows, in index order.

    A GPU named both by index and by UUID is filled once (by its first name): the names are resolved to
    UUIDs before any filler starts, rather than two fillers taking each other for a foreign job.
    """
    if config.gpus is None:
        return [config.gpu]
    if config.gpus != "all":
        named = list(config.gpus)
        if all(n.isdigit() for n in named) or not any(n.isdigit() for n in named):
            return named  # config refuses a name given twice; only an index and a UUID can meet
        uuid_of = {str(info.index): info.uuid for info in backend.devices()}
        selectors: list[str] = []
        for name in named:
            if uuid_of.get(name, name) not in {uuid_of.get(s, s) for s in selectors}:
                selectors.append(name)
        return selectors
    selectors = [str(info.index) for info in backend.devices()]
    if not selectors:
        raise NoGpuError("FORGE_GPUS=all but NVML shows no GPU: in Kubernetes, set NVIDIA_VISIBLE_DEVICES=all "
                         "with runtimeClassName: nvidia; in Docker, --gpus all")
    return selectors


OnStart = Callable[[GpuSlot, Runtime], None]  # a GPU's filler is built (tools and tests look inside)


def run_gpu(config: Config, backend: Backend, slot: GpuSlot, stream: TextIO, stop: threading.Event,
            wake: threading.Event, heartbeat: Callable[[], None], on_start: OnStart | None = None,
            controls: Controls = NO_CONTROLS) -> None:
    """One GPU's filler, in its own thread: its failure is logged and kept in its slot, never raised."""
    started: list[Runtime] = []

    def beat() -> None:
        slot.beat()
        heartbeat()

    def attach(rt: Runtime) -> None:
        started.append(rt)
        slot.attach(rt.info, lambda: rt.filler.status(rt.now()))
        if controls.on_transition is not None:
            controls.on_transition()
        if on_start is not None:
            on_start(slot, rt)

    try:
        if backend.virtual_time:
            run_simulated(config, stream, stop, heartbeat=beat, on_start=attach, controls=controls)
        else:
            run_real(config, stream, stop, wake, heartbeat=beat, backend=backend, on_start=attach, controls=controls)
        slot.stopped()
        return
    except NoGpuError as error:
        reason, code = f"no usable GPU: {error}", EXIT_NO_GPU
    except GpuTakenError as error:
        reason, code = str(error), EXIT_CONFIG
    except GpuFailedError as error:
        reason, code = str(error), EXIT_GPU_FAILED
    except Exception as error:  # noqa: BLE001 - a bug, but one GPU's: the others go on
        reason, code = f"internal error, please report: {type(error).__name__}: {error}", EXIT_INTERNAL
    slot.failed(reason, code)
    if started:  # on the filler's own clock, like its other lines
        started[0].log.emit("error", reason=reason, exit_code=code)
    else:
        static: dict[str, object] = {"gpu": slot.index, "uuid": slot.uuid or None, "gpu_requested": config.gpu}
        EventLog(config.log_format, stream, static=static).emit("error", t=0.0, reason=reason, exit_code=code)


def run_fleet(config: Config, out: TextIO, stop: threading.Event, wake: threading.Event,
              fleet: Fleet, heartbeat: Callable[[], None], on_start: OnStart | None = None,
              controls: Controls = NO_CONTROLS) -> int:
    """One filler thread per GPU until every one has ended; the exit code (see the module's docstring)."""
    stream = cast(TextIO, LockedStream(out))  # EventLog needs only write() and flush()
    backend = backend_for(config)
    slots: list[GpuSlot] = []
    threads: list[threading.Thread] = []
    stops: list[tuple[threading.Event, threading.Event]] = []
    ended: list[threading.Event] = []
    for selector in gpu_selectors(config, backend):
        slot = fleet.add(selector)
        gpu_stop, gpu_wake, gpu_ended = threading.Event(), threading.Event(), threading.Event()

        def body(selector: str = selector, slot: GpuSlot = slot, gpu_stop: threading.Event = gpu_stop,
                 gpu_wake: threading.Event = gpu_wake, gpu_ended: threading.Event = gpu_ended) -> None:
            try:
                run_gpu(dataclasses.replace(config, gpu=selector), backend, slot, stream, gpu_stop, gpu_wake,
                        heartbeat, on_start, controls)
            finally:
                gpu_ended.set()
                wake.set()  # the main thread counts the fillers still running

        slots.append(slot)
        threads.append(threading.Thread(target=body, name=f"gpu-{selector}", daemon=True))
        stops.append((gpu_stop, gpu_wake))
        ended.append(gpu_ended)
    for thread in threads:
        thread.start()
    while not all(e.is_set() for e in ended):
        wake.wait()
        wake.clear()
        if stop.is_set():
            for gpu_stop, gpu_wake in stops:
                gpu_stop.reason = stop_reason(stop)  # type: ignore[attr-defined]
                gpu_stop.set()
                gpu_wake.set()
            for thread in threads:
                thread.join(timeout=DRAIN_LIMIT_S + 2.0)
            break
    failed = [slot for slot in slots if slot.status == "failed"]
    if not failed:
        return EXIT_OK
    if len(failed) == len(slots) and all(slot.exit_code == EXIT_NO_GPU for slot in failed):
        reasons = "; ".join((slot.reason or "").removeprefix("no usable GPU: ") for slot in failed)
        print(f"forge-load: no usable GPU: {reasons}", file=sys.stderr)
        return EXIT_NO_GPU
    if all(slot.exit_code == EXIT_CONFIG for slot in failed):  # GPUs another filler of this user fills
        if len(failed) == len(slots):
            say("forge-load: " + "; ".join(slot.reason or "" for slot in failed))
        return EXIT_CONFIG
    return EXIT_INTERNAL if any(slot.exit_code == EXIT_INTERNAL for slot in failed) else EXIT_GPU_FAILED


# --- the process --------------------------------------------------------------------------------------------

def stop_reason(stop: threading.Event) -> str:
    return getattr(stop, "reason", "signal")


_stop_lock = threading.Lock()


def request_stop(stop: threading.Event, wake: threading.Event, reason: str) -> None:
    """Stop every filler; the first reason is the one logged (a second signal changes nothing)."""
    with _stop_lock:
        if not stop.is_set():
            stop.reason = reason  # type: ignore[attr-defined]
            stop.set()
    wake.set()


def install_signals(stop: threading.Event, wake: threading.Event,
                    signals: StopSignals | None = None, switch: PauseSwitch | None = None) -> StopSignals:
    """SIGTERM, SIGINT and SIGHUP stop the fillers (see forge_load.cli), SIGUSR1 and SIGUSR2 pause and resume them;
    `signals` when already installed."""
    signals = signals or StopSignals.install()
    signals.watch(lambda name: request_stop(stop, wake, f"signal {name}"),
                  None if switch is None else switch.set)
    return signals


def say(text: str) -> None:
    """One line on stderr, escaped; a closed stderr is no reason to fail."""
    try:
        print(escape_controls(text), file=sys.stderr, flush=True)
    except (OSError, ValueError):
        _to_devnull(sys.stderr)


def _to_devnull(stream: TextIO) -> None:
    """Point a broken standard stream at /dev/null, so that the interpreter's last flush cannot fail."""
    with contextlib.suppress(Exception):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def main(argv: list[str] | None = None, stream: TextIO | None = None, signals: StopSignals | None = None,
         title: ProcessTitle | None = None) -> int:
    """The process: `signals` are the stop and pause signals forge_load.cli caught first; without them (main()
    called on its own) they are installed here and put back on return. `title` names the process after its
    GPUs and their states (the forge-load command's; left alone when None)."""
    stop, wake = threading.Event(), threading.Event()
    switch = PauseSwitch()
    installed = install_signals(stop, wake, signals, switch)
    try:
        return _main(argv, stream or sys.stdout, stop, wake, switch, title)
    finally:
        if signals is None:
            installed.restore()


def _main(argv: list[str] | None, out: TextIO, stop: threading.Event, wake: threading.Event,
          switch: PauseSwitch | None = None, title: ProcessTitle | None = None) -> int:
    if title is not None:
        title.set(describe_title([]))
    try:
        config = load_config(argv)
    except ConfigError as error:
        say(f"forge-load: {error}")
        return EXIT_CONFIG
    for warning in unknown_variables(os.environ):
        say(f"forge-load: {warning}")
    limit = metrics.open_files_limit()
    if limit is not None and limit < MIN_OPEN_FILES:
        say(f"forge-load: this process may open {limit} files (the host's or container's limit, RLIMIT_NOFILE: "
            f"`ulimit -n`), fewer than the {MIN_OPEN_FILES} it needs: raise it (`docker run --ulimit "
            "nofile=1024`, LimitNOFILE= in a systemd unit)")
        return EXIT_CONFIG
    # Every line goes through one LogStream: a write that fails stops the fillers instead of raising in them.
    log_stream = LogStream(out, lambda error: request_stop(stop, wake, "stdout could not be written"))
    log_out = cast(TextIO, log_stream)
    path, private = health.heartbeat_location(config)
    beat = health.Heartbeat(path, private_dir=private, on_refused=lambda why: say(
        f"forge-load: warning: heartbeat not written: {why}; `python -m forge_load.health` reports unhealthy"))
    holder = beat.claim()
    if holder is not None:  # another filler of this user holds this heartbeat (docs: forge_load/service/health.py)
        same = (f"the heartbeat {escape_controls(str(path))} of the same GPUs ({health.heartbeat_name(config)})"
                if private else f"FORGE_HEARTBEAT_FILE={escape_controls(str(path))}")
        if not config.simulate:
            say(f"forge-load: another forge-load (pid {holder}) already runs with {same}: two fillers on one GPU "
                "only yield to each other, and the health check cannot tell them apart; stop that one, or give this "
                "one other GPUs (FORGE_GPU, FORGE_GPUS) or its own FORGE_HEARTBEAT_FILE")
            return EXIT_CONFIG
        say(f"forge-load: warning: another forge-load (pid {holder}) already runs with {same}: this one writes no "
            "heartbeat, and `python -m forge_load.health` with these settings judges that one")
        beat.writes = False
    error_log = EventLog(config.log_format, log_out, clock=time.monotonic, start_s=time.monotonic())
    fleet = Fleet(config.health_max_age_s, simulated=config.simulate)
    try:
        board = start_kubelet(config, error_log, stop)
    except ConfigError as error:
        say(f"forge-load: {error}")
        return EXIT_CONFIG
    controls = Controls(switch, None if title is None else lambda: title.set(describe_title(fleet.slots)), board)
    if config.pause_file is not None and not os.path.isdir(os.path.dirname(config.pause_file)):
        say(f"forge-load: warning: FORGE_PAUSE_FILE={config.pause_file}: its directory does not exist (yet), so "
            "the file cannot appear: is the directory mounted?")
    server: metrics.MetricsServer | None = None
    if config.metrics_port is not None:
        try:
            server = metrics.serve(fleet, config.metrics_addr, config.metrics_port)
        except ConfigError as error:
            say(f"forge-load: {error}")
            return EXIT_CONFIG
        host = f"[{server.addr}]" if ":" in server.addr else server.addr
        error_log.emit("metrics", listen=f"{host}:{server.port}", port=server.port, paths="/metrics,/health")
    try:
        if stop.is_set():  # a signal (or a dead stdout) during start-up: no GPU is opened at all
            error_log.emit("stop", state="starting", reason=stop_reason(stop))
            code = EXIT_OK
        else:
            code = run_fleet(config, log_out, stop, wake, fleet, beat, controls=controls)  # one GPU: a fleet of one
            if controls.on_transition is not None:
                controls.on_transition()  # stopped or failed, for the last moments
    except NoGpuError as error:  # FORGE_GPUS=all and NVML shows none
        say(f"forge-load: no usable GPU: {error}")
        code = EXIT_NO_GPU
    except Exception as error:  # noqa: BLE001 - a bug: one line, not a traceback in docker logs
        error_log.emit("error", reason=f"internal error, please report: {type(error).__name__}: {error}",
                       exit_code=EXIT_INTERNAL)
        code = EXIT_INTERNAL
    finally:
        beat.clear()
        if server is not None:
            server.close()
    return _log_checked(code, log_stream, out)


def start_kubelet(config: Config, log: EventLog, stop: threading.Event) -> HoldBoard | None:
    """With FORGE_KUBELET_SOCKET: the thread that holds what the kubelet assigns (service/kubelet.py), and the
    board it keeps; this filler's own pod (POD_NAMESPACE, POD_NAME from the downward API) is never held for."""
    if config.kubelet_socket is None:
        return None
    try:
        from forge_load.podresources import api_pb2_grpc  # noqa: F401 - grpcio, checked before any GPU is opened
        from forge_load.service import kubelet
    except ImportError as error:
        raise ConfigError(f"FORGE_KUBELET_SOCKET={config.kubelet_socket} needs the grpcio and protobuf packages "
                          f"({error}): pip install 'forge-load[kubernetes]', or unset it") from None
    own_pod = None
    if os.environ.get("POD_NAME"):
        own_pod = (os.environ.get("POD_NAMESPACE", ""), os.environ["POD_NAME"])
    board = HoldBoard()
    client = kubelet.KubeletHolds(config.kubelet_socket, board, lambda line: log.emit("kubelet", reason=line),
                                  kubelet.nvml_resolver() if not config.simulate else kubelet.simulated_resolver,
                                  own_pod=own_pod)
    log.emit("kubelet", socket=config.kubelet_socket, own_pod="/".join(own_pod) if own_pod else None,
             poll_s=client.poll_s)
    client.start(stop)
    return board


def _log_checked(code: int, log_stream: LogStream, out: TextIO) -> int:
    """`code`, or EXIT_LOG_LOST (said in one line on stderr) when the log could not be written."""
    if log_stream.failure is None:
        return code
    _to_devnull(out)
    why = log_stream.failure.strerror or str(log_stream.failure)
    say(f"forge-load: stdout could not be written ({why}): the fillers were stopped, their kernels finished")
    return EXIT_LOG_LOST if code == EXIT_OK else code
