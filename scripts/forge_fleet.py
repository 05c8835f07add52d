#!/usr/bin/env python3
"""forge_fleet: one forge_load container per GPU on this host, through the Docker engine.

    forge_fleet.py up [--gpus all|0,1|GPU-...] [--target 0.5] [-e KEY=VALUE ...]
    forge_fleet.py status
    forge_fleet.py logs 0 [-f] [--tail 50]
    forge_fleet.py down [--gpus ...]
    forge_fleet.py watch [--hold-dir DIR] [--created-hold 60]

`watch` follows the engine's container events and holds (forge_load.operators.holds) the GPUs of every container that
asks for them, from its `create` until it dies or is removed, so that the fillers step aside before the
container's process starts (docs/docker-watch.md).

`up` starts a container named forge_load_gpu_<index> for each GPU, with a device request for exactly that
GPU (by UUID), the settings as environment, log rotation, a restart policy, --pid=host (so the filler sees
every process on its GPU and yields at once), the host's hold directory mounted (--hold-dir), and labels.
Run it again and it changes nothing that is already right: a container whose settings, image and GPU
match is left alone (started again if it had stopped); one that differs is recreated. `--simulate` runs the
filler on simulated GPUs (`--count N` of them) with no device request, for hosts without GPUs.

Before it creates anything, `up` checks the settings each container would get (--target, -e) with the
filler's own configuration code, so a value the filler would refuse never reaches a container that Docker
restarts for ever; a FORGE_ variable the filler does not know gets a one-line warning (a typo, most likely).

The Docker engine is the one DOCKER_HOST names (else the default socket). Exit codes: 0 done; 1 an error,
said in one line (engine unreachable or DOCKER_HOST malformed, image missing, no such GPU, a container of
our name that is not ours, ...); 2 bad usage, or a setting the filler would refuse (one line); 130
interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_IMAGE = os.environ.get("FORGE_IMAGE", "forge-load:latest")
DEFAULT_PREFIX = "forge_load_gpu_"
DEFAULT_HOLD_DIR = "/run/forge-load/holds"  # forge_load.operators.holds.DEFAULT_HOLD_DIR (tests/test_fleet.py checks)
FILLER_UID = FILLER_GID = 10001  # the image's user (Dockerfile, USER; tests/test_fleet.py checks)
LABEL_FLEET = "io.forge_load.fleet"  # value: the name prefix; marks a container as ours
LABEL_GPU_INDEX = "io.forge_load.gpu.index"
LABEL_GPU_UUID = "io.forge_load.gpu.uuid"
LABEL_SPEC = "io.forge_load.spec"  # hash of everything `up` asked for; equal hash = nothing to change
LABEL_ROLE = "io.forge_load.role"  # what the container is, as the image says too: a GPU filler
ROLE = "gpu-filler"
STOP_TIMEOUT_S = 10
_ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class FleetError(Exception):
    """A failure to tell the user in one line; exit code 1."""


class SettingsError(Exception):
    """A setting the filler would refuse, in the filler's own words; exit code 2."""


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
    try:
        from forge_load.control.probe import NoGpuError
        from forge_load.gpu.nvml import list_devices
    except ImportError as error:
        raise FleetError(f"cannot import forge_load ({error}): run from the repository, or `pip install .`") from error
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


# --- the engine ---------------------------------------------------------------------------------------------

def connect() -> Any:
    """A docker SDK client that has answered a ping, or a FleetError saying where it looked."""
    try:
        import docker
        from docker.errors import DockerException
    except ImportError as error:
        raise FleetError(f"the Python docker SDK is missing ({error}): pip install docker") from error
    where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock (DOCKER_HOST is not set)"
    try:
        client = docker.from_env(timeout=30)
    except (DockerException, ValueError) as error:  # ValueError: a DOCKER_HOST urllib cannot parse
        raise FleetError(f"cannot reach the Docker engine at {where}: DOCKER_HOST is not usable "
                         f"({_short(error)})") from error
    try:
        client.ping()
    except (DockerException, OSError) as error:
        raise FleetError(f"cannot reach the Docker engine at {where}: {_short(error)}") from error
    return client


def require_image(client: Any, image: str) -> Any:
    from docker.errors import ImageNotFound

    try:
        return client.images.get(image)
    except ImageNotFound:
        raise FleetError(f"image {image} is not on this engine: build it first with "
                         f"`docker build -t {image.split(':')[0]} .` in the forge_load repository") from None


def _short(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


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
    try:
        from forge_load.config.load import load_config, unknown_variables
        from forge_load.config.values import ConfigError
    except ImportError as error:
        raise FleetError(f"cannot import forge_load ({error}): run from the repository, or `pip install .`") from error
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
        raise FleetError(f"a container named {spec['name']} exists and was not started by forge_fleet (it has no "
                         f"{LABEL_FLEET} label): remove or rename it, or use --prefix")
    if labels.get(LABEL_SPEC) != spec["labels"][LABEL_SPEC]:
        return "recreate"
    return "keep" if existing.status == "running" else "start"


# --- the commands -------------------------------------------------------------------------------------------

def find_container(client: Any, name: str) -> Any | None:
    from docker.errors import NotFound

    try:
        return client.containers.get(name)
    except NotFound:
        return None


def ours(client: Any, prefix: str) -> list[Any]:
    found = client.containers.list(all=True, filters={"label": f"{LABEL_FLEET}={prefix}"})
    return sorted(found, key=lambda c: int((c.labels or {}).get(LABEL_GPU_INDEX, "0") or 0))


def prepare_hold_dir(path: str) -> str | None:
    """Make a missing hold directory one the image's filler can write its acknowledgement in (0775, group 10001);
    an existing one is its owner's decision: one warning where the filler cannot write it (`hold --wait` would
    then return before the drain). Returns that warning, or None."""
    try:
        if not os.path.isdir(path):
            os.makedirs(path, mode=0o755, exist_ok=True)
            os.chmod(path, 0o775)
            os.chown(path, -1, FILLER_GID)
        st = os.stat(path)
    except OSError as error:
        return f"warning: --hold-dir {path}: {error.strerror or error}; holds need it (docs/holds.md)"
    writable = (st.st_uid == FILLER_UID and st.st_mode & 0o200 or st.st_gid == FILLER_GID and st.st_mode & 0o020
                or st.st_mode & 0o002)
    if writable:
        return None
    return (f"warning: --hold-dir {path} is not writable by the fillers (uid {FILLER_UID}): they honour holds but "
            f"cannot acknowledge a drain, so `forge-load hold --wait` returns at once; make it with "
            f"`install -d -m 0775 -g {FILLER_GID} {path}` (docs/holds.md)")


def cmd_up(args: argparse.Namespace, out: Any) -> int:
    opts = Options(image=args.image, prefix=args.prefix, simulate=args.simulate, target=args.target,
                   env=parse_env(args.env), restart=args.restart, log_max_size=args.log_max_size,
                   log_max_file=args.log_max_file, pid_host=args.pid_host, pause_dir=args.pause_dir,
                   hold_dir=None if args.hold_dir == "none" else args.hold_dir)
    if opts.pause_dir is not None and not opts.pause_dir.startswith("/"):
        raise FleetError(f"--pause-dir {opts.pause_dir!r}: expected an absolute path on the host, such as "
                         "/run/forge-load")
    if opts.hold_dir is not None and not opts.hold_dir.startswith("/"):
        raise FleetError(f"--hold-dir {opts.hold_dir!r}: expected an absolute path on the host, such as "
                         f"{DEFAULT_HOLD_DIR}, or none")
    for warning in check_settings(opts):
        say(f"forge_fleet: {warning}")
    client = connect()
    image = require_image(client, args.image)
    if opts.hold_dir is not None and (hold_warning := prepare_hold_dir(opts.hold_dir)) is not None:
        say(f"forge_fleet: {hold_warning}")
    gpus = select_gpus(discover_gpus(args.simulate, args.count), args.gpus)
    for gpu in gpus:
        if gpu.mig_enabled:
            say(f"warning: GPU {gpu.index} ({gpu.uuid}) is in MIG mode: NVML reports no utilization there")
    # Decide everything before changing anything: a name collision stops the whole `up`.
    steps: list[tuple[Any, dict[str, Any], Any, str]] = []  # plan() recreates, starts or keeps only one found
    for gpu in gpus:
        spec = desired(gpu, opts, image.id)
        found = find_container(client, spec["name"])
        steps.append((gpu, spec, found, plan(found, spec)))
    for gpu, spec, existing, action in steps:
        if action == "recreate":
            existing.stop(timeout=STOP_TIMEOUT_S)
            existing.remove(force=True)
        if action in ("create", "recreate"):
            container = client.containers.run(**run_kwargs(spec))
        else:
            container = existing
            if action == "start":
                container.start()
        done = {"create": "created", "recreate": "recreated", "start": "started", "keep": "unchanged"}[action]
        print(f"gpu {gpu.index:<3} {spec['name']:<24} {done:<10} {container.short_id}", file=out)
    return 0


def cmd_down(args: argparse.Namespace, out: Any) -> int:
    client = connect()
    containers = ours(client, args.prefix)
    if args.gpus.strip().lower() != "all":
        wanted = {p.strip().lower() for p in args.gpus.split(",")}
        containers = [c for c in containers if {c.labels.get(LABEL_GPU_INDEX, ""),
                                                c.labels.get(LABEL_GPU_UUID, "").lower()} & wanted]
    if not containers:
        print("no forge_load containers to remove", file=out)
    for container in containers:
        started = time.monotonic()
        container.stop(timeout=STOP_TIMEOUT_S)
        took_s = time.monotonic() - started
        container.reload()
        code = container.attrs.get("State", {}).get("ExitCode")
        container.remove(force=True)
        print(f"gpu {container.labels.get(LABEL_GPU_INDEX, '?'):<3} {container.name:<24} removed    "
              f"(exit code {code}, stopped in {took_s:.1f} s)", file=out)
    return 0


def last_status_line(container: Any) -> str:
    """The last status (or start/yield/resume/error/stop) line the filler logged, from `docker logs`."""
    try:
        raw: str = container.logs(tail=200, stdout=True, stderr=True).decode(errors="replace")
    except Exception as error:  # noqa: BLE001 - the engine may refuse logs for a container going away
        return f"(no logs: {_short(error)})"
    lines = [line for line in raw.splitlines() if line.strip()]
    for wanted in ("status", None):
        for line in reversed(lines):
            if wanted is None or _event(line) == wanted:
                return line.strip()
    return "(no log lines yet)"


def _event(line: str) -> str | None:
    if line.lstrip().startswith("{"):
        try:
            return str(json.loads(line).get("event"))
        except (ValueError, AttributeError):
            return None
    m = re.search(r"(?:^|\s)event=(\S+)", line)
    return m.group(1) if m else None


def cmd_status(args: argparse.Namespace, out: Any) -> int:
    client = connect()
    containers = ours(client, args.prefix)
    known = {c.labels.get(LABEL_GPU_INDEX) for c in containers}
    rows = []
    for c in containers:
        state = c.attrs.get("State", {})
        health = (state.get("Health") or {}).get("Status", "-")
        status = c.status if c.status != "exited" else f"exited({state.get('ExitCode')})"
        rows.append((c.labels.get(LABEL_GPU_INDEX, "?"), c.name, status, health, last_status_line(c)))
    if not args.simulate:
        try:  # GPUs with no container yet, where NVML answers; status works without it too
            for gpu in discover_gpus(False, 0):
                if str(gpu.index) not in known:
                    rows.append((str(gpu.index), container_name(args.prefix, gpu.index), "absent", "-", ""))
        except FleetError:
            pass
    if not rows:
        print("no forge_load containers (start them with: forge_fleet.py up)", file=out)
        return 0
    rows.sort(key=lambda r: int(r[0]) if r[0].isdigit() else 1 << 30)
    print(f"{'GPU':<4} {'CONTAINER':<24} {'STATE':<12} {'HEALTH':<10} LAST STATUS", file=out)
    for gpu, name, status, health, line in rows:
        print(f"{gpu:<4} {name:<24} {status:<12} {health:<10} {line}", file=out)
    return 0


def cmd_logs(args: argparse.Namespace, out: Any) -> int:
    client = connect()
    name = args.gpu if not args.gpu.isdigit() else container_name(args.prefix, int(args.gpu))
    container = find_container(client, name)
    if container is None:
        raise FleetError(f"no container {name}: start it with `forge_fleet.py up --gpus {args.gpu}`")
    tail: Any = args.tail if args.tail >= 0 else "all"
    if not args.follow:
        out.write(container.logs(tail=tail).decode(errors="replace"))
        return 0
    try:
        for chunk in container.logs(stream=True, follow=True, tail=tail):
            out.write(chunk.decode(errors="replace"))
            out.flush()
    except KeyboardInterrupt:
        pass
    return 0


# --- watch: holds for the containers that ask for GPUs (docs/docker-watch.md) ---------------------------------

ENGINE_RETRY_S = (1.0, 2.0, 5.0, 10.0)
EXPIRE_EVERY_S = 1.0
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")


def engine_files(containers_dir: str | None, container_id: str) -> dict[str, Any] | None:
    """What a container asks for, from the engine's own files (`<DockerRootDir>/containers/<id>/hostconfig.json`
    and `config.v2.json`, written at create): no call to the engine, which can keep an inspect waiting until the
    container has started. None where they cannot be read (no access, another layout): the caller inspects."""
    if containers_dir is None or not _HEX64.match(container_id):
        return None
    from forge_load.operators.holds import HoldError, read_small

    where = os.path.join(containers_dir, container_id)
    try:
        host = json.loads(read_small(os.path.join(where, "hostconfig.json"), 1 << 20))
        config = json.loads(read_small(os.path.join(where, "config.v2.json"), 4 << 20))
    except (OSError, HoldError, ValueError):
        return None
    if not isinstance(host, dict) or not isinstance(config, dict) or not isinstance(config.get("Config"), dict):
        return None
    return {"HostConfig": host, "Config": config["Config"], "Name": config.get("Name", ""),
            "Created": config.get("Created")}


class Watch:
    """The event loop of `watch`: the engine's container events into forge_load.operators.dockerwatch.DockerHolds.

    On `create` the labels in the event say whether the container is ours or a monitor; the engine's files say
    what GPUs it asks for at once. Where they cannot be read, an inspect runs on a thread of its own (it can
    wait until the container has started) and that container's later events wait for it, in order, while every
    other container's go on."""

    def __init__(self, client: Any, holds_: Any, containers_dir: str | None, log: Any) -> None:
        self.client = client
        self.holds = holds_
        self.containers_dir = containers_dir
        self.log = log
        self.lock = threading.Lock()
        self.pending: dict[str, list[tuple[str, str, float, dict[str, str]]]] = {}

    def handle(self, event: dict[str, Any]) -> None:
        from forge_load.operators.dockerwatch import EVENTS

        action = str(event.get("Action") or event.get("status") or "")
        if event.get("Type", "container") != "container" or action not in EVENTS:
            return
        actor = event.get("Actor") or {}
        container_id = str(actor.get("ID") or event.get("id") or "")
        attributes = {str(k): str(v) for k, v in (actor.get("Attributes") or {}).items()}
        name = attributes.get("name", container_id[:12])
        now_s = time.time()
        with self.lock:
            if container_id in self.pending:  # an inspect is on its way: after it, in order
                self.pending[container_id].append((action, name, now_s, attributes))
                return
            if action in ("create", "start") and not self.holds.known(container_id):
                labels = {k: v for k, v in attributes.items() if k not in ("image", "name")}
                if self.holds.learn(container_id, name, labels, None) is None and \
                        not self.holds.known(container_id):
                    attrs = engine_files(self.containers_dir, container_id)
                    if attrs is None:
                        self.pending[container_id] = [(action, name, now_s, attributes)]
                        threading.Thread(target=self._inspect, args=(container_id,), daemon=True).start()
                        return
                    self.holds.learn(container_id, name, labels, attrs)
            self.holds.event(action, container_id, name, now_s)

    def _inspect(self, container_id: str) -> None:
        try:
            attrs: dict[str, Any] | None = self.client.api.inspect_container(container_id)
        except Exception as error:  # noqa: BLE001 - gone already, or the engine went away: its events decide
            attrs = None
            self.log(f"event=note holder=docker-{container_id[:12]} cannot inspect: {_short(error)}")
        with self.lock:
            queued = self.pending.pop(container_id, [])
            for index, (action, name, now_s, attributes) in enumerate(queued):
                if index == 0 and attrs is not None:
                    labels = {k: v for k, v in attributes.items() if k not in ("image", "name")}
                    self.holds.learn(container_id, name, labels, attrs)
                self.holds.event(action, container_id, name, now_s)

    def reconcile(self) -> None:
        from forge_load.operators.dockerwatch import Seen, not_held_because

        seen = []
        for row in self.client.api.containers(all=True):
            container_id = str(row.get("Id", ""))
            labels = {str(k): str(v) for k, v in (row.get("Labels") or {}).items()}
            status = str(row.get("State", ""))
            name = str((row.get("Names") or [f"/{container_id[:12]}"])[0]).lstrip("/")
            attrs: dict[str, Any] | None = {}
            if not_held_because(labels) is None and status in ("running", "paused", "restarting", "created"):
                attrs = engine_files(self.containers_dir, container_id) or self._inspect_or_none(container_id)
            if attrs is not None:  # None: removed since it was listed
                seen.append(Seen(container_id, name, status, labels, attrs))
        with self.lock:
            self.holds.reconcile(seen, time.time())

    def _inspect_or_none(self, container_id: str) -> dict[str, Any] | None:
        from docker.errors import NotFound

        try:
            return dict(self.client.api.inspect_container(container_id))
        except NotFound:
            return None

    def expire_forever(self, stop: threading.Event) -> None:
        while not stop.wait(EXPIRE_EVERY_S):
            with self.lock:
                self.holds.expire(time.time())


def containers_dir_of(client: Any, log: Any) -> str | None:
    try:
        root = str(client.info().get("DockerRootDir") or "")
    except Exception:  # noqa: BLE001 - an engine that will not say: inspect instead
        root = ""
    where = os.path.join(root, "containers") if root else None
    if where is None or not os.access(where, os.R_OK | os.X_OK):
        log(f"event=note the engine's files ({where or 'DockerRootDir unknown'}) cannot be read here: each "
            "container asking for GPUs is inspected, which can hold it until after its process has started")
        return None
    return where


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def cmd_watch(args: argparse.Namespace, out: Any) -> int:
    from forge_load.operators.dockerwatch import EVENTS, DockerHolds
    from forge_load.service import holdcmd

    try:
        hold_dir = holdcmd.hold_dir_of(args.hold_dir, os.environ)
    except holdcmd.BadInput as error:
        raise SettingsError(str(error)) from None
    if not 0 < args.created_hold <= 86400:
        raise SettingsError(f"--created-hold={args.created_hold!r}: expected seconds above 0, at most 86400")
    uuids = holdcmd.host_uuids()
    if not uuids:
        raise FleetError("neither NVML nor /proc/driver/nvidia/gpus shows a GPU on this host: nothing to hold")

    def log(line: str) -> None:
        shown = "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in line)
        try:
            print(f"t={time.time():.3f} {shown}", file=out, flush=True)
        except (OSError, ValueError):
            pass

    holds_ = DockerHolds(hold_dir, uuids, log, args.created_hold)
    log(f"event=watch hold_dir={hold_dir} gpus={','.join(uuids)} created_hold_s={args.created_hold:g}")
    stop = threading.Event()
    watch: Watch | None = None
    failures = 0
    lost = False
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            try:
                client = connect()
                if watch is None:
                    watch = Watch(client, holds_, containers_dir_of(client, log), log)
                    threading.Thread(target=watch.expire_forever, args=(stop,), daemon=True).start()
                watch.client = client
                since = time.time()
                # The stream first, then the list: what happens while we list comes in the stream.
                stream = client.events(decode=True, since=f"{since:.9f}",
                                       filters={"type": "container", "event": list(EVENTS)})
                watch.reconcile()
                failures = 0
                log("event=engine state=connected")
                lost = False
                for event in stream:
                    watch.handle(event)
                raise FleetError("the engine closed the event stream")
            except KeyboardInterrupt:
                raise
            except Exception as error:  # noqa: BLE001 - the engine gone, restarted, refusing: say so, retry
                wait_s = ENGINE_RETRY_S[min(failures, len(ENGINE_RETRY_S) - 1)]
                failures += 1
                if not lost:  # one line per outage; the next `connected` line ends it
                    log(f"event=engine state=lost error={_short(error)!r} (holds stay until the engine says what "
                        "runs; trying again every few seconds)")
                lost = True
                time.sleep(wait_s)
    except KeyboardInterrupt:  # SIGINT, or SIGTERM (docker stop)
        log("event=stop holds stay as they are: the next `watch` reconciles them with what runs")
        return 0
    finally:
        stop.set()


# --- the command line ---------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forge_fleet.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--image", default=DEFAULT_IMAGE,
                        help=f"image to run (default {DEFAULT_IMAGE}; env FORGE_IMAGE)")
    common.add_argument("--prefix", default=DEFAULT_PREFIX, help=f"container name prefix (default {DEFAULT_PREFIX})")
    common.add_argument("--simulate", action="store_true", help="simulated GPUs, no device requests")
    common.add_argument("--count", type=int, default=2, help="how many simulated GPUs with --simulate (default 2)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{up,down,status,logs,watch}")

    up = sub.add_parser("up", parents=[common], help="start (or bring up to date) one container per GPU")
    up.add_argument("--gpus", default="all", help="all (default), or a list of indices/UUIDs such as 0,1")
    up.add_argument("--target", help="FORGE_TARGET for every container, e.g. 0.5 or 50%% (default: the image's, 0.5)")
    up.add_argument("-e", "--env", action="append", default=[], metavar="KEY=VALUE",
                    help="more environment for the filler (repeatable), e.g. -e FORGE_LOG_FORMAT=json")
    up.add_argument("--restart", default="unless-stopped", choices=["no", "on-failure", "always", "unless-stopped"],
                    help="restart policy (default unless-stopped)")
    up.add_argument("--log-max-size", default="3m", help="json-file log rotation: size per file (default 3m)")
    up.add_argument("--log-max-file", type=int, default=3, help="json-file log rotation: files kept (default 3)")
    up.add_argument("--no-pid-host", dest="pid_host", action="store_false",
                    help="do not share the host's PID namespace (the filler then sees foreign jobs only by "
                         "their memory and utilization, not in the process list)")
    up.add_argument("--pause-dir", metavar="DIR",
                    help="a host directory mounted read-only into every container: the fillers pause while "
                         "DIR/pause exists (FORGE_PAUSE_FILE), e.g. written by a scheduler's prolog")
    up.add_argument("--hold-dir", metavar="DIR", default=DEFAULT_HOLD_DIR,
                    help="the host's hold directory (`forge-load hold`, docs/holds.md), mounted read-write into "
                         f"every container; none: not mounted (default {DEFAULT_HOLD_DIR})")
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", parents=[common], help="stop and remove the containers")
    down.add_argument("--gpus", default="all", help="all (default), or a list of indices/UUIDs")
    down.set_defaults(func=cmd_down)

    status = sub.add_parser("status", parents=[common], help="one row per GPU: state, health, last status line")
    status.set_defaults(func=cmd_status)

    logs = sub.add_parser("logs", parents=[common], help="a GPU's container logs")
    logs.add_argument("gpu", help="GPU index (or container name)")
    logs.add_argument("-f", "--follow", action="store_true", help="follow the logs")
    logs.add_argument("--tail", type=int, default=-1, help="only the last N lines")
    logs.set_defaults(func=cmd_logs)

    watch = sub.add_parser("watch", help="hold the GPUs of every container that asks for them, from its create "
                                         "until it dies (docs/docker-watch.md)")
    watch.add_argument("--hold-dir", default=None,
                       help=f"the hold directory (default FORGE_HOLD_DIR, else {DEFAULT_HOLD_DIR})")
    watch.add_argument("--created-hold", type=float, default=60.0, metavar="SECONDS",
                       help="how long a container created and not started is held for (default 60)")
    watch.set_defaults(func=cmd_watch)
    return parser


def say(text: str) -> None:
    """One line on stderr, every control character escaped (values from the command line and the engine
    must not be able to forge output)."""
    shown = "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in text)
    print(shown, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None, out: Any = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "count", 1) < 1:
            say("forge_fleet: --count must be at least 1")
            return 2
        return int(args.func(args, out or sys.stdout))
    except KeyboardInterrupt:
        say("forge_fleet: interrupted; containers already created or changed stay as they are")
        return 130
    except SettingsError as error:
        say(f"forge_fleet: {error}")
        return 2
    except FleetError as error:
        say(f"forge_fleet: {error}")
        return 1
    except Exception as error:
        from docker.errors import DockerException

        if not isinstance(error, DockerException):
            raise
        text = getattr(error, "explanation", None) or _short(error)
        hint = ""
        if "device driver" in str(text) and "gpu" in str(text):
            hint = (" (no GPU support in this engine: install the NVIDIA Container Toolkit and run "
                    "`nvidia-ctk runtime configure --runtime=docker`, or use --simulate)")
        say(f"forge_fleet: the Docker engine refused: {text}{hint}")
        return 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # forge_load from this checkout when it is not installed
    raise SystemExit(main())
