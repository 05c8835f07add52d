"""The `forge-load` command (the `forge-load-python` console script, which bin/forge-load runs): its first argument
names a command, anything else is the filler's flags. Every command is a module of forge_load/commands/, imported
only when it is called, so that each loads nothing of the others' (no GPU library for `hold` in a Slurm prolog, no
signal handlers for a command; the filler installs its own before its heavy imports: commands/filler.py).

A new command: its module in forge_load/commands/ with a `main(argv) -> int` (argv: the arguments after the
command's name) and a `build_parser(prog)` (the completion and the man page), its line in COMMANDS, and what it does
in config/load.py's COMMANDS (the filler's --help lists them; tests/test_cli_help.py checks the three agree).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence

# Each command and where it starts: "module:function" under forge_load/commands/ (in the order of the filler's --help,
# config/load.py's COMMANDS, which says what each does).
COMMANDS = {
    "status": "status:main",  # every filler sharing the hold directory (docs/operating.md): any user, no GPU library
    "hold": "hold:main_hold",  # docs/holds.md: no GPU library, fast for a Slurm prolog
    "release": "hold:main_release",
    "holds": "hold:main_holds",
    "health": "health:main",  # exit 0 healthy, 1 not; never 2, which Docker reserves (as `python -m forge_load.health`)
    "fleet": "fleet:main",  # the containers of a Docker host (docs/deploying.md): no CUDA, the docker SDK at need
    "plot": "plot:main",  # a run drawn from its log (docs/operating.md): matplotlib only to draw
}
FILLER = "filler:main"  # no command: the filler


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    where = FILLER
    if args and args[0] in COMMANDS:
        where, args = COMMANDS[args[0]], args[1:]
    module, _, function = where.partition(":")
    command: Callable[[list[str]], int] = getattr(importlib.import_module(f"forge_load.commands.{module}"), function)
    return command(args)


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
