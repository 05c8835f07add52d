"""The simulated GPU's settings (FORGE_SIM_*): what the simulator is told, and their rows of the settings table."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from forge_load.config.values import (
    Setting,
    bool_value,
    failures_value,
    float_value,
    indices_value,
    int_value,
    intervals_value,
    ratio_value,
    show_number,
    speed_value,
    window_value,
)

# Every simulated GPU's UUID: this prefix, then the seed and the index, 6 digits each. The same for every simulated
# filler of a seed on a host (tests and examples name them), so a hold for one belongs in the filler's own hold
# directory, never the host-wide one (the hold command refuses it there).
SIM_UUID_PREFIX: str = "GPU-51a00000-0000-4000-8000-"


def sim_uuid(seed: int, index: int) -> str:
    return f"{SIM_UUID_PREFIX}{seed:06d}{index:06d}"


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



# The simulated GPU's UUID carries the seed in 6 digits.
MAX_SIM_SEED = 999_999


def spans_text(spans: tuple[tuple[float, float], ...]) -> str:
    return ",".join(f"{show_number(a)}-{show_number(b)}" for a, b in spans) or "none"


def _devices_text(devices: tuple[int, ...] | None) -> str:
    return "all" if devices is None else ",".join(map(str, devices))


def _failures_text(failures: tuple[tuple[int, float], ...]) -> str:
    return ",".join(f"{i}@{show_number(t)}" for i, t in failures) or "none"


SIM_SETTINGS: tuple[Setting, ...] = (
    Setting("sim.speed", "FORGE_SIM_SPEED", "--sim-speed", speed_value,
            "simulator: virtual seconds per real second, 0 = as fast as possible, else >= 0.1; default 1",
            logged="sim_speed"),
    Setting("sim.window_s", "FORGE_SIM_WINDOW", "--sim-window", window_value,
            "simulator: NVML sample window in seconds, 1/6 to 1; default 1/6",
            logged="sim_window_s"),
    Setting("sim.sms", "FORGE_SIM_SMS", "--sim-sms", partial(int_value, low=1, high=1024),
            "simulator: SM count; default 132",
            logged="sim_sms"),
    Setting("sim.foreign_s", "FORGE_SIM_FOREIGN", "--sim-foreign", intervals_value,
            "simulator: foreign jobs as START-END[,START-END...] virtual seconds; default none",
            logged="sim_foreign_s", shown=spans_text),
    Setting("sim.foreign_hidden_s", "FORGE_SIM_FOREIGN_HIDDEN", "--sim-foreign-hidden", intervals_value,
            "simulator: more foreign jobs, START-END[,...], always hidden from the process list; default none",
            logged="sim_foreign_hidden_s", shown=spans_text),
    Setting("sim.foreign_load_ratio", "FORGE_SIM_FOREIGN_LOAD", "--sim-foreign-load",
            partial(ratio_value, example=0.9), "simulator: busy ratio of a foreign job; default 0.9",
            logged="sim_foreign_load"),
    Setting("sim.foreign_mem_mib", "FORGE_SIM_FOREIGN_MEM", "--sim-foreign-mem",
            partial(float_value, low=0.0, low_inclusive=True, what="MiB"),
            "simulator: MiB a foreign job takes; default 2048",
            logged="sim_foreign_mem_mib"),
    Setting("sim.hide_foreign", "FORGE_SIM_HIDE_FOREIGN", "--sim-hide-foreign", bool_value,
            "simulator: hide foreign jobs from the process list; default off", boolean=True,
            logged="sim_hide_foreign"),
    Setting("sim.seed", "FORGE_SIM_SEED", "--sim-seed", partial(int_value, low=0, high=MAX_SIM_SEED),
            "simulator: random seed, 0 to 999999; default 0",
            logged="sim_seed"),
    Setting("sim.gpus", "FORGE_SIM_GPUS", "--sim-gpus", partial(int_value, low=1, high=64),
            "simulator: number of simulated GPUs (indices 0..N-1; pick with --gpu or --gpus); default 1",
            logged="sim_gpus"),
    Setting("sim.foreign_gpus", "FORGE_SIM_FOREIGN_GPUS", "--sim-foreign-gpus", indices_value,
            "simulator: devices the --sim-foreign jobs run on, all or a list such as 1,2; default all",
            logged="sim_foreign_gpus", shown=_devices_text),
    Setting("sim.fail_gpus", "FORGE_SIM_FAIL_GPU", "--sim-fail-gpu", failures_value,
            "simulator: lose devices while running, DEVICE@SECONDS[,...] such as 2@30; default none",
            logged="sim_fail_gpu", shown=_failures_text),
)
