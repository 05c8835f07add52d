"""What several commands share: bad input said in one line (exit 2), and the hold directory they are given
(--hold-dir, FORGE_HOLD_DIR). No GPU library (the host's GPUs: host_gpus.py)."""

from __future__ import annotations

import os

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


def seconds(flag: str, raw: str, low_s: float, high_s: float) -> float:
    """A number of seconds from `low_s` to `high_s`, in ASCII digits (--wait, --watch)."""
    accepted = f"seconds from {low_s:g} to {high_s:g}"
    try:
        value = float(raw)
    except ValueError:
        raise bad(flag, raw, accepted) from None
    if not raw.strip().replace(".", "", 1).isascii() or not low_s <= value <= high_s:
        raise bad(flag, raw, accepted)
    return value


def hold_dir_of(raw: str | None, env: dict[str, str] | os._Environ[str]) -> str:
    """--hold-dir, else FORGE_HOLD_DIR, else the default: an absolute path without control characters."""
    if raw is not None:
        flag, value = "--hold-dir", raw
    elif "FORGE_HOLD_DIR" in env:
        flag, value = "FORGE_HOLD_DIR", env["FORGE_HOLD_DIR"]
    else:
        return holds.DEFAULT_HOLD_DIR
    if not value.startswith("/") or escape_controls(value) != value:
        raise bad(flag, value, "an absolute path, such as /run/forge-load/holds")
    return value
