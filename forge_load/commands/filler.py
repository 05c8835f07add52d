"""`forge-load` without a command: the filler, its stop signals caught first, before anything else is imported.

The imports behind the filler take a few hundred milliseconds. In a container the filler is PID 1, and the
kernel drops a signal to PID 1 that has no handler: a `docker stop` in that window would be lost, and Docker
would kill the filler 10 s later. So this module, which imports nothing heavy, installs the handlers first.

SIGTERM, SIGINT and SIGHUP all mean "stop": the kernels in flight finish, a `stop` line is logged, exit 0.
SIGUSR1 pauses and SIGUSR2 resumes. How they are caught and handed on: service/unix_signals.py. The process names
itself after its GPUs and their states (service/title.py). Exit codes: service/app.py says when each applies
(forge_load/exits.py names them).
"""

from __future__ import annotations

from collections.abc import Sequence

from forge_load.exits import EXIT_INTERNAL
from forge_load.service.unix_signals import StopSignals


def main(argv: Sequence[str]) -> int:
    signals = StopSignals.install()  # before the imports below: they take a while
    try:
        from forge_load.service.app import main as run
        from forge_load.service.title import ProcessTitle

        return run(list(argv), signals=signals, title=ProcessTitle())
    except Exception as error:  # noqa: BLE001 - a bug outside the run loops: one line, no traceback
        from forge_load.log import internal_error, say

        say(f"forge-load: {internal_error(error)}")
        return EXIT_INTERNAL
    finally:
        signals.ignore()
