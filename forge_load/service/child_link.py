"""What a MIG device's child process (gpu_threads.fill_in_child) and its parent tell each other while it fills.

Parent to child, on the child's stdin after its brief: the kubelet's holds on that MIG device and on its GPU, pickled
as `("holds", (Hold, ...))` whenever they change (the kubelet is asked by the parent only). Child to parent, on a pipe
of its own: its status (GpuStatus) and the age of its loop's heartbeat, one JSON line at each change of state and at
least every REPORT_S, so that the parent's /metrics, /health and process title show the child as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import threading
from collections.abc import Callable
from typing import IO

from forge_load.control.status import GpuStatus
from forge_load.steering.holds import Hold

REPORT_S = 1.0  # the child's status reaches its parent at least this often
MAX_LINE_BYTES = 64 * 1024  # a status line is a few hundred bytes: anything longer is not one


def send_holds(stdin: IO[bytes], holds: tuple[Hold, ...]) -> None:
    """The kubelet's holds of the child's MIG device (and of its GPU), all of them: they replace the last ones."""
    pickle.dump(("holds", holds), stdin)
    stdin.flush()


def read_messages(stdin: IO[bytes], on_holds: Callable[[tuple[Hold, ...]], object]) -> None:
    """Read the parent's messages until its end of stdin closes (it ended, whatever ended it): then return."""
    while True:
        try:
            message = pickle.load(stdin)
        except (EOFError, OSError, pickle.UnpicklingError, ValueError):
            return
        if isinstance(message, tuple) and len(message) == 2 and message[0] == "holds":
            holds = message[1]
            if isinstance(holds, tuple) and all(isinstance(h, Hold) for h in holds):
                on_holds(holds)


def encode_status(status: GpuStatus, beat_age_s: float | None) -> bytes:
    return json.dumps({"status": dataclasses.asdict(status), "beat_age_s": beat_age_s}).encode("utf-8") + b"\n"


def report_status(fd: int, snapshot: Callable[[], tuple[GpuStatus, float | None] | None], changed: threading.Event,
                  done: threading.Event) -> None:
    """The child's side: its status on `fd` at each `changed` and every REPORT_S; once `done` (its filler has ended,
    and `changed` set with it), one last report, then `fd` is closed. A write that fails (the parent is gone) ends it.
    `snapshot`: its status and its loop heartbeat's age now; None before its filler started."""
    try:
        while True:
            changed.wait(REPORT_S)
            changed.clear()
            last = done.is_set()
            now = snapshot()
            if now is not None:
                os.write(fd, encode_status(*now))
            if last:
                return
    except OSError:
        pass  # the parent is gone: the child sees its stdin end and stops
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


class StatusReader:
    """The parent's side: reads what the child reported, without blocking; `latest` is its newest status and when its
    loop last beat (on the caller's clock), or None before the first report."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self._pending = b""
        self.latest: tuple[GpuStatus, float | None] | None = None

    def read(self, now_s: float) -> tuple[GpuStatus, float | None] | None:
        """Take in what has arrived; the newest report among it, None when no new one did."""
        fresh: tuple[GpuStatus, float | None] | None = None
        while self.fd >= 0:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                break
            lines = (self._pending + chunk).split(b"\n")
            self._pending = lines.pop()[-MAX_LINE_BYTES:]
            for line in lines:
                report = self._decode(line, now_s)
                if report is not None:
                    self.latest = fresh = report
        return fresh

    @staticmethod
    def _decode(line: bytes, now_s: float) -> tuple[GpuStatus, float | None] | None:
        try:
            loaded = json.loads(line)
            status = GpuStatus(**loaded["status"])
            age_s = loaded["beat_age_s"]
        except (ValueError, KeyError, TypeError):
            return None  # not a report of ours: the next one is
        return status, (now_s - float(age_s) if isinstance(age_s, (int, float)) else None)

    def close(self) -> None:
        if self.fd >= 0:  # once: its number may be another file's afterwards
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
