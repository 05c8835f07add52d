"""One filler thread per GPU (FORGE_GPUS; one GPU is one thread too): which GPUs, each one's thread, its failure
kept in its slot, and the process's exit code when every one has ended."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import TextIO, cast

from forge_load.config.settings import Config
from forge_load.control.filler import NO_CONTROLS, Controls
from forge_load.control.probe import GpuFailedError, MigModeError, NoGpuError, Probe
from forge_load.control.reasons import State
from forge_load.control.status import GpuSlot, GpuSlots, GpuStatus
from forge_load.exits import EXIT_CONFIG, EXIT_GPU_FAILED, EXIT_INTERNAL, EXIT_NO_GPU, EXIT_OK
from forge_load.gpu.backend import Backend, backend_for
from forge_load.log import EventLog, LogStream, internal_error, say
from forge_load.service.exclusive import END_WAIT_S, ENDING_POLL_S, ChildProcess, supervisor_status
from forge_load.service.exclusive import supervise as run_exclusive
from forge_load.service.loop import handed_on, run_loop
from forge_load.service.runtime import (
    DRAIN_LIMIT_S,
    GpuTakenError,
    Runtime,
    StopEvent,
    pauses_for,
    stop_reason,
)
from forge_load.service.unix_signals import PAUSE_SIGNALS
from forge_load.steering.hold_watch import held_uuids

CHILD_POLL_S = 0.1  # a MIG device's child: how soon its exit and its reports are seen
# A child's report whose loop heartbeat is older than this does not beat its slot: /health sees a stalled child.
CHILD_BEAT_FRESH_S = 5.0
PAUSE_SIGNAL_OF = {paused: signum for signum, paused in PAUSE_SIGNALS.items()}  # paused -> the signal saying so

# --- several GPUs in one process -------------------------------------------------------------------------------

def shared_stream(out: TextIO, stop: threading.Event, wake: threading.Event) -> TextIO:
    """`out` for every GPU thread at once: a LogStream (main()'s) already writes one whole line at a time; any other
    stream is put behind one, whose failed write stops the fillers as main()'s does."""
    if isinstance(out, LogStream):
        return out

    def failed(_error: OSError) -> None:
        stop.set()
        wake.set()

    return cast(TextIO, LogStream(out, failed))


def gpu_selectors(config: Config, backend: Backend) -> list[str]:
    """The GPUs FORGE_GPUS names: `all` is every GPU the backend shows, in index order, a GPU in MIG mode as its
    MIG devices.

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
    selectors = []
    for info in backend.devices():
        # A GPU in MIG mode runs CUDA only on its MIG devices: each is filled (in a child process, fill_in_child);
        # one with none made yet stays named as a whole, and its filler says so (exit 3, that GPU's alone).
        migs = backend.mig_devices(info.uuid) if info.mig_enabled else []
        selectors += migs or [str(info.index)]
    if not selectors:
        raise NoGpuError("FORGE_GPUS=all but NVML shows no GPU: in Kubernetes, set NVIDIA_VISIBLE_DEVICES=all "
                         "with runtimeClassName: nvidia; in Docker, --gpus all")
    return selectors


OnStart = Callable[[GpuSlot, Runtime], None]  # a GPU's filler is built (tools and tests look inside)


def in_child(selector: str, selectors: list[str]) -> bool:
    """Whether a GPU's filler runs in a child process: a MIG device among several GPUs, since CUDA shows a process
    one MIG device only (docs/design.md §12); a MIG device alone is filled in-process."""
    return selector.startswith("MIG-") and len(selectors) > 1


def fill_in_child(config: Config, backend: Backend, slot: GpuSlot, stop: threading.Event, wake: threading.Event,
                  controls: Controls, beat: Callable[[], None], child: ChildProcess | None = None,
                  exclusive: Callable[[Probe], None] | None = None) -> int:
    """A MIG device's whole filler in a child process (exclusive_child, told it is one) until it ends, or until
    `stop`, when it is asked to end (SIGTERM; killed after END_WAIT_S). Its lines are its own, on our stdout; the
    pause signals and the kubelet's holds of its MIG device and GPU are passed on to it; its status reports
    (child_link.py) are its slot's, and each one whose loop heartbeat is fresh beats ours. Its exit code (0 when it
    ended as asked). A MIG device in an exclusive compute mode (NVML sets it per MIG device) is handed to
    `exclusive` as a whole GPU in one is: a filler that keeps its context would fail a job given it."""
    probe = backend.open_probe(config.gpu)  # NVML only: its info for /metrics and /health
    if handed_on(probe, exclusive):
        return EXIT_OK
    info = probe.info
    probe.close()
    board = controls.board
    child_cfg = dataclasses.replace(config, gpus=None, metrics_port=None, kubelet_socket=None)
    child = child or ChildProcess(child_cfg, time.monotonic(), whole_filler=True, board=board is not None)
    switch = controls.switch
    starting = supervisor_status(State.FILLING.value)

    def forward() -> None:
        if switch is not None:
            child.send(PAUSE_SIGNAL_OF[switch.by is not None])

    def status() -> GpuStatus:
        reports = child.reports
        return reports.latest[0] if reports is not None and reports.latest is not None else starting

    if switch is not None:
        switch.listeners.add(forward)
    if board is not None:
        board.listeners.add(wake.set)  # a kubelet hold is passed on at once, not at the next poll
    sent_generation = -1
    try:
        child.start()
        if switch is not None and switch.by is not None:
            forward()  # paused before it started: blocked in it until its handlers are in
        slot.attach(info, status)
        if controls.on_transition is not None:
            controls.on_transition()
        asked_s: float | None = None
        while (code := child.poll()) is None:
            if board is not None and board.generation != sent_generation:
                sent_generation = board.generation
                child.send_holds(board.holds_of(held_uuids(info.uuid, info.gpu_uuid)))
            state_before = status().state
            report = child.reports.read(time.monotonic()) if child.reports is not None else None
            if report is not None:
                child_status, beat_s = report
                if beat_s is not None and time.monotonic() - beat_s <= CHILD_BEAT_FRESH_S:
                    beat()
                if child_status.state != state_before and controls.on_transition is not None:
                    controls.on_transition()
            if stop.is_set() and asked_s is None:
                asked_s = time.monotonic()
                child.end()
            elif asked_s is not None and time.monotonic() - asked_s > END_WAIT_S:
                child.kill()
            wake.wait(CHILD_POLL_S if asked_s is None else ENDING_POLL_S)
            wake.clear()
    finally:
        if switch is not None:
            switch.listeners.remove(forward)
        if board is not None:
            board.listeners.remove(wake.set)
        if child.poll() is None:  # this thread failed: the child must not outlive its filler
            child.kill()
    return 0 if asked_s is not None and code < 0 else code


Expand = Callable[[GpuSlot, list[str]], None]  # a GPU named as a whole is in MIG mode: fill these MIG devices


def run_gpu(config: Config, backend: Backend, slot: GpuSlot, stream: TextIO, stop: threading.Event,
            wake: threading.Event, controls: Controls = NO_CONTROLS, on_start: OnStart | None = None,
            supervise: bool = True, child: bool = False, expand: Expand | None = None) -> None:
    """One GPU's filler, in its own thread: its failure is logged and kept in its slot, never raised. `supervise`:
    a GPU in an exclusive compute mode is supervised, its work in a child process (False: this is that child).
    `child`: the filler runs in a child process (in_child), which logs its own failure. `expand`: a GPU named as a
    whole that is in MIG mode is handed to it, with its MIG devices, in one line (without it, or with no MIG device
    made yet, refused as a GPU that cannot be filled). `controls.heartbeat` is the process's heartbeat, beaten
    with the slot's."""
    started: list[Runtime] = []
    heartbeat = controls.heartbeat

    def beat() -> None:
        slot.beat()
        if heartbeat is not None:
            heartbeat()

    def attach(rt: Runtime) -> None:
        started.append(rt)
        slot.attach(rt.info, lambda: rt.filler.status(rt.now()))
        if controls.on_transition is not None:
            controls.on_transition()
        if on_start is not None:
            on_start(slot, rt)

    def exclusive(probe: Probe) -> None:
        def attach_status(snapshot: Callable[[], GpuStatus]) -> None:
            slot.attach(probe.info, snapshot)
            if controls.on_transition is not None:
                controls.on_transition()

        run_exclusive(config, probe, stream, stop, wake, attach_status, beat, pauses_for(config, controls),
                      on_change=controls.on_transition, board=controls.board)

    try:
        if child:
            code = fill_in_child(config, backend, slot, stop, wake, controls, beat,
                                 exclusive=exclusive if supervise else None)
            if code == EXIT_OK:
                slot.stopped()
            else:  # its own error line said why
                slot.failed(f"its child process exited with {code}", code if code > 0 else EXIT_GPU_FAILED)
            return
        run_loop(config, backend, stream, stop, wake, dataclasses.replace(controls, heartbeat=beat),
                 exclusive=exclusive if supervise else None, on_start=attach)
        slot.stopped()
        return
    except MigModeError as error:
        if expand is None or not error.mig_uuids:
            reason, code = f"no usable GPU: {error}", EXIT_NO_GPU
        else:
            static: dict[str, object] = {"gpu": error.gpu_index, "uuid": error.gpu_uuid}
            EventLog(config.log_format, stream, static=static).emit(
                "mig", t=0.0, mig_devices=len(error.mig_uuids),
                reason=f"GPU {error.gpu_index} is in MIG mode, where CUDA runs only on its MIG devices: each of its "
                       f"{len(error.mig_uuids)} MIG devices is filled by a child process of its own")
            expand(slot, error.mig_uuids)
            return
    except NoGpuError as error:
        reason, code = f"no usable GPU: {error}", EXIT_NO_GPU
    except GpuTakenError as error:
        reason, code = str(error), EXIT_CONFIG
    except GpuFailedError as error:
        reason, code = str(error), EXIT_GPU_FAILED
    except Exception as error:  # noqa: BLE001 - a bug, but one GPU's: the others go on
        reason, code = internal_error(error), EXIT_INTERNAL
    slot.failed(reason, code)
    if started:  # on the filler's own clock, like its other lines
        started[0].log.emit("error", reason=reason, exit_code=code)
    else:
        static = {"gpu": slot.index, "uuid": slot.uuid or None, "gpu_requested": config.gpu}
        EventLog(config.log_format, stream, static=static).emit("error", t=0.0, reason=reason, exit_code=code)


def run_gpus(config: Config, out: TextIO, stop: threading.Event, wake: threading.Event,
             gpu_slots: GpuSlots, controls: Controls = NO_CONTROLS, on_start: OnStart | None = None) -> int:
    """One filler thread per GPU until every one has ended; the exit code (see the module's docstring)."""
    stream = shared_stream(out, stop, wake)
    backend = backend_for(config)
    slots: list[GpuSlot] = []
    threads: list[threading.Thread] = []
    stops: list[tuple[StopEvent, threading.Event]] = []
    ended: list[threading.Event] = []
    expansions: queue.SimpleQueue[tuple[GpuSlot, list[str]]] = queue.SimpleQueue()

    def expand(slot: GpuSlot, mig_uuids: list[str]) -> None:  # told in a GPU's thread; acted on in this one
        expansions.put((slot, mig_uuids))

    def start(selector: str, child: bool) -> None:
        slot = gpu_slots.add(selector)
        gpu_stop, gpu_wake, gpu_ended = StopEvent(), threading.Event(), threading.Event()

        def body() -> None:
            try:
                run_gpu(dataclasses.replace(config, gpu=selector), backend, slot, stream, gpu_stop, gpu_wake,
                        controls, on_start, child=child, expand=expand)
            finally:
                gpu_ended.set()
                wake.set()  # the main thread counts the fillers still running

        slots.append(slot)
        threads.append(threading.Thread(target=body, name=f"gpu-{selector}", daemon=True))
        stops.append((gpu_stop, gpu_wake))
        ended.append(gpu_ended)
        threads[-1].start()

    selectors = gpu_selectors(config, backend)
    for selector in selectors:
        start(selector, in_child(selector, selectors))
    while not all(e.is_set() for e in ended) or not expansions.empty():
        wake.wait()
        wake.clear()
        while not expansions.empty() and not stop.is_set():
            # A GPU named as a whole is in MIG mode: its slot gives way to one per MIG device, each filled in a
            # child process (CUDA shows a process one MIG device only); one named already is not filled twice.
            whole, mig_uuids = expansions.get()
            gpu_slots.remove(whole)
            slots.remove(whole)
            for mig_uuid in mig_uuids:
                if mig_uuid not in selectors:
                    selectors.append(mig_uuid)
                    start(mig_uuid, child=True)
        if stop.is_set():
            for gpu_stop, gpu_wake in stops:
                gpu_stop.request(stop_reason(stop))
                gpu_wake.set()
            for thread in threads:
                thread.join(timeout=DRAIN_LIMIT_S + 2.0)
            break
    failed = [slot for slot in slots if slot.status == "failed"]
    if not failed:
        return EXIT_OK
    if len(failed) == len(slots) and all(slot.exit_code == EXIT_NO_GPU for slot in failed):
        return EXIT_NO_GPU  # each one's error line said why
    if all(slot.exit_code == EXIT_CONFIG for slot in failed):  # GPUs another filler of this user fills
        if len(failed) == len(slots):
            say("forge-load: " + "; ".join(slot.reason or "" for slot in failed))
        return EXIT_CONFIG
    return EXIT_INTERNAL if any(slot.exit_code == EXIT_INTERNAL for slot in failed) else EXIT_GPU_FAILED
