"""Docker containers to holds (docs/docker-watch.md): which GPUs a container asks for, and the holds that follow
its life. Pure: no Docker SDK and no clock here; `forge-load fleet watch` (forge_load/fleet/watch.py) feeds it the
engine's events, what it looked up about each container, and the time.

A container is held for from its `create` (the engine announces it 0.1-0.4 s before the container's process
runs) until it dies or is removed; a `start` holds again (a restart). A container created and not started
holds for at most `created_hold_s`: its holds carry that expiry, so the fillers drop them even if the watcher
is gone. Holders are `docker-<first 12 hex digits of the id>`; the watcher only ever releases holds whose
holder starts with `docker-`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from forge_load.steering import holds
from forge_load.steering.holds import Hold, HoldError

HOLDER_PREFIX = "docker-"
LABEL_ROLE = "io.forge_load.role"  # the image and `forge-load fleet up` set gpu-filler on our own fillers
LABEL_FLEET = "io.forge_load.fleet"  # set by `forge-load fleet up` on its fillers
NOT_HELD_ROLES = ("gpu-filler", "gpu-monitor")  # gpu-monitor: dcgm-exporter and the like (docs/docker-watch.md)
NVIDIA_RUNTIMES = ("nvidia",)  # runtimes that read NVIDIA_VISIBLE_DEVICES from the container's environment
CDI_KIND = "nvidia.com/gpu"
DEFAULT_CREATED_HOLD_S = 60.0
MAX_REASON_CHARS = 200
EVENTS = ("create", "start", "die", "destroy")  # the container events the watcher follows


@dataclass(frozen=True)
class Request:
    """What a container asks for: every GPU (`all`), GPUs by index or UUID (`ids`), or none. `notes` say where a
    request was read more widely than written (a count, an id that names no GPU here, a MIG device)."""

    all: bool = False
    ids: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def any(self) -> bool:
        return self.all or bool(self.ids)


def _strings(value: object) -> list[str]:
    if isinstance(value, list):
        return [str(v) for v in value if isinstance(v, str | int)]
    return []


def _has_gpu_capability(request: Mapping[str, Any]) -> bool:
    caps = request.get("Capabilities")
    return isinstance(caps, list) and any(isinstance(c, list) and "gpu" in c for c in caps)


def _split_ids(raw: str) -> list[str]:
    return [item.strip() for item in raw.split(",") if item.strip()]


def gpu_request(attrs: Mapping[str, Any]) -> Request:
    """The GPUs a container asks for, from its inspect-shaped attributes (`HostConfig`, `Config`).

    - device requests with the `gpu` capability: `DeviceIDs` (indices or UUIDs); `Count: -1` is every GPU;
      `Count: N` is N GPUs of the engine's choosing, which the request does not name: every GPU is held;
    - CDI requests (`Driver: cdi`) and CDI ids `nvidia.com/gpu=<index|UUID|all|i:j>`;
    - `NVIDIA_VISIBLE_DEVICES` in the environment only where the container runs with an NVIDIA runtime (CUDA
      images set it to `all` and under runc it gives no GPU at all).
    """
    host = attrs.get("HostConfig") or {}
    config = attrs.get("Config") or {}
    every = False
    ids: list[str] = []
    notes: list[str] = []
    requests = host.get("DeviceRequests") if isinstance(host, Mapping) else None
    for request in requests if isinstance(requests, list) else []:
        if not isinstance(request, Mapping):
            continue
        driver = str(request.get("Driver") or "")
        device_ids = _strings(request.get("DeviceIDs"))
        if driver == "cdi" or any(d.startswith(CDI_KIND + "=") for d in device_ids):
            for cdi in device_ids:
                kind, eq, name = cdi.partition("=")
                if kind == CDI_KIND and eq:
                    if name == "all":
                        every = True
                    else:
                        ids.append(name)
            continue
        if not (driver in ("", "nvidia") and (driver == "nvidia" or _has_gpu_capability(request))):
            continue
        count = request.get("Count")
        if device_ids:
            ids.extend(device_ids)
        elif isinstance(count, int) and count != 0:
            every = True
            if count > 0:
                notes.append(f"asks for {count} GPU(s) of the engine's choosing: every GPU held")
    runtime = str(host.get("Runtime") or "") if isinstance(host, Mapping) else ""
    if runtime in NVIDIA_RUNTIMES:
        env = config.get("Env") if isinstance(config, Mapping) else None
        for item in env if isinstance(env, list) else []:
            key, _, value = str(item).partition("=")
            if key == "NVIDIA_VISIBLE_DEVICES":
                value = value.strip()
                if value == "all":
                    every = True
                elif value not in ("", "none", "void"):
                    ids.extend(_split_ids(value))
    return Request(every, tuple(dict.fromkeys(ids)), tuple(notes))


def resolve(request: Request, host_uuids: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The host's GPU UUIDs a request names (host NVML order for indices), and notes. An id that names no GPU
    of this host (a MIG device, an index out of range, a UUID of another machine) holds every GPU: a job must
    never be filled over for want of a name."""
    if request.all:
        return tuple(host_uuids), request.notes
    notes = list(request.notes)
    out: list[str] = []
    by_lower = {u.lower(): u for u in host_uuids}
    for raw in request.ids:
        base = raw.split(":", 1)[0] if ":" in raw and raw.split(":", 1)[0].isdigit() else raw  # MIG i:j -> GPU i
        if base.isascii() and base.isdigit() and int(base) < len(host_uuids):
            uuid = host_uuids[int(base)]
        elif base.lower() in by_lower:
            uuid = by_lower[base.lower()]
        else:
            notes.append(f"{raw!r} names no GPU of this host: every GPU held")
            return tuple(host_uuids), tuple(notes)
        if uuid not in out:
            out.append(uuid)
    return tuple(out), tuple(notes)


def not_held_because(labels: Mapping[str, str]) -> str | None:
    """Why a container with these labels is never held for (ours, or a GPU monitor), else None."""
    role = labels.get(LABEL_ROLE)
    if role in NOT_HELD_ROLES:
        return f"{LABEL_ROLE}={role}"
    if LABEL_FLEET in labels:
        return f"{LABEL_FLEET}={labels[LABEL_FLEET]}"
    return None


def holder_of(container_id: str) -> str:
    return HOLDER_PREFIX + container_id[:12]


def parse_created(raw: object) -> float | None:
    """The engine's `Created` time (RFC 3339 with nanoseconds) as Unix seconds; None if it is not one."""
    if not isinstance(raw, str) or not raw:
        return None
    text = raw.strip().replace("Z", "+00:00")
    head, dot, rest = text.partition(".")
    if dot:  # at most microseconds for fromisoformat
        digits = "".join(c for c in rest if c.isdigit())
        zone = rest[len(digits):]
        text = f"{head}.{digits[:6]}{zone}"
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


@dataclass
class Tracked:
    """A container asking for GPUs, as the watcher knows it."""

    container_id: str
    name: str
    gpus: tuple[str, ...]
    held: bool = False
    until_unix_s: float | None = None


@dataclass(frozen=True)
class Seen:
    """One container as the engine lists it (for reconciliation)."""

    container_id: str
    name: str
    status: str  # running, paused, restarting, created, exited, dead, removing
    labels: Mapping[str, str]
    attrs: Mapping[str, Any] = field(default_factory=dict)


class DockerHolds:
    """The holds of the containers on one engine, kept in `hold_dir` through forge_load.steering.holds.

    `log(line)` gets one line per hold (all GPUs of one container) and per release, and one per problem.
    What a container asks for is the caller's to look up (`learn`): from the engine's own files, or an inspect."""

    def __init__(self, hold_dir: str, host_uuids: Sequence[str], log: Callable[[str], None],
                 created_hold_s: float = DEFAULT_CREATED_HOLD_S) -> None:
        self.hold_dir = hold_dir
        self.host_uuids = tuple(host_uuids)
        self.log = log
        self.created_hold_s = created_hold_s
        self.tracked: dict[str, Tracked] = {}
        self.skipped: dict[str, str] = {}  # container id -> why it is never held for
        self.no_gpu: set[str] = set()  # containers known to ask for no GPU

    # --- what a container asks for -------------------------------------------------------------------

    def learn(self, container_id: str, name: str, labels: Mapping[str, str],
              attrs: Mapping[str, Any] | None) -> Tracked | None:
        """Remember what a container asks for (`attrs` None: labels only, the GPUs unknown yet)."""
        why = not_held_because(labels)
        if why is not None:
            self.skipped[container_id] = why
            return None
        if attrs is None:
            return None
        request = gpu_request(attrs)
        if not request.any:
            self.no_gpu.add(container_id)
            return None
        gpus, notes = resolve(request, self.host_uuids)
        if not gpus:  # a host without GPUs
            self.no_gpu.add(container_id)
            return None
        known = self.tracked.get(container_id)
        if known is not None and known.gpus == gpus:
            return known
        for note in notes:  # once per container
            self.log(f"event=note holder={holder_of(container_id)} container={name} {note}")
        tracked = Tracked(container_id, name, gpus)
        self.tracked[container_id] = tracked
        return tracked

    def known(self, container_id: str) -> bool:
        """Whether nothing more need be looked up about this container."""
        return container_id in self.tracked or container_id in self.skipped or container_id in self.no_gpu

    # --- holds ---------------------------------------------------------------------------------------

    def _reason(self, tracked: Tracked) -> str:
        return f"Docker container {tracked.name[:MAX_REASON_CHARS]} ({tracked.container_id[:12]})"

    def hold(self, container_id: str, now_unix_s: float, why: str, until_unix_s: float | None,
             rewrite: bool = False) -> bool:
        """Place (or refresh) the container's holds, one line when it was not held; `rewrite`: write the files even
        if they should be there already. False when it is not held for (or cannot be)."""
        tracked = self.tracked.get(container_id)
        if tracked is None:
            return False
        same = tracked.held and tracked.until_unix_s == until_unix_s
        if same and not rewrite:
            return True
        holder = holder_of(container_id)
        try:
            holds.ensure_dir(self.hold_dir)
            for uuid in tracked.gpus:
                holds.place(self.hold_dir, Hold(uuid, holder, self._reason(tracked), now_unix_s, until_unix_s))
        except HoldError as error:
            self.log(f"event=error holder={holder} container={tracked.name} cannot hold: {error}")
            return False
        already = tracked.held  # a start after its create: the same hold, now without an end
        tracked.held, tracked.until_unix_s = True, until_unix_s
        if not already:
            until = "none" if until_unix_s is None else f"{until_unix_s:.3f}"
            self.log(f"event=hold holder={holder} container={tracked.name} gpus={','.join(tracked.gpus)} "
                     f"why={why} until={until}")
        return True

    def release(self, container_id: str, why: str) -> None:
        tracked = self.tracked.get(container_id)
        if tracked is None or not tracked.held:
            return
        holder = holder_of(container_id)
        try:
            for uuid in tracked.gpus:
                holds.release(self.hold_dir, uuid, holder)
        except HoldError as error:
            self.log(f"event=error holder={holder} container={tracked.name} cannot release: {error}")
            return
        tracked.held, tracked.until_unix_s = False, None
        self.log(f"event=release holder={holder} container={tracked.name} gpus={','.join(tracked.gpus)} why={why}")

    # --- the engine's events -------------------------------------------------------------------------

    def event(self, action: str, container_id: str, name: str, now_unix_s: float) -> None:
        """One container event, after the caller learned what the container asks for (`learn`)."""
        if action == "create":
            self.hold(container_id, now_unix_s, "create", now_unix_s + self.created_hold_s)
        elif action == "start":
            self.hold(container_id, now_unix_s, "start", None)
        elif action == "die":
            self.release(container_id, "died")
        elif action == "destroy":
            self.release(container_id, "removed")
            self.forget(container_id)

    def forget(self, container_id: str) -> None:
        self.tracked.pop(container_id, None)
        self.skipped.pop(container_id, None)
        self.no_gpu.discard(container_id)

    def expire(self, now_unix_s: float) -> None:
        """Created and never started within `created_hold_s`: released (the fillers drop it at that time too)."""
        for tracked in list(self.tracked.values()):
            if tracked.held and tracked.until_unix_s is not None and tracked.until_unix_s <= now_unix_s:
                self.release(tracked.container_id, "never started")

    # --- reconciliation ------------------------------------------------------------------------------

    def reconcile(self, containers: Iterable[Seen], now_unix_s: float) -> None:
        """Holds for what runs (and what was created less than `created_hold_s` ago), none for the rest: every
        hold of ours (holder `docker-...`) in the directory that no such container explains is released."""
        wanted: dict[str, tuple[str, ...]] = {}
        seen_ids: set[str] = set()
        for seen in containers:
            seen_ids.add(seen.container_id)
            tracked = self.learn(seen.container_id, seen.name, seen.labels, seen.attrs)
            if tracked is None:
                continue
            until: float | None = None
            want = seen.status in ("running", "paused", "restarting")
            if seen.status == "created":
                created = parse_created(seen.attrs.get("Created"))
                until = (created if created is not None else -math.inf) + self.created_hold_s
                want = until > now_unix_s
            if want and self.hold(seen.container_id, now_unix_s, "reconciled", until, rewrite=True):
                wanted[holder_of(seen.container_id)] = tracked.gpus
            elif not want:
                self.release(seen.container_id, "reconciled")
        for container_id in set(self.tracked) - seen_ids:
            self.release(container_id, "gone")
            self.forget(container_id)
        try:
            listing = holds.list_dir(self.hold_dir)
        except HoldError as error:
            self.log(f"event=error cannot list the hold directory: {error}")
            return
        stale: dict[str, list[str]] = {}
        for uuid, holders in listing.holds.items():
            for holder in holders:
                if holder.startswith(HOLDER_PREFIX) and uuid not in wanted.get(holder, ()):
                    stale.setdefault(holder, []).append(uuid)
        for holder, uuids in sorted(stale.items()):
            try:
                for uuid in uuids:
                    holds.release(self.hold_dir, uuid, holder)
            except HoldError as error:
                self.log(f"event=error holder={holder} cannot release: {error}")
                continue
            self.log(f"event=release holder={holder} gpus={','.join(sorted(uuids))} why=reconciled")
