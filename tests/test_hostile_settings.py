"""Every setting against hostile and careless values, generated from forge_load.config.settings.SETTINGS (so a
new setting inherits the checks): the table of bad values by variable and by flag, integers over the digit
limit, addresses, the floors and the extremes each timing setting accepts (the loop neither spins nor
starves), a ratio written as a percent, and unknown variables. In-process where it can be, the whole process
for a sample.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import threading

import pytest

from forge_load.config import values as config_values
from forge_load.config.load import load_config
from forge_load.config.settings import SETTINGS
from forge_load.config.values import ConfigError
from forge_load.service.loop import run_simulated
from tests.hostile_support import assert_config_exit, assert_one_clean_line, forge

# --- the table of hostile values ------------------------------------------------------------------------------

# Every one of these must be refused by every setting: one line naming the variable, exit 2.
HOSTILE: dict[str, str] = {
    "empty": "",
    "spaces": "   ",
    "tab": "\t",
    "huge int": "9" * 4000,
    "huge negative int": "-" + "9" * 4000,
    "over the int digit limit": "9" * 5000,
    "leading zeros": "0" * 5000 + "1",
    "1e999": "1e999",
    "-1e999": "-1e999",
    "nan": "nan",
    "NaN%": "NaN%",
    "inf": "inf",
    "-inf": "-inf",
    "Infinity": "Infinity",
    "negative": "-1",
    "newline after": "0.5\n",
    "newline before": "\n1",
    "forged line": "1\nt=9.00 event=stop reason=forged",
    "carriage return": "1\r",
    "escape sequence": "0.5\x1b[31m",
    "bel": "\x07",
    "del": "1\x7f",
    "C1 next line": "0.5\x85",
    "line separator": "0.5\u2028",
    "bidi override": "\u202e0.5",
    "arabic-indic digit": "\u0661",
    "arabic-indic percent": "\u0665\u0660%",
    "fullwidth digit": "\uff11",
    "very long": "1" * 100_000,  # an environment string may hold 128 KiB
    "very long spaces": "1" + " " * 100_000 + "x",
}
IN_PROCESS_ONLY = {"nul": "0.5\x00"}  # the environment cannot carry NUL


# A directory may have any name: those of these that are names a directory can have are one, taken from the current
# directory (test_a_directory_may_have_a_name_that_reads_as_a_number); the others it refuses like any setting.
DIRECTORY_SETTINGS = frozenset({"FORGE_HOLD_DIR", "FORGE_RUNTIME_DIR"})
DIRECTORY_NAMES = ("1e999", "-1e999", "nan", "NaN%", "inf", "-inf", "Infinity", "negative", "arabic-indic digit",
                   "arabic-indic percent", "fullwidth digit")


def hostile_for(env: str) -> dict[str, str]:
    values = {**HOSTILE, **IN_PROCESS_ONLY}
    return {k: v for k, v in values.items() if k not in DIRECTORY_NAMES} if env in DIRECTORY_SETTINGS else values


CASES = [(s.env, label, raw) for s in SETTINGS for label, raw in hostile_for(s.env).items()]


@pytest.mark.parametrize(("env", "label", "raw"), CASES, ids=[f"{e}-{label}" for e, label, _ in CASES])
def test_every_setting_refuses_every_hostile_value(env: str, label: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([], {env: raw})
    assert_one_clean_line(str(info.value), env)


FLAG_CASES = [(s.flag, s.env, label, raw) for s in SETTINGS if not s.boolean
              for label, raw in hostile_for(s.env).items()]


@pytest.mark.parametrize(("flag", "env", "label", "raw"), FLAG_CASES,
                         ids=[f"{f}-{label}" for f, _, label, _ in FLAG_CASES])
def test_every_flag_refuses_every_hostile_value(flag: str, env: str, label: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([f"{flag}={raw}"], {})
    assert_one_clean_line(str(info.value), flag)


@pytest.mark.parametrize("env", sorted(DIRECTORY_SETTINGS))
@pytest.mark.parametrize("label", DIRECTORY_NAMES)
def test_a_directory_may_have_a_name_that_reads_as_a_number(env: str, label: str) -> None:
    setting = next(s for s in SETTINGS if s.env == env)
    expected = os.path.abspath(HOSTILE[label])
    assert getattr(load_config([], {env: HOSTILE[label]}), setting.key) == expected
    assert getattr(load_config([f"{setting.flag}={HOSTILE[label]}"], {}), setting.key) == expected


# The whole process for a sample of the values on one setting; app.main() in this process for the rest.
SAMPLE = ["empty", "over the int digit limit", "1e999", "NaN%", "forged line", "escape sequence",
          "arabic-indic digit", "very long"]


@pytest.mark.parametrize("label", SAMPLE)
def test_process_exits_2_with_one_line(label: str) -> None:
    assert_config_exit(forge("--simulate", env={"FORGE_SIM_SEED": HOSTILE[label]}), "FORGE_SIM_SEED")


def run_main(env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess[str]:
    """app.main() in this process, with `env` over a simulated one-second run as the whole environment."""
    from forge_load.service.app import main

    for name in [k for k in os.environ if k.upper().startswith("FORGE_") or k == "TARGET"]:
        monkeypatch.delenv(name)
    for name, value in {"FORGE_SIMULATE": "1", "FORGE_SIM_SPEED": "0", "FORGE_DURATION": "1", **env}.items():
        monkeypatch.setenv(name, value)
    code = main([])
    captured = capsys.readouterr()
    return subprocess.CompletedProcess([], code, captured.out, captured.err)


@pytest.mark.parametrize("env", [s.env for s in SETTINGS])
def test_main_exits_2_for_a_forged_line_in_every_setting(env: str, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert_config_exit(run_main({env: HOSTILE["forged line"]}, monkeypatch, capsys), env)


@pytest.mark.parametrize("env", ["FORGE_SIM_SEED", "FORGE_GPU", "FORGE_METRICS_PORT", "FORGE_SIM_SMS",
                                 "FORGE_FOREIGN_SAMPLES", "FORGE_SIM_GPUS", "FORGE_SIM_FAIL_GPU",
                                 "FORGE_SIM_FOREIGN_GPUS", "FORGE_GPUS"])
@pytest.mark.parametrize("digits", [4000, 4301, 5000])
def test_integers_over_the_digit_limit_exit_2(env: str, digits: int, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    raw = "9" * digits + ("@1" if env == "FORGE_SIM_FAIL_GPU" else "")
    assert_config_exit(run_main({env: raw}, monkeypatch, capsys), env)


# --- addresses (no forged lines through FORGE_METRICS_ADDR) ------------------------------------------------------

@pytest.mark.parametrize("raw", [
    "fe80::1%eth0\nt=1.00 event=stop", "fe80::1%\x1b[2J", "fe80::1%", "fe80::1%" + "x" * 40, "::1%lo%lo",
    "localhost", "example.com", "127.0.0.1:9400", "[::1]:9400", "127.1", "0x7f.0.0.1", "1.2.3.4/24",
])
def test_metrics_addr_is_an_ip_literal_only(raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([], {"FORGE_METRICS_ADDR": raw})
    assert_one_clean_line(str(info.value), "FORGE_METRICS_ADDR")


@pytest.mark.parametrize(("raw", "expected"), [
    ("::1", "::1"), ("[::1]", "::1"), ("127.0.0.2", "127.0.0.2"), ("0.0.0.0", "0.0.0.0"), ("::", "::"),
    ("fe80::1%eth0", "fe80::1%eth0"), ("fe80::1%2", "fe80::1%2"),
])
def test_metrics_addr_good_values(raw: str, expected: str) -> None:
    assert load_config([], {"FORGE_METRICS_ADDR": raw}).metrics_addr == expected


def test_a_zone_id_with_a_newline_forges_no_line() -> None:
    result = forge("--simulate", "--duration", "1", env={"FORGE_METRICS_PORT": "0",
                                                          "FORGE_METRICS_ADDR": "fe80::1%x\nt=1.00 event=stop"})
    assert_config_exit(result, "FORGE_METRICS_ADDR")


# --- floors: no setting can make the loop spin or starve -------------------------------------------------------

@pytest.mark.parametrize(("env", "raw", "accepted"), [
    ("FORGE_LOG_INTERVAL", "1e-20", "0.1"),
    ("FORGE_LOG_INTERVAL", "0.05", "0.1"),
    ("FORGE_LOG_INTERVAL", "0", "0.1"),
    ("FORGE_LOG_INTERVAL", "90000", "86400"),
    ("FORGE_HEALTH_MAX_AGE", "0.5", "2"),
    ("FORGE_HEALTH_MAX_AGE", "1e-9", "2"),
    ("FORGE_SIM_SPEED", "1e-20", "0.1"),
    ("FORGE_SIM_SPEED", "0.05", "0.1"),
    ("FORGE_POLL_INTERVAL", "1e-20", "0.01"),
    ("FORGE_SIM_SEED", "1000000", "999999"),
    ("FORGE_SIM_FOREIGN", ",".join(f"{k}-{k + 0.5}" for k in range(1001)), "1000"),
    ("FORGE_GPU", "100000", "1023"),
])
def test_below_the_floor_is_refused_with_the_range(env: str, raw: str, accepted: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([], {env: raw})
    assert_one_clean_line(str(info.value), env, accepted)


def test_tiny_log_interval_exits_2() -> None:
    assert_config_exit(forge("--simulate", "--duration", "5", env={"FORGE_LOG_INTERVAL": "1e-20"}),
                       "FORGE_LOG_INTERVAL")


def test_health_max_age_covers_the_heartbeat_of_a_slow_simulation() -> None:
    # At 0.1 virtual seconds per second the loop beats every ~10 s of wall time: 5 s would flap.
    with pytest.raises(ConfigError) as info:
        load_config([], {"FORGE_SIMULATE": "1", "FORGE_SIM_SPEED": "0.1", "FORGE_HEALTH_MAX_AGE": "5"})
    assert_one_clean_line(str(info.value), "FORGE_HEALTH_MAX_AGE", "FORGE_SIM_SPEED")
    assert load_config([], {"FORGE_SIMULATE": "1", "FORGE_SIM_SPEED": "0.1"}).health_max_age_s == 30


# The extremes each timing-related setting accepts; every setting must be listed (a new one must be thought
# about): () for a setting that does not pace the loop.
EXTREMES: dict[str, tuple[str, ...]] = {
    "FORGE_TARGET": ("1e-9", "1"),
    "FORGE_GPU": (),
    "FORGE_GPUS": (),
    "FORGE_BOOST_TARGET": ("1",),
    "FORGE_BOOST_AFTER": ("0", "1e-9", "1e300"),
    "FORGE_RESUME_AFTER": ("0", "1e-9", "1e300"),
    "FORGE_LOG_INTERVAL": ("0.1", "86400"),
    "FORGE_LOG_FORMAT": (),
    "FORGE_DURATION": ("1e-9", "1e300"),
    "FORGE_CONTROLLER": ("legacy",),
    "FORGE_METRIC": (),  # the GPM ones are refused at start on a GPU without GPM: tests/test_metric_vgpu.py
    "FORGE_SHAPE": ("burn",),
    "FORGE_POLL_INTERVAL": ("0.01", "1"),
    "FORGE_FOREIGN_MEM_MIB": ("1e-9", "1e300"),
    "FORGE_FOREIGN_UTIL": ("1e-9", "0.999999"),
    "FORGE_FOREIGN_SAMPLES": ("1", "100"),
    "FORGE_USE_PROCESS_LIST": ("0",),
    "FORGE_SIMULATE": (),
    "FORGE_METRICS_PORT": (),
    "FORGE_METRICS_ADDR": (),
    "FORGE_HEALTH_MAX_AGE": (),  # read by /health and the health command, not by the loop
    "FORGE_HEARTBEAT_FILE": (),
    "FORGE_SIM_SPEED": (),  # paced against the wall clock; its floor is what the health max age is checked against
    "FORGE_SIM_WINDOW": ("0.1657", "1"),
    "FORGE_SIM_SMS": ("1", "1024"),
    "FORGE_SIM_FOREIGN": (",".join(f"{k / 100:g}-{k / 100 + 1e-9:.9f}" for k in range(100)), "0-1e300"),
    "FORGE_SIM_FOREIGN_HIDDEN": ("4-1e300",),  # after the base run's visible job (1-3)
    "FORGE_SIM_FOREIGN_LOAD": ("1e-9", "1"),
    "FORGE_SIM_FOREIGN_MEM": ("0", "1e300"),
    "FORGE_SIM_HIDE_FOREIGN": ("1",),
    "FORGE_SIM_SEED": ("0", "999999"),
    "FORGE_SIM_GPUS": ("64",),
    "FORGE_SIM_FOREIGN_GPUS": ("0",),
    "FORGE_SIM_FAIL_GPU": ("0@1e300",),
    "FORGE_MAX_POWER_W": ("10", "10000"),  # below idle power: launches nothing; above the board: never binds
    "FORGE_ACTIVE_HOURS": ("Mon-Sun", "Mon 00:00-00:01"),  # always, and (nearly) never: paused the whole run
    "FORGE_PAUSE_FILE": ("/",),  # a directory: there, and unreadable as a time: paused the whole run
    "FORGE_HOLD_DIR": (),  # a directory the filler writes its acknowledgement into: tests/test_filler_holds.py
    "FORGE_RUNTIME_DIR": (),  # a directory the filler writes its status into: tests/test_status_cmd.py
    "FORGE_HOLD_IDLE_AGE_OUT": ("0", "1e-9", "1e300"),
    "FORGE_KUBELET_SOCKET": (),  # a socket the filler connects to: tests/test_kubelet.py
}


def test_every_setting_has_its_extremes_listed() -> None:
    assert set(EXTREMES) == {s.env for s in SETTINGS}


class _CappedStream(io.StringIO):
    """Stops the run after `cap` lines, so that a setting that makes the loop spin fails instead of hanging."""

    def __init__(self, stop: threading.Event, cap: int) -> None:
        super().__init__()
        self.stop, self.cap, self.lines = stop, cap, 0

    def write(self, text: str) -> int:
        self.lines += text.count("\n")
        if self.lines >= self.cap:
            self.stop.set()
        return super().write(text)


EXTREME_CASES = [(env, raw) for env, values in EXTREMES.items() for raw in values]


@pytest.mark.parametrize(("env", "raw"), EXTREME_CASES, ids=[f"{e}={r[:20]}" for e, r in EXTREME_CASES])
def test_extreme_settings_neither_spin_nor_starve_the_loop(env: str, raw: str) -> None:
    """Five virtual seconds (a foreign job from 1 to 3 s): the loop keeps beating and writes a bounded log."""
    flags = {"FORGE_SIMULATE": "1", "FORGE_SIM_SPEED": "0", "FORGE_LOG_FORMAT": "json", "FORGE_LOG_INTERVAL": "1",
             "FORGE_SIM_FOREIGN": "1-3", "FORGE_RESUME_AFTER": "1", env: raw}
    config = load_config([], flags)
    stop = threading.Event()
    out = _CappedStream(stop, cap=200)
    beats: list[float] = []

    def beat() -> None:
        beats.append(0.0)
        if len(beats) >= 5:
            stop.set()

    run = run_simulated(config, out, stop, heartbeat=beat)
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    ended_early = config.duration_s and config.duration_s < 5
    assert len(beats) >= (1 if ended_early else 5), "the loop did not advance in virtual time"
    assert out.lines < 100, f"{out.lines} lines in 5 virtual seconds: the loop spins"
    assert events[-1]["event"] == "stop"
    assert not run.runtime.worker.in_flight


def test_the_health_max_age_floor_in_the_help_is_accepted() -> None:
    [setting] = [s for s in SETTINGS if s.env == "FORGE_HEALTH_MAX_AGE"]
    match = re.search(r">= ([0-9.]+)", setting.help)
    assert match, setting.help
    floor = match[1]
    assert load_config([], {"FORGE_HEALTH_MAX_AGE": floor}).health_max_age_s == float(floor)
    assert load_config(["--health-max-age", floor], {}).health_max_age_s == float(floor)
    with pytest.raises(ConfigError) as info:
        load_config([], {"FORGE_HEALTH_MAX_AGE": f"{float(floor) - 0.01:g}"})
    assert_one_clean_line(str(info.value), "FORGE_HEALTH_MAX_AGE", floor)


# --- a ratio above 1: the percent it suggests is one the setting takes, and only for a whole number ---------------

RATIO_SETTINGS = [s for s in SETTINGS if getattr(s.parse, "func", None) is config_values.ratio_value]


@pytest.mark.parametrize("env", [s.env for s in RATIO_SETTINGS])
@pytest.mark.parametrize("raw", ["1.5", "2", "10", "50", "99.5", "100", "150", "1e2"])
def test_a_ratio_above_1_suggests_only_a_percent_that_is_meant_and_taken(env: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([], {env: raw})
    message = str(info.value)
    assert_one_clean_line(message, env)
    suggested = re.search(r"did you mean (\S+)\?", message)
    if not raw.isdigit():  # 1.5 is not how a percent is written: 1.5 % is no likelier than 15 % or 0.15
        assert suggested is None, message
        return
    [setting] = [s for s in RATIO_SETTINGS if s.env == env]
    if suggested is not None:
        assert suggested[1] == f"{raw}%"
        setting.parse(suggested[1])  # the setting takes it (another setting may still disagree: a boost below target)
    else:
        with pytest.raises(config_values.Rejected):
            setting.parse(raw + "%")


def test_there_are_ratio_settings_to_check() -> None:
    assert {"FORGE_TARGET", "FORGE_BOOST_TARGET", "FORGE_FOREIGN_UTIL"} <= {s.env for s in RATIO_SETTINGS}


def test_a_typo_is_warned_about_with_the_closest_name() -> None:
    result = forge("--simulate", "--sim-speed", "0", "--duration", "1", env={"FORGE_TARGE": "0.9"})
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "FORGE_TARGE" in lines[0] and "FORGE_TARGET" in lines[0], result.stderr


def test_unknown_variables_are_warned_about_in_one_clean_line_each() -> None:
    from forge_load.config.load import unknown_variables

    warnings = unknown_variables({"FORGE_LOG_INTERVALS": "1", "forge_target": "0.5", "FORGE_X\x1b[2J": "1",
                                  "FORGE_TARGET": "0.5", "PATH": "/bin", "FORGE_IMAGE": "forge-load:latest"})
    assert len(warnings) == 3, warnings
    for warning in warnings:
        assert_one_clean_line(warning)
    assert any("FORGE_LOG_INTERVAL" in w and "FORGE_LOG_INTERVALS" in w for w in warnings)
    assert any("forge_target" in w and "FORGE_TARGET" in w for w in warnings)
