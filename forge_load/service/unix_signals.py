"""Stop signals (SIGTERM, SIGINT, SIGHUP) and the pause signals (SIGUSR1 pauses, SIGUSR2 resumes), caught from
the first moment and handed to the run loops. A pause signal's default action would end the process, so it is
caught as early as the stop signals.

The C-level handler writes each signal's number into a pipe (signal.set_wakeup_fd), even while the main
thread is busy importing; a watcher thread started later reads the pipe and sets the stop events. No lock is
ever taken inside a signal handler, so a signal cannot deadlock a thread that holds one. Once main() has
returned, the stop signals are ignored: a second Ctrl-C during interpreter shutdown changes nothing (Python
restores the default handlers while it finalizes, which would otherwise turn it into exit 130 or 143).
This module imports nothing heavy: cli.py installs it before anything else.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PAUSE_SIGNALS = {signal.SIGUSR1: True, signal.SIGUSR2: False}  # signal -> pause (True) or resume (False)
CAUGHT = (*STOP_SIGNALS, *PAUSE_SIGNALS)


def _noted(_signum: int, _frame: object) -> None:
    """The Python-level handler: nothing to do, the wakeup pipe carries the signal."""


class StopSignals:
    """Stop and pause signals, caught from install() on; watch() hands each one to a callback, in a thread of its
    own."""

    def __init__(self, read_fd: int, write_fd: int, previous: dict[signal.Signals, Any],
                 previous_wakeup_fd: int) -> None:
        self._read_fd, self._write_fd = read_fd, write_fd
        self._previous, self._previous_wakeup_fd = previous, previous_wakeup_fd
        self._watching = False

    @classmethod
    def install(cls) -> StopSignals:
        """From the main thread, as early as possible."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        previous = {signum: signal.signal(signum, _noted) for signum in CAUGHT}
        return cls(read_fd, write_fd, previous, previous_wakeup_fd)

    def watch(self, on_signal: Callable[[str], None],
              on_pause: Callable[[bool, str], None] | None = None) -> None:
        """Call on_signal("SIGTERM") for each stop signal and on_pause(True, "SIGUSR1") / on_pause(False,
        "SIGUSR2") for each pause signal: those caught before this call at once, in order, in this thread (so
        the caller knows of them when this returns), later ones from a thread of its own."""
        import threading

        def deliver(data: bytes) -> None:
            for signum in data:
                if signum in STOP_SIGNALS:
                    on_signal(signal.Signals(signum).name)
                elif signum in PAUSE_SIGNALS and on_pause is not None:
                    on_pause(PAUSE_SIGNALS[signal.Signals(signum)], signal.Signals(signum).name)

        os.set_blocking(self._read_fd, False)
        try:
            deliver(os.read(self._read_fd, 4096))
        except BlockingIOError:
            pass
        os.set_blocking(self._read_fd, True)

        def run() -> None:
            try:
                while data := os.read(self._read_fd, 64):  # b"" once restore() has closed the other end
                    deliver(data)
            except OSError:
                pass
            finally:
                os.close(self._read_fd)

        self._watching = True
        threading.Thread(target=run, name="signals", daemon=True).start()

    def ignore(self) -> None:
        """After the stop line: any further stop or pause signal is ignored, through interpreter shutdown."""
        for signum in CAUGHT:
            signal.signal(signum, signal.SIG_IGN)

    def restore(self) -> None:
        """Put back what was there before install() (for callers of app.main() in a process of their own)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        os.close(self._write_fd)
        if not self._watching:
            os.close(self._read_fd)
