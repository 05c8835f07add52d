"""`forge-load fleet watch` (docs/docker-watch.md): follows the engine's container events and holds
(forge_load.steering.holds) the GPUs of every container that asks for them, from its `create` until it dies or
is removed, so that the fillers step aside before the container's process starts. What is held when is decided
by forge_load.steering.dockerwatch (pure); this is its loop over the engine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from typing import Any

from forge_load.exits import EXIT_OK
from forge_load.fleet import engine
from forge_load.fleet.engine import FleetError, short
from forge_load.fleet.events import EventSplitter
from forge_load.log import OutputLost, escape_controls
from forge_load.steering.dockerwatch import EVENTS, DockerHolds, Seen, not_held_because
from forge_load.steering.holds import HoldError, read_small

ENGINE_RETRY_S = (1.0, 2.0, 5.0, 10.0)
EXPIRE_EVERY_S = 1.0
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_CONTAINER_ID = re.compile(r"[0-9A-Za-z]{1,128}\Z")  # the engine's are 64 hex digits; also a holder's name part


def engine_files(containers_dir: str | None, container_id: str) -> dict[str, Any] | None:
    """What a container asks for, from the engine's own files (`<DockerRootDir>/containers/<id>/hostconfig.json`
    and `config.v2.json`, written at create): no call to the engine, which can keep an inspect waiting until the
    container has started. None where they cannot be read (no access, another layout): the caller inspects."""
    if containers_dir is None or not _HEX64.match(container_id):
        return None
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


def short_json(value: object) -> str:
    """A value from the engine, as JSON, in at most 200 characters: for a line that says what was ignored."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 200 else text[:197] + "..."  # ASCII: a log line escapes the rest


class Watch:
    """The event loop of `watch`: the engine's container events into forge_load.steering.dockerwatch.DockerHolds.

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
        action = str(event.get("Action") or event.get("status") or "")
        if event.get("Type", "container") != "container" or action not in EVENTS:
            return
        # Whatever the engine sends: fields of another shape cost this event only, with one line.
        actor = event.get("Actor")
        actor = actor if isinstance(actor, dict) else {}
        container_id = str(actor.get("ID") or event.get("id") or "")
        raw_attributes = actor.get("Attributes")
        if not _CONTAINER_ID.match(container_id) or not isinstance(raw_attributes, dict | None):
            self.log(f"event=note the engine sent a {action} event without a container id (letters and digits) "
                     f"or with attributes that are not an object, ignored: {short_json(event)}")
            return
        attributes = {str(k): str(v) for k, v in (raw_attributes or {}).items()}
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
            self.log(f"event=note holder=docker-{container_id[:12]} cannot inspect: {short(error)}")
        with self.lock:
            queued = self.pending.pop(container_id, [])
            for index, (action, name, now_s, attributes) in enumerate(queued):
                if index == 0 and attrs is not None:
                    labels = {k: v for k, v in attributes.items() if k not in ("image", "name")}
                    self.holds.learn(container_id, name, labels, attrs)
                self.holds.event(action, container_id, name, now_s)

    def reconcile(self) -> None:
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


def run(hold_dir: str, uuids: list[str], created_hold_s: float, out: Any) -> int:
    """Hold the GPUs of this host (`uuids`) that containers ask for, in `hold_dir`, until SIGINT or SIGTERM (exit
    0); the command (forge_load/commands/fleet.py) has checked what it was given."""

    def log(line: str) -> None:
        try:
            print(f"t={time.time():.3f} {escape_controls(line)}", file=out, flush=True)
        except (OSError, ValueError, OutputLost):
            pass  # a line lost, not the watch: the holds it places matter more than its log (and come from threads)

    holds_ = DockerHolds(hold_dir, uuids, log, created_hold_s)
    log(f"event=watch hold_dir={hold_dir} gpus={','.join(uuids)} created_hold_s={created_hold_s:g}")
    stop = threading.Event()
    watch: Watch | None = None
    failures = 0
    lost = False
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            try:
                client = engine.connect()
                if watch is None:
                    watch = Watch(client, holds_, containers_dir_of(client, log), log)
                    threading.Thread(target=watch.expire_forever, args=(stop,), daemon=True).start()
                watch.client = client
                since = time.time()
                # The stream first, then the list: what happens while we list comes in the stream.
                # Raw chunks, split here: the SDK's decoder goes deaf after one chunk that is not JSON (events.py).
                stream = client.events(decode=False, since=f"{since:.9f}",
                                       filters={"type": "container", "event": list(EVENTS)})
                splitter = EventSplitter(lambda text, size: log(
                    f"event=note the engine sent {size} characters that are not an event, ignored: {text!r}"))
                watch.reconcile()
                failures = 0
                log("event=engine state=connected")
                lost = False
                for chunk in stream:
                    for event in splitter.feed(chunk):
                        watch.handle(event)
                raise FleetError("the engine closed the event stream")
            except KeyboardInterrupt:
                raise
            except Exception as error:  # noqa: BLE001 - the engine gone, restarted, refusing: say so, retry
                wait_s = ENGINE_RETRY_S[min(failures, len(ENGINE_RETRY_S) - 1)]
                failures += 1
                if not lost:  # one line per outage; the next `connected` line ends it
                    log(f"event=engine state=lost error={short(error)!r} (holds stay until the engine says what "
                        "runs; trying again every few seconds)")
                lost = True
                time.sleep(wait_s)
    except KeyboardInterrupt:  # SIGINT, or SIGTERM (docker stop)
        log("event=stop holds stay as they are: the next `watch` reconciles them with what runs")
        return EXIT_OK
    finally:
        stop.set()
