"""Child processes of the benchmark and their CPU time.

Every child runs in its own session (so it and whatever it starts can be signalled by process group id), its
stdout lines are parsed as JSON events as they come, with a wall-clock stamp, and all children are ended when
the benchmark exits for any reason but SIGKILL.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import REPO, BenchError
from bench.analysis import parse_events

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of a process, in clock ticks, from /proc/<pid>/stat (None once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), counted from the state (3)


def cpu_percent(readings: Sequence[tuple[float, int]], start_s: float, end_s: float) -> float | None:
    """% of one core between the first reading at or after start_s and the last at or before end_s."""
    inside = [(t, ticks) for t, ticks in readings if start_s <= t <= end_s]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < 1.0:
        return None
    return 100.0 * (inside[-1][1] - inside[0][1]) / CLK_TCK / (inside[-1][0] - inside[0][0])


class Children:
    """Every process the bench started; all are ended (by their own process group id) on exit."""

    def __init__(self) -> None:
        self.alive: list[Child] = []
        self.lock = threading.Lock()

    def add(self, child: Child) -> None:
        with self.lock:
            self.alive.append(child)

    def kill_all(self) -> None:
        with self.lock:
            children = list(self.alive)
        for child in children:
            child.stop(grace_s=3.0)


CHILDREN = Children()
atexit.register(CHILDREN.kill_all)


class Child:
    """A subprocess whose stdout lines are parsed as JSON events as they come, with a wall-clock stamp."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], stdin: bool = False) -> None:
        self.name = name
        self.events: list[dict[str, Any]] = []
        self.text: list[str] = []
        self.stderr: list[str] = []
        self.exit_wall: float | None = None
        self.cond = threading.Condition()
        self.started_wall = time.time()
        # Its own session, so that stop() can signal its whole process group by its id.
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                                     env=env, cwd=str(REPO), start_new_session=True)
        self.pid = self.proc.pid
        CHILDREN.add(self)
        threading.Thread(target=self._read_out, daemon=True, name=f"{name}-out").start()
        threading.Thread(target=self._read_err, daemon=True, name=f"{name}-err").start()
        threading.Thread(target=self._wait, daemon=True, name=f"{name}-wait").start()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            received = time.time()
            with self.cond:
                self.text.append(line.rstrip("\n"))
                for event in parse_events([line]):
                    event["_received_wall"] = received
                    self.events.append(event)
                self.cond.notify_all()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self.cond:
                self.stderr = (self.stderr + [line.rstrip("\n")])[-40:]

    def _wait(self) -> None:
        self.proc.wait()
        with self.cond:
            self.exit_wall = time.time()
            self.cond.notify_all()
        with CHILDREN.lock:
            if self in CHILDREN.alive:
                CHILDREN.alive.remove(self)

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float,
                 what: str) -> dict[str, Any]:
        """The first event matching `predicate`; BenchError on timeout or if the process exits first."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                hit = next((e for e in self.events if predicate(e)), None)
                if hit is not None:
                    return hit
                if self.exit_wall is not None:
                    raise BenchError(f"{self.name} exited with code {self.proc.returncode} before {what}"
                                     f"{self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BenchError(f"{self.name}: no {what} within {timeout_s:g} s{self.tail()}")
                self.cond.wait(min(left, 0.5))

    def wait_exit(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.exit_wall is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stop(grace_s=5.0)
                    raise BenchError(f"{self.name} did not finish within {timeout_s:g} s (killed){self.tail()}")
                self.cond.wait(min(left, 0.5))
        return self.proc.returncode

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM its process group, then SIGKILL after `grace_s`."""
        if self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as error:
            raise BenchError(f"{self.name}: cannot write to it ({error}){self.tail()}") from error

    def tail(self) -> str:
        lines = [line for line in self.stderr if line.strip()][-5:]
        return (": " + " | ".join(lines)) if lines else ""


class CpuWatch(threading.Thread):
    """Reads a process's CPU time every `interval_s` (every `fast_s` while `fast()` is true, around its start-up)
    until it exits: (wall time, ticks) readings, for cpu_percent and cpu_s_at."""

    def __init__(self, pid: int, interval_s: float = 0.25, fast_s: float = 0.02,
                 fast: Callable[[], bool] = lambda: False) -> None:
        super().__init__(daemon=True, name=f"cpu-{pid}")
        self.pid = pid
        self.interval_s = interval_s
        self.fast_s = fast_s
        self.fast = fast
        self.readings: list[tuple[float, int]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            ticks = cpu_ticks(self.pid)
            if ticks is None:
                return
            self.readings.append((time.time(), ticks))
            self.stop_event.wait(self.fast_s if self.fast() else self.interval_s)


def cpu_s_at(readings: Sequence[tuple[float, int]], wall_s: float) -> float | None:
    """The process's CPU seconds at `wall_s`, interpolated between the readings around it (None outside)."""
    for (a, ticks_a), (b, ticks_b) in zip(readings, readings[1:]):
        if a <= wall_s <= b:
            share = (wall_s - a) / (b - a) if b > a else 1.0
            return (ticks_a + share * (ticks_b - ticks_a)) / CLK_TCK
    return None
