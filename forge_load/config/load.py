"""The daemon's settings: read from the environment, overridden by command-line flags, every value checked.

A bad value is a ConfigError whose message is one line naming the variable (and its flag), the value as
given (escaped, and shortened when long) and what is accepted; service/app.py prints it and exits 2. Every value is
refused, never guessed at, when it holds a control character, is longer than MAX_VALUE_CHARS, or has digits
other than ASCII ones. Nothing here touches the GPU. `python -m forge_load.health` and `forge-load fleet up`
read and check settings through load_config too, so all three accept and refuse the same values.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from forge_load import __version__
from forge_load.config.cmdline import COMMANDS, ArgParser, UsageError, closest
from forge_load.config.heartbeat import DEFAULT_HEALTH_MAX_AGE_S, MIN_HEALTH_MAX_AGE_S, heartbeat_period_s
from forge_load.config.settings import BY_KEY, DEFAULT_BOOST_TARGET, LEGACY_TARGET_ENV, SETTINGS, Config
from forge_load.config.sim import SimConfig
from forge_load.config.tools import TOOL_VARIABLES
from forge_load.config.values import ConfigError, Setting, parse_value, percent_value, show_number, show_value, unusable
from forge_load.log import escape_controls
from forge_load.steering.schedule import ScheduleError, local_zone

COMMANDS_EPILOG = "\n".join(["commands (forge-load COMMAND --help):",
                             *(f"  {name:<9} {what}" for name, (_, what) in COMMANDS.items()),
                             "", "Without a command, forge-load runs the filler with the options above."])


def build_arg_parser() -> argparse.ArgumentParser:
    """Every setting as a flag. Defaults are None so load_config can tell "given" from "not given"."""
    parser = ArgParser(
        prog="forge-load",
        description="Keep a GPU at a target utilization; step aside while other jobs use it.",
        epilog=COMMANDS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the epilog's table as written
        allow_abbrev=False,  # --foreign-* and --sim-* share prefixes; abbreviations would be guesses
    )
    parser.add_argument("-V", "--version", action="version", version=f"forge-load {__version__}")
    for s in SETTINGS:
        help_text = f"{s.help} [env {s.env}]".replace("%", "%%")
        if s.boolean:
            parser.add_argument(s.flag, dest=s.dest, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        else:  # no argparse `choices`: a bad value gets the setting's own message, as from the environment
            metavar = "{" + ",".join(s.choices) + "}" if s.choices else "VALUE"
            parser.add_argument(s.flag, dest=s.dest, default=None, metavar=metavar, help=help_text)
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
        return _Given(setting.flag, cli, parse_value(setting.flag, cli, setting.parse, f"env {setting.env}"))
    if setting.env in env:
        raw = env[setting.env]
        return _Given(setting.env, raw, parse_value(setting.env, raw, setting.parse, f"flag {setting.flag_label}"))
    if setting.key == "target_ratio" and LEGACY_TARGET_ENV in env:
        raw = env[LEGACY_TARGET_ENV]
        value = parse_value(LEGACY_TARGET_ENV, raw, percent_value, "legacy; prefer FORGE_TARGET=0.5 or --target")
        return _Given(LEGACY_TARGET_ENV, raw, value)
    return None


def load_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Build the Config from `env` (default os.environ), then `argv` flags (default sys.argv[1:]) over it.

    A value overridden by a flag is not read, so a stale variable cannot stop a corrected command line.
    """
    return _load(argv, env)[0]


def load_settings(argv: Sequence[str] | None = None,
                  env: Mapping[str, str] | None = None) -> tuple[Config, list[str]]:
    """load_config(), and a warning line for each thing given that does less than it seems to: a FORGE_ variable
    that is no setting (unknown_variables), simulated GPUs that no filler fills."""
    env = os.environ if env is None else env
    config, given = _load(argv, env)
    warnings = unknown_variables(env)
    sim_gpus = given.get("sim.gpus")
    if config.simulate and config.sim.gpus > 1 and sim_gpus is not None and "gpu" not in given \
            and "gpus" not in given:
        # As on a real host with several GPUs, the default fills GPU 0 alone: said, since a simulated GPU is this
        # process's own and nothing else will ever fill the others.
        warnings.append(
            f"warning: {sim_gpus.name}={config.sim.gpus} simulates {config.sim.gpus} GPUs, and only GPU 0 "
            f"is filled ({BY_KEY['gpu'].env}'s default, as on a real host): --gpus all "
            f"({BY_KEY['gpus'].env}=all) fills every one, --gpu N another")
    return config, warnings


def _load(argv: Sequence[str] | None, env: Mapping[str, str] | None) -> tuple[Config, dict[str, _Given]]:
    env = os.environ if env is None else env
    try:
        args = build_arg_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except UsageError as error:
        # Every bad setting is reported the same way (app.py, exit 2); the message quotes what was typed: escaped,
        # and cut short.
        text = escape_controls(" ".join(str(error).split()))
        text = text if len(text) <= 300 else text[:300] + "..."
        raise ConfigError(f"command line: {text} (see --help)") from None
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
        target_text = (f"{t.name}={show_value(t.raw)}" if t
                       else f"the default target {show_number(config.target_ratio)} ({BY_KEY['target_ratio'].env})")
        raise ConfigError(
            f"{boost.name}={show_value(boost.raw)} is below {target_text}: expected a boost target >= the target "
            f"and <= 1 (or leave {boost.name} unset to boost to "
            f"{show_number(max(DEFAULT_BOOST_TARGET, config.target_ratio))})"
        )
    _check_gpu_choice(given)
    _check_metric(config, given)
    _check_sim_devices(config.sim, given)
    _check_sim_jobs(config.sim, given)
    config = _check_time_zone(config, given, env)
    return _check_health_max_age(config, given), given


def _check_metric(config: Config, given: Mapping[str, _Given]) -> None:
    """The legacy law is the original tool's, which knows NVML utilization only."""
    metric = given.get("metric")
    if metric is not None and config.metric != "utilization" and config.controller == "legacy":
        controller = given.get("controller")
        raise ConfigError(
            f"{metric.name}={show_value(metric.raw)} is not valid with "
            f"{controller.name if controller else BY_KEY['controller'].env}=legacy: expected utilization, the only "
            "metric the legacy law holds (or the pi controller for sm_activity and gr_activity)"
        )


def _check_time_zone(config: Config, given: Mapping[str, _Given], env: Mapping[str, str]) -> Config:
    """The active hours and the pause file's times are local time: TZ must name a zone this system knows."""
    users = [given[key].name for key in ("active_hours", "pause_file") if key in given]
    if not users or "TZ" not in env:
        return config
    raw = env["TZ"]
    why = unusable(raw)
    try:
        if why is None:
            local_zone(raw)
    except ScheduleError as error:
        why = str(error)
    if why is not None:
        raise ConfigError(
            f"TZ={show_value(raw)} is not valid: {why}; expected a zone name such as Europe/Berlin (from "
            f"/usr/share/zoneinfo: the tzdata package) or a POSIX rule such as CET-1CEST,M3.5.0,M10.5.0/3, or TZ "
            f"unset for the system's local time ({' and '.join(users)} {'read' if len(users) > 1 else 'reads'} "
            "local time)"
        )
    return dataclasses.replace(config, time_zone=raw)


def _check_health_max_age(config: Config, given: Mapping[str, _Given]) -> Config:
    """FORGE_HEALTH_MAX_AGE must span two heartbeats, or /health would flap; its default grows to fit."""
    least_s = max(MIN_HEALTH_MAX_AGE_S, 2 * heartbeat_period_s(config))
    got = given.get("health_max_age_s")
    if got is None:
        return dataclasses.replace(config, health_max_age_s=max(DEFAULT_HEALTH_MAX_AGE_S, least_s))
    if config.health_max_age_s >= least_s:
        return config
    poll, speed = given.get("poll_interval_s"), given.get("sim.speed")
    why = f"1 s + {poll.name if poll else BY_KEY['poll_interval_s'].env} {show_number(config.poll_interval_s)} s"
    if config.simulate and 0 < config.sim.speed < 1:
        why = f"({why}) / {speed.name if speed else BY_KEY['sim.speed'].env} {show_number(config.sim.speed)}"
    raise ConfigError(
        f"{got.name}={show_value(got.raw)} is not valid: expected seconds >= {show_number(least_s)}, twice the "
        "longest gap "
        f"between two heartbeats of the loop ({why}), or /health would flap"
    )


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """One warning line per FORGE_ variable in `env` that is no setting (a typo, most likely), naming the
    closest setting. Unknown variables are not refused: a newer setting in an older filler's environment
    must not stop it."""
    known = [s.env for s in SETTINGS]
    warnings = []
    for name in sorted(env):
        if not name.upper().startswith("FORGE_") or name in known or name in TOOL_VARIABLES:
            continue
        close = closest(name.upper(), known)
        hint = f" (did you mean {close}?)" if close else ""
        shown = escape_controls(name if len(name) <= 80 else name[:40] + "...")
        warnings.append(f"warning: {shown} is not a setting forge-load knows{hint}; it is ignored")
    return warnings


def _check_gpu_choice(given: Mapping[str, _Given]) -> None:
    one, several = given.get("gpu"), given.get("gpus")
    if one is not None and several is not None:
        raise ConfigError(
            f"{one.name}={show_value(one.raw)} and {several.name}={show_value(several.raw)} are both set: "
            f"expected one of them, "
            f"{BY_KEY['gpu'].env} for one GPU or {BY_KEY['gpus'].env} for several"
        )


def _check_sim_devices(sim: SimConfig, given: Mapping[str, _Given]) -> None:
    """Devices named by the simulator's settings must exist among the simulated GPUs."""
    count = sim.gpus
    named = [("sim.foreign_gpus", i) for i in sim.foreign_gpus or ()] + [("sim.fail_gpus", i) for i, _ in sim.fail_gpus]
    for key, device in named:
        if device >= count:
            got = given[key]
            count_name = given["sim.gpus"].name if "sim.gpus" in given else "the default " + BY_KEY["sim.gpus"].env
            devices = "device 0" if count == 1 else f"devices 0 to {count - 1}"
            raise ConfigError(
                f"{got.name}={show_value(got.raw)} names simulated device {device}, but {count_name} simulates "
                f"{count} ({devices}): expected a device below {count}"
            )


def _check_sim_jobs(sim: SimConfig, given: Mapping[str, _Given]) -> None:
    """Visible and hidden simulated jobs together must not overlap, as within each list."""
    spans = sorted([*sim.foreign_s, *sim.foreign_hidden_s])
    for (a, b), (c, d) in zip(spans, spans[1:]):
        if c < b:  # each list is free of overlaps already, so this pair has one of each
            shown, hidden = given["sim.foreign_s"], given["sim.foreign_hidden_s"]
            raise ConfigError(
                f"{hidden.name}={hidden.raw!r} overlaps {shown.name}={shown.raw!r} "
                f"({show_number(a)}-{show_number(b)} and "
                f"{show_number(c)}-{show_number(d)}): expected jobs that do not overlap, visible or hidden"
            )
