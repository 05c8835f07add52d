"""The `forge-load` command (the `forge-load-python` console script, which bin/forge-load runs): its first argument
names a command, anything else is the filler's flags. Every command is a module of forge_load/commands/, imported
only when it is called, so that each loads nothing of the others' (no GPU library for `hold` in a Slurm prolog, no
signal handlers for a command; the filler installs its own before its heavy imports: commands/filler.py).

A new command: its module in forge_load/commands/ with a `main(argv) -> int` (argv: the arguments after the
command's name) and a `build_parser(prog)` (the completion and the man page), and its line in config/cmdline.py's
COMMANDS: where it starts and what it does, in one place (tests/test_cli_help.py checks every module has its line).

The standard streams are made safe here, once for every command: a closed one at start keeps its number (/dev/null
holds it, so that no file opened later takes it), a closed stdout or stdin reads and writes as closed, a closed stderr
loses the messages and nothing else; a write to stdout that fails ends the command, in one line and exit 5, or in
none and exit 141 where the reader of a pipe stopped reading (docs/operating.md, "Exit codes and signals").
"""

from __future__ import annotations

import errno
import importlib
import io
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO, cast

from forge_load.config.cmdline import COMMANDS
from forge_load.exits import EXIT_BROKEN_PIPE, EXIT_OUTPUT_LOST
from forge_load.log import OutputLost, say, to_devnull

FILLER = "filler:main"  # no command: the filler


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    prog, where = "forge-load", FILLER
    if args and args[0] in COMMANDS:
        prog, where, args = f"forge-load {args[0]}", COMMANDS[args[0]][0], args[1:]
    module, _, function = where.partition(":")
    command: Callable[[list[str]], int] = getattr(importlib.import_module(f"forge_load.commands.{module}"), function)
    stdout = sys.stdout
    sys.stdout = cast(TextIO, _Stdout(stdout))
    try:
        return command(args)
    except OutputLost as lost:
        return output_lost(prog, lost.error, stdout)
    finally:
        sys.stdout = stdout


class _Stdout:
    """sys.stdout while a command runs: a write that fails raises OutputLost, which no handler of the command's own
    mistakes for bad input (an `except OSError`), up to main(). The filler's log catches it as its own failure
    (log.LogStream: the fillers stop, exit 5)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (OSError, ValueError) as error:  # ValueError: closed under us
            raise _lost(error) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError) as error:
            raise _lost(error) from None

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, buffer...: the stream's own
        return getattr(self._stream, name)


def _lost(error: OSError | ValueError) -> OutputLost:
    return OutputLost(error if isinstance(error, OSError) else OSError(errno.EBADF, "stdout is closed"))


def output_lost(prog: str, error: OSError, stdout: TextIO) -> int:
    """A command's stdout failed: a reader that stopped reading is a quiet end (EXIT_BROKEN_PIPE, as for any tool
    that SIGPIPE ends); anything else (closed, full) is one line and EXIT_OUTPUT_LOST."""
    to_devnull(stdout)  # what is still buffered goes nowhere, and the last flush cannot fail again
    if error.errno == errno.EPIPE:
        return EXIT_BROKEN_PIPE
    say(f"{prog}: stdout could not be written ({error.strerror or error})")
    return EXIT_OUTPUT_LOST


class _Closed(io.RawIOBase):
    """A standard stream that was closed when the process started: every read and write fails as on a closed
    descriptor (EBADF), while /dev/null keeps its number (`fd`) taken."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd

    def fileno(self) -> int:
        return self._fd

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    def write(self, data: Any) -> int:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))


def standard_streams() -> None:
    """Each standard stream closed at start (`<&-`, `>&-`, `2>&-`: Python then sets it to None) is given /dev/null's
    descriptor, so that no file this process opens takes its number (a heartbeat opened as descriptor 1 would be
    written to as stdout by whatever writes there, a child's included). stdin and stdout then fail as closed: a
    command says so (exit 5), the filler stops (exit 5). stderr writes to /dev/null: its messages are lost, and the
    exit code still says what happened (without this, print() to a None stderr writes to stdout: into the log)."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        os.set_inheritable(fd, True)  # a child started with the standard streams finds it taken too
        if fd == 0:
            setattr(sys, name, io.TextIOWrapper(io.BufferedReader(_Closed(fd)), encoding="utf-8"))
        elif fd == 1:
            setattr(sys, name, io.TextIOWrapper(cast(Any, _Closed(fd)), encoding="utf-8", write_through=True))
        else:
            setattr(sys, name, open(fd, "w", encoding="utf-8", errors="backslashreplace", closefd=False))


def entry() -> None:
    """The console script: the standard streams made safe, main(), then out at once. Everything is logged, flushed
    and closed by then; what is left is the interpreter's own teardown (every module's objects, the CUDA bindings'
    and NVML's among them, beside daemon threads that may still sit in a driver call), which nobody waits for and
    which would only stretch `docker stop` on a busy host."""
    standard_streams()
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # already said (exit 5) or nowhere to say it
    os._exit(code)


if __name__ == "__main__":
    entry()
