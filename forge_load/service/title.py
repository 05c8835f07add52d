"""The process's name, so that `ps`, `top` and the GPU's process list (nvidia-smi) show what it is and what it
does: the command line (/proc/PID/cmdline) reads `forge-load: gpu 0 filling` (every GPU, with FORGE_GPUS) and
the short name (/proc/PID/comm, 15 characters) `forge-load`.

The command line is rewritten by the setproctitle package where it is installed (the image has it); without it
the command line stays the interpreter's, and only the short name is set, by prctl(PR_SET_NAME) through
ctypes (Linux). Neither can fail the filler.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import threading
from collections.abc import Callable, Iterable
from types import ModuleType

from forge_load.control.status import GpuSlot

COMM = "forge-load"  # /proc/PID/comm: at most 15 bytes
PR_SET_NAME = 15  # <linux/prctl.h>


def _setproctitle() -> ModuleType | None:
    try:
        import setproctitle
    except ImportError:
        return None
    module: ModuleType = setproctitle
    return module


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, looked up once: find_library runs `ldconfig -p` (a child process) each time it is asked, and
    the title is set at start and at every change of state."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def set_comm(name: str = COMM) -> bool:
    """The calling thread's short name (the main thread's is the process's, in `ps`); False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = _libc()
    if libc is None:
        return False
    try:
        return int(libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def describe(slots: Iterable[GpuSlot]) -> str:
    """`forge-load: gpu 0 filling, gpu 1 yielding`: every GPU of the process with its state."""
    parts = [f"gpu {slot.index if slot.index is not None else slot.requested} {slot.state}" for slot in slots]
    return f"{COMM}: {', '.join(parts) or 'starting'}"


class ProcessTitle:
    """Sets the title from any thread; `setter` stands in for setproctitle (tests)."""

    def __init__(self, setter: Callable[[str], None] | None = None) -> None:
        module = _setproctitle() if setter is None else None
        self._set = setter if setter is not None else (module.setproctitle if module is not None else None)
        self._lock = threading.Lock()
        self.title = ""

    def set(self, title: str) -> None:
        with self._lock:
            if title == self.title:
                return
            self.title = title
            if self._set is not None:
                try:
                    self._set(title)
                except Exception:  # noqa: BLE001 - a name is never worth stopping the filler for
                    self._set = None
            # setproctitle also names the calling thread after the title's first 15 bytes; the short name stays ours.
            set_comm()
