"""How a setting's value is read: one parser per kind of value (ratios, seconds, GPUs, addresses, paths...), each
refusing what it cannot use with the wording of what it accepts, and parse_value, which turns a refusal into the
one-line ConfigError that names the variable or flag and the value. Every value is refused, never guessed at,
when it holds a control character, is longer than MAX_VALUE_CHARS, or has digits other than ASCII ones.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from forge_load.steering.schedule import ACCEPTED as ACTIVE_HOURS_ACCEPTED
from forge_load.steering.schedule import ActiveHours, ScheduleError, parse_active_hours


class ConfigError(Exception):
    """A setting that cannot be used. The message is one line for the operator; the process exits 2."""



# A power cap below any GPU's idle power or above any board's limit is a typo (a cap below idle is no error to
# the filler, which then launches nothing).
MIN_POWER_CAP_W = 10.0
MAX_POWER_CAP_W = 10000.0
# NVML's shortest sample window is 1/6 s; accept values written with a few digits, like 0.1666.
_WINDOW_MIN_S = 1 / 6
_WINDOW_TOLERANCE_S = 1e-3
# Longer than any sensible value (64 GPU UUIDs, hundreds of foreign jobs), short enough that no parser can be slow.
MAX_VALUE_CHARS = 4096
# A whole number with more digits than this is out of every range here (and int() of thousands of digits fails).
_MAX_INT_DIGITS = 18
MAX_GPU_INDEX = 1023
# The simulated GPU's UUID carries the seed in 6 digits.
MAX_SIM_FOREIGN_JOBS = 1000  # per setting; the simulator finds jobs by time, so only set-up grows with it
# A simulation at least a tenth of real time, so that its loop (and heartbeat) steps at least every 20 s of wall
# time.
MIN_SIM_SPEED = 0.1


# --- value parsers -------------------------------------------------------------------------------------
# Each takes the raw text and returns the value or raises Rejected(accepted, detail); parse_value turns that
# into the one-line ConfigError, so the wording of "what is accepted" lives next to the check.


class Rejected(Exception):
    def __init__(self, accepted: str, detail: str | None = None) -> None:
        super().__init__(accepted)
        self.accepted = accepted
        self.detail = detail


# Plain decimal numbers with ASCII digits only: float() would also take "nan", "inf", "1_000" and "١".
_NUMBER_RE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_INT_RE = re.compile(r"[+-]?[0-9]+")
_UNITS = ("ms", "s", "m", "h")  # "ms" before "s" and "m": the first suffix that matches is the unit
_UNIT_S = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_HEX = "[0-9a-f]"
_UUID = rf"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"
_GPU_UUID_RE = re.compile(rf"(GPU|MIG)-({_UUID})", re.IGNORECASE | re.ASCII)
# MIG devices under drivers before R470 were named MIG-GPU-<uuid>/<gi>/<ci>.
_OLD_MIG_RE = re.compile(rf"MIG-GPU-({_UUID})/([0-9]{{1,4}})/([0-9]{{1,4}})", re.IGNORECASE | re.ASCII)
# An IPv6 zone is an interface name (at most 15 characters on Linux) or number.
_ZONE_RE = re.compile(r"[A-Za-z0-9_.-]{1,15}")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def show_number(value: float) -> str:
    return f"{value:g}"


def _interval(low: float | None, low_inclusive: bool, high: float | None, high_inclusive: bool) -> str:
    if high is None:
        return f"{'>=' if low_inclusive else '>'} {show_number(low or 0.0)}"
    opening, closing = "[" if low_inclusive else "(", "]" if high_inclusive else ")"
    return f"{opening}{show_number(low or 0.0)}, {show_number(high)}{closing}"


def _in_range(value: float, low: float | None, low_inclusive: bool, high: float | None, high_inclusive: bool) -> bool:
    if low is not None and (value < low or (value == low and not low_inclusive)):
        return False
    if high is not None and (value > high or (value == high and not high_inclusive)):
        return False
    return True


def _stripped(raw: str, accepted: str) -> str:
    # Spaces and tabs around a value are forgiven; any other control character (a newline too) is refused
    # by parse_value before a parser sees the value.
    text = raw.strip(" \t")
    if not text:
        raise Rejected(accepted, "empty")
    return text


def _float_of(text: str, accepted: str) -> float:
    if not _NUMBER_RE.fullmatch(text):
        raise Rejected(accepted, "not a number")
    value = float(text)
    if not math.isfinite(value):
        raise Rejected(accepted, "not a finite number")
    return value + 0.0  # -0 is 0


def _int_of(text: str, accepted: str, what: str = "not a whole number") -> int:
    if not _INT_RE.fullmatch(text):
        raise Rejected(accepted, what)
    if len(text.lstrip("+-").lstrip("0")) > _MAX_INT_DIGITS:
        raise Rejected(accepted, "out of range")
    return int(text)


def ratio_value(
    raw: str,
    *,
    low: float = 0.0,
    low_inclusive: bool = False,
    high: float = 1.0,
    high_inclusive: bool = True,
    example: float = 0.5,
) -> float:
    accepted = (
        f"a ratio in {_interval(low, low_inclusive, high, high_inclusive)} "
        f"such as {show_number(example)} or {show_number(example * 100)}%"
    )
    text = _stripped(raw, accepted)
    if text.endswith("%"):
        value = _float_of(text[:-1].rstrip(), accepted) / 100
    else:
        value = _float_of(text, accepted)
        if value > 1:
            # The legacy TARGET was a percent; FORGE_* ratios are not, so "50" is ambiguous. Only a whole number
            # reads as a percent: 1.5 is no likelier 1.5 % than a slip for 0.15 or 15.
            fits_as_percent = text.isdigit() and _in_range(value / 100, low, low_inclusive, high, high_inclusive)
            hint = f" (did you mean {text}%?)" if fits_as_percent else ""
            raise Rejected(accepted, f"a ratio above 1 needs %{hint}" if hint else "above 1, the most a ratio is")
    if not _in_range(value, low, low_inclusive, high, high_inclusive):
        raise Rejected(accepted, "out of range")
    return value


def percent_value(raw: str) -> float:
    # Legacy TARGET: the original image's percent. Below 1 is refused: TARGET=0.5 likely meant 50 %.
    accepted = "a percent from 1 to 100 such as 50 or 50%"
    text = _stripped(raw, accepted)
    if text.endswith("%"):
        text = text[:-1].rstrip()
    value = _float_of(text, accepted)
    if not 1 <= value <= 100:
        raise Rejected(accepted, "out of range")
    return value / 100


def seconds_value(
    raw: str,
    *,
    low: float | None = 0.0,
    low_inclusive: bool = True,
    high: float | None = None,
    high_inclusive: bool = True,
    accepted: str | None = None,
) -> float:
    accepted = accepted or (
        f"seconds {_interval(low, low_inclusive, high, high_inclusive)}, a number optionally with ms, s, m or h"
    )
    text = _stripped(raw, accepted)
    unit = next((u for u in _UNITS if text.lower().endswith(u)), None)
    number = text[:-len(unit)].rstrip(" \t") if unit else text
    value = _float_of(number, accepted) * _UNIT_S[unit]
    if not math.isfinite(value) or not _in_range(value, low, low_inclusive, high, high_inclusive):
        raise Rejected(accepted, "out of range")
    return value


def float_value(raw: str, *, low: float, low_inclusive: bool, high: float | None = None, what: str) -> float:
    accepted = f"{what} {_interval(low, low_inclusive, high, True)}"
    value = _float_of(_stripped(raw, accepted), accepted)
    if not _in_range(value, low, low_inclusive, high, True):
        raise Rejected(accepted, "out of range")
    return value


def speed_value(raw: str) -> float:
    accepted = f"0 (as fast as possible) or virtual seconds per real second >= {show_number(MIN_SIM_SPEED)}"
    value = _float_of(_stripped(raw, accepted), accepted)
    if value != 0 and value < MIN_SIM_SPEED:
        raise Rejected(accepted, "out of range")
    return value


def int_value(raw: str, *, low: int, high: int | None = None) -> int:
    accepted = f"a whole number {_interval(low, True, high, True)}"
    value = _int_of(_stripped(raw, accepted), accepted)
    if not _in_range(value, low, True, high, True):
        raise Rejected(accepted, "out of range")
    return value


def bool_value(raw: str) -> bool:
    accepted = "one of 1/0, true/false, yes/no, on/off"
    text = _stripped(raw, accepted).lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise Rejected(accepted)


def choice_value(raw: str, *, choices: tuple[str, ...]) -> str:
    accepted = "one of " + ", ".join(choices)
    text = _stripped(raw, accepted).lower()
    if text not in choices:
        raise Rejected(accepted)
    return text


def gpu_value(raw: str) -> str:
    accepted = (f"a GPU index from 0 to {MAX_GPU_INDEX}, or a UUID such as GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx "
                "or MIG-...")
    text = _stripped(raw, accepted)
    if _INT_RE.fullmatch(text):
        index = _int_of(text, accepted)
        if index < 0:
            raise Rejected(accepted, "negative index")
        if index > MAX_GPU_INDEX:
            raise Rejected(accepted, "index out of range")
        return str(index)
    # NVML reports UUIDs as an upper-case prefix and lower-case hex; compare in that form.
    if m := _GPU_UUID_RE.fullmatch(text):
        return f"{m[1].upper()}-{m[2].lower()}"
    if m := _OLD_MIG_RE.fullmatch(text):
        return f"MIG-GPU-{m[1].lower()}/{int(m[2])}/{int(m[3])}"
    raise Rejected(accepted)


def gpus_value(raw: str) -> Literal["all"] | tuple[str, ...]:
    accepted = "all, or a comma-separated list of GPU indices and UUIDs such as 0,1 or GPU-...,GPU-..."
    text = _stripped(raw, accepted)
    if text.lower() == "all":
        return "all"
    gpus: list[str] = []
    for piece in text.split(","):
        try:
            gpu = gpu_value(piece)
        except Rejected as rejected:
            raise Rejected(accepted, f"{show_value(piece.strip())} is not a GPU index or UUID") from rejected
        if gpu in gpus:
            raise Rejected(accepted, f"GPU {gpu} is listed twice")
        gpus.append(gpu)
    return tuple(gpus)


def port_value(raw: str) -> int:
    try:
        return int_value(raw, low=0, high=65535)
    except Rejected as rejected:
        raise Rejected("a TCP port from 1 to 65535 (0 = any free port)", rejected.detail) from None


def addr_value(raw: str) -> str:
    # An IP literal only: a host name would resolve differently for the filler and the health check.
    accepted = ("an IP address (not a host name) to listen on, such as 0.0.0.0, 127.0.0.1, :: or ::1; "
                "a link-local IPv6 address may name its interface, fe80::1%eth0")
    text = _stripped(raw, accepted)
    inner = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    _, percent, zone = inner.partition("%")
    if percent and not _ZONE_RE.fullmatch(zone):
        raise Rejected(accepted, "the zone after % is not an interface name or number")
    try:
        return str(ipaddress.ip_address(inner))
    except ValueError:
        raise Rejected(accepted) from None


def url_host(addr: str) -> str:
    """An IP address as the host part of `host:port` and of a URL: an IPv6 address in brackets."""
    return f"[{addr}]" if ":" in addr else addr


def path_value(raw: str, example: str = "/run/forge_load/heartbeat") -> str:
    accepted = f"an absolute path, such as {example}"
    text = _stripped(raw, accepted)
    if not text.startswith("/"):
        raise Rejected(accepted, "not an absolute path")
    return text


NAME_MAX_BYTES = 255  # the longest name of one directory entry Linux's file systems take (NAME_MAX)
PATH_MAX_BYTES = 4095  # the longest path the kernel resolves (PATH_MAX, less its NUL)


def dir_value(raw: str, example: str = "/run/forge-load/holds") -> str:
    """A directory's path; a relative one is taken from the current directory (made absolute, so that the start
    line and every reader name the same directory). Any name a directory can have is one (`-1` and `nan` too); one
    that no file system takes (a name over NAME_MAX bytes, a path over PATH_MAX) is refused."""
    accepted = f"a directory's path, such as {example}"
    path = os.path.abspath(_stripped(raw, accepted))
    encoded = os.fsencode(path)
    if len(encoded) > PATH_MAX_BYTES or any(len(part) > NAME_MAX_BYTES for part in encoded.split(b"/")):
        raise Rejected(accepted, f"longer than a path ({PATH_MAX_BYTES} bytes) or a name in it "
                                 f"({NAME_MAX_BYTES} bytes) can be")
    return path


def indices_value(raw: str) -> tuple[int, ...] | None:
    accepted = "all, or a comma-separated list of simulated device indices such as 0,2"
    text = _stripped(raw, accepted)
    if text.lower() == "all":
        return None
    indices: list[int] = []
    for piece in text.split(","):
        index = _int_of(piece.strip(" \t"), accepted, f"{show_value(piece.strip())} is not a device index")
        if index < 0:
            raise Rejected(accepted, f"{show_value(piece.strip())} is not a device index")
        if index in indices:
            raise Rejected(accepted, f"device {index} is listed twice")
        indices.append(index)
    return tuple(sorted(indices))


def failures_value(raw: str) -> tuple[tuple[int, float], ...]:
    accepted = "DEVICE@SECONDS[,DEVICE@SECONDS...] such as 2@30 (device 2 is lost at virtual second 30), or none"
    text = _stripped(raw, accepted)
    if text.lower() == "none":
        return ()
    failures: dict[int, float] = {}
    for piece in text.split(","):
        device_text, at, time_text = piece.strip().partition("@")
        not_this = f"{show_value(piece.strip())} is not DEVICE@SECONDS"
        device = _int_of(device_text.strip(" \t"), accepted, not_this) if at else -1
        if device < 0:
            raise Rejected(accepted, not_this)
        try:
            at_s = seconds_value(time_text)
        except Rejected:
            raise Rejected(accepted, f"{show_value(piece.strip())} does not have SECONDS >= 0") from None
        if device in failures:
            raise Rejected(accepted, f"device {device} is listed twice")
        failures[device] = at_s
    return tuple(sorted(failures.items()))


def power_value(raw: str) -> float:
    accepted = f"watts from {show_number(MIN_POWER_CAP_W)} to {show_number(MAX_POWER_CAP_W)}, such as 300 or 300W"
    text = _stripped(raw, accepted)
    number = text[:-1].rstrip(" \t") if text[-1] in "wW" else text
    value = _float_of(number, accepted)
    if not MIN_POWER_CAP_W <= value <= MAX_POWER_CAP_W:
        raise Rejected(accepted, "out of range")
    return value


def active_hours_value(raw: str) -> ActiveHours:
    text = _stripped(raw, ACTIVE_HOURS_ACCEPTED)
    try:
        return parse_active_hours(text)
    except ScheduleError as error:
        raise Rejected(ACTIVE_HOURS_ACCEPTED, str(error)) from None


def window_value(raw: str) -> float:
    return seconds_value(
        raw,
        low=_WINDOW_MIN_S - _WINDOW_TOLERANCE_S,
        high=1.0,
        accepted="seconds from 1/6 (0.1667) to 1, the NVML sample window",
    )


def intervals_value(raw: str) -> tuple[tuple[float, float], ...]:
    accepted = (f"START-END[,START-END...] in virtual seconds, 0 <= START < END, not overlapping, at most "
                f"{MAX_SIM_FOREIGN_JOBS} jobs, or none")
    text = _stripped(raw, accepted)
    if text.lower() == "none":
        return ()
    pieces = text.split(",")
    if len(pieces) > MAX_SIM_FOREIGN_JOBS:
        raise Rejected(accepted, f"{len(pieces)} jobs")
    spans: list[tuple[float, float]] = []
    for piece in pieces:
        start_text, dash, end_text = piece.strip(" \t").partition("-")
        if not dash:
            raise Rejected(accepted, f"{show_value(piece.strip())} is not START-END")
        start = _float_of(start_text.strip(" \t"), accepted)
        end = _float_of(end_text.strip(" \t"), accepted)
        if start < 0 or end <= start:
            raise Rejected(accepted, f"{show_value(piece.strip())} does not have 0 <= START < END")
        spans.append((start, end))
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start < end:  # touching spans are two jobs back to back, which is allowed
            raise Rejected(accepted, "intervals overlap")
    return tuple(spans)


def show_value(raw: str) -> str:
    """The value for a one-line message: repr escapes every control character and shows stray spaces; a long
    value is cut short, so a 100 kB variable is not echoed back whole."""
    if len(raw) <= 80:
        return repr(raw)
    return f"{raw[:40]!r}... ({len(raw)} characters)"


def unusable(raw: str) -> str | None:
    """Why no parser should see `raw` at all, or None."""
    if len(raw) > MAX_VALUE_CHARS:
        return f"longer than {MAX_VALUE_CHARS} characters"
    if not raw.isprintable() and any(not (c.isprintable() or c in " \t") for c in raw):
        return "contains a control character"
    return None


def parse_value(name: str, raw: str, parser: Callable[[str], Any], also: str = "") -> Any:
    why = unusable(raw)
    try:
        if why is None:
            return parser(raw)
        parser("")  # only for the wording of what is accepted: every parser refuses the empty string
        accepted = "a value of printable characters"
    except Rejected as rejected:
        why, accepted = why or rejected.detail, rejected.accepted
    detail = f"{why}; " if why else ""
    suffix = f" ({also})" if also else ""
    raise ConfigError(f"{name}={show_value(raw)} is not valid: {detail}expected {accepted}{suffix}")




@dataclass(frozen=True)
class Setting:
    key: str  # Config field, or "sim.<field>"
    env: str
    flag: str  # for booleans, the positive form; argparse adds --no-...
    parse: Callable[[str], object]
    help: str
    boolean: bool = False
    # The start line shows it as `logged=<value>` (shown(value) if given); "" leaves it out. Left out too: a
    # value that is None (unset), and the simulator's settings when not simulating.
    logged: str = ""
    shown: Callable[[Any], object] | None = None

    @property
    def dest(self) -> str:
        return self.key.replace(".", "_")

    @property
    def flag_label(self) -> str:
        return "--[no-]" + self.flag[2:] if self.boolean else self.flag

    @property
    def choices(self) -> tuple[str, ...] | None:
        """The values it takes where they are a fixed few (its parser is choice_value's): for --help and the shell
        completion; the value itself is still checked by the parser, with its own message."""
        parse = self.parse
        if isinstance(parse, partial) and parse.func is choice_value:
            return tuple(parse.keywords["choices"])
        return None
