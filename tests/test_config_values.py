"""Every setting's good and bad values, one setting at a time (forge_load/config/values.py's parsers, through
load_config): what each good value becomes, and the one-line error for each bad variable and bad flag."""

from __future__ import annotations

import os

import pytest

from forge_load.config.settings import describe
from forge_load.config.values import ConfigError
from tests.test_config import assert_one_line_error, attr, load

# --- good values, one setting at a time ------------------------------------------------------------------

GOOD_ENV: list[tuple[str, str, str, object]] = [
    # (env var, value, Config attribute path, expected)
    ("FORGE_TARGET", "0.5", "target_ratio", 0.5),
    ("FORGE_TARGET", "50%", "target_ratio", 0.5),
    ("FORGE_TARGET", " 50 % ", "target_ratio", 0.5),
    ("FORGE_TARGET", "1", "target_ratio", 1.0),
    ("FORGE_TARGET", "100%", "target_ratio", 1.0),
    ("FORGE_TARGET", ".25", "target_ratio", 0.25),
    ("FORGE_TARGET", "0.5%", "target_ratio", 0.005),
    ("FORGE_TARGET", "5e-1", "target_ratio", 0.5),
    ("FORGE_GPU", "0", "gpu", "0"),
    ("FORGE_GPU", "3", "gpu", "3"),
    ("FORGE_GPU", " 07 ", "gpu", "7"),
    ("FORGE_GPU", "GPU-5b8f1e2a-0c3d-4e5f-8a9b-0123456789ab", "gpu", "GPU-5b8f1e2a-0c3d-4e5f-8a9b-0123456789ab"),
    ("FORGE_GPU", "gpu-5B8F1E2A-0C3D-4E5F-8A9B-0123456789AB", "gpu", "GPU-5b8f1e2a-0c3d-4e5f-8a9b-0123456789ab"),
    ("FORGE_GPU", "MIG-5b8f1e2a-0c3d-4e5f-8a9b-0123456789ab", "gpu", "MIG-5b8f1e2a-0c3d-4e5f-8a9b-0123456789ab"),
    ("FORGE_GPU", "MIG-GPU-5b8f1e2a-0c3d-4e5f-8a9b-0123456789ab/1/0", "gpu",
     "MIG-GPU-5b8f1e2a-0c3d-4e5f-8a9b-0123456789ab/1/0"),
    ("FORGE_BOOST_TARGET", "0.8", "boost_target_ratio", 0.8),
    ("FORGE_BOOST_TARGET", "75%", "boost_target_ratio", 0.75),
    ("FORGE_BOOST_TARGET", "0.5", "boost_target_ratio", 0.5),  # equal to the default target
    ("FORGE_BOOST_AFTER", "0", "boost_after_s", 0.0),
    ("FORGE_BOOST_AFTER", "120", "boost_after_s", 120.0),
    ("FORGE_BOOST_AFTER", "1h", "boost_after_s", 3600.0),
    ("FORGE_BOOST_AFTER", "30m", "boost_after_s", 1800.0),
    ("FORGE_RESUME_AFTER", "0", "resume_after_s", 0.0),
    ("FORGE_RESUME_AFTER", "12.5", "resume_after_s", 12.5),
    ("FORGE_RESUME_AFTER", "90s", "resume_after_s", 90.0),
    ("FORGE_LOG_INTERVAL", "0.5", "log_interval_s", 0.5),
    ("FORGE_LOG_INTERVAL", "86400", "log_interval_s", 86400.0),
    ("FORGE_LOG_FORMAT", "json", "log_format", "json"),
    ("FORGE_LOG_FORMAT", "JSON", "log_format", "json"),
    ("FORGE_LOG_FORMAT", " Text ", "log_format", "text"),
    ("FORGE_DURATION", "0", "duration_s", 0.0),
    ("FORGE_DURATION", "300", "duration_s", 300.0),
    ("FORGE_CONTROLLER", "legacy", "controller", "legacy"),
    ("FORGE_CONTROLLER", "PI", "controller", "pi"),
    ("FORGE_METRIC", "gr_activity", "metric", "gr_activity"),
    ("FORGE_METRIC", "SM_ACTIVITY", "metric", "sm_activity"),
    ("FORGE_SHAPE", "burn", "shape", "burn"),
    ("FORGE_SHAPE", "Lean", "shape", "lean"),
    ("FORGE_POLL_INTERVAL", "0.01", "poll_interval_s", 0.01),
    ("FORGE_POLL_INTERVAL", "1", "poll_interval_s", 1.0),
    ("FORGE_POLL_INTERVAL", "250ms", "poll_interval_s", 0.25),
    ("FORGE_FOREIGN_MEM_MIB", "128", "foreign_mem_mib", 128.0),
    ("FORGE_FOREIGN_MEM_MIB", "0.5", "foreign_mem_mib", 0.5),
    ("FORGE_FOREIGN_UTIL", "0.2", "foreign_util_ratio", 0.2),
    ("FORGE_FOREIGN_UTIL", "5%", "foreign_util_ratio", 0.05),
    ("FORGE_FOREIGN_UTIL", "99%", "foreign_util_ratio", 0.99),
    ("FORGE_FOREIGN_SAMPLES", "1", "foreign_util_samples", 1),
    ("FORGE_FOREIGN_SAMPLES", "100", "foreign_util_samples", 100),
    ("FORGE_FOREIGN_SAMPLES", "+3", "foreign_util_samples", 3),
    ("FORGE_USE_PROCESS_LIST", "0", "use_process_list", False),
    ("FORGE_USE_PROCESS_LIST", "false", "use_process_list", False),
    ("FORGE_USE_PROCESS_LIST", "No", "use_process_list", False),
    ("FORGE_USE_PROCESS_LIST", "OFF", "use_process_list", False),
    ("FORGE_USE_PROCESS_LIST", "1", "use_process_list", True),
    ("FORGE_USE_PROCESS_LIST", "yes", "use_process_list", True),
    ("FORGE_SIMULATE", "1", "simulate", True),
    ("FORGE_SIMULATE", "TRUE", "simulate", True),
    ("FORGE_SIMULATE", "on", "simulate", True),
    ("FORGE_SIMULATE", "no", "simulate", False),
    ("FORGE_SIM_SPEED", "0", "sim.speed", 0.0),
    ("FORGE_SIM_SPEED", "100", "sim.speed", 100.0),
    ("FORGE_SIM_SPEED", "0.5", "sim.speed", 0.5),
    ("FORGE_SIM_WINDOW", "1", "sim.window_s", 1.0),
    ("FORGE_SIM_WINDOW", "0.5", "sim.window_s", 0.5),
    ("FORGE_SIM_WINDOW", "0.1666", "sim.window_s", 0.1666),
    ("FORGE_SIM_WINDOW", "0.167", "sim.window_s", 0.167),
    ("FORGE_SIM_SMS", "1", "sim.sms", 1),
    ("FORGE_SIM_SMS", "1024", "sim.sms", 1024),
    ("FORGE_SIM_SMS", "108", "sim.sms", 108),
    ("FORGE_SIM_FOREIGN", "10-20", "sim.foreign_s", ((10.0, 20.0),)),
    ("FORGE_SIM_FOREIGN", "0-5,30.5-40", "sim.foreign_s", ((0.0, 5.0), (30.5, 40.0))),
    ("FORGE_SIM_FOREIGN", " 30-40 , 0-10 ", "sim.foreign_s", ((0.0, 10.0), (30.0, 40.0))),  # sorted
    ("FORGE_SIM_FOREIGN", "0-10,10-20", "sim.foreign_s", ((0.0, 10.0), (10.0, 20.0))),  # touching is fine
    ("FORGE_SIM_FOREIGN", "none", "sim.foreign_s", ()),
    ("FORGE_SIM_FOREIGN_HIDDEN", "30-40,0-10", "sim.foreign_hidden_s", ((0.0, 10.0), (30.0, 40.0))),
    ("FORGE_SIM_FOREIGN_LOAD", "0.5", "sim.foreign_load_ratio", 0.5),
    ("FORGE_SIM_FOREIGN_LOAD", "100%", "sim.foreign_load_ratio", 1.0),
    ("FORGE_SIM_FOREIGN_MEM", "0", "sim.foreign_mem_mib", 0.0),
    ("FORGE_SIM_FOREIGN_MEM", "40960", "sim.foreign_mem_mib", 40960.0),
    ("FORGE_SIM_HIDE_FOREIGN", "1", "sim.hide_foreign", True),
    ("FORGE_SIM_HIDE_FOREIGN", "false", "sim.hide_foreign", False),
    ("FORGE_SIM_SEED", "0", "sim.seed", 0),
    ("FORGE_SIM_SEED", "12345", "sim.seed", 12345),
    ("FORGE_GPUS", "all", "gpus", "all"),
    ("FORGE_GPUS", " ALL ", "gpus", "all"),
    ("FORGE_GPUS", "0", "gpus", ("0",)),
    ("FORGE_GPUS", "2, 0,1", "gpus", ("2", "0", "1")),
    ("FORGE_GPUS", "1,GPU-5B8F1E2A-0C3D-4E5F-8A9B-0123456789AB", "gpus",
     ("1", "GPU-5b8f1e2a-0c3d-4e5f-8a9b-0123456789ab")),
    ("FORGE_METRICS_PORT", "9401", "metrics_port", 9401),
    ("FORGE_METRICS_PORT", "0", "metrics_port", 0),
    ("FORGE_METRICS_PORT", "65535", "metrics_port", 65535),
    ("FORGE_METRICS_ADDR", "127.0.0.1", "metrics_addr", "127.0.0.1"),
    ("FORGE_METRICS_ADDR", "::", "metrics_addr", "::"),
    ("FORGE_METRICS_ADDR", "[::1]", "metrics_addr", "::1"),
    ("FORGE_HEALTH_MAX_AGE", "30", "health_max_age_s", 30.0),
    ("FORGE_HEALTH_MAX_AGE", "90.5", "health_max_age_s", 90.5),
    ("FORGE_HEALTH_MAX_AGE", "2.2", "health_max_age_s", 2.2),  # twice (1 s + the 0.1-s poll)
    ("FORGE_HEALTH_MAX_AGE", "2m", "health_max_age_s", 120.0),
    ("FORGE_HEARTBEAT_FILE", "/run/forge_load/heartbeat", "heartbeat_file", "/run/forge_load/heartbeat"),
    ("FORGE_LOG_INTERVAL", "0.1", "log_interval_s", 0.1),
    ("FORGE_SIM_SPEED", "0.1", "sim.speed", 0.1),
    ("FORGE_SIM_SPEED", "-0", "sim.speed", 0.0),
    ("FORGE_SIM_SEED", "999999", "sim.seed", 999999),
    ("FORGE_GPU", "1023", "gpu", "1023"),
    ("FORGE_DURATION", "-0", "duration_s", 0.0),
    ("FORGE_TARGET", "\t0.5 ", "target_ratio", 0.5),
    ("FORGE_SIM_GPUS", "1", "sim.gpus", 1),
    ("FORGE_SIM_GPUS", "8", "sim.gpus", 8),
    ("FORGE_SIM_FOREIGN_GPUS", "all", "sim.foreign_gpus", None),
    ("FORGE_SIM_FOREIGN_GPUS", "0", "sim.foreign_gpus", (0,)),
    ("FORGE_SIM_FAIL_GPU", "none", "sim.fail_gpus", ()),
    ("FORGE_SIM_FAIL_GPU", "0@30", "sim.fail_gpus", ((0, 30.0),)),
    ("FORGE_SIM_FAIL_GPU", "0@1.5s", "sim.fail_gpus", ((0, 1.5),)),
    ("FORGE_MAX_POWER_W", "300", "max_power_w", 300.0),
    ("FORGE_MAX_POWER_W", " 450.5W ", "max_power_w", 450.5),
    ("FORGE_MAX_POWER_W", "250 w", "max_power_w", 250.0),
    ("FORGE_MAX_POWER_W", "10", "max_power_w", 10.0),
    ("FORGE_MAX_POWER_W", "10000", "max_power_w", 10000.0),
    ("FORGE_PAUSE_FILE", "/run/forge-load/pause", "pause_file", "/run/forge-load/pause"),
    ("FORGE_HOLD_DIR", "/srv/holds", "hold_dir", "/srv/holds"),
    ("FORGE_HOLD_DIR", "holds", "hold_dir", os.path.join(os.getcwd(), "holds")),  # from the current directory
    ("FORGE_HOLD_DIR", "/srv//x/../holds/", "hold_dir", "/srv/holds"),
    ("FORGE_RUNTIME_DIR", "/srv/run", "runtime_dir", "/srv/run"),
    ("FORGE_RUNTIME_DIR", "run", "runtime_dir", os.path.join(os.getcwd(), "run")),
    ("FORGE_HOLD_IDLE_AGE_OUT", "0", "hold_idle_age_out_s", 0.0),
    ("FORGE_HOLD_IDLE_AGE_OUT", "36h", "hold_idle_age_out_s", 129600.0),
    ("FORGE_KUBELET_SOCKET", "/var/lib/kubelet/pod-resources/kubelet.sock", "kubelet_socket",
     "/var/lib/kubelet/pod-resources/kubelet.sock"),
]



@pytest.mark.parametrize(("var", "raw", "path", "expected"), GOOD_ENV, ids=[f"{v}={r!r}" for v, r, _, _ in GOOD_ENV])
def test_good_env_values(var: str, raw: str, path: str, expected: object) -> None:
    got = attr(load({var: raw}), path)
    if isinstance(expected, float):
        assert got == pytest.approx(expected)
    else:
        assert got == expected


def test_integer_settings_are_ints() -> None:
    c = load({"FORGE_FOREIGN_SAMPLES": "4", "FORGE_SIM_SMS": "66", "FORGE_SIM_SEED": "9"})
    assert type(c.foreign_util_samples) is int
    assert type(c.sim.sms) is int
    assert type(c.sim.seed) is int


def test_ratio_and_percent_forms_agree() -> None:
    assert load({"FORGE_TARGET": "0.37"}).target_ratio == pytest.approx(load({"FORGE_TARGET": "37%"}).target_ratio)


# --- bad values ------------------------------------------------------------------------------------------

BAD_ENV: list[tuple[str, str]] = [
    # target
    ("FORGE_TARGET", ""),
    ("FORGE_TARGET", "   "),
    ("FORGE_TARGET", "abc"),
    ("FORGE_TARGET", "50"),  # a ratio above 1 needs %
    ("FORGE_TARGET", "1.5"),
    ("FORGE_TARGET", "120%"),
    ("FORGE_TARGET", "0"),
    ("FORGE_TARGET", "0%"),
    ("FORGE_TARGET", "-0.5"),
    ("FORGE_TARGET", "nan"),
    ("FORGE_TARGET", "NaN"),
    ("FORGE_TARGET", "inf"),
    ("FORGE_TARGET", "-inf"),
    ("FORGE_TARGET", "1e999"),
    ("FORGE_TARGET", "%"),
    ("FORGE_TARGET", "50%%"),
    ("FORGE_TARGET", "0.5.1"),
    ("FORGE_TARGET", "0,5"),
    ("FORGE_TARGET", "1_0%"),
    ("FORGE_TARGET", "0x10"),
    ("FORGE_TARGET", "0.5\nFORGE_GPU=1"),
    # legacy target
    ("TARGET", ""),
    ("TARGET", "abc"),
    ("TARGET", "0"),
    ("TARGET", "0.5"),  # below 1 %: probably meant a ratio
    ("TARGET", "101"),
    ("TARGET", "150%"),
    ("TARGET", "nan"),
    # gpu
    ("FORGE_GPU", ""),
    ("FORGE_GPU", "-1"),
    ("FORGE_GPU", "1.5"),
    ("FORGE_GPU", "gpu0"),
    ("FORGE_GPU", "0,1"),
    ("FORGE_GPU", "all"),
    ("FORGE_GPU", "GPU-12345"),
    ("FORGE_GPU", "GPU-5b8f1e2a-0c3d-4e5f-8a9b-0123456789ag"),
    ("FORGE_GPU", "UUID-5b8f1e2a-0c3d-4e5f-8a9b-0123456789ab"),
    # boost target
    ("FORGE_BOOST_TARGET", ""),
    ("FORGE_BOOST_TARGET", "60"),
    ("FORGE_BOOST_TARGET", "110%"),
    ("FORGE_BOOST_TARGET", "0"),
    ("FORGE_BOOST_TARGET", "x"),
    # times
    ("FORGE_BOOST_AFTER", ""),
    ("FORGE_BOOST_AFTER", "-1"),
    ("FORGE_BOOST_AFTER", "soon"),
    ("FORGE_BOOST_AFTER", "inf"),
    ("FORGE_BOOST_AFTER", "1d"),
    ("FORGE_BOOST_AFTER", "h"),
    ("FORGE_RESUME_AFTER", "-5"),
    ("FORGE_RESUME_AFTER", "nan"),
    ("FORGE_RESUME_AFTER", " "),
    ("FORGE_LOG_INTERVAL", "0"),
    ("FORGE_LOG_INTERVAL", "-1"),
    ("FORGE_LOG_INTERVAL", "86401"),
    ("FORGE_LOG_INTERVAL", "2d"),
    ("FORGE_LOG_INTERVAL", "ten"),
    ("FORGE_DURATION", "-1"),
    ("FORGE_DURATION", "forever"),
    ("FORGE_DURATION", "inf"),
    ("FORGE_POLL_INTERVAL", "0"),
    ("FORGE_POLL_INTERVAL", "0.001"),
    ("FORGE_POLL_INTERVAL", "2"),
    ("FORGE_POLL_INTERVAL", "nan"),
    ("FORGE_POLL_INTERVAL", "5ms"),
    # choices
    ("FORGE_LOG_FORMAT", ""),
    ("FORGE_LOG_FORMAT", "xml"),
    ("FORGE_LOG_FORMAT", "jsonl"),
    ("FORGE_CONTROLLER", "pid"),
    ("FORGE_METRIC", "sm_active"),
    ("FORGE_METRIC", ""),
    ("FORGE_SHAPE", "fma"),
    ("FORGE_SHAPE", ""),
    ("FORGE_CONTROLLER", ""),
    # foreign detection
    ("FORGE_FOREIGN_MEM_MIB", "0"),
    ("FORGE_FOREIGN_MEM_MIB", "-64"),
    ("FORGE_FOREIGN_MEM_MIB", "64MiB"),
    ("FORGE_FOREIGN_MEM_MIB", "inf"),
    ("FORGE_FOREIGN_UTIL", "0"),
    ("FORGE_FOREIGN_UTIL", "1"),
    ("FORGE_FOREIGN_UTIL", "100%"),
    ("FORGE_FOREIGN_UTIL", "10"),
    ("FORGE_FOREIGN_UTIL", "nan"),
    ("FORGE_FOREIGN_SAMPLES", "2.5"),
    ("FORGE_FOREIGN_SAMPLES", "2.0"),
    ("FORGE_FOREIGN_SAMPLES", "0"),
    ("FORGE_FOREIGN_SAMPLES", "101"),
    ("FORGE_FOREIGN_SAMPLES", "1e2"),
    ("FORGE_FOREIGN_SAMPLES", "two"),
    ("FORGE_FOREIGN_SAMPLES", ""),
    # booleans
    ("FORGE_USE_PROCESS_LIST", ""),
    ("FORGE_USE_PROCESS_LIST", "maybe"),
    ("FORGE_USE_PROCESS_LIST", "2"),
    ("FORGE_USE_PROCESS_LIST", "y"),
    ("FORGE_SIMULATE", "enabled"),
    ("FORGE_SIMULATE", "-1"),
    ("FORGE_SIM_HIDE_FOREIGN", "hidden"),
    # simulator
    ("FORGE_SIM_SPEED", "-1"),
    ("FORGE_SIM_SPEED", "inf"),
    ("FORGE_SIM_SPEED", "nan"),
    ("FORGE_SIM_SPEED", "fast"),
    ("FORGE_SIM_SPEED", "1e999"),
    ("FORGE_SIM_FOREIGN_MEM", "1e400"),
    ("FORGE_DURATION", "1e999"),
    ("FORGE_SIM_SPEED", ""),
    ("FORGE_SIM_WINDOW", "0.1"),
    ("FORGE_SIM_WINDOW", "0.16"),
    ("FORGE_SIM_WINDOW", "1.5"),
    ("FORGE_SIM_WINDOW", "0"),
    ("FORGE_SIM_WINDOW", "1/6"),
    ("FORGE_SIM_SMS", "0"),
    ("FORGE_SIM_SMS", "1025"),
    ("FORGE_SIM_SMS", "132.5"),
    ("FORGE_SIM_SMS", "-4"),
    ("FORGE_SIM_FOREIGN", ""),
    ("FORGE_SIM_FOREIGN", "garbage"),
    ("FORGE_SIM_FOREIGN", "10"),
    ("FORGE_SIM_FOREIGN", "20-10"),
    ("FORGE_SIM_FOREIGN_HIDDEN", "20-10"),
    ("FORGE_SIM_FOREIGN_HIDDEN", "10-20,15-30"),
    ("FORGE_SIM_FOREIGN", "10-10"),
    ("FORGE_SIM_FOREIGN", "-5-10"),
    ("FORGE_SIM_FOREIGN", "10-20,15-30"),
    ("FORGE_SIM_FOREIGN", "15-30,10-20"),
    ("FORGE_SIM_FOREIGN", "0-100,10-20"),
    ("FORGE_SIM_FOREIGN", "10-20,"),
    ("FORGE_SIM_FOREIGN", "10-20;30-40"),
    ("FORGE_SIM_FOREIGN", "a-b"),
    ("FORGE_SIM_FOREIGN", "10-nan"),
    ("FORGE_SIM_FOREIGN", "10-inf"),
    ("FORGE_SIM_FOREIGN", "1-2-3"),
    ("FORGE_SIM_FOREIGN_LOAD", "0"),
    ("FORGE_SIM_FOREIGN_LOAD", "90"),
    ("FORGE_SIM_FOREIGN_LOAD", "101%"),
    ("FORGE_SIM_FOREIGN_MEM", "-1"),
    ("FORGE_SIM_FOREIGN_MEM", "lots"),
    ("FORGE_SIM_SEED", "-1"),
    ("FORGE_SIM_SEED", "1.5"),
    ("FORGE_SIM_SEED", "abc"),
    # several GPUs, metrics, health
    ("FORGE_GPUS", ""),
    ("FORGE_GPUS", "any"),
    ("FORGE_GPUS", "0,"),
    ("FORGE_GPUS", "0,0"),
    ("FORGE_GPUS", "0;1"),
    ("FORGE_GPUS", "-1"),
    ("FORGE_GPUS", "all,0"),
    ("FORGE_GPUS", "GPU-12345"),
    ("FORGE_METRICS_PORT", ""),
    ("FORGE_METRICS_PORT", "-1"),
    ("FORGE_METRICS_PORT", "65536"),
    ("FORGE_METRICS_PORT", "http"),
    ("FORGE_METRICS_PORT", "9400.5"),
    ("FORGE_METRICS_ADDR", ""),
    ("FORGE_METRICS_ADDR", "localhost:9400"),
    ("FORGE_METRICS_ADDR", "300.1.1.1"),
    ("FORGE_HEALTH_MAX_AGE", "0"),
    ("FORGE_HEALTH_MAX_AGE", "-5"),
    ("FORGE_HEALTH_MAX_AGE", "never"),
    ("FORGE_HEALTH_MAX_AGE", "1.9"),
    ("FORGE_HEALTH_MAX_AGE", "2"),  # below twice (1 s + the 0.1-s poll)
    ("FORGE_HEARTBEAT_FILE", ""),
    ("FORGE_HEARTBEAT_FILE", "heartbeat"),
    ("FORGE_HEARTBEAT_FILE", "/tmp/a\nb"),
    ("FORGE_LOG_INTERVAL", "0.09"),
    ("FORGE_SIM_SPEED", "0.09"),
    ("FORGE_SIM_SEED", "1000000"),
    ("FORGE_GPU", "1024"),
    ("FORGE_TARGET", "0.5\n"),
    ("FORGE_TARGET", "\u0665\u0660%"),
    ("FORGE_SIM_GPUS", "0"),
    ("FORGE_SIM_GPUS", "65"),
    ("FORGE_SIM_GPUS", "two"),
    ("FORGE_SIM_FOREIGN_GPUS", ""),
    ("FORGE_SIM_FOREIGN_GPUS", "-1"),
    ("FORGE_SIM_FOREIGN_GPUS", "0,0"),
    ("FORGE_SIM_FOREIGN_GPUS", "x"),
    ("FORGE_SIM_FAIL_GPU", ""),
    ("FORGE_SIM_FAIL_GPU", "0"),
    ("FORGE_SIM_FAIL_GPU", "@5"),
    ("FORGE_SIM_FAIL_GPU", "0@"),
    ("FORGE_SIM_FAIL_GPU", "0@-1"),
    ("FORGE_SIM_FAIL_GPU", "x@5"),
    ("FORGE_SIM_FAIL_GPU", "0@5,0@6"),
    ("FORGE_SIM_FAIL_GPU", "0@inf"),
    ("FORGE_MAX_POWER_W", "9.9"),
    ("FORGE_MAX_POWER_W", "10001"),
    ("FORGE_MAX_POWER_W", "0"),
    ("FORGE_MAX_POWER_W", "300kW"),
    ("FORGE_MAX_POWER_W", "W"),
    ("FORGE_MAX_POWER_W", "none"),
    ("FORGE_ACTIVE_HOURS", ""),
    ("FORGE_ACTIVE_HOURS", "always"),
    ("FORGE_ACTIVE_HOURS", "Mon-Fri 8-17"),
    ("FORGE_ACTIVE_HOURS", "Mon-Fri 20:00-08:00,"),
    ("FORGE_ACTIVE_HOURS", "Mon 25:00-26:00"),
    ("FORGE_PAUSE_FILE", ""),
    ("FORGE_PAUSE_FILE", "pause"),
    ("FORGE_HOLD_DIR", ""),
    ("FORGE_RUNTIME_DIR", ""),
    ("FORGE_HOLD_IDLE_AGE_OUT", "-1"),
    ("FORGE_HOLD_IDLE_AGE_OUT", "1d"),
    ("FORGE_KUBELET_SOCKET", "kubelet.sock"),
    ("FORGE_KUBELET_SOCKET", ""),
]


def test_active_hours_are_parsed_and_described() -> None:
    config = load({"FORGE_ACTIVE_HOURS": " Mon-Fri  20:00-08:00 , Sat-Sun "})
    assert config.active_hours is not None and config.active_hours.text == "Mon-Fri 20:00-08:00, Sat-Sun"
    assert describe(config)["active_hours"] == "Mon-Fri 20:00-08:00, Sat-Sun"
    capped = load({"FORGE_MAX_POWER_W": "300", "FORGE_PAUSE_FILE": "/run/p", "TZ": "Europe/Berlin"})
    assert {k: describe(capped)[k] for k in ("max_power_w", "pause_file", "tz")} == {
        "max_power_w": 300.0, "pause_file": "/run/p", "tz": "Europe/Berlin"}
    assert "active_hours" not in describe(capped) and "max_power_w" not in describe(load())


@pytest.mark.parametrize("tz", ["Europe/Berlin", ":America/New_York", "UTC", "CET-1CEST,M3.5.0,M10.5.0/3", "EST5EDT",
                                ""])
def test_tz_is_read_when_the_hours_need_it(tz: str) -> None:
    assert load({"FORGE_ACTIVE_HOURS": "Sat-Sun", "TZ": tz}).time_zone == tz


@pytest.mark.parametrize("tz", ["Europe/Berln", "Mars/Olympus_Mons", "../../etc/passwd", "\x1b[31m"])
def test_a_tz_no_zone_file_knows_is_refused_once_the_hours_need_it(tz: str) -> None:
    assert load({"TZ": tz}).time_zone is None  # nothing reads local time: not our business
    with pytest.raises(ConfigError) as info:
        load({"FORGE_ACTIVE_HOURS": "Sat-Sun", "TZ": tz})
    assert_one_line_error(info.value, "TZ=", "FORGE_ACTIVE_HOURS reads local time", "Europe/Berlin")
    with pytest.raises(ConfigError) as info:
        load({"FORGE_PAUSE_FILE": "/run/p", "TZ": tz}, ["--active-hours", "Sat"])
    assert_one_line_error(info.value, "--active-hours and FORGE_PAUSE_FILE read local time")


@pytest.mark.parametrize(("var", "raw"), BAD_ENV, ids=[f"{v}={r!r}" for v, r in BAD_ENV])
def test_bad_env_value(var: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        load({var: raw})
    message = assert_one_line_error(info.value, var, repr(raw))
    assert message.startswith(f"{var}={raw!r}"), message
    assert "expected" in message


def test_env_error_also_names_the_flag() -> None:
    with pytest.raises(ConfigError) as info:
        load({"FORGE_TARGET": "abc"})
    assert_one_line_error(info.value, "FORGE_TARGET", "'abc'", "--target", "0.5", "50%")


def test_ratio_above_one_says_percent_is_needed() -> None:
    with pytest.raises(ConfigError) as info:
        load({"FORGE_TARGET": "50"})
    assert_one_line_error(info.value, "FORGE_TARGET", "'50'", "%", "50%")
    assert "above 1" in str(info.value)


def test_bad_bool_names_accepted_forms() -> None:
    with pytest.raises(ConfigError) as info:
        load({"FORGE_SIMULATE": "maybe"})
    assert_one_line_error(info.value, "FORGE_SIMULATE", "'maybe'", "true/false", "yes/no", "on/off", "1/0")


def test_simulator_values_are_checked_even_when_not_simulating() -> None:
    with pytest.raises(ConfigError):
        load({"FORGE_SIM_SMS": "0"})


BAD_FLAGS: list[tuple[list[str], str, str]] = [
    (["--target", "abc"], "--target", "abc"),
    (["--target", "50"], "--target", "50"),
    (["--target=120%"], "--target", "120%"),
    (["--target", "0%"], "--target", "0%"),
    (["--target", ""], "--target", ""),
    (["--gpu", "-1"], "--gpu", "-1"),
    (["--boost-target", "2"], "--boost-target", "2"),
    (["--boost-after", "-1"], "--boost-after", "-1"),
    (["--resume-after", "nan"], "--resume-after", "nan"),
    (["--log-interval", "0"], "--log-interval", "0"),
    (["--log-format", "yaml"], "--log-format", "yaml"),
    (["--duration", "x"], "--duration", "x"),
    (["--controller", "bang"], "--controller", "bang"),
    (["--metric", "power"], "--metric", "power"),
    (["--poll-interval", "5"], "--poll-interval", "5"),
    (["--foreign-mem-mib", "0"], "--foreign-mem-mib", "0"),
    (["--foreign-util", "1"], "--foreign-util", "1"),
    (["--foreign-samples", "2.5"], "--foreign-samples", "2.5"),
    (["--sim-speed", "inf"], "--sim-speed", "inf"),
    (["--sim-window", "2"], "--sim-window", "2"),
    (["--sim-sms", "0"], "--sim-sms", "0"),
    (["--sim-foreign", "5-1"], "--sim-foreign", "5-1"),
    (["--sim-foreign-load", "0"], "--sim-foreign-load", "0"),
    (["--sim-foreign-mem", "-3"], "--sim-foreign-mem", "-3"),
    (["--sim-seed", "x"], "--sim-seed", "x"),
]


@pytest.mark.parametrize(("argv", "flag", "raw"), BAD_FLAGS, ids=[" ".join(a) for a, _, _ in BAD_FLAGS])
def test_bad_flag_value(argv: list[str], flag: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        load({}, argv)
    assert_one_line_error(info.value, flag, repr(raw), "expected")


def test_flag_error_also_names_the_env_variable() -> None:
    with pytest.raises(ConfigError) as info:
        load({}, ["--foreign-samples", "2.5"])
    assert_one_line_error(info.value, "--foreign-samples", "'2.5'", "FORGE_FOREIGN_SAMPLES")
