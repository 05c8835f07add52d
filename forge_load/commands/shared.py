"""What several commands share: bad input said in one line (exit 2), and the hold directory they are given
(--hold-dir, FORGE_HOLD_DIR). No GPU library (the host's GPUs: host_gpus.py)."""

from __future__ import annotations

import os
import re

from forge_load.log import escape_controls
from forge_load.steering import holds


class BadInput(Exception):
    """One line for the operator; exit 2."""


def shown(raw: str) -> str:
    """A value as given, for a line that names it: escaped, quoted, and cut at 80 characters."""
    text = escape_controls(raw)
    return repr(text if len(text) <= 80 else text[:80] + "...")


def bad(flag: str, raw: str, accepted: str) -> BadInput:
    return BadInput(f"{flag}={shown(raw)}: expected {accepted}")


SECONDS_RE = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+", re.ASCII)  # no sign, exponent or `_` (1_0 is not 10)


def seconds(flag: str, raw: str, low_s: float, high_s: float) -> float:
    """A number of seconds from `low_s` to `high_s`, in ASCII digits with at most one point (--wait, --watch)."""
    accepted = f"seconds from {low_s:g} to {high_s:g}, in digits (such as 5 or 0.5)"
    if not SECONDS_RE.fullmatch(raw.strip()):
        raise bad(flag, raw, accepted)
    value = float(raw)
    if not low_s <= value <= high_s:
        raise bad(flag, raw, accepted)
    return value


def dir_of(flag: str, raw: str | None, variable: str, env: dict[str, str] | os._Environ[str]) -> str | None:
    """A directory given by `flag`, else by `variable`, else None: a path without control characters, taken from
    the current directory where relative (made absolute, so that it names the same directory in every line)."""
    if raw is not None:
        name, value = flag, raw
    elif variable in env:
        name, value = variable, env[variable]
    else:
        return None
    if not value.strip() or escape_controls(value) != value:
        raise bad(name, value, "a directory's path, such as /run/forge-load/holds")
    return os.path.abspath(value)


def hold_dir_of(raw: str | None, env: dict[str, str] | os._Environ[str]) -> str:
    """--hold-dir, else FORGE_HOLD_DIR, else the default (dir_of)."""
    return dir_of("--hold-dir", raw, "FORGE_HOLD_DIR", env) or holds.DEFAULT_HOLD_DIR
