"""forge_load.config: defaults, flags and their precedence over variables, the legacy TARGET, one GPU or several,
the boost against the target, the parser, describe(). Each setting's good and bad values: test_config_values.py."""

from __future__ import annotations

import dataclasses

import pytest

from forge_load.config.load import build_arg_parser, load_config, load_settings
from forge_load.config.settings import Config, describe
from forge_load.config.sim import SimConfig
from forge_load.config.values import ConfigError
from forge_load.steering.schedule import parse_active_hours


def load(env: dict[str, str] | None = None, argv: list[str] | None = None) -> Config:
    return load_config(argv or [], env or {})


def assert_one_line_error(err: ConfigError, *needles: str) -> str:
    message = str(err)
    assert message, "empty message"
    assert "\n" not in message and "\r" not in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


def attr(config: Config, path: str) -> object:
    value: object = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


# --- defaults --------------------------------------------------------------------------------------------


def test_defaults() -> None:
    c = load()
    assert c.target_ratio == 0.5
    assert c.gpu == "0"
    assert c.boost_target_ratio == 0.6
    assert c.boost_after_s == 3600
    assert c.resume_after_s == 60
    assert c.log_interval_s == 10
    assert c.log_format == "text"
    assert c.duration_s == 0
    assert c.controller == "pi"
    assert c.poll_interval_s == 0.1
    assert c.foreign_mem_mib == 64
    assert c.foreign_util_ratio == 0.1
    assert c.foreign_util_samples == 2
    assert c.use_process_list is True
    assert c.simulate is False
    s = c.sim
    assert s.speed == 1.0
    assert s.window_s == pytest.approx(1 / 6)
    assert s.sms == 132
    assert s.foreign_s == ()
    assert s.foreign_load_ratio == 0.9
    assert s.foreign_mem_mib == 2048
    assert s.hide_foreign is False
    assert s.seed == 0


def test_load_defaults_equal_dataclass_defaults() -> None:
    assert load() == Config()
    assert load().sim == SimConfig()


def test_config_is_frozen() -> None:
    c = load()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.target_ratio = 0.9  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.sim.seed = 3  # type: ignore[misc]


def test_unrelated_environment_is_ignored() -> None:
    assert load({"PATH": "/bin", "FORGE": "x", "FORGE_TARGETS": "zzz", "HOME": "/root"}) == Config()


def test_reads_os_environ_when_env_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TARGET", raising=False)
    monkeypatch.setenv("FORGE_TARGET", "0.3")
    assert load_config([], None).target_ratio == 0.3


# --- legacy TARGET ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "expected"), [("50", 0.5), ("50%", 0.5), ("1", 0.01), ("100", 1.0), (" 75 ", 0.75),
                                               ("37.5", 0.375)])
def test_legacy_target_is_a_percent(raw: str, expected: float) -> None:
    assert load({"TARGET": raw}).target_ratio == pytest.approx(expected)


def test_forge_target_wins_over_legacy_target() -> None:
    assert load({"TARGET": "80", "FORGE_TARGET": "0.3"}).target_ratio == 0.3


def test_legacy_target_not_read_when_forge_target_set() -> None:
    # A TARGET left over from something else must not break a configured daemon.
    assert load({"TARGET": "x86_64-linux-gnu", "FORGE_TARGET": "0.4"}).target_ratio == 0.4


def test_target_flag_wins_over_legacy_target() -> None:
    assert load({"TARGET": "80"}, ["--target", "0.2"]).target_ratio == 0.2


def test_legacy_target_above_default_boost_means_no_boost() -> None:
    c = load({"TARGET": "80"})
    assert c.target_ratio == 0.8
    assert c.boost_target_ratio == 0.8


# --- flags -----------------------------------------------------------------------------------------------

GOOD_FLAGS: list[tuple[list[str], str, object]] = [
    (["--target", "0.7"], "target_ratio", 0.7),
    (["--target=70%"], "target_ratio", 0.7),
    (["--gpu", "2"], "gpu", "2"),
    (["--gpu", "GPU-5b8f1e2a-0c3d-4e5f-8a9b-0123456789ab"], "gpu", "GPU-5b8f1e2a-0c3d-4e5f-8a9b-0123456789ab"),
    (["--boost-target", "0.9"], "boost_target_ratio", 0.9),
    (["--boost-after", "0"], "boost_after_s", 0.0),
    (["--resume-after", "5"], "resume_after_s", 5.0),
    (["--log-interval", "30"], "log_interval_s", 30.0),
    (["--log-format", "json"], "log_format", "json"),
    (["--duration", "60"], "duration_s", 60.0),
    (["--controller", "legacy"], "controller", "legacy"),
    (["--metric", "sm_activity"], "metric", "sm_activity"),
    (["--shape", "burn"], "shape", "burn"),
    (["--poll-interval", "0.05"], "poll_interval_s", 0.05),
    (["--foreign-mem-mib", "256"], "foreign_mem_mib", 256.0),
    (["--foreign-util", "0.15"], "foreign_util_ratio", 0.15),
    (["--foreign-samples", "3"], "foreign_util_samples", 3),
    (["--no-process-list"], "use_process_list", False),
    (["--process-list"], "use_process_list", True),
    (["--simulate"], "simulate", True),
    (["--no-simulate"], "simulate", False),
    (["--sim-speed", "0"], "sim.speed", 0.0),
    (["--sim-window", "1"], "sim.window_s", 1.0),
    (["--sim-sms", "114"], "sim.sms", 114),
    (["--sim-foreign", "5-6,1-2"], "sim.foreign_s", ((1.0, 2.0), (5.0, 6.0))),
    (["--sim-foreign-hidden", "8-9"], "sim.foreign_hidden_s", ((8.0, 9.0),)),
    (["--sim-foreign-load", "50%"], "sim.foreign_load_ratio", 0.5),
    (["--sim-foreign-mem", "1024"], "sim.foreign_mem_mib", 1024.0),
    (["--sim-hide-foreign"], "sim.hide_foreign", True),
    (["--sim-seed", "7"], "sim.seed", 7),
    (["--gpus", "all"], "gpus", "all"),
    (["--metrics-port", "9401"], "metrics_port", 9401),
    (["--metrics-addr", "127.0.0.1"], "metrics_addr", "127.0.0.1"),
    (["--health-max-age", "10"], "health_max_age_s", 10.0),
    (["--heartbeat-file", "/tmp/x/heartbeat"], "heartbeat_file", "/tmp/x/heartbeat"),
    (["--sim-gpus", "3"], "sim.gpus", 3),
    (["--sim-gpus", "3", "--sim-foreign-gpus", "2,1"], "sim.foreign_gpus", (1, 2)),
    (["--sim-gpus", "3", "--sim-fail-gpu", "2@6,0@1m"], "sim.fail_gpus", ((0, 60.0), (2, 6.0))),
    (["--max-power-w", "350"], "max_power_w", 350.0),
    (["--active-hours", "Sat-Sun"], "active_hours", parse_active_hours("Sat-Sun")),
    (["--pause-file", "/run/p"], "pause_file", "/run/p"),
    (["--hold-dir", "/run/h"], "hold_dir", "/run/h"),
    (["--runtime-dir", "/run/r"], "runtime_dir", "/run/r"),
    (["--hold-idle-age-out", "2h"], "hold_idle_age_out_s", 7200.0),
    (["--kubelet-socket", "/run/k/kubelet.sock"], "kubelet_socket", "/run/k/kubelet.sock"),
]


@pytest.mark.parametrize(("argv", "path", "expected"), GOOD_FLAGS, ids=[" ".join(a) for a, _, _ in GOOD_FLAGS])
def test_good_flags(argv: list[str], path: str, expected: object) -> None:
    got = attr(load({}, argv), path)
    if isinstance(expected, float):
        assert got == pytest.approx(expected)
    else:
        assert got == expected


def test_every_setting_has_a_flag() -> None:
    flags = {opt for action in build_arg_parser()._actions for opt in action.option_strings}
    for argv, _, _ in GOOD_FLAGS:
        assert argv[0].split("=")[0] in flags
    fields = {f.name for f in dataclasses.fields(Config)} - {"sim", "time_zone"}  # TZ is the system's variable
    sim_fields = {f.name for f in dataclasses.fields(SimConfig)}
    covered = {path for _, path, _ in GOOD_FLAGS}
    assert {p for p in covered if "." not in p} == fields
    assert {p.split(".")[1] for p in covered if "." in p} == sim_fields


@pytest.mark.parametrize(
    ("env", "argv", "path", "expected"),
    [
        ({"FORGE_TARGET": "0.3"}, ["--target", "0.4"], "target_ratio", 0.4),
        ({"FORGE_GPU": "1"}, ["--gpu", "2"], "gpu", "2"),
        ({"FORGE_LOG_FORMAT": "json"}, ["--log-format", "text"], "log_format", "text"),
        ({"FORGE_USE_PROCESS_LIST": "1"}, ["--no-process-list"], "use_process_list", False),
        ({"FORGE_USE_PROCESS_LIST": "0"}, ["--process-list"], "use_process_list", True),
        ({"FORGE_SIMULATE": "yes"}, ["--no-simulate"], "simulate", False),
        ({"FORGE_SIM_SEED": "1"}, ["--sim-seed", "2"], "sim.seed", 2),
        ({"FORGE_SIM_FOREIGN": "1-2"}, ["--sim-foreign", "none"], "sim.foreign_s", ()),
    ],
)
def test_flag_wins_over_env(env: dict[str, str], argv: list[str], path: str, expected: object) -> None:
    assert attr(load(env, argv), path) == expected


def test_env_used_when_flag_absent() -> None:
    c = load({"FORGE_TARGET": "0.3", "FORGE_GPU": "1"}, ["--gpu", "2"])
    assert c.target_ratio == 0.3
    assert c.gpu == "2"


def test_bad_env_value_overridden_by_flag_is_not_an_error() -> None:
    assert load({"FORGE_TARGET": "garbage"}, ["--target", "0.4"]).target_ratio == 0.4


def test_last_flag_wins() -> None:
    assert load({}, ["--target", "0.2", "--target", "0.3"]).target_ratio == 0.3


# --- one GPU or several ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "argv", "needles"),
    [
        ({"FORGE_GPU": "1", "FORGE_GPUS": "all"}, [], ("FORGE_GPU='1'", "FORGE_GPUS='all'")),
        ({"FORGE_GPU": "1"}, ["--gpus", "0,1"], ("FORGE_GPU='1'", "--gpus='0,1'")),
        ({}, ["--gpu", "0", "--gpus", "all"], ("--gpu='0'", "--gpus='all'")),
    ],
)
def test_gpu_and_gpus_are_exclusive(env: dict[str, str], argv: list[str], needles: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as info:
        load(env, argv)
    assert_one_line_error(info.value, *needles, "both set", "one of them")


def test_gpus_unset_means_one_gpu() -> None:
    c = load({"FORGE_GPU": "3"})
    assert (c.gpu, c.gpus) == ("3", None)


@pytest.mark.parametrize(
    ("env", "argv", "needles"),
    [
        ({"FORGE_SIM_FAIL_GPU": "1@5"}, [], ("FORGE_SIM_FAIL_GPU='1@5'", "device 1", "FORGE_SIM_GPUS", "below 1")),
        ({}, ["--sim-gpus", "3", "--sim-fail-gpu", "3@5"], ("--sim-fail-gpu='3@5'", "--sim-gpus", "devices 0 to 2")),
        ({"FORGE_SIM_GPUS": "2"}, ["--sim-foreign-gpus", "0,4"], ("--sim-foreign-gpus='0,4'", "device 4")),
    ],
)
def test_simulated_devices_must_exist(env: dict[str, str], argv: list[str], needles: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as info:
        load(env, argv)
    assert_one_line_error(info.value, *needles)


# --- boost target against target -------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "env", "warned"), [
    (["--simulate", "--sim-gpus", "2"], {}, "--sim-gpus=2"),
    (["--simulate"], {"FORGE_SIM_GPUS": "4"}, "FORGE_SIM_GPUS=4"),
    (["--simulate", "--sim-gpus", "2", "--gpus", "all"], {}, None),
    (["--simulate", "--sim-gpus", "2", "--gpu", "1"], {}, None),  # a GPU chosen: as asked
    (["--simulate", "--sim-gpus", "2"], {"FORGE_GPU": "0"}, None),
    (["--simulate", "--sim-gpus", "1"], {}, None),
    (["--sim-gpus", "2"], {}, None),  # no simulation: a real host's GPUs
])
def test_simulated_gpus_that_no_filler_fills_are_said(argv: list[str], env: dict[str, str],
                                                      warned: str | None) -> None:
    # --sim-gpus 2 alone filled simulated GPU 0 and left GPU 1 idle, silently.
    config, warnings = load_settings(argv, env)
    assert config == load_config(argv, env)
    if warned is None:
        assert warnings == []
    else:
        (line,) = warnings
        assert line.startswith(f"warning: {warned} simulates") and "GPU 0" in line and "--gpus all" in line, line


def test_boost_below_target_names_both() -> None:
    with pytest.raises(ConfigError) as info:
        load({"FORGE_TARGET": "0.7", "FORGE_BOOST_TARGET": "0.65"})
    assert_one_line_error(info.value, "FORGE_BOOST_TARGET", "'0.65'", "FORGE_TARGET", "'0.7'")


def test_boost_below_target_from_flags_names_flags() -> None:
    with pytest.raises(ConfigError) as info:
        load({}, ["--target", "80%", "--boost-target", "70%"])
    assert_one_line_error(info.value, "--boost-target", "'70%'", "--target", "'80%'")


def test_boost_below_default_target() -> None:
    with pytest.raises(ConfigError) as info:
        load({"FORGE_BOOST_TARGET": "0.4"})
    assert_one_line_error(info.value, "FORGE_BOOST_TARGET", "'0.4'", "0.5")


def test_boost_below_legacy_target_names_target() -> None:
    with pytest.raises(ConfigError) as info:
        load({"TARGET": "90", "FORGE_BOOST_TARGET": "0.8"})
    assert_one_line_error(info.value, "FORGE_BOOST_TARGET", "TARGET", "'90'")


def test_target_above_default_boost_without_boost_means_no_boost() -> None:
    c = load({"FORGE_TARGET": "0.75"})
    assert c.boost_target_ratio == 0.75


def test_target_below_default_boost_keeps_default_boost() -> None:
    assert load({"FORGE_TARGET": "0.3"}).boost_target_ratio == 0.6


def test_boost_equal_to_target_is_fine() -> None:
    c = load({"FORGE_TARGET": "0.7", "FORGE_BOOST_TARGET": "70%"})
    assert c.boost_target_ratio == pytest.approx(c.target_ratio)


# --- argparse behaviour ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--bogus"], "--bogus"),
        (["--bogus=1"], "--bogus=1"),
        (["stray"], "stray"),
        (["--target"], "--target"),
        (["--targ", "0.5"], "--targ"),  # no abbreviations
        (["--simulate=yes"], "--simulate"),
    ],
)
def test_argparse_errors_become_config_errors(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load({}, argv)
    assert_one_line_error(info.value, needle)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        load({}, ["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--target" in out and "FORGE_TARGET" in out and "50%" in out


def test_build_arg_parser_is_fresh_and_usable() -> None:
    args = build_arg_parser().parse_args(["--target", "0.4"])
    assert args.target_ratio == "0.4"


# --- describe --------------------------------------------------------------------------------------------

BASE_KEYS = {
    "target", "gpu", "boost_target", "boost_after_s", "resume_after_s", "log_interval_s", "log_format",
    "duration_s", "controller", "metric", "shape", "poll_interval_s", "foreign_mem_mib", "foreign_util",
    "foreign_samples",
    "use_process_list", "simulate", "hold_dir", "hold_idle_age_out_s",
}
SIM_KEYS = {
    "sim_speed", "sim_window_s", "sim_sms", "sim_foreign_s", "sim_foreign_hidden_s", "sim_foreign_load",
    "sim_foreign_mem_mib", "sim_hide_foreign", "sim_seed", "sim_gpus", "sim_foreign_gpus", "sim_fail_gpu",
}


def test_describe_without_simulation() -> None:
    d = describe(load({"FORGE_TARGET": "60%", "FORGE_GPU": "1"}))
    assert set(d) == BASE_KEYS
    assert d["target"] == pytest.approx(0.6)
    assert d["gpu"] == "1"
    assert d["boost_target"] == pytest.approx(0.6)
    assert d["simulate"] is False


def test_describe_with_simulation() -> None:
    d = describe(load({"FORGE_SIMULATE": "1", "FORGE_SIM_FOREIGN": "30-40,0-10"}))
    assert set(d) == BASE_KEYS - {"hold_dir"} | SIM_KEYS  # the host's default hold directory: only where set
    explicit = describe(load({"FORGE_SIMULATE": "1", "FORGE_HOLD_DIR": "/tmp/sim-holds"}))
    assert explicit["hold_dir"] == "/tmp/sim-holds"
    assert d["sim_foreign_s"] == "0-10,30-40"
    assert d["sim_sms"] == 132


def test_describe_values_are_flat() -> None:
    d = describe(load({"FORGE_SIMULATE": "1"}))
    for key, value in d.items():
        assert isinstance(value, (str, int, float, bool)), key
    assert d["sim_foreign_s"] == "none"


def test_describe_several_gpus_and_metrics() -> None:
    d = describe(load({"FORGE_GPUS": "0,2", "FORGE_METRICS_PORT": "9401"}))
    assert set(d) == BASE_KEYS | {"gpus", "metrics", "health_max_age_s"}
    assert d["gpus"] == "0,2"
    assert d["metrics"] == "0.0.0.0:9401"
    d = describe(load({"FORGE_GPUS": "all", "FORGE_METRICS_PORT": "0", "FORGE_METRICS_ADDR": "::1"}))
    assert (d["gpus"], d["metrics"]) == ("all", "[::1]:0")


def test_describe_simulated_devices() -> None:
    d = describe(load({}, ["--simulate", "--sim-gpus", "3", "--sim-foreign-gpus", "1", "--sim-fail-gpu", "2@6"]))
    assert (d["sim_gpus"], d["sim_foreign_gpus"], d["sim_fail_gpu"]) == (3, "1", "2@6")
    d = describe(load({"FORGE_SIMULATE": "1"}))
    assert (d["sim_gpus"], d["sim_foreign_gpus"], d["sim_fail_gpu"]) == (1, "all", "none")


def test_config_module_imports_no_gpu_libraries() -> None:
    import subprocess
    import sys

    code = (
        "import sys, forge_load.config.load; "
        "bad = [m for m in ('numba', 'pynvml') if m in sys.modules]; "
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
