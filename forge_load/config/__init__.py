"""The daemon's settings: read from the environment, overridden by command-line flags, every value checked.

A bad value is a ConfigError whose message is one line naming the variable (and its flag), the value as
given (escaped, and shortened when long) and what is accepted; app.py prints it and exits 2. Every value is
refused, never guessed at, when it holds a control character, is longer than MAX_VALUE_CHARS, or has digits
other than ASCII ones. Nothing here touches the GPU. `python -m forge_load.health` and scripts/forge_fleet.py
read and check settings through load_config too, so all three accept and refuse the same values.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import ipaddress
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, NoReturn

from forge_load import __version__
from forge_load.log import escape_controls
from forge_load.operators.holds import DEFAULT_HOLD_DIR, DEFAULT_IDLE_AGE_OUT_S
from forge_load.operators.schedule import ACCEPTED as ACTIVE_HOURS_ACCEPTED
from forge_load.operators.schedule import ActiveHours, ScheduleError, local_zone, parse_active_hours


class ConfigError(Exception):
    """A setting that cannot be used. The message is one line for the operator; the process exits 2."""


@dataclass(frozen=True)
class SimConfig:
    speed: float = 1.0
    window_s: float = 1 / 6
    sms: int = 132
    foreign_s: tuple[tuple[float, float], ...] = ()
    foreign_hidden_s: tuple[tuple[float, float], ...] = ()  # more jobs, always left out of the process list
    foreign_load_ratio: float = 0.9
    foreign_mem_mib: float = 2048.0
    hide_foreign: bool = False
    seed: int = 0
    gpus: int = 1
    foreign_gpus: tuple[int, ...] | None = None  # which simulated devices get the foreign jobs; None = all
    fail_gpus: tuple[tuple[int, float], ...] = ()  # (device, virtual second it is lost)


@dataclass(frozen=True)
class Config:
    target_ratio: float = 0.5
    gpu: str = "0"
    gpus: Literal["all"] | tuple[str, ...] | None = None  # several GPUs in one process; None = just `gpu`
    boost_target_ratio: float = 0.6
    boost_after_s: float = 3600.0
    resume_after_s: float = 60.0
    log_interval_s: float = 10.0
    log_format: str = "text"
    duration_s: float = 0.0
    controller: str = "pi"
    poll_interval_s: float = 0.1
    foreign_mem_mib: float = 64.0
    foreign_util_ratio: float = 0.1
    foreign_util_samples: int = 2
    use_process_list: bool = True
    simulate: bool = False
    metrics_port: int | None = None  # None: no metrics/health server; 0: any free port
    metrics_addr: str = "0.0.0.0"
    health_max_age_s: float = 30.0
    heartbeat_file: str | None = None  # None: forge_load.service.health's default, in a directory only we own
    max_power_w: float | None = None  # the power cap; None: none
    active_hours: ActiveHours | None = None  # None: always
    pause_file: str | None = None
    hold_dir: str = DEFAULT_HOLD_DIR
    hold_idle_age_out_s: float = DEFAULT_IDLE_AGE_OUT_S  # 0: never
    kubelet_socket: str | None = None  # the kubelet's pod-resources socket; None: not asked
    time_zone: str | None = None  # TZ as given, checked when the hours or the pause file need local time
    sim: SimConfig = field(default_factory=SimConfig)


MAX_FOREIGN_SAMPLES = 100  # the Monitor keeps this many judged sample windows for the signals
# A power cap below any GPU's idle power or above any board's limit is a typo (a cap below idle is no error to
# the filler, which then launches nothing).
MIN_POWER_CAP_W = 10.0
MAX_POWER_CAP_W = 10000.0
CONTROLLER_NAMES = ("pi", "legacy")  # controller.make_controller makes each of these

# Boost target used when none is given; a target above it means "no boost" rather than an error.
DEFAULT_BOOST_TARGET = 0.6
LEGACY_TARGET_ENV = "TARGET"
# NVML's shortest sample window is 1/6 s; accept values written with a few digits, like 0.1666.
_WINDOW_MIN_S = 1 / 6
_WINDOW_TOLERANCE_S = 1e-3
# Longer than any sensible value (64 GPU UUIDs, hundreds of foreign jobs), short enough that no parser can be slow.
MAX_VALUE_CHARS = 4096
# A whole number with more digits than this is out of every range here (and int() of thousands of digits fails).
_MAX_INT_DIGITS = 18
MAX_GPU_INDEX = 1023
# The simulated GPU's UUID carries the seed in 6 digits.
MAX_SIM_SEED = 999_999
MAX_SIM_FOREIGN_JOBS = 1000  # per setting; the simulator finds jobs by time, so only set-up grows with it
# Floors that keep the loop sane: status lines at most 10 a second; a simulation at least a tenth of real time,
# so that its loop (and heartbeat) steps at least every 20 s of wall time.
MIN_LOG_INTERVAL_S = 0.1
MIN_SIM_SPEED = 0.1
# The loop beats its heartbeat once a second of its clock, on the first step after that (filler.py), and
# steps at least once per poll interval. /health and the health command allow twice the longest gap, and never
# less than this: under a second, /health would flap between polls.
HEARTBEAT_EVERY_S = 1.0
MIN_HEALTH_MAX_AGE_S = 2.0
DEFAULT_HEALTH_MAX_AGE_S = 30.0


# --- value parsers -------------------------------------------------------------------------------------
# Each takes the raw text and returns the value or raises _Rejected(accepted, detail); _apply turns that
# into the one-line ConfigError, so the wording of "what is accepted" lives next to the check.


class _Rejected(Exception):
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


def _num(value: float) -> str:
    return f"{value:g}"


def _interval(low: float | None, low_inclusive: bool, high: float | None, high_inclusive: bool) -> str:
    if high is None:
        return f"{'>=' if low_inclusive else '>'} {_num(low or 0.0)}"
    return f"{'[' if low_inclusive else '('}{_num(low or 0.0)}, {_num(high)}{']' if high_inclusive else ')'}"


def _in_range(value: float, low: float | None, low_inclusive: bool, high: float | None, high_inclusive: bool) -> bool:
    if low is not None and (value < low or (value == low and not low_inclusive)):
        return False
    if high is not None and (value > high or (value == high and not high_inclusive)):
        return False
    return True


def _stripped(raw: str, accepted: str) -> str:
    # Spaces and tabs around a value are forgiven; any other control character (a newline too) is refused
    # by _apply before a parser sees the value.
    text = raw.strip(" \t")
    if not text:
        raise _Rejected(accepted, "empty")
    return text


def _float_of(text: str, accepted: str) -> float:
    if not _NUMBER_RE.fullmatch(text):
        raise _Rejected(accepted, "not a number")
    value = float(text)
    if not math.isfinite(value):
        raise _Rejected(accepted, "not a finite number")
    return value + 0.0  # -0 is 0


def _int_of(text: str, accepted: str, what: str = "not a whole number") -> int:
    if not _INT_RE.fullmatch(text):
        raise _Rejected(accepted, what)
    if len(text.lstrip("+-").lstrip("0")) > _MAX_INT_DIGITS:
        raise _Rejected(accepted, "out of range")
    return int(text)


def _ratio_value(
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
        f"such as {_num(example)} or {_num(example * 100)}%"
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
            raise _Rejected(accepted, f"a ratio above 1 needs %{hint}" if hint else "above 1, the most a ratio is")
    if not _in_range(value, low, low_inclusive, high, high_inclusive):
        raise _Rejected(accepted, "out of range")
    return value


def _percent_value(raw: str) -> float:
    # Legacy TARGET: the original image's percent. Below 1 is refused: TARGET=0.5 likely meant 50 %.
    accepted = "a percent from 1 to 100 such as 50 or 50%"
    text = _stripped(raw, accepted)
    if text.endswith("%"):
        text = text[:-1].rstrip()
    value = _float_of(text, accepted)
    if not 1 <= value <= 100:
        raise _Rejected(accepted, "out of range")
    return value / 100


def _seconds_value(
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
        raise _Rejected(accepted, "out of range")
    return value


def _float_value(raw: str, *, low: float, low_inclusive: bool, high: float | None = None, what: str) -> float:
    accepted = f"{what} {_interval(low, low_inclusive, high, True)}"
    value = _float_of(_stripped(raw, accepted), accepted)
    if not _in_range(value, low, low_inclusive, high, True):
        raise _Rejected(accepted, "out of range")
    return value


def _speed_value(raw: str) -> float:
    accepted = f"0 (as fast as possible) or virtual seconds per real second >= {_num(MIN_SIM_SPEED)}"
    value = _float_of(_stripped(raw, accepted), accepted)
    if value != 0 and value < MIN_SIM_SPEED:
        raise _Rejected(accepted, "out of range")
    return value


def _int_value(raw: str, *, low: int, high: int | None = None) -> int:
    accepted = f"a whole number {_interval(low, True, high, True)}"
    value = _int_of(_stripped(raw, accepted), accepted)
    if not _in_range(value, low, True, high, True):
        raise _Rejected(accepted, "out of range")
    return value


def _bool_value(raw: str) -> bool:
    accepted = "one of 1/0, true/false, yes/no, on/off"
    text = _stripped(raw, accepted).lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise _Rejected(accepted)


def _choice_value(raw: str, *, choices: tuple[str, ...]) -> str:
    accepted = "one of " + ", ".join(choices)
    text = _stripped(raw, accepted).lower()
    if text not in choices:
        raise _Rejected(accepted)
    return text


def _gpu_value(raw: str) -> str:
    accepted = (f"a GPU index from 0 to {MAX_GPU_INDEX}, or a UUID such as GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx "
                "or MIG-...")
    text = _stripped(raw, accepted)
    if _INT_RE.fullmatch(text):
        index = _int_of(text, accepted)
        if index < 0:
            raise _Rejected(accepted, "negative index")
        if index > MAX_GPU_INDEX:
            raise _Rejected(accepted, "index out of range")
        return str(index)
    # NVML reports UUIDs as an upper-case prefix and lower-case hex; compare in that form.
    if m := _GPU_UUID_RE.fullmatch(text):
        return f"{m[1].upper()}-{m[2].lower()}"
    if m := _OLD_MIG_RE.fullmatch(text):
        return f"MIG-GPU-{m[1].lower()}/{int(m[2])}/{int(m[3])}"
    raise _Rejected(accepted)


def _gpus_value(raw: str) -> Literal["all"] | tuple[str, ...]:
    accepted = "all, or a comma-separated list of GPU indices and UUIDs such as 0,1 or GPU-...,GPU-..."
    text = _stripped(raw, accepted)
    if text.lower() == "all":
        return "all"
    gpus: list[str] = []
    for piece in text.split(","):
        try:
            gpu = _gpu_value(piece)
        except _Rejected as rejected:
            raise _Rejected(accepted, f"{_shown(piece.strip())} is not a GPU index or UUID") from rejected
        if gpu in gpus:
            raise _Rejected(accepted, f"GPU {gpu} is listed twice")
        gpus.append(gpu)
    return tuple(gpus)


def _port_value(raw: str) -> int:
    try:
        return _int_value(raw, low=0, high=65535)
    except _Rejected as rejected:
        raise _Rejected("a TCP port from 1 to 65535 (0 = any free port)", rejected.detail) from None


def _addr_value(raw: str) -> str:
    # An IP literal only: a host name would resolve differently for the filler and the health check.
    accepted = ("an IP address (not a host name) to listen on, such as 0.0.0.0, 127.0.0.1, :: or ::1; "
                "a link-local IPv6 address may name its interface, fe80::1%eth0")
    text = _stripped(raw, accepted)
    inner = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    _, percent, zone = inner.partition("%")
    if percent and not _ZONE_RE.fullmatch(zone):
        raise _Rejected(accepted, "the zone after % is not an interface name or number")
    try:
        return str(ipaddress.ip_address(inner))
    except ValueError:
        raise _Rejected(accepted) from None


def _path_value(raw: str, example: str = "/run/forge_load/heartbeat") -> str:
    accepted = f"an absolute path, such as {example}"
    text = _stripped(raw, accepted)
    if not text.startswith("/"):
        raise _Rejected(accepted, "not an absolute path")
    return text


def _indices_value(raw: str) -> tuple[int, ...] | None:
    accepted = "all, or a comma-separated list of simulated device indices such as 0,2"
    text = _stripped(raw, accepted)
    if text.lower() == "all":
        return None
    indices: list[int] = []
    for piece in text.split(","):
        index = _int_of(piece.strip(" \t"), accepted, f"{_shown(piece.strip())} is not a device index")
        if index < 0:
            raise _Rejected(accepted, f"{_shown(piece.strip())} is not a device index")
        if index in indices:
            raise _Rejected(accepted, f"device {index} is listed twice")
        indices.append(index)
    return tuple(sorted(indices))


def _failures_value(raw: str) -> tuple[tuple[int, float], ...]:
    accepted = "DEVICE@SECONDS[,DEVICE@SECONDS...] such as 2@30 (device 2 is lost at virtual second 30), or none"
    text = _stripped(raw, accepted)
    if text.lower() == "none":
        return ()
    failures: dict[int, float] = {}
    for piece in text.split(","):
        device_text, at, time_text = piece.strip().partition("@")
        not_this = f"{_shown(piece.strip())} is not DEVICE@SECONDS"
        device = _int_of(device_text.strip(" \t"), accepted, not_this) if at else -1
        if device < 0:
            raise _Rejected(accepted, not_this)
        try:
            at_s = _seconds_value(time_text)
        except _Rejected:
            raise _Rejected(accepted, f"{_shown(piece.strip())} does not have SECONDS >= 0") from None
        if device in failures:
            raise _Rejected(accepted, f"device {device} is listed twice")
        failures[device] = at_s
    return tuple(sorted(failures.items()))


def _power_value(raw: str) -> float:
    accepted = f"watts from {_num(MIN_POWER_CAP_W)} to {_num(MAX_POWER_CAP_W)}, such as 300 or 300W"
    text = _stripped(raw, accepted)
    number = text[:-1].rstrip(" \t") if text[-1] in "wW" else text
    value = _float_of(number, accepted)
    if not MIN_POWER_CAP_W <= value <= MAX_POWER_CAP_W:
        raise _Rejected(accepted, "out of range")
    return value


def _active_hours_value(raw: str) -> ActiveHours:
    text = _stripped(raw, ACTIVE_HOURS_ACCEPTED)
    try:
        return parse_active_hours(text)
    except ScheduleError as error:
        raise _Rejected(ACTIVE_HOURS_ACCEPTED, str(error)) from None


def _window_value(raw: str) -> float:
    return _seconds_value(
        raw,
        low=_WINDOW_MIN_S - _WINDOW_TOLERANCE_S,
        high=1.0,
        accepted="seconds from 1/6 (0.1667) to 1, the NVML sample window",
    )


def _intervals_value(raw: str) -> tuple[tuple[float, float], ...]:
    accepted = (f"START-END[,START-END...] in virtual seconds, 0 <= START < END, not overlapping, at most "
                f"{MAX_SIM_FOREIGN_JOBS} jobs, or none")
    text = _stripped(raw, accepted)
    if text.lower() == "none":
        return ()
    pieces = text.split(",")
    if len(pieces) > MAX_SIM_FOREIGN_JOBS:
        raise _Rejected(accepted, f"{len(pieces)} jobs")
    spans: list[tuple[float, float]] = []
    for piece in pieces:
        start_text, dash, end_text = piece.strip(" \t").partition("-")
        if not dash:
            raise _Rejected(accepted, f"{_shown(piece.strip())} is not START-END")
        start = _float_of(start_text.strip(" \t"), accepted)
        end = _float_of(end_text.strip(" \t"), accepted)
        if start < 0 or end <= start:
            raise _Rejected(accepted, f"{_shown(piece.strip())} does not have 0 <= START < END")
        spans.append((start, end))
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start < end:  # touching spans are two jobs back to back, which is allowed
            raise _Rejected(accepted, "intervals overlap")
    return tuple(spans)


def parse_ratio(
    name: str,
    raw: str,
    *,
    low: float = 0.0,
    low_inclusive: bool = False,
    high: float = 1.0,
    high_inclusive: bool = True,
    example: float = 0.5,
) -> float:
    """"0.5" and "50%" both give 0.5; "50" is refused (a ratio above 1 needs %). Raises ConfigError."""
    parser = partial(
        _ratio_value, low=low, low_inclusive=low_inclusive, high=high, high_inclusive=high_inclusive, example=example
    )
    ratio: float = _apply(name, raw, parser)
    return ratio


def _shown(raw: str) -> str:
    """The value for a one-line message: repr escapes every control character and shows stray spaces; a long
    value is cut short, so a 100 kB variable is not echoed back whole."""
    if len(raw) <= 80:
        return repr(raw)
    return f"{raw[:40]!r}... ({len(raw)} characters)"


def _unusable(raw: str) -> str | None:
    """Why no parser should see `raw` at all, or None."""
    if len(raw) > MAX_VALUE_CHARS:
        return f"longer than {MAX_VALUE_CHARS} characters"
    if not raw.isprintable() and any(not (c.isprintable() or c in " \t") for c in raw):
        return "contains a control character"
    return None


def _apply(name: str, raw: str, parser: Callable[[str], Any], also: str = "") -> Any:
    why = _unusable(raw)
    try:
        if why is None:
            return parser(raw)
        parser("")  # only for the wording of what is accepted: every parser refuses the empty string
        accepted = "a value of printable characters"
    except _Rejected as rejected:
        why, accepted = why or rejected.detail, rejected.accepted
    detail = f"{why}; " if why else ""
    suffix = f" ({also})" if also else ""
    raise ConfigError(f"{name}={_shown(raw)} is not valid: {detail}expected {accepted}{suffix}")


# --- the settings table --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    key: str  # Config field, or "sim.<field>"
    env: str
    flag: str  # for booleans, the positive form; argparse adds --no-...
    parse: Callable[[str], object]
    help: str
    boolean: bool = False

    @property
    def dest(self) -> str:
        return self.key.replace(".", "_")

    @property
    def flag_label(self) -> str:
        return "--[no-]" + self.flag[2:] if self.boolean else self.flag


SETTINGS: tuple[Setting, ...] = (
    Setting("target_ratio", "FORGE_TARGET", "--target", partial(_ratio_value, example=0.5),
            "utilization to hold, 0.5 or 50% (legacy env TARGET=50 also read); default 0.5"),
    Setting("gpu", "FORGE_GPU", "--gpu", _gpu_value, "GPU index or UUID; default 0"),
    Setting("gpus", "FORGE_GPUS", "--gpus", _gpus_value,
            "fill several GPUs from one process: all, or a list such as 0,1 (not with FORGE_GPU); default unset"),
    Setting("boost_target_ratio", "FORGE_BOOST_TARGET", "--boost-target", partial(_ratio_value, example=0.6),
            "utilization to hold after a long quiet spell, >= target; default 0.6 (or the target if higher)"),
    Setting("boost_after_s", "FORGE_BOOST_AFTER", "--boost-after", _seconds_value,
            "seconds without foreign work before boosting, 0 disables; default 3600"),
    Setting("resume_after_s", "FORGE_RESUME_AFTER", "--resume-after", _seconds_value,
            "seconds the GPU must be free of foreign work before resuming; default 60"),
    Setting("log_interval_s", "FORGE_LOG_INTERVAL", "--log-interval",
            partial(_seconds_value, low=MIN_LOG_INTERVAL_S, high=86400.0),
            "seconds between status lines, 0.1 to 86400; default 10"),
    Setting("log_format", "FORGE_LOG_FORMAT", "--log-format", partial(_choice_value, choices=("text", "json")),
            "text or json; default text"),
    Setting("duration_s", "FORGE_DURATION", "--duration", _seconds_value,
            "seconds to run, 0 = until stopped; default 0"),
    Setting("controller", "FORGE_CONTROLLER", "--controller", partial(_choice_value, choices=CONTROLLER_NAMES),
            "pi or legacy; default pi"),
    Setting("poll_interval_s", "FORGE_POLL_INTERVAL", "--poll-interval",
            partial(_seconds_value, low=0.01, high=1.0), "seconds between GPU polls, 0.01 to 1; default 0.1"),
    Setting("foreign_mem_mib", "FORGE_FOREIGN_MEM_MIB", "--foreign-mem-mib",
            partial(_float_value, low=0.0, low_inclusive=False, what="MiB"),
            "device memory beyond baseline and our own that means a foreign job; default 64"),
    Setting("foreign_util_ratio", "FORGE_FOREIGN_UTIL", "--foreign-util",
            partial(_ratio_value, high_inclusive=False, example=0.1),
            "utilization beyond our own share that means a foreign job; default 0.1"),
    Setting("foreign_util_samples", "FORGE_FOREIGN_SAMPLES", "--foreign-samples",
            partial(_int_value, low=1, high=MAX_FOREIGN_SAMPLES), "consecutive samples over that needed; default 2"),
    Setting("use_process_list", "FORGE_USE_PROCESS_LIST", "--process-list", _bool_value,
            "treat other processes on the GPU as foreign jobs; default on", boolean=True),
    Setting("simulate", "FORGE_SIMULATE", "--simulate", _bool_value,
            "run against a simulated GPU; default off", boolean=True),
    Setting("metrics_port", "FORGE_METRICS_PORT", "--metrics-port", _port_value,
            "serve Prometheus /metrics and /health on this port (0 = any free port); default off"),
    Setting("metrics_addr", "FORGE_METRICS_ADDR", "--metrics-addr", _addr_value,
            "IP address (not a host name) the metrics server listens on; default 0.0.0.0"),
    # load_config also holds it to twice the heartbeat's longest gap (heartbeat_period_s).
    Setting("health_max_age_s", "FORGE_HEALTH_MAX_AGE", "--health-max-age",
            partial(_seconds_value, low=MIN_HEALTH_MAX_AGE_S),
            "seconds without a loop heartbeat before /health and the health command report a GPU stalled; "
            f">= {2 * (HEARTBEAT_EVERY_S + Config.poll_interval_s):g}, twice the heartbeat's longest gap "
            "2 x (1 s + poll interval), divided by the simulation's speed when below 1; default 30"),
    Setting("heartbeat_file", "FORGE_HEARTBEAT_FILE", "--heartbeat-file", _path_value,
            "file the loop touches and `python -m forge_load.health` checks; default "
            "/tmp/forge_load-<uid>/heartbeat-<GPUs> (heartbeat-gpu0)"),
    Setting("max_power_w", "FORGE_MAX_POWER_W", "--max-power-w", _power_value,
            "power cap: board power (1-s mean) stays at or under this many watts while filling; default none"),
    Setting("active_hours", "FORGE_ACTIVE_HOURS", "--active-hours", _active_hours_value,
            "when the filler may run, in local time (TZ), such as 'Mon-Fri 20:00-08:00, Sat-Sun'; paused outside; "
            "default always"),
    Setting("pause_file", "FORGE_PAUSE_FILE", "--pause-file", _path_value,
            "paused while this file exists, until the time it holds if any (ISO 8601 or Unix); default none"),
    Setting("hold_dir", "FORGE_HOLD_DIR", "--hold-dir", partial(_path_value, example=DEFAULT_HOLD_DIR),
            "directory of holds (`forge-load hold`): nothing runs on a GPU while a hold names it; the filler writes "
            f"its acknowledgement there; default {DEFAULT_HOLD_DIR}"),
    Setting("hold_idle_age_out_s", "FORGE_HOLD_IDLE_AGE_OUT", "--hold-idle-age-out", _seconds_value,
            "a hold over a GPU without foreign work for this long is taken for its dead holder's and no longer "
            f"honoured, 0 = never; default {DEFAULT_IDLE_AGE_OUT_S / 3600:g}h"),
    Setting("kubelet_socket", "FORGE_KUBELET_SOCKET", "--kubelet-socket",
            partial(_path_value, example="/var/lib/kubelet/pod-resources/kubelet.sock"),
            "the kubelet's pod-resources socket: every GPU the kubelet assigns to another container is held "
            "(docs/kubernetes-holds.md); default none"),
    Setting("sim.speed", "FORGE_SIM_SPEED", "--sim-speed", _speed_value,
            "simulator: virtual seconds per real second, 0 = as fast as possible, else >= 0.1; default 1"),
    Setting("sim.window_s", "FORGE_SIM_WINDOW", "--sim-window", _window_value,
            "simulator: NVML sample window in seconds, 1/6 to 1; default 1/6"),
    Setting("sim.sms", "FORGE_SIM_SMS", "--sim-sms", partial(_int_value, low=1, high=1024),
            "simulator: SM count; default 132"),
    Setting("sim.foreign_s", "FORGE_SIM_FOREIGN", "--sim-foreign", _intervals_value,
            "simulator: foreign jobs as START-END[,START-END...] virtual seconds; default none"),
    Setting("sim.foreign_hidden_s", "FORGE_SIM_FOREIGN_HIDDEN", "--sim-foreign-hidden", _intervals_value,
            "simulator: more foreign jobs, START-END[,...], always hidden from the process list; default none"),
    Setting("sim.foreign_load_ratio", "FORGE_SIM_FOREIGN_LOAD", "--sim-foreign-load",
            partial(_ratio_value, example=0.9), "simulator: busy ratio of a foreign job; default 0.9"),
    Setting("sim.foreign_mem_mib", "FORGE_SIM_FOREIGN_MEM", "--sim-foreign-mem",
            partial(_float_value, low=0.0, low_inclusive=True, what="MiB"),
            "simulator: MiB a foreign job takes; default 2048"),
    Setting("sim.hide_foreign", "FORGE_SIM_HIDE_FOREIGN", "--sim-hide-foreign", _bool_value,
            "simulator: hide foreign jobs from the process list; default off", boolean=True),
    Setting("sim.seed", "FORGE_SIM_SEED", "--sim-seed", partial(_int_value, low=0, high=MAX_SIM_SEED),
            "simulator: random seed, 0 to 999999; default 0"),
    Setting("sim.gpus", "FORGE_SIM_GPUS", "--sim-gpus", partial(_int_value, low=1, high=64),
            "simulator: number of simulated GPUs (indices 0..N-1; pick with --gpu or --gpus); default 1"),
    Setting("sim.foreign_gpus", "FORGE_SIM_FOREIGN_GPUS", "--sim-foreign-gpus", _indices_value,
            "simulator: devices the --sim-foreign jobs run on, all or a list such as 1,2; default all"),
    Setting("sim.fail_gpus", "FORGE_SIM_FAIL_GPU", "--sim-fail-gpu", _failures_value,
            "simulator: lose devices while running, DEVICE@SECONDS[,...] such as 2@30; default none"),
)
_BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse would print usage and exit 2 itself; the app reports every bad setting the same way. The
        # message quotes what was typed: escaped, and cut short.
        text = escape_controls(" ".join(message.split()))
        text = text if len(text) <= 300 else text[:300] + "..."
        raise ConfigError(f"command line: {text} (see --help)")


def build_arg_parser() -> argparse.ArgumentParser:
    """Every setting as a flag. Defaults are None so load_config can tell "given" from "not given"."""
    parser = _Parser(
        prog="forge-load",
        description="Keep a GPU at a target utilization; step aside while other jobs use it.",
        epilog="Holds: `forge-load hold|release|holds --help` (docs/holds.md).",
        allow_abbrev=False,  # --foreign-* and --sim-* share prefixes; abbreviations would be guesses
    )
    parser.add_argument("--version", action="version", version=f"forge-load {__version__}")
    for s in SETTINGS:
        help_text = f"{s.help} [env {s.env}]".replace("%", "%%")
        if s.boolean:
            parser.add_argument(s.flag, dest=s.dest, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        else:
            parser.add_argument(s.flag, dest=s.dest, default=None, metavar="VALUE", help=help_text)
    return parser


# --- loading -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Given:
    name: str  # the env variable or flag it came from
    raw: str
    value: Any  # of the type its setting's Config field has (tests/test_config.py checks every parser's)


def _read(setting: Setting, args: argparse.Namespace, env: Mapping[str, str]) -> _Given | None:
    cli = getattr(args, setting.dest)
    if isinstance(cli, bool):
        return _Given(f"--{'' if cli else 'no-'}{setting.flag[2:]}", "", cli)
    if cli is not None:
        return _Given(setting.flag, cli, _apply(setting.flag, cli, setting.parse, f"env {setting.env}"))
    if setting.env in env:
        raw = env[setting.env]
        return _Given(setting.env, raw, _apply(setting.env, raw, setting.parse, f"flag {setting.flag_label}"))
    if setting.key == "target_ratio" and LEGACY_TARGET_ENV in env:
        raw = env[LEGACY_TARGET_ENV]
        value = _apply(LEGACY_TARGET_ENV, raw, _percent_value, "legacy; prefer FORGE_TARGET=0.5 or --target")
        return _Given(LEGACY_TARGET_ENV, raw, value)
    return None


def load_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Build the Config from `env` (default os.environ), then `argv` flags (default sys.argv[1:]) over it.

    A value overridden by a flag is not read, so a stale variable cannot stop a corrected command line.
    """
    env = os.environ if env is None else env
    args = build_arg_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    given: dict[str, _Given] = {}
    for s in SETTINGS:
        got = _read(s, args, env)
        if got is not None:
            given[s.key] = got

    # Each value was checked by its setting's parser; replace() takes them by name, typed by the dataclass.
    config = dataclasses.replace(
        Config(), **{k: g.value for k, g in given.items() if "." not in k},
        sim=dataclasses.replace(SimConfig(), **{k.split(".", 1)[1]: g.value for k, g in given.items() if "." in k}))
    boost = given.get("boost_target_ratio")
    if boost is None:
        # An operator who asks for more than the default boost means "this much", not "error".
        config = dataclasses.replace(config, boost_target_ratio=max(DEFAULT_BOOST_TARGET, config.target_ratio))
    elif config.boost_target_ratio < config.target_ratio:
        t = given.get("target_ratio")
        target_text = (f"{t.name}={_shown(t.raw)}" if t
                       else f"the default target {_num(config.target_ratio)} ({_BY_KEY['target_ratio'].env})")
        raise ConfigError(
            f"{boost.name}={_shown(boost.raw)} is below {target_text}: expected a boost target >= the target "
            f"and <= 1 (or leave {boost.name} unset to boost to "
            f"{_num(max(DEFAULT_BOOST_TARGET, config.target_ratio))})"
        )
    _check_gpu_choice(given)
    _check_sim_devices(config.sim, given)
    _check_sim_jobs(config.sim, given)
    config = _check_time_zone(config, given, env)
    return _check_health_max_age(config, given)


def _check_time_zone(config: Config, given: Mapping[str, _Given], env: Mapping[str, str]) -> Config:
    """The active hours and the pause file's times are local time: TZ must name a zone this system knows."""
    users = [given[key].name for key in ("active_hours", "pause_file") if key in given]
    if not users or "TZ" not in env:
        return config
    raw = env["TZ"]
    why = _unusable(raw)
    try:
        if why is None:
            local_zone(raw)
    except ScheduleError as error:
        why = str(error)
    if why is not None:
        raise ConfigError(
            f"TZ={_shown(raw)} is not valid: {why}; expected a zone name such as Europe/Berlin (from "
            f"/usr/share/zoneinfo: the tzdata package) or a POSIX rule such as CET-1CEST,M3.5.0,M10.5.0/3, or TZ "
            f"unset for the system's local time ({' and '.join(users)} {'read' if len(users) > 1 else 'reads'} "
            "local time)"
        )
    return dataclasses.replace(config, time_zone=raw)


def heartbeat_period_s(config: Config) -> float:
    """The longest wall-clock gap between two heartbeats of a healthy loop: a beat each HEARTBEAT_EVERY_S of
    the loop's clock, on the first step after it, with a step at least every poll interval; a simulation
    slower than real time stretches both."""
    period_s = HEARTBEAT_EVERY_S + config.poll_interval_s
    if config.simulate and 0 < config.sim.speed < 1:
        period_s /= config.sim.speed
    return period_s


def _check_health_max_age(config: Config, given: Mapping[str, _Given]) -> Config:
    """FORGE_HEALTH_MAX_AGE must span two heartbeats, or /health would flap; its default grows to fit."""
    least_s = max(MIN_HEALTH_MAX_AGE_S, 2 * heartbeat_period_s(config))
    got = given.get("health_max_age_s")
    if got is None:
        return dataclasses.replace(config, health_max_age_s=max(DEFAULT_HEALTH_MAX_AGE_S, least_s))
    if config.health_max_age_s >= least_s:
        return config
    poll, speed = given.get("poll_interval_s"), given.get("sim.speed")
    why = f"1 s + {poll.name if poll else _BY_KEY['poll_interval_s'].env} {_num(config.poll_interval_s)} s"
    if config.simulate and 0 < config.sim.speed < 1:
        why = f"({why}) / {speed.name if speed else _BY_KEY['sim.speed'].env} {_num(config.sim.speed)}"
    raise ConfigError(
        f"{got.name}={_shown(got.raw)} is not valid: expected seconds >= {_num(least_s)}, twice the longest gap "
        f"between two heartbeats of the loop ({why}), or /health would flap"
    )


# FORGE_ variables that the project's own scripts read (tests, the container engine, the fleet script), not
# the filler: no warning for these.
TOOL_VARIABLES = frozenset({
    "FORGE_IMAGE", "FORGE_VENV", "FORGE_SKIP_SYSTEM_TOOLS", "FORGE_REQUIRE_DOCKER", "FORGE_ENGINE_STARTED",
    "FORGE_DOCKER_DIR", "FORGE_BASE_IMAGE", "FORGE_DEBIAN_MIRROR", "FORGE_PIP_INDEX_URL",
    "FORGE_DOCKER_STORAGE_DRIVER",
})


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """One warning line per FORGE_ variable in `env` that is no setting (a typo, most likely), naming the
    closest setting. Unknown variables are not refused: a newer setting in an older filler's environment
    must not stop it."""
    known = [s.env for s in SETTINGS]
    warnings = []
    for name in sorted(env):
        if not name.upper().startswith("FORGE_") or name in known or name in TOOL_VARIABLES:
            continue
        close = difflib.get_close_matches(name.upper(), known, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        shown = escape_controls(name if len(name) <= 80 else name[:40] + "...")
        warnings.append(f"warning: {shown} is not a setting forge-load knows{hint}; it is ignored")
    return warnings


def _check_gpu_choice(given: Mapping[str, _Given]) -> None:
    one, several = given.get("gpu"), given.get("gpus")
    if one is not None and several is not None:
        raise ConfigError(
            f"{one.name}={_shown(one.raw)} and {several.name}={_shown(several.raw)} are both set: "
            f"expected one of them, "
            f"{_BY_KEY['gpu'].env} for one GPU or {_BY_KEY['gpus'].env} for several"
        )


def _check_sim_devices(sim: SimConfig, given: Mapping[str, _Given]) -> None:
    """Devices named by the simulator's settings must exist among the simulated GPUs."""
    count = sim.gpus
    named = [("sim.foreign_gpus", i) for i in sim.foreign_gpus or ()] + [("sim.fail_gpus", i) for i, _ in sim.fail_gpus]
    for key, device in named:
        if device >= count:
            got = given[key]
            count_name = given["sim.gpus"].name if "sim.gpus" in given else "the default " + _BY_KEY["sim.gpus"].env
            devices = "device 0" if count == 1 else f"devices 0 to {count - 1}"
            raise ConfigError(
                f"{got.name}={_shown(got.raw)} names simulated device {device}, but {count_name} simulates "
                f"{count} ({devices}): expected a device below {count}"
            )


def _check_sim_jobs(sim: SimConfig, given: Mapping[str, _Given]) -> None:
    """Visible and hidden simulated jobs together must not overlap, as within each list."""
    spans = sorted([*sim.foreign_s, *sim.foreign_hidden_s])
    for (a, b), (c, d) in zip(spans, spans[1:]):
        if c < b:  # each list is free of overlaps already, so this pair has one of each
            shown, hidden = given["sim.foreign_s"], given["sim.foreign_hidden_s"]
            raise ConfigError(
                f"{hidden.name}={hidden.raw!r} overlaps {shown.name}={shown.raw!r} ({_num(a)}-{_num(b)} and "
                f"{_num(c)}-{_num(d)}): expected jobs that do not overlap, visible or hidden"
            )


def _spans_text(spans: tuple[tuple[float, float], ...]) -> str:
    return ",".join(f"{_num(a)}-{_num(b)}" for a, b in spans) or "none"


def describe(config: Config) -> dict[str, object]:
    """The effective settings, flat, for the `start` log line; sim_* only when simulating."""
    out: dict[str, object] = {
        "target": config.target_ratio,
        "gpu": config.gpu,
        "boost_target": config.boost_target_ratio,
        "boost_after_s": config.boost_after_s,
        "resume_after_s": config.resume_after_s,
        "log_interval_s": config.log_interval_s,
        "log_format": config.log_format,
        "duration_s": config.duration_s,
        "controller": config.controller,
        "poll_interval_s": config.poll_interval_s,
        "foreign_mem_mib": config.foreign_mem_mib,
        "foreign_util": config.foreign_util_ratio,
        "foreign_samples": config.foreign_util_samples,
        "use_process_list": config.use_process_list,
        "simulate": config.simulate,
    }
    if config.gpus is not None:
        out["gpus"] = config.gpus if isinstance(config.gpus, str) else ",".join(config.gpus)
    if config.max_power_w is not None:
        out["max_power_w"] = config.max_power_w
    if config.active_hours is not None:
        out["active_hours"] = config.active_hours.text
    if config.pause_file is not None:
        out["pause_file"] = config.pause_file
    out["hold_dir"] = config.hold_dir
    out["hold_idle_age_out_s"] = config.hold_idle_age_out_s
    if config.kubelet_socket is not None:
        out["kubelet_socket"] = config.kubelet_socket
    if config.time_zone is not None:
        out["tz"] = config.time_zone
    if config.metrics_port is not None:
        host = f"[{config.metrics_addr}]" if ":" in config.metrics_addr else config.metrics_addr
        out.update(metrics=f"{host}:{config.metrics_port}", health_max_age_s=config.health_max_age_s)
    if config.simulate:
        sim = config.sim
        out.update(
            sim_speed=sim.speed,
            sim_window_s=sim.window_s,
            sim_sms=sim.sms,
            sim_foreign_s=_spans_text(sim.foreign_s),
            sim_foreign_hidden_s=_spans_text(sim.foreign_hidden_s),
            sim_foreign_load=sim.foreign_load_ratio,
            sim_foreign_mem_mib=sim.foreign_mem_mib,
            sim_hide_foreign=sim.hide_foreign,
            sim_seed=sim.seed,
            sim_gpus=sim.gpus,
            sim_foreign_gpus="all" if sim.foreign_gpus is None else ",".join(map(str, sim.foreign_gpus)),
            sim_fail_gpu=",".join(f"{i}@{_num(t)}" for i, t in sim.fail_gpus) or "none",
        )
    return out
