"""The child process of exclusive compute mode (exclusive.py): the ordinary filler of one GPU, whose CUDA context
lives and dies with this process. Started by the supervisor as `python -m forge_load.service.exclusive_child`, with the
config pickled on stdin."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable
from typing import IO, TextIO

from forge_load.config.settings import Config
from forge_load.control.policy import FILLING_STATES
from forge_load.control.status import GpuSlot
from forge_load.gpu.backend import Backend, NvidiaBackend
from forge_load.log import internal_error
from forge_load.service import gpu_threads, runtime
from forge_load.service.title import ProcessTitle


def child_main(stdin: IO[bytes], out: TextIO, backend: Backend | None = None,
               title: Callable[[str], None] | None = None) -> int:
    """The child: the ordinary filler of one GPU, which ends when asked (SIGTERM), when its filler stops filling,
    or when the supervisor is gone (EOF on stdin). `backend`: the machine's GPUs (tests: the simulated one);
    `title` names the process (ProcessTitle.set)."""
    config, parent_start_s = pickle.load(stdin)
    if not isinstance(config, Config) or not isinstance(parent_start_s, float):
        raise TypeError("the supervisor sent something other than (Config, its start time)")
    # Named in ps and in the GPU's process list like its parent (docs/design.md §10); it lives only while filling.
    if title is not None:
        title(f"forge-load: exclusive-mode child of {os.getppid()}, filling {config.gpu}")
    stop, wake = runtime.StopEvent(), threading.Event()

    def asked(signum: int, _frame: object) -> None:
        runtime.request_stop(stop, wake, f"asked to end by the supervisor ({signal.Signals(signum).name})")

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, asked)

    def orphaned() -> None:
        with contextlib.suppress(OSError):
            stdin.read()
        runtime.request_stop(stop, wake, "the supervisor is gone")

    threading.Thread(target=orphaned, name="supervisor", daemon=True).start()
    started: list[runtime.Runtime] = []

    def not_filling() -> None:
        if started and started[0].filler.state not in FILLING_STATES:
            state = started[0].filler.state.value
            runtime.request_stop(stop, wake, f"{state} in exclusive compute mode: ends, so that its context goes too")

    def on_start(_slot: GpuSlot, rt: runtime.Runtime) -> None:
        rt.log.t_offset_s = rt.start_s - parent_start_s  # one timeline with the supervisor's lines (monotonic)
        started.append(rt)

    slot = GpuSlot(config.gpu)
    gpu_threads.run_gpu(config, backend or NvidiaBackend(), slot, out, stop, wake,
                        runtime.Controls(on_transition=not_filling), on_start=on_start, supervise=False)
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
