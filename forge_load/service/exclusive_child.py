"""The child process of exclusive compute mode (exclusive.py): the ordinary filler of one GPU, whose CUDA context
lives and dies with this process. Started by the supervisor as `python -m forge_load.service.exclusive_child`, with
(config, the supervisor's start, the hold directory, the holds it let age out, a dict: on a MIG device `of_gpu`, its
GPU's UUID, whose holds are its own too) pickled on stdin.

It does not trust the supervisor to stay alive and awake: before its context exists it takes the GPU's context lock
in the hold directory (take_context_lock), which `hold --wait` reads and the kernel lets go only at its exit; and it
watches the hold directory itself, ending on a hold the supervisor has not ended it for within SUPERVISOR_GRACE_S (a
supervisor stopped or hung on NVML or on its stdout), so that a hold is honoured whatever becomes of its parent.

The same child, told it is a whole filler (in that dict: `whole_filler`, its status pipe, whether the kubelet's holds
come from its parent), is a MIG device's filler (gpu_threads.fill_in_child; CUDA shows a process one MIG device
only): it keeps filling through its yields, pauses and holds (the config's hold directory, read by its filler as any
filler's, and the kubelet's holds its parent passes on), takes SIGUSR1/SIGUSR2 from its parent, reports its status to
it (child_link.py), and has no context lock (that is exclusive mode's)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TextIO

from forge_load.config.settings import Config
from forge_load.control.filler import Controls
from forge_load.control.policy import FILLING_STATES
from forge_load.control.status import GpuSlot, GpuStatus
from forge_load.exits import EXIT_NO_CONTEXT_LOCK
from forge_load.gpu.backend import Backend, NvidiaBackend
from forge_load.log import internal_error, say
from forge_load.service import child_link, gpu_threads, runtime
from forge_load.service.health import claim_lock
from forge_load.service.title import ProcessTitle
from forge_load.service.unix_signals import PAUSE_SIGNALS, StopSignals
from forge_load.steering import filler_dirs
from forge_load.steering import holds as disk
from forge_load.steering.filler_dirs import OwnDir, context_file
from forge_load.steering.hold_files import FILE_MODE, HoldError, legacy_context_lock_name
from forge_load.steering.hold_watch import HoldBoard, HoldWatch
from forge_load.steering.pause import PauseSwitch

HOLDS_POLL_S = 0.1  # the child's own look at the holds, as often as the supervisor's
# The supervisor ends the child at its next step (0.1 s) after a hold appears; only a hold it has let stand this long
# means the supervisor cannot (stopped, hung), and the child ends itself.
SUPERVISOR_GRACE_S = 0.5
LOCK_TRIES_S = 1.0  # a `hold --wait` asking the lock holds it for microseconds: tried again this long
LOCK_FD_FLOOR = 1024  # the lock's descriptor at least this less one (or the limit): above the driver's files


def _above_the_drivers(fd: int) -> int:
    """The lock's descriptor moved high: a dying process's files are closed in order of number, so the lock goes after
    the driver's (opened later, numbered lower than this), whose closing frees the context."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    floor = min(soft if soft != resource.RLIM_INFINITY else LOCK_FD_FLOOR, LOCK_FD_FLOOR) - 1
    try:
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor)
    except OSError:
        return fd
    os.close(fd)
    return high


@dataclass
class ContextLock:
    """The child's hold on its GPU's context locks, kept until the process exits (close() stands for that exit)."""

    fd: int  # the write lock on <GPU-UUID>.context in this user's filler directory: what this release reads
    legacy_fd: int | None = None  # the flock on filler.<GPU-UUID>.lock: what the hold commands of earlier releases read

    def close(self) -> None:
        for fd in (self.fd, self.legacy_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)


def take_context_lock(hold_dir: str, gpu_uuid: str, stop: threading.Event) -> tuple[ContextLock | None, str | None]:
    """The GPU's context lock in this user's filler directory (filler_dirs.context_file: a write lock no reader can
    take), taken before any context exists and never let go: the kernel lets go of it at this process's exit, whatever
    stops or hangs meanwhile; `hold --wait` reads it (acks.FillersLook). Beside it, where it can, format 1's `flock`
    for the hold commands of earlier releases. (the lock, None), or (None, why not): then no context is created."""
    own = OwnDir(hold_dir)
    deadline_s = time.monotonic() + LOCK_TRIES_S
    while True:
        try:
            fd = filler_dirs.write_lock(own.fd(), context_file(gpu_uuid))
            break
        except BlockingIOError:
            if time.monotonic() >= deadline_s or stop.wait(0.01):
                return None, (f"{os.path.join(own.path, context_file(gpu_uuid))} is locked by another live process "
                              "of this user: a context of ours may be on the GPU already")
        except (OSError, HoldError) as error:
            why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            return None, f"cannot take the context lock in {hold_dir} ({why})"
    legacy, _holder = claim_lock(Path(hold_dir) / legacy_context_lock_name(gpu_uuid), mode=FILE_MODE)
    return ContextLock(_above_the_drivers(fd), _above_the_drivers(legacy) if legacy is not None else None), None


def watch_holds(hold_dir: str, gpu_uuid: str, aged_out: dict[str, int], stop: runtime.StopEvent,
                wake: threading.Event, of_gpu: str = "") -> None:
    """Until `stop`: a hold on this GPU (or, on a MIG device, on its GPU `of_gpu`) that the supervisor has not ended
    us for within SUPERVISOR_GRACE_S stops the child. The holds the supervisor let age out (holder -> its file's
    mtime then) are no reason: it judged them."""
    watch = HoldWatch(hold_dir, gpu_uuid, idle_age_out_s=0.0, whole_gpu_uuid=of_gpu)  # age-out: the supervisor's
    seen_s: float | None = None
    while not stop.wait(HOLDS_POLL_S):
        now_s = time.monotonic()
        watch.check(now_s, time.time())
        new = [holder for holder in watch.holders if aged_out.get(holder) != watch.stamp(holder)]
        if not new and watch.fail_safe is None:
            seen_s = None
            continue
        seen_s = now_s if seen_s is None else seen_s
        if now_s - seen_s >= SUPERVISOR_GRACE_S:
            runtime.request_stop(stop, wake, f"held by {','.join(new) or 'the fail-safe'}, and the supervisor has not "
                                             "ended the child: ends, so that its context goes too")
            return


def child_main(stdin: IO[bytes], out: TextIO, backend: Backend | None = None,
               title: Callable[[str], None] | None = None) -> int:
    """The child: the ordinary filler of one GPU, which ends when asked (SIGTERM), when its filler stops filling,
    when the supervisor is gone (EOF on stdin), or on a hold the supervisor has not ended it for. `backend`: the
    machine's GPUs (tests: the simulated one); `title` names the process (ProcessTitle.set)."""
    brief = pickle.load(stdin)
    config, parent_start_s = brief[0], brief[1]
    hold_dir, aged_out = (brief[2], brief[3]) if len(brief) >= 4 else ("", {})
    extra = brief[4] if len(brief) == 5 and isinstance(brief[4], dict) else {}  # ChildProcess.start
    whole_filler = extra.get("whole_filler") is True  # a MIG device's whole filler
    status_fd = extra.get("status_fd")
    board = HoldBoard() if extra.get("board") is True else None  # the kubelet's, passed on by its parent
    of_gpu = extra.get("of_gpu") if isinstance(extra.get("of_gpu"), str) else ""  # a MIG device's GPU
    if (not isinstance(config, Config) or not isinstance(parent_start_s, float) or not isinstance(hold_dir, str)
            or not isinstance(aged_out, dict)):
        raise TypeError("the supervisor sent something other than (Config, its start time, the hold directory, "
                        "the holds aged out)")
    # Named in ps and in the GPU's process list like its parent (docs/design.md §10); it lives only while filling.
    if title is not None:
        kind = "MIG-device child" if whole_filler else "exclusive-mode child"
        title(f"forge-load: {kind} of {os.getppid()}, filling {config.gpu}")
    stop, wake = runtime.StopEvent(), threading.Event()
    switch: PauseSwitch | None = None
    if whole_filler:
        # Its parent forwards SIGUSR1/SIGUSR2, blocked until now (ChildProcess.start): caught as the forge-load
        # command catches them, so that no lock is taken in a signal handler.
        switch = PauseSwitch()
        StopSignals.install().watch(lambda name: runtime.request_stop(stop, wake, f"asked to end by its parent "
                                                                                  f"({name})"), switch.set)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(PAUSE_SIGNALS))
    else:
        def asked(signum: int, _frame: object) -> None:
            runtime.request_stop(stop, wake, f"asked to end by the supervisor ({signal.Signals(signum).name})")

        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, asked)

    def orphaned() -> None:
        # Its parent's messages (the kubelet's holds, to a MIG device's child) until its end of stdin closes
        child_link.read_messages(stdin, board.replace if board is not None else lambda _holds: None)
        runtime.request_stop(stop, wake, "the supervisor is gone")

    threading.Thread(target=orphaned, name="supervisor", daemon=True).start()
    if hold_dir and disk.configured(hold_dir):
        _lock, why_not = take_context_lock(hold_dir, config.gpu or "", stop)  # kept open: it goes with the process
        if why_not is not None:  # `hold --wait` could not see our context: none is created
            say(f"forge-load: exclusive-mode child: {why_not}: ends without creating a context")
            return EXIT_NO_CONTEXT_LOCK
        threading.Thread(target=watch_holds, args=(hold_dir, config.gpu or "", aged_out, stop, wake, of_gpu),
                         name="holds", daemon=True).start()
    started: list[runtime.Runtime] = []
    slot = GpuSlot(config.gpu)
    changed = threading.Event()  # the filler's state changed: its parent is told at once

    def not_filling() -> None:
        changed.set()
        if not whole_filler and started and started[0].filler.state not in FILLING_STATES:
            state = started[0].filler.state.value
            runtime.request_stop(stop, wake, f"{state} in exclusive compute mode: ends, so that its context goes too")

    def on_start(_slot: GpuSlot, rt: runtime.Runtime) -> None:
        rt.log.t_offset_s = rt.start_s - parent_start_s  # one timeline with the supervisor's lines (monotonic)
        started.append(rt)
        changed.set()

    def report() -> tuple[GpuStatus, float | None] | None:
        if not started:
            return None
        beat_s = slot.last_beat_s
        return started[0].filler.status(started[0].now()), (None if beat_s is None else slot.clock() - beat_s)

    done = threading.Event()
    reporter = threading.Thread(target=child_link.report_status, args=(status_fd, report, changed, done),
                                name="report", daemon=True)
    if isinstance(status_fd, int):
        reporter.start()
    gpu_threads.run_gpu(config, backend or NvidiaBackend(), slot, out, stop, wake,
                        Controls(switch, on_transition=not_filling, board=board), on_start=on_start, supervise=False)
    if reporter.is_alive():  # its last state, for its parent's last look
        done.set()
        changed.set()
        reporter.join(timeout=1.0)
    return slot.exit_code if slot.status == "failed" else 0


if __name__ == "__main__":
    code = 1
    try:
        code = child_main(sys.stdin.buffer, sys.stdout, title=ProcessTitle().set)
    except Exception as error:  # noqa: BLE001 - one line in docker logs, not a traceback
        print(f"forge-load: exclusive-mode child: {internal_error(error)}", file=sys.stderr, flush=True)
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    os._exit(code)  # as forge_load.cli: everything is logged and the context closed; skip numba's teardown
