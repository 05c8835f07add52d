"""What `forge-load fleet up` wants for each GPU: the GPUs (NVML's, or simulated), the settings checked as the
filler will check them, the keyword arguments of the container, the hash that says whether a container found is
already right, and what to do with it (create, keep, start, recreate). No engine is contacted here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from forge_load.config.load import load_config, unknown_variables
from forge_load.config.values import ConfigError
from forge_load.fleet.engine import FleetError, SettingsError
from forge_load.steering.holds import DEFAULT_HOLD_DIR

__all__ = ["DEFAULT_HOLD_DIR"]  # the default of `up --hold-dir` and `watch --hold-dir`

DEFAULT_IMAGE = os.environ.get("FORGE_IMAGE", "forge-load:latest")
DEFAULT_PREFIX = "forge_load_gpu_"
FILLER_UID = FILLER_GID = 10001  # the image's user (Dockerfile, USER; tests/test_fleet.py checks)
LABEL_FLEET = "io.forge_load.fleet"  # value: the name prefix; marks a container as ours
LABEL_GPU_INDEX = "io.forge_load.gpu.index"
LABEL_GPU_UUID = "io.forge_load.gpu.uuid"
LABEL_SPEC = "io.forge_load.spec"  # hash of everything `up` asked for; equal hash = nothing to change
LABEL_ROLE = "io.forge_load.role"  # what the container is, as the image says too: a GPU filler
ROLE = "gpu-filler"
STOP_TIMEOUT_S = 10
_ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    mig_enabled: bool = False


# --- GPUs ---------------------------------------------------------------------------------------------------

def discover_gpus(simulate: bool, count: int) -> list[Gpu]:
    """The host's GPUs through NVML (forge_load.gpu.nvml), or `count` simulated ones."""
    if simulate:
        return [Gpu(i, f"SIM-GPU-{i}", "simulated") for i in range(count)]
    from forge_load.control.probe import NoGpuError
    from forge_load.gpu.nvml import list_devices  # pynvml, imported when NVML is asked

    try:
        devices = list_devices()
    except NoGpuError as error:
        hint = "" if "--simulate" in str(error) else " (on a host without GPUs, use --simulate)"
        raise FleetError(f"no GPU found through NVML: {error}{hint}") from error
    if not devices:
        raise FleetError("NVML shows no GPU on this host (on a host without GPUs, use --simulate)")
    return [Gpu(d.index, d.uuid, d.name, d.mig_enabled) for d in devices]


def select_gpus(gpus: Sequence[Gpu], wanted: str) -> list[Gpu]:
    """`all`, or a comma-separated list of indices and UUIDs, in the order given; a clear error for a GPU
    that is not there."""
    if wanted.strip().lower() == "all":
        return list(gpus)
    by_index = {str(g.index): g for g in gpus}
    by_uuid = {g.uuid.lower(): g for g in gpus}
    chosen: list[Gpu] = []
    for piece in (p.strip() for p in wanted.split(",")):
        if not piece:
            raise FleetError(f"--gpus {wanted!r}: an empty item; expected all, or a list such as 0,1 or GPU-...")
        gpu = by_index.get(piece) or by_uuid.get(piece.lower())
        if gpu is None:
            there = ", ".join(f"{g.index} ({g.uuid})" for g in gpus) or "none"
            raise FleetError(f"GPU {piece} does not exist on this host; GPUs here: {there}")
        if gpu not in chosen:
            chosen.append(gpu)
    return chosen


# --- what `up` wants for one GPU ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Options:
    image: str
    prefix: str
    simulate: bool
    target: str | None
    env: tuple[tuple[str, str], ...]
    restart: str
    log_max_size: str
    log_max_file: int
    pid_host: bool
    pause_dir: str | None = None  # a host directory, mounted read-only at the same path: DIR/pause pauses
    hold_dir: str | None = None  # the host's hold directory, mounted read-write at the same path (docs/holds.md)


def container_name(prefix: str, index: int) -> str:
    return f"{prefix}{index}"


def parse_env(items: Iterable[str]) -> tuple[tuple[str, str], ...]:
    pairs: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not _ENV_KEY_RE.match(key):
            raise FleetError(f"-e {item!r}: expected KEY=VALUE")
        pairs[key] = value
    return tuple(sorted(pairs.items()))


def container_env(gpu: Gpu, opts: Options) -> dict[str, str]:
    """The environment the filler in this GPU's container gets."""
    env = dict(opts.env)
    if opts.target is not None:
        env["FORGE_TARGET"] = opts.target
    if opts.simulate:
        env["FORGE_SIMULATE"] = "1"
        env.setdefault("FORGE_SIM_SEED", str(gpu.index))
    if opts.pause_dir is not None:
        env.setdefault("FORGE_PAUSE_FILE", f"{opts.pause_dir.rstrip('/')}/pause")
    if opts.hold_dir is not None:
        env.setdefault("FORGE_HOLD_DIR", opts.hold_dir)
    # Inside a container with one GPU, that GPU is index 0: FORGE_GPU stays at its default.
    return env


def check_settings(opts: Options) -> list[str]:
    """Check the containers' settings as the filler will (SettingsError), before anything is created; the
    filler's warnings about FORGE_ variables it does not know."""
    env = container_env(Gpu(0, "", ""), opts)
    try:
        load_config([], env)
    except ConfigError as error:
        raise SettingsError(f"a setting the filler would refuse: {error}") from None
    return unknown_variables(env)


def desired(gpu: Gpu, opts: Options, image_id: str) -> dict[str, Any]:
    """The keyword arguments of containers.run() for this GPU, labels (with the spec hash) included."""
    env = container_env(gpu, opts)
    spec: dict[str, Any] = {
        "image": opts.image,
        "name": container_name(opts.prefix, gpu.index),
        "environment": dict(sorted(env.items())),
        "restart_policy": {"Name": opts.restart} if opts.restart != "no" else None,
        "log_config": {"Type": "json-file",
                       "Config": {"max-size": opts.log_max_size, "max-file": str(opts.log_max_file)}},
        "pid_mode": "host" if opts.pid_host else None,
        "stop_signal": "SIGTERM",
        "device_uuid": None if opts.simulate else gpu.uuid,
    }
    volumes: dict[str, dict[str, str]] = {}
    if opts.pause_dir is not None:  # only when asked: the spec of a fleet without one is unchanged
        volumes[opts.pause_dir] = {"bind": opts.pause_dir, "mode": "ro"}
    if opts.hold_dir is not None:  # read-write: the filler writes its acknowledgement there
        volumes[opts.hold_dir] = {"bind": opts.hold_dir, "mode": "rw"}
    if volumes:
        spec["volumes"] = volumes
    fingerprint = json.dumps({**spec, "image_id": image_id}, sort_keys=True)
    spec["labels"] = {
        LABEL_ROLE: ROLE,
        LABEL_FLEET: opts.prefix,
        LABEL_GPU_INDEX: str(gpu.index),
        LABEL_GPU_UUID: gpu.uuid,
        LABEL_SPEC: hashlib.sha256(fingerprint.encode()).hexdigest()[:16],
    }
    return spec


def run_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    from docker.types import DeviceRequest, LogConfig

    kwargs = {k: v for k, v in spec.items() if k not in ("device_uuid", "log_config") and v is not None}
    kwargs["log_config"] = LogConfig(type=spec["log_config"]["Type"], config=spec["log_config"]["Config"])
    if spec["device_uuid"] is not None:
        kwargs["device_requests"] = [DeviceRequest(device_ids=[spec["device_uuid"]], capabilities=[["gpu"]])]
    kwargs["detach"] = True
    return kwargs


def plan(existing: Any | None, spec: dict[str, Any]) -> str:
    """What `up` does for one GPU: create, keep, start or recreate (or raise: not our container)."""
    if existing is None:
        return "create"
    labels = existing.labels or {}
    if LABEL_FLEET not in labels:
        raise FleetError(f"a container named {spec['name']} exists and was not started by forge-load fleet (it has "
                         f"no {LABEL_FLEET} label): remove or rename it, or use --prefix")
    if labels.get(LABEL_SPEC) != spec["labels"][LABEL_SPEC]:
        return "recreate"
    return "keep" if existing.status == "running" else "start"
