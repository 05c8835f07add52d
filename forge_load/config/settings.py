"""The settings table: every setting's Config field, variable, flag, parser, help and name in the start line.

load.py reads the table (environment, then flags); scripts/gen_docs.py writes docs/settings.md from it;
describe() writes the start line's settings from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Literal

from forge_load.config.heartbeat import HEARTBEAT_EVERY_S, MIN_HEALTH_MAX_AGE_S
from forge_load.config.sim import SIM_SETTINGS, SimConfig
from forge_load.config.values import (
    Setting,
    active_hours_value,
    addr_value,
    bool_value,
    choice_value,
    dir_value,
    float_value,
    gpu_value,
    gpus_value,
    int_value,
    path_value,
    port_value,
    power_value,
    ratio_value,
    seconds_value,
    url_host,
)
from forge_load.steering.holds import DEFAULT_HOLD_DIR, DEFAULT_IDLE_AGE_OUT_S
from forge_load.steering.schedule import ActiveHours


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
    metric: str = "utilization"  # what the target is a target of (control/quantity.py)
    shape: str = "lean"  # what our kernels are (control/shape.py)
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
    runtime_dir: str | None = None  # None: filler_dirs.default_runtime_dir()
    hold_idle_age_out_s: float = DEFAULT_IDLE_AGE_OUT_S  # 0: never
    kubelet_socket: str | None = None  # the kubelet's pod-resources socket; None: not asked
    time_zone: str | None = None  # TZ as given, checked when the hours or the pause file need local time
    sim: SimConfig = field(default_factory=SimConfig)


MAX_FOREIGN_SAMPLES = 100  # the Monitor keeps this many judged sample windows for the signals
CONTROLLER_NAMES = ("pi", "legacy")  # controller.make_controller makes each of these
METRIC_NAMES = ("utilization", "sm_activity", "gr_activity")  # quantity.QUANTITIES holds each of these
SHAPE_NAMES = ("lean", "burn")  # control/shape.py lays out each of these

# Boost target used when none is given; a target above it means "no boost" rather than an error.
DEFAULT_BOOST_TARGET = 0.6
LEGACY_TARGET_ENV = "TARGET"

# The variables forge-load reads that are not its settings: the man page's ENVIRONMENT (scripts/gen_docs.py).
OTHER_VARIABLES: dict[str, str] = {
    LEGACY_TARGET_ENV: "the original image's target, a percent (TARGET=50), where FORGE_TARGET is not set",
    "TZ": "the local time of FORGE_ACTIVE_HOURS, the pause file's times and the log's time; a zone this system "
          "knows, or a POSIX rule (a FIFO or a device is refused before Python starts)",
    "TMPDIR": "where the default heartbeat and GPU locks are, $TMPDIR/forge_load-<uid>/ (/tmp without it)",
    "RUNTIME_DIRECTORY": "a systemd unit's runtime directory (RuntimeDirectory=): the heartbeat and the GPU locks "
                         "are there instead",
    "NODE_NAME": "the hostname label of forge_load_gpu_info (the node, from the downward API in a pod)",
    "POD_NAMESPACE": "with POD_NAME, this filler's own pod, which the kubelet's holds never hold for",
    "POD_NAME": "see POD_NAMESPACE",
    "CUDA_VISIBLE_DEVICES": "the devices CUDA shows this process; set to a MIG device's UUID for its filler where "
                            "unset",
    "DOCKER_HOST": "the Docker engine of forge-load fleet (default unix:///var/run/docker.sock)",
}

# Status lines at most 10 a second.
MIN_LOG_INTERVAL_S = 0.1


def _gpus_text(gpus: Literal["all"] | tuple[str, ...]) -> str:
    return gpus if isinstance(gpus, str) else ",".join(gpus)


def _hours_text(hours: ActiveHours) -> str:
    return hours.text


SETTINGS: tuple[Setting, ...] = (
    Setting("target_ratio", "FORGE_TARGET", "--target", partial(ratio_value, example=0.5),
            "utilization to hold, 0.5 or 50% (legacy env TARGET=50 also read); default 0.5",
            logged="target"),
    Setting("gpu", "FORGE_GPU", "--gpu", gpu_value, "GPU index or UUID; default 0",
            logged="gpu"),
    Setting("gpus", "FORGE_GPUS", "--gpus", gpus_value,
            "fill several GPUs from one process: all, or a list such as 0,1 (not with FORGE_GPU); default unset",
            logged="gpus", shown=_gpus_text),
    Setting("boost_target_ratio", "FORGE_BOOST_TARGET", "--boost-target", partial(ratio_value, example=0.6),
            "utilization to hold after a long quiet spell, >= target; default 0.6 (or the target if higher)",
            logged="boost_target"),
    Setting("boost_after_s", "FORGE_BOOST_AFTER", "--boost-after", seconds_value,
            "seconds without foreign work before boosting, 0 disables; default 3600",
            logged="boost_after_s"),
    Setting("resume_after_s", "FORGE_RESUME_AFTER", "--resume-after", seconds_value,
            "seconds the GPU must be free of foreign work before resuming; default 60",
            logged="resume_after_s"),
    Setting("log_interval_s", "FORGE_LOG_INTERVAL", "--log-interval",
            partial(seconds_value, low=MIN_LOG_INTERVAL_S, high=86400.0),
            "seconds between status lines, 0.1 to 86400; default 10",
            logged="log_interval_s"),
    Setting("log_format", "FORGE_LOG_FORMAT", "--log-format", partial(choice_value, choices=("text", "json")),
            "text or json; default text",
            logged="log_format"),
    Setting("duration_s", "FORGE_DURATION", "--duration", seconds_value,
            "seconds to run, 0 = until stopped; default 0",
            logged="duration_s"),
    Setting("controller", "FORGE_CONTROLLER", "--controller", partial(choice_value, choices=CONTROLLER_NAMES),
            "pi or legacy; default pi",
            logged="controller"),
    Setting("metric", "FORGE_METRIC", "--metric", partial(choice_value, choices=METRIC_NAMES),
            "what the target is a target of: utilization (NVML's), sm_activity (GPM SM_UTIL) or gr_activity "
            "(GPM GRAPHICS_UTIL); the GPM ones need compute capability 9.0 or newer; default utilization",
            logged="metric"),
    Setting("shape", "FORGE_SHAPE", "--shape", partial(choice_value, choices=SHAPE_NAMES),
            "what our kernels are: lean (a sleeping warp, one per SM for sm_activity: the metric at the fewest "
            "watts) or burn (FMA loops in full waves on every SM: for what lean cannot move, such as SM occupancy, "
            "pipe, tensor or DRAM activity and power-based dashboards); default lean",
            logged="shape"),
    Setting("poll_interval_s", "FORGE_POLL_INTERVAL", "--poll-interval",
            partial(seconds_value, low=0.01, high=1.0), "seconds between GPU polls, 0.01 to 1; default 0.1",
            logged="poll_interval_s"),
    Setting("foreign_mem_mib", "FORGE_FOREIGN_MEM_MIB", "--foreign-mem-mib",
            partial(float_value, low=0.0, low_inclusive=False, what="MiB"),
            "device memory beyond baseline and our own that means a foreign job; default 64",
            logged="foreign_mem_mib"),
    Setting("foreign_util_ratio", "FORGE_FOREIGN_UTIL", "--foreign-util",
            partial(ratio_value, high_inclusive=False, example=0.1),
            "utilization (and, with GPM, SM activity) beyond our own share that means a foreign job; default 0.1",
            logged="foreign_util"),
    Setting("foreign_util_samples", "FORGE_FOREIGN_SAMPLES", "--foreign-samples",
            partial(int_value, low=1, high=MAX_FOREIGN_SAMPLES), "consecutive samples over that needed; default 2",
            logged="foreign_samples"),
    Setting("use_process_list", "FORGE_USE_PROCESS_LIST", "--process-list", bool_value,
            "treat other processes on the GPU as foreign jobs; default on", boolean=True,
            logged="use_process_list"),
    Setting("simulate", "FORGE_SIMULATE", "--simulate", bool_value,
            "run against a simulated GPU; default off", boolean=True,
            logged="simulate"),
    Setting("metrics_port", "FORGE_METRICS_PORT", "--metrics-port", port_value,
            "serve Prometheus /metrics and /health on this port (0 = any free port); default off"),
    Setting("metrics_addr", "FORGE_METRICS_ADDR", "--metrics-addr", addr_value,
            "IP address (not a host name) the metrics server listens on; default 0.0.0.0"),
    # load_config also holds it to twice the heartbeat's longest gap (heartbeat_period_s).
    Setting("health_max_age_s", "FORGE_HEALTH_MAX_AGE", "--health-max-age",
            partial(seconds_value, low=MIN_HEALTH_MAX_AGE_S),
            "seconds without a loop heartbeat before /health and the health command report a GPU stalled; "
            f">= {2 * (HEARTBEAT_EVERY_S + Config.poll_interval_s):g}, twice the heartbeat's longest gap "
            "2 x (1 s + poll interval), divided by the simulation's speed when below 1; default 30"),
    Setting("heartbeat_file", "FORGE_HEARTBEAT_FILE", "--heartbeat-file", path_value,
            "file the loop touches and `python -m forge_load.health` checks; default "
            "$TMPDIR/forge_load-<uid>/heartbeat-<GPUs> (heartbeat-gpu0; /tmp without TMPDIR; a systemd unit's "
            "$RUNTIME_DIRECTORY/heartbeat-<GPUs>)"),
    Setting("max_power_w", "FORGE_MAX_POWER_W", "--max-power-w", power_value,
            "power cap: board power (1-s mean) stays at or under this many watts while filling; default none",
            logged="max_power_w"),
    Setting("active_hours", "FORGE_ACTIVE_HOURS", "--active-hours", active_hours_value,
            "when the filler may run, in local time (TZ), such as 'Mon-Fri 20:00-08:00, Sat-Sun'; paused outside; "
            "default always",
            logged="active_hours", shown=_hours_text),
    Setting("pause_file", "FORGE_PAUSE_FILE", "--pause-file", path_value,
            "paused while this file exists, until the time it holds if any (ISO 8601 or Unix); default none",
            logged="pause_file"),
    Setting("hold_dir", "FORGE_HOLD_DIR", "--hold-dir", partial(dir_value, example=DEFAULT_HOLD_DIR),
            "directory of holds (`forge-load hold`): nothing runs on a GPU while a hold names it; the filler writes "
            f"its acknowledgement and status in a directory of its own there; default {DEFAULT_HOLD_DIR}",
            logged="hold_dir"),
    Setting("runtime_dir", "FORGE_RUNTIME_DIR", "--runtime-dir", partial(dir_value, example="/run/forge-load"),
            "where the filler reports its status for `forge-load status` when it has no directory of its own in the "
            "hold directory (none there, or not writable); made if missing; default $RUNTIME_DIRECTORY in a systemd "
            "unit, /run/forge-load for root, else $XDG_RUNTIME_DIR/forge-load or $TMPDIR/forge_load-<uid>",
            logged="runtime_dir"),
    Setting("hold_idle_age_out_s", "FORGE_HOLD_IDLE_AGE_OUT", "--hold-idle-age-out", seconds_value,
            "a hold over a GPU without foreign work for this long is taken for its dead holder's and no longer "
            f"honoured, 0 = never; default {DEFAULT_IDLE_AGE_OUT_S / 3600:g}h",
            logged="hold_idle_age_out_s"),
    Setting("kubelet_socket", "FORGE_KUBELET_SOCKET", "--kubelet-socket",
            partial(path_value, example="/var/lib/kubelet/pod-resources/kubelet.sock"),
            "the kubelet's pod-resources socket: every GPU the kubelet assigns to another container is held "
            "(docs/kubernetes-holds.md); default none",
            logged="kubelet_socket"),
    *SIM_SETTINGS,
)
BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}


def describe(config: Config) -> dict[str, object]:
    """The effective settings, flat, for the `start` log line, named and shown as the table says; sim_* only
    when simulating."""
    out: dict[str, object] = {}
    for setting in SETTINGS:
        simulator = setting.key.startswith("sim.")
        if not setting.logged or (simulator and not config.simulate):
            continue
        value = getattr(config.sim, setting.key[4:]) if simulator else getattr(config, setting.key)
        if value is None and not simulator:
            continue
        if setting.key == "hold_dir" and config.simulate and value == DEFAULT_HOLD_DIR:
            continue  # still watched, but rarely what a simulated run is about: named on its line only when set
        out[setting.logged] = value if setting.shown is None else setting.shown(value)
    if config.time_zone is not None:
        out["tz"] = config.time_zone
    if config.metrics_port is not None:
        out.update(metrics=f"{url_host(config.metrics_addr)}:{config.metrics_port}",
                   health_max_age_s=config.health_max_age_s)
    return out
