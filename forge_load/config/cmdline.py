"""The one argument parser of every command and of the filler's own flags: argparse, except that a command line it
refuses is an exception (UsageError) for the caller to say in its own one line and exit code, where argparse would
print its usage and exit 2 itself (2 is "unhealthy" to nobody and "reserved" to Docker's health check)."""

from __future__ import annotations

import argparse
from typing import NoReturn


class UsageError(Exception):
    """argparse's message for a command line it refused (an unknown flag, a missing value), as argparse words it."""


class ArgParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)
