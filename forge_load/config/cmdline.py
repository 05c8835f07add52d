"""The command line: the table of commands (COMMANDS), and the one argument parser of every command and of the filler's
own flags: argparse, except that a command line it refuses is an exception (UsageError) for the caller to say in its own
one line and exit code, where argparse would print its usage and exit 2 itself (2 is "unhealthy" to nobody and
"reserved" to Docker's health check)."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Iterable, Sequence
from typing import NoReturn

# Every command of `forge-load COMMAND`, in the order the filler's --help lists them: where it starts ("module:function"
# under forge_load/commands/, which forge_load/cli.py imports only when it is called) and what it does, in the one
# line the filler's --help, the completion and the man page give it.
COMMANDS: dict[str, tuple[str, str]] = {
    "status": ("status:main", "every filler on this host, a row per GPU"),
    "hold": ("hold:main_hold", "hold GPUs for a job: their fillers step aside (docs/holds.md)"),
    "release": ("hold:main_release", "release a hold"),
    "holds": ("hold:main_holds", "the holds in place"),
    "health": ("health:main", "the health check of a filler started with the same settings"),
    "fleet": ("fleet:main", "one filler container per GPU of a Docker host: up, down, status, logs, watch"),
    "plot": ("plot:main", "draw a run from its log (PNG or SVG)"),
}


class UsageError(Exception):
    """argparse's message for a command line it refused (an unknown flag, a missing value), as argparse words it."""


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name `name` is most likely a typo of (difflib's ratio of at least 0.6), or None: for a flag this
    parser does not know, and for a FORGE_ variable that is no setting (config/load.py)."""
    found = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return found[0] if found else None


class ArgParser(argparse.ArgumentParser):
    _given: list[str] | None = None  # the arguments being parsed, for error()'s guesses

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        raise UsageError(message + self._guesses(message))

    def _guesses(self, message: str) -> str:
        """" (did you mean --target?)" for each flag given that this parser does not know and that is close to one it
        does, as a mistyped FORGE_ variable is told (config/load.py): argparse says only that it is not known, or
        that the flag it was meant for is missing."""
        known = [option for option in self._option_string_actions if option.startswith("--")]
        typos = {flag: guess for flag in (word.partition("=")[0] for word in self._given or [])
                 if flag.startswith("--") and flag not in self._option_string_actions
                 and (guess := closest(flag, known)) is not None}
        return "".join(f" ({flag}: did you mean {guess}?)" for flag, guess in typos.items())
