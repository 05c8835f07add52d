"""The `forge-load` command: stop signals are caught first, before anything else is imported.

The imports behind the filler take a few hundred milliseconds. In a container the filler is PID 1, and the
kernel drops a signal to PID 1 that has no handler: a `docker stop` in that window would be lost, and Docker
would kill the filler 10 s later. So this module, which imports nothing heavy, installs the handlers first.

SIGTERM, SIGINT and SIGHUP all mean "stop": the kernels in flight finish, a `stop` line is logged, exit 0.
SIGUSR1 pauses and SIGUSR2 resumes. How they are caught and handed on: service/unix_signals.py. The process names
itself after its GPUs and their states (title.py).

`forge-load hold|release|holds ...` (service/holdcmd.py), `forge-load health` (service/health.py) and
`forge-load fleet ...` (fleet/) and `forge-load plot` (plot/) are commands, dispatched before anything else.
"""

from __future__ import annotations

import os
import sys

from forge_load.service.unix_signals import StopSignals


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in ("hold", "release", "holds"):
        # The hold commands (docs/holds.md): no signal handlers, no GPU library, fast for a Slurm prolog.
        from forge_load.service.holdcmd import main as command

        return command(sys.argv[1:])
    if len(sys.argv) > 1 and sys.argv[1] == "fleet":
        # The containers of a Docker host (docs/deploying.md): no signal handlers (Ctrl-C is the operator's),
        # no CUDA, the docker SDK only for a command that needs the engine.
        from forge_load.fleet.command import main as fleet

        return fleet(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "status":
        # Every filler of the host that shares the hold directory (docs/operating.md): any user, no GPU library.
        from forge_load.service.statuscmd import main as status

        return status(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "plot":
        # A run drawn from its log (docs/operating.md): matplotlib, the optional extra, imported only to draw.
        from forge_load.plot.command import main as plot

        return plot(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "health":
        # The health check (exit 0 healthy, 1 not; never 2, which Docker reserves), as `python -m forge_load.health`.
        from forge_load.service.health import main as check

        return check(sys.argv[2:])
    signals = StopSignals.install()  # before the imports below: they take a while
    try:
        from forge_load.service.app import main as run
        from forge_load.service.title import ProcessTitle

        return run(signals=signals, title=ProcessTitle())
    except Exception as error:  # noqa: BLE001 - a bug outside the run loops: one line, no traceback
        from forge_load.log import escape_controls, internal_error

        print(escape_controls(f"forge-load: {internal_error(error)}"),
              file=sys.stderr)
        return 1
    finally:
        signals.ignore()


def entry() -> None:
    """The console script: main(), then out at once. Everything is logged, flushed and closed by then; what is
    left is the interpreter tearing down numba's objects, half a second of CPU that would stretch `docker
    stop` past its second on a busy host."""
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a broken stdout was already reported (exit 5)
    os._exit(code)


if __name__ == "__main__":
    entry()
