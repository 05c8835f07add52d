"""Exclusive compute mode (docs/exclusive.md): our CUDA context exists only while our kernels may run.

In EXCLUSIVE_PROCESS mode a GPU takes one process's context at a time, idle or not, so an idle context of ours
makes a job's context creation fail (CUDA_ERROR_DEVICE_UNAVAILABLE): yielding after the job appears protects
nothing. There the GPU's thread in the main process holds no context at all. It supervises with NVML and the
holds only, and the GPU work runs in a child process (`python -m forge_load.service.exclusive_child`: the filler
for that one GPU) that it starts while nothing stands in the way and ends, drained, on a hold, a pause or a foreign
process. Its acknowledgement says `drained` only once the child has exited: the context went with it.

Without a hold directory nothing announces a job before it starts, so the supervisor fills nothing and creates
no context; it says so in its start line. The child ends itself whenever its filler stops filling (a yield or a
pause): it never sits on an idle context.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol, TextIO

from forge_load.config.settings import Config
from forge_load.control.probe import DeviceInfo, NoGpuError, Probe
from forge_load.control.reasons import Reasons, State, Verdict
from forge_load.control.status import STOPPED, GpuStatus
from forge_load.gpu.clocks import WallLoopClock
from forge_load.log import EventLog
from forge_load.service.child_link import StatusReader, send_holds
from forge_load.service.runtime import run_steps
from forge_load.service.unix_signals import PAUSE_SIGNALS
from forge_load.steering.filler_dirs import context_file
from forge_load.steering.filler_status import StatusWriter
from forge_load.steering.hold_watch import FillerHolds, HoldBoard, jobs_announced
from forge_load.steering.holds import Hold
from forge_load.steering.pause import Pauses

CHILD_MODULE = "forge_load.service.exclusive_child"  # its main
END_WAIT_S = 5.0  # a child not gone this long after SIGTERM is killed (its context goes either way)
ENDING_POLL_S = 0.01  # while a child ends: the acknowledgement follows its exit within this


def prohibited_error(info: DeviceInfo) -> NoGpuError:
    return NoGpuError(f"GPU {info.index} ({info.uuid}) is in PROHIBITED compute mode: no process may create a "
                      "CUDA context on it, so there is nothing to fill (nvidia-smi -c DEFAULT or EXCLUSIVE_PROCESS "
                      "allows it)")


class Child(Protocol):
    """The GPU work in a process of its own: the only thing here that ever holds a CUDA context."""

    def start(self) -> int:
        """Start it; its pid."""

    def end(self) -> None:
        """Ask it to end: it stops launching, its kernels drain, it exits (and its context goes)."""

    def kill(self) -> None: ...

    def poll(self) -> int | None:
        """Its exit code once it has exited and been reaped, else None."""


class ChildProcess:
    """`python -m forge_load.service.exclusive_child` with the config, the supervisor's start (time.monotonic(),
    which is the system's: the child logs on the same timeline), the hold directory and the holds aged out now
    (`aged_out`: the child watches the holds too, and these it must not end for) pickled on its stdin; stdin stays
    open, so the child sees EOF (and ends) when this process dies, whatever killed it.

    `whole_filler`: the child is a MIG device's whole filler (gpu_threads.fill_in_child): it keeps filling through
    yields, pauses and holds, as any filler does, takes SIGUSR1/SIGUSR2 from its parent, reports its status on a pipe
    (`reports`, child_link.py) and, with `board`, takes the kubelet's holds from it (send_holds). Where
    `config.gpu` is a MIG device (`MIG-…`), the child is shown it alone (CUDA_VISIBLE_DEVICES), whatever this
    process's CUDA_VISIBLE_DEVICES names: CUDA shows a process one MIG device only (docs/design.md §12). `of_gpu`: the
    GPU of the MIG device it fills, whose holds hold it too."""

    def __init__(self, config: Config, start_s: float, hold_dir: str = "",
                 aged_out: Callable[[], dict[str, int]] = dict, whole_filler: bool = False,
                 board: bool = False, of_gpu: str = "", report: bool = False) -> None:
        self.config = config
        self.start_s = start_s
        self.hold_dir = hold_dir
        self.aged_out = aged_out
        self.whole_filler = whole_filler
        self.report = report or whole_filler  # its status on a pipe: its shares, for its parent's status file
        self.of_gpu = of_gpu
        self.board = board
        self.reports: StatusReader | None = None  # a whole filler's status reports, once started
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> int:
        gpu = self.config.gpu or ""
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu} if gpu.startswith("MIG-") else None
        # The pause signals stay blocked in the child (the mask is inherited) until its handlers are in: a SIGUSR1
        # forwarded before then would otherwise end it (their default action).
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, set(PAUSE_SIGNALS)) if self.whole_filler else None
        read_fd, write_fd = os.pipe() if self.report else (-1, -1)
        try:
            proc = subprocess.Popen([sys.executable, "-m", CHILD_MODULE], stdin=subprocess.PIPE, close_fds=True,
                                    env=env, pass_fds=(write_fd,) if self.report else ())
        finally:
            if blocked is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            if self.report:
                os.close(write_fd)  # the child's now: its end (or death) is the pipe's
        if self.report:
            self.reports = StatusReader(read_fd)
        stdin = proc.stdin
        assert stdin is not None
        try:
            brief = (self.config, self.start_s, self.hold_dir, self.aged_out())
            extra: dict[str, object] = {"of_gpu": self.of_gpu}
            if self.report:  # its status pipe keeps its number in the child
                extra.update(status_fd=write_fd)
            if self.whole_filler:
                extra.update(whole_filler=True, board=self.board)
            pickle.dump((*brief, extra), stdin)
            stdin.flush()
        except OSError:
            pass  # it died at once: poll() says so
        self._proc = proc
        return proc.pid

    def end(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()

    def send_holds(self, holds: tuple[Hold, ...]) -> None:
        """The kubelet's holds on a whole filler's MIG device and its GPU (child_link.py), while it runs."""
        if self._proc is not None and self._proc.stdin is not None and self._proc.returncode is None:
            with contextlib.suppress(OSError, ValueError):
                send_holds(self._proc.stdin, holds)

    def send(self, signum: signal.Signals) -> None:
        """Forward a signal (the pause signals, to a whole filler) while it runs."""
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signum)

    def poll(self) -> int | None:
        if self._proc is None:
            return None
        code = self._proc.poll()
        if code is not None and self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
            if self.reports is not None:
                self.reports.read(time.monotonic())  # its last words
                self.reports.close()
        return code


def child_config(config: Config, info: DeviceInfo) -> Config:
    """The child fills one GPU, by UUID, and nothing else: the supervisor owns the metrics, the heartbeat, the
    pauses, the holds and the duration."""
    # hold_dir "": no holds at all (app.build): the supervisor reads and acknowledges them, never the child
    return dataclasses.replace(config, gpu=info.uuid, gpus=None, metrics_port=None, duration_s=0.0, pause_file=None,
                               active_hours=None, hold_dir="")


class Supervisor:
    """One exclusive-mode GPU: starts the child while nothing stands in the way, ends it when something does, and
    acknowledges the holds. What stands in the way is Reasons' verdict, as for any filler (control/reasons.py): the
    child is its actuator. Stepped by the caller with its clock (the holds read the wall clock they were given), so
    tests run it in virtual time."""

    def __init__(self, info: DeviceInfo, probe: Probe, child: Child, holds: FillerHolds, log: EventLog,
                 pauses: Pauses | None, resume_after_s: float, foreign_mem_mib: float, start_s: float,
                 on_change: Callable[[], None] | None = None, target_ratio: float | None = None) -> None:
        self.info = info
        self.target_ratio = target_ratio  # shown in its status row (the child holds it)
        self.on_change = on_change  # told after every change of state (the process title follows it)
        self.probe = probe
        self.child = child
        self.holds = holds
        self.watch = holds.watch
        self.reasons = Reasons(resume_after_s, pauses, holds)
        self.log = log
        self.foreign_mem_mib = foreign_mem_mib
        self.start_s = start_s
        self.baseline_mib = probe.memory_used_mib() or 0.0  # before any context of ours
        self.child_pid: int | None = None
        self.ending_since_s: float | None = None  # asked to end at; None while running unasked or not running
        self.our_pids: set[int] = set()
        self.verdict = Verdict(State.FILLING, None)  # at the last step: whether a child may run, and why not
        self.stopping = False  # close(): the filler stops
        self.yields = 0
        self.report: StatusWriter | None = None  # the status file `forge-load status` reads (supervise() sets it)

    @property
    def running(self) -> bool:
        return self.child_pid is not None

    @property
    def state(self) -> str:
        return STOPPED if self.stopping else self.verdict.state.value

    @property
    def holds_begun(self) -> int:
        return self.reasons.holds_begun

    def _t(self, now_s: float) -> float:
        return now_s - self.start_s

    def _foreign(self) -> str | None:
        """A process other than ours on the GPU, or (with no child of ours) memory nobody of ours holds."""
        processes = self.probe.processes() or []
        others = sorted(p.pid for p in processes if p.pid not in self.our_pids)
        if others:
            return f"process {others[0]} on the GPU" + (f" (and {len(others) - 1} more)" if len(others) > 1 else "")
        if not self.running:
            used_mib = self.probe.memory_used_mib()
            if used_mib is not None and used_mib - self.baseline_mib >= self.foreign_mem_mib:
                return f"{used_mib - self.baseline_mib:.0f} MiB of GPU memory in use by another process"
        return None

    def step(self, now_s: float) -> float:
        """Act on the holds, the pauses and NVML now; returns when to step again."""
        state_before = self.state
        look = self.reasons.look_holds(now_s)
        for problem in look.problems:
            self.log.emit("hold_warning", t=self._t(now_s), reason=problem)
        for line in look.lines:  # as the filler's, without its fields: the supervisor has no shares to show
            self.log.emit(line.event, t=self._t(now_s), holder=line.holder, reason=line.reason, **line.more)
        self._reap(now_s)  # first: a child that ended by itself counts in what follows
        if self.reasons.pauses_due(fresh=True):  # at every step: the supervisor has no readings to wait for
            self.reasons.look_pauses()
        foreign = self._foreign()
        if foreign is not None:
            self.watch.foreign_seen(now_s)
            self.reasons.foreign_seen(now_s)
        self.verdict = self.reasons.verdict(now_s, foreign)
        if self.verdict.reason is None and not self.running and not self.holds.ack_ok:
            self._acknowledge(now_s)  # before any context of ours: can `hold --wait` see it go?
        if self.verdict.reason is None and self.holds.ack_failing:
            # `hold --wait` could not see our context go: none is created (docs/holds.md: the directory)
            self.verdict = Verdict(State.PAUSED, "its acknowledgement cannot be written in the hold directory: no "
                                                 "context of ours until it can")
        why = self.verdict.reason
        if self.running and why is not None and self.ending_since_s is None:
            self._end(now_s, why)
        elif self.running and self.ending_since_s is not None and now_s - self.ending_since_s > END_WAIT_S:
            self.log.emit("child_kill", t=self._t(now_s), child_pid=self.child_pid,
                          reason=f"not gone {END_WAIT_S:g} s after it was asked to end")
            self.child.kill()
        elif not self.running and why is None:
            self.child_pid = self.child.start()
            self.our_pids.add(self.child_pid)
            self.log.emit("child_start", t=self._t(now_s), child_pid=self.child_pid,
                          reason="nothing holds the GPU: the child creates our context and fills")
        self.acknowledge(now_s)
        if self.on_change is not None and self.state != state_before:
            self.on_change()
        return now_s + (ENDING_POLL_S if self.ending_since_s is not None else 0.1)

    def _end(self, now_s: float, why: str) -> None:
        self.ending_since_s = now_s
        self.log.emit("child_end", t=self._t(now_s), child_pid=self.child_pid, reason=why)
        self.child.end()

    def _reap(self, now_s: float) -> None:
        if not self.running:
            return
        code = self.child.poll()
        if code is None:
            return
        asked = self.ending_since_s is not None
        self.log.emit("drained", t=self._t(now_s), child_pid=self.child_pid, exit_code=code, context="gone",
                      reason="asked to end" if asked else "the child ended by itself")
        if not asked:  # it yielded, or its GPU failed: not again before a quiet while
            self.yields += 1
            self.reasons.wait_quiet(now_s)
        self.child_pid = None
        self.ending_since_s = None

    def _acknowledge(self, now_s: float) -> None:
        """Drained means no child of ours: no context of ours on the GPU, let alone a kernel."""
        problem = self.holds.acknowledge(now_s, self.state, drained=not self.running)
        if problem is not None:
            self.log.emit("hold_warning", t=self._t(now_s), reason=problem)

    def acknowledge(self, now_s: float) -> None:
        self._acknowledge(now_s)
        held_by = self.watch.holders
        if self.report is not None and self.report.due(self.state, held_by):
            # the state and why are the supervisor's; the shares the child's (its reports), or none of ours without one
            util, own, power = self._readings(now_s)
            self.report.write(self.state, held_by, self.target_ratio, util, own, power, reason=self.verdict.reason)

    def _readings(self, now_s: float) -> tuple[float | None, float | None, float | None]:
        """(utilization, our share of it, power): the running child's latest report, else NVML's, with no share of
        ours (no child: no context of ours, let alone a kernel)."""
        reports = getattr(self.child, "reports", None)
        if self.running and reports is not None:
            reports.read(now_s)
            if reports.latest is not None:
                status = reports.latest[0]
                return status.util_ratio, status.own_ratio, status.power_w
        util, power = self.probe.utilization_ratio(), self.probe.power_w()
        return util, (None if self.running else 0.0), power

    def close(self, now_s: float, wait: Callable[[float], None], clock: Callable[[], float]) -> None:
        """End the child (if any) and wait for it; killed after END_WAIT_S."""
        self.stopping = True
        if self.running and self.ending_since_s is None:
            self._end(now_s, "the filler stops")
        while self.running:
            now = clock()
            if self.ending_since_s is not None and now - self.ending_since_s > END_WAIT_S:
                self.child.kill()
            self._reap(now)
            if self.running:
                wait(ENDING_POLL_S)

    def status(self) -> GpuStatus:
        return supervisor_status(self.state, self.yields, len(self.watch.honoured), self.holds_begun)


def supervisor_status(state: str, yields: int = 0, holds: int = 0, holds_begun: int = 0) -> GpuStatus:
    """What /metrics and the title show of an exclusive-mode GPU: its state and holds; the shares and the memory are
    the child's, in its log lines."""
    return GpuStatus(state=state, target=0.0, holding=0.0, util_ratio=None, own_ratio=None, foreign_ratio=None,
                     multiplier=0, own_mem_mib=None, power_w=None, temperature_c=None, yields=yields,
                     yielding_s=0.0, own_busy_s=0.0, holds=holds, holds_begun=holds_begun)


def supervise(config: Config, probe: Probe, stream: TextIO, stop: threading.Event, wake: threading.Event,
              attach: Callable[[Callable[[], GpuStatus]], None], beat: Callable[[], None],
              pauses: Pauses | None, child: Child | None = None, hold_dir: str | None = None,
              on_change: Callable[[], None] | None = None, board: HoldBoard | None = None) -> None:
    """One exclusive-mode GPU until `stop` or the duration: in the GPU's thread of the main process, which never
    creates a context here. `attach` hands the slot its status; `board` holds what the kubelet assigned (those
    holds count as configured holds, with or without the directory); `child` and `hold_dir` are for tests."""
    info = probe.info
    clock = WallLoopClock()  # no Monitor of its own: it asks NVML at each step
    start_s = clock.now()
    log = EventLog(config.log_format, stream, clock=clock.now, start_s=start_s,
                   static={"gpu": info.index, "uuid": info.uuid})
    hold_dir = hold_dir or config.hold_dir
    mode = info.compute_mode.value
    end_s = start_s + config.duration_s if config.duration_s > 0 else math.inf

    def idle(now_s: float) -> float:
        beat()
        return now_s + 1.0

    if not jobs_announced(hold_dir, board):
        log.emit("exclusive", t=0.0, compute_mode=mode, hold_dir=hold_dir, holds=False, filling=False,
                 reason=f"{mode} compute mode takes one process's context at a time, and no hold directory "
                        f"{hold_dir} exists to announce jobs: no context of ours is created, nothing is filled "
                        "until the directory appears")
        idle_status = supervisor_status(State.PAUSED.value)
        attach(lambda: idle_status)
        ended = run_steps(clock, stop, wake, end_s, idle, done=lambda: jobs_announced(hold_dir, board))
        if ended is not None:
            log.emit("stop", state=State.PAUSED.value, reason=ended)
            return
    log.emit("exclusive", compute_mode=mode, hold_dir=hold_dir, holds=True, filling=True,
             reason=f"{mode} compute mode: the GPU work runs in a child process that holds our context only while "
                    "it fills, and ends on a hold, a pause or a foreign job")
    holds = FillerHolds(hold_dir, info.uuid, os.getpid(), time.time, config.hold_idle_age_out_s, board,
                        whole_gpu_uuid=info.gpu_uuid)  # a MIG device: its GPU's holds are its own too
    child = child or ChildProcess(child_config(config, info), start_s, hold_dir, holds.watch.aged_out,
                                  of_gpu=info.gpu_uuid, report=True)
    sup = Supervisor(info, probe, child, holds, log, pauses, config.resume_after_s, config.foreign_mem_mib, start_s,
                     on_change, target_ratio=config.target_ratio)
    sup.report = StatusWriter(hold_dir, info.uuid, info.index, os.getpid(), runtime_dir=config.runtime_dir)
    attach(sup.status)

    def step(now_s: float) -> float:
        due_s = sup.step(now_s)
        beat()
        return due_s

    reason: str | None = "an error"  # what the stop line says if the steps raise (the error line follows)
    try:
        reason = run_steps(clock, stop, wake, end_s, step)
    finally:
        sup.close(clock.now(), time.sleep, clock.now)
        if not holds.own.locked(context_file(info.uuid)):
            holds.own.remove(context_file(info.uuid))  # its last child has gone: no empty lock file left behind
        sup.report.close()
        sup.holds.close()  # as any filler that stops: `hold --wait` need not wait for the acknowledgement to age
        log.emit("stop", state=sup.state, reason=reason, yields=sup.yields)
