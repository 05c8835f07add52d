"""`forge-load fleet watch` (forge_load/fleet/watch.py, docs/docker-watch.md): container events into holds.

First the logic against fake events and a fake engine (no engine needed): what a container asks for, the holds
that follow its life, the labels that are never held for, reconciliation, and the order of events while an
inspect is on its way. Then with the real engine of tests/docker_support.py (tests marked `docker`): the watcher
as a process, and a 2-GPU virtual GPU where a container running a CUDA job on GPU 1 finds GPU 1's filler drained
before its context exists while GPU 0 keeps filling.
"""

from __future__ import annotations

import http.server
import io
import json
import os
import queue
import shutil
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from docker_support import (
    IMAGE,
    ROOT,
    _unavailable,
    docker_cli,
    docker_client,
    forge_image,
    image,
    remove_containers,
    unique_name,
)
from test_fleet import run_fleet

from forge_load.commands.fleet import build_parser, cmd_watch
from forge_load.fleet import engine as fleet_engine
from forge_load.fleet import events as fleet_events
from forge_load.fleet import plan
from forge_load.fleet import watch as fleet_watch
from forge_load.steering import dockerwatch, holds
from forge_load.steering.dockerwatch import DockerHolds, Request, Seen, gpu_request, resolve
from vgpu import Kernel, VirtualGpu
from vgpu.pytest_plugin import VgpuFactory

__all__ = ["docker_client", "forge_image"]  # fixtures, imported for pytest

UUIDS = ["GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111",
         "GPU-22222222-2222-2222-2222-222222222222"]
ID_A, ID_B, ID_C = ("a" * 64), ("b" * 64), ("c" * 64)


def attrs(requests: list[dict[str, Any]] | None = None, runtime: str = "runc", env: list[str] | None = None,
          created: str | None = None) -> dict[str, Any]:
    return {"HostConfig": {"DeviceRequests": requests, "Runtime": runtime}, "Config": {"Env": env or []},
            "Created": created}


def gpus(*ids: str) -> dict[str, Any]:
    return {"Driver": "", "Count": 0, "DeviceIDs": list(ids), "Capabilities": [["gpu"]], "Options": {}}


def count(n: int) -> dict[str, Any]:
    return {"Driver": "", "Count": n, "DeviceIDs": None, "Capabilities": [["gpu"]], "Options": {}}


# --- what a container asks for ------------------------------------------------------------------------------

def test_device_requests_by_index_uuid_and_count() -> None:
    assert gpu_request(attrs([gpus("1")])) == Request(ids=("1",))  # --gpus device=1, as the engine stores it
    assert gpu_request(attrs([gpus("0", "GPU-x")])) == Request(ids=("0", "GPU-x"))
    assert gpu_request(attrs([count(-1)])) == Request(all=True)  # --gpus all
    counted = gpu_request(attrs([count(2)]))  # --gpus 2: which two is the engine's choice, not in the request
    assert counted.all and "engine's choosing" in counted.notes[0]
    assert not gpu_request(attrs(None)).any and not gpu_request(attrs([])).any and not gpu_request({}).any
    other = {"Driver": "", "Count": -1, "DeviceIDs": None, "Capabilities": [["tpu"]]}
    assert not gpu_request(attrs([other])).any  # a request for something else is not a GPU


def test_cdi_ids() -> None:
    cdi = {"Driver": "cdi", "Count": 0, "DeviceIDs": ["nvidia.com/gpu=1", "vendor.example/fpga=0"]}
    assert gpu_request(attrs([cdi])) == Request(ids=("1",))
    assert gpu_request(attrs([{"Driver": "cdi", "DeviceIDs": ["nvidia.com/gpu=all"]}])).all
    assert gpu_request(attrs([{"Driver": "cdi", "DeviceIDs": [f"nvidia.com/gpu={UUIDS[2]}"]}])).ids == (UUIDS[2],)


def test_visible_devices_only_under_the_nvidia_runtime() -> None:
    # CUDA images set NVIDIA_VISIBLE_DEVICES=all in their environment: under runc that is no GPU at all.
    assert not gpu_request(attrs(env=["NVIDIA_VISIBLE_DEVICES=all"])).any
    assert gpu_request(attrs(runtime="nvidia", env=["NVIDIA_VISIBLE_DEVICES=all"])).all
    assert gpu_request(attrs(runtime="nvidia", env=["NVIDIA_VISIBLE_DEVICES=0,2"])).ids == ("0", "2")
    for nothing in ("none", "void", ""):
        assert not gpu_request(attrs(runtime="nvidia", env=[f"NVIDIA_VISIBLE_DEVICES={nothing}"])).any


def test_resolve_indices_uuids_mig_and_unknown_ids() -> None:
    assert resolve(Request(ids=("1", UUIDS[2].lower())), UUIDS) == ((UUIDS[1], UUIDS[2]), ())
    assert resolve(Request(ids=("2:0",)), UUIDS)[0] == (UUIDS[2],)  # a MIG device i:j holds its GPU i
    assert resolve(Request(all=True), UUIDS)[0] == tuple(UUIDS)
    for unknown in ("7", "GPU-99999999-9999-9999-9999-999999999999", "MIG-0a1b"):
        held, notes = resolve(Request(ids=("0", unknown)), UUIDS)
        assert held == tuple(UUIDS) and "names no GPU of this host" in notes[0]  # never fill over a job


def test_labels_never_held_for() -> None:
    assert dockerwatch.not_held_because({"io.forge_load.role": "gpu-filler"}) is not None  # the image's label
    assert dockerwatch.not_held_because({"io.forge_load.role": "gpu-monitor"}) is not None  # dcgm-exporter ...
    assert dockerwatch.not_held_because({"io.forge_load.fleet": "forge_load_gpu_"}) is not None  # fleet up
    assert dockerwatch.not_held_because({"io.forge_load.role": "training"}) is None
    assert dockerwatch.not_held_because({}) is None
    # The labels `forge-load fleet up` sets are the ones the watcher reads.
    spec = plan.desired(plan.Gpu(0, UUIDS[0], "A"), _opts(), "sha256:1")
    assert dockerwatch.not_held_because(spec["labels"]) is not None
    assert plan.LABEL_ROLE == dockerwatch.LABEL_ROLE and plan.LABEL_FLEET == dockerwatch.LABEL_FLEET


def test_created_time_of_the_engine() -> None:
    assert dockerwatch.parse_created("2026-11-25T17:26:26.750047559Z") == pytest.approx(1795627586.750047)
    assert dockerwatch.parse_created("2026-11-25T17:26:26Z") == 1795627586.0
    assert dockerwatch.parse_created("") is None and dockerwatch.parse_created("soon") is None


# --- the holds that follow a container's life -------------------------------------------------------------

class Book:
    def __init__(self, hold_dir: Path, created_hold_s: float = 60.0) -> None:
        self.lines: list[str] = []
        self.dir = hold_dir
        self.holds = DockerHolds(str(hold_dir), UUIDS, self.lines.append, created_hold_s)

    def on_disk(self) -> dict[tuple[str, str], holds.Hold]:
        found, problems = holds.all_holds(str(self.dir))
        assert problems == []
        return {(h.gpu_uuid, h.holder): h for h in found}

    def events(self, kind: str) -> list[str]:
        return [line for line in self.lines if line.startswith(f"event={kind} ")]

    def feed(self, action: str, container_id: str, now_s: float, labels: dict[str, str] | None = None,
             asks: dict[str, Any] | None = None) -> None:
        if action in ("create", "start") and not self.holds.known(container_id):
            self.holds.learn(container_id, f"name_{container_id[:2]}", labels or {}, asks)
        self.holds.event(action, container_id, f"name_{container_id[:2]}", now_s)


def test_create_start_die_destroy(tmp_path: Path) -> None:
    book = Book(tmp_path / "holds")
    holder = "docker-" + ID_A[:12]
    book.feed("create", ID_A, 1000.0, asks=attrs([gpus("1")]))
    (hold,) = book.on_disk().values()  # held at create, before the process runs, for a bounded time
    assert (hold.gpu_uuid, hold.holder, hold.until_unix_s) == (UUIDS[1], holder, 1060.0)
    assert "Docker container name_aa" in hold.reason
    book.feed("start", ID_A, 1000.2)
    (hold,) = book.on_disk().values()
    assert hold.until_unix_s is None and hold.since_unix_s == 1000.0  # the same hold, now without an end
    book.holds.expire(5000.0)  # a started container's hold never runs out
    assert len(book.on_disk()) == 1
    book.feed("die", ID_A, 1010.0)
    assert book.on_disk() == {}
    book.feed("start", ID_A, 1020.0)  # restarted (a restart policy, `docker start`): held again, no lookup
    assert book.on_disk()[(UUIDS[1], holder)].until_unix_s is None
    book.feed("die", ID_A, 1030.0)
    book.feed("destroy", ID_A, 1030.1)
    assert book.on_disk() == {} and not book.holds.known(ID_A)
    # One line per hold and per release.
    assert len(book.events("hold")) == 2 and len(book.events("release")) == 2, book.lines
    assert f"holder={holder}" in book.events("hold")[0] and f"gpus={UUIDS[1]}" in book.events("hold")[0]
    assert "why=died" in book.events("release")[0]


def test_created_and_never_started_holds_for_a_bounded_time(tmp_path: Path) -> None:
    book = Book(tmp_path / "holds", created_hold_s=30.0)
    book.feed("create", ID_A, 1000.0, asks=attrs([count(-1)]))
    assert {gpu for gpu, _ in book.on_disk()} == set(UUIDS)
    # The fillers drop it at its end by themselves, whether the watcher is there or not.
    assert not holds.read_holds(str(book.dir), UUIDS[0], 1030.0).held
    assert holds.read_holds(str(book.dir), UUIDS[0], 1029.9).held
    book.holds.expire(1029.9)
    assert len(book.on_disk()) == 3
    book.holds.expire(1030.0)
    assert book.on_disk() == {} and "why=never started" in book.events("release")[0]
    book.feed("start", ID_A, 1100.0)  # started late after all: held from its start
    assert len(book.on_disk()) == 3


def test_ours_monitors_and_containers_without_gpus_are_never_held_for(tmp_path: Path) -> None:
    book = Book(tmp_path / "holds")
    book.feed("create", ID_A, 1.0, labels={"io.forge_load.role": "gpu-filler"}, asks=attrs([count(-1)]))
    book.feed("create", ID_B, 1.0, labels={"io.forge_load.role": "gpu-monitor"}, asks=attrs([count(-1)]))
    book.feed("create", ID_C, 1.0, asks=attrs())
    for container_id in (ID_A, ID_B, ID_C):
        book.feed("start", container_id, 2.0)
    assert book.on_disk() == {} and book.lines == []
    assert all(book.holds.known(c) for c in (ID_A, ID_B, ID_C))  # nothing to look up at their next start


def test_reconcile_holds_what_runs_and_releases_only_our_stale_holds(tmp_path: Path) -> None:
    book = Book(tmp_path / "holds")
    hold_dir = str(book.dir)
    holds.ensure_dir(hold_dir)
    now_s = 1_800_000_000.0
    gone = "docker-" + "d" * 12
    holds.place(hold_dir, holds.Hold(UUIDS[0], gone, "Docker container that went", 1.0))  # the watcher was down
    holds.place(hold_dir, holds.Hold(UUIDS[2], "slurm-42", "Slurm job 42", 1.0))  # not ours to touch
    holds.place(hold_dir, holds.Hold(UUIDS[2], "docker-" + ID_A[:12], "its GPU changed", 1.0))
    created = time.strftime("%Y-%m-%dT%H:%M:%S.123456789Z", time.gmtime(now_s - 10))
    old = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now_s - 600))
    book.holds.reconcile([
        Seen(ID_A, "running", "running", {}, attrs([gpus("1")])),
        Seen(ID_B, "fresh", "created", {}, attrs([gpus("0")], created=created)),
        Seen(ID_C, "stale", "created", {}, attrs([gpus("0")], created=old)),
        Seen("e" * 64, "exited", "exited", {}, {}),
        Seen("f" * 64, "filler", "running", {"io.forge_load.role": "gpu-filler"}, {}),
    ], now_s)
    disk = book.on_disk()
    assert set(disk) == {(UUIDS[1], "docker-" + ID_A[:12]), (UUIDS[0], "docker-" + ID_B[:12]),
                         (UUIDS[2], "slurm-42")}
    assert disk[(UUIDS[1], "docker-" + ID_A[:12])].until_unix_s is None
    assert disk[(UUIDS[0], "docker-" + ID_B[:12])].until_unix_s == pytest.approx(now_s - 10 + 0.123456 + 60, abs=1e-3)
    assert any(f"holder={gone}" in line and "why=reconciled" in line for line in book.events("release"))
    # Again, after the engine came back: nothing changed, so nothing said; a container gone is released.
    book.lines.clear()
    book.holds.reconcile([Seen(ID_A, "running", "running", {}, attrs([gpus("1")]))], now_s + 1)
    assert set(book.on_disk()) == {(UUIDS[1], "docker-" + ID_A[:12]), (UUIDS[2], "slurm-42")}
    assert book.events("hold") == [] and len(book.events("release")) == 1, book.lines


def test_a_note_once_per_container(tmp_path: Path) -> None:
    book = Book(tmp_path / "holds")
    for now_s in (1.0, 2.0):  # reconciled again after the engine came back
        book.holds.reconcile([Seen(ID_A, "counted", "running", {}, attrs([count(2)]))], now_s)
    assert len(book.events("note")) == 1 and len(book.events("hold")) == 1, book.lines
    assert {gpu for gpu, _ in book.on_disk()} == set(UUIDS)


# --- the event loop: lookups without waiting on the engine ---------------------------------------------------

class SlowEngine:
    """An engine whose inspect waits until the test says (as one made on `create` can wait for the start)."""

    def __init__(self, answers: dict[str, dict[str, Any]]) -> None:
        self.answers = answers
        self.go = threading.Event()
        self.asked: list[str] = []
        self.api = self

    def inspect_container(self, container_id: str) -> dict[str, Any]:
        self.asked.append(container_id)
        self.go.wait(10)
        return self.answers[container_id]


def event(action: str, container_id: str, **labels: str) -> dict[str, Any]:
    return {"Type": "container", "Action": action, "id": container_id, "timeNano": 0,
            "Actor": {"ID": container_id, "Attributes": {"image": "busybox", "name": f"n_{container_id[:2]}",
                                                          **labels}}}


def engine_dir(root: Path, container_id: str, asks: dict[str, Any]) -> None:
    where = root / container_id
    where.mkdir(parents=True)
    (where / "hostconfig.json").write_text(json.dumps(asks["HostConfig"]))
    (where / "config.v2.json").write_text(json.dumps({"Config": asks["Config"], "Name": "/n",
                                                      "Created": "2026-11-25T17:26:26.750047559Z"}))


def test_create_reads_the_engines_files_without_asking_the_engine(tmp_path: Path) -> None:
    book = Book(tmp_path / "holds")
    engine = SlowEngine({})
    engine_dir(tmp_path / "containers", ID_A, attrs([gpus("2")]))
    watch = fleet_watch.Watch(engine, book.holds, str(tmp_path / "containers"), book.lines.append)
    watch.handle(event("create", ID_A))
    assert engine.asked == [] and set(book.on_disk()) == {(UUIDS[2], "docker-" + ID_A[:12])}
    watch.handle(event("create", ID_B, **{"io.forge_load.role": "gpu-monitor"}))  # the labels suffice
    watch.handle(event("exec_create: sh", ID_A))
    assert engine.asked == []
    assert fleet_watch.engine_files(str(tmp_path / "containers"), "../" + ID_A[3:]) is None  # ids only


def test_an_inspect_on_its_way_holds_up_only_its_own_containers_events(tmp_path: Path) -> None:
    book = Book(tmp_path / "holds")
    engine = SlowEngine({ID_A: attrs([gpus("0")]), ID_B: attrs([gpus("1")])})
    watch = fleet_watch.Watch(engine, book.holds, None, book.lines.append)  # the engine's files out of reach
    started = time.monotonic()
    watch.handle(event("create", ID_A))
    for action in ("start", "die", "destroy"):
        watch.handle(event(action, ID_A))  # queued behind the inspect, in order
    assert time.monotonic() - started < 1.0 and book.on_disk() == {}  # handle() never waits for it
    engine.go.set()
    deadline = time.monotonic() + 10
    while ID_A in watch.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    with watch.lock:  # the inspect's thread empties pending, then replays the queue, both under the lock
        pass
    assert book.on_disk() == {} and not book.holds.known(ID_A)  # held, released, forgotten: in that order
    assert [line.split()[0] for line in book.lines] == ["event=hold", "event=release"], book.lines
    watch.handle(event("create", ID_B))
    while ID_B in watch.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    with watch.lock:
        pass
    assert set(book.on_disk()) == {(UUIDS[1], "docker-" + ID_B[:12])}


class FakeEngine:
    """An engine for `watch` itself: the containers it lists, the events it sends, then the end it comes to."""

    def __init__(self, root: Path, running: list[str], events: list[dict[str, Any]], end: BaseException) -> None:
        self.root, self.running, self.sent, self.end = root, running, events, end
        self.api = self
        self.since: str | None = None

    def info(self) -> dict[str, str]:
        return {"DockerRootDir": str(self.root)}

    def containers(self, all: bool) -> list[dict[str, Any]]:  # noqa: A002 - the SDK's name
        return [{"Id": c, "Names": [f"/n_{c[:2]}"], "State": "running", "Labels": {}} for c in self.running]

    def inspect_container(self, container_id: str) -> dict[str, Any]:
        raise AssertionError("the engine's files are there: no inspect")

    def events(self, **kwargs: Any) -> Iterator[bytes]:
        self.since = kwargs["since"]
        assert kwargs["filters"] == {"type": "container", "event": list(dockerwatch.EVENTS)}
        assert kwargs["decode"] is False  # the raw chunks, as the engine sends them: split by the watcher
        for sent in self.sent:
            yield json.dumps(sent).encode() + b"\n"
        raise self.end


def test_the_engine_lost_and_back_reconciles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container created and started; the engine goes (one line) and comes back without it: its hold goes."""
    engine_dir(tmp_path / "containers", ID_A, attrs([gpus("0")]))
    engines = [FakeEngine(tmp_path, [], [event("create", ID_A), event("start", ID_A)], ConnectionError("gone")),
               FakeEngine(tmp_path, [], [], ConnectionError("still gone")),
               FakeEngine(tmp_path, [], [], KeyboardInterrupt())]
    refusals = [RuntimeError("refused")] * 2

    def connect() -> FakeEngine:
        if len(engines) == 2 and refusals:
            raise refusals.pop()
        return engines.pop(0)

    monkeypatch.setattr(fleet_engine, "connect", connect)
    monkeypatch.setattr(fleet_watch, "ENGINE_RETRY_S", (0.0,))
    monkeypatch.setattr("forge_load.commands.host_gpus.host_uuids", lambda: UUIDS)
    out = io.StringIO()
    args = build_parser().parse_args(["watch", "--hold-dir", str(tmp_path / "holds")])
    assert cmd_watch(args, out) == 0
    lines = [line.split(" ", 1)[1] for line in out.getvalue().splitlines()]
    events = [line.split()[0] for line in lines]
    # One line per outage (the two refused connections say nothing more), the reconciliation's release before
    # the `connected` line.
    assert events == ["event=watch", "event=engine", "event=hold", "event=engine", "event=release",
                      "event=engine", "event=engine", "event=engine", "event=stop"], lines
    assert lines[3].startswith("event=engine state=lost error='gone'") and "why=gone" in lines[4]
    assert lines[5] == "event=engine state=connected" and "still gone" in lines[6]
    assert list((tmp_path / "holds").iterdir()) == []


def test_a_container_removed_while_listed_is_not_an_engine_failure(tmp_path: Path) -> None:
    from docker.errors import NotFound

    class Removed(FakeEngine):
        def inspect_container(self, container_id: str) -> dict[str, Any]:
            raise NotFound(f"No such container: {container_id}")

    book = Book(tmp_path / "holds")
    watch = fleet_watch.Watch(Removed(tmp_path, [ID_B], [], KeyboardInterrupt()), book.holds, None, book.lines.append)
    watch.reconcile()  # listed, then gone before its inspect: nothing to hold, and no exception
    assert book.on_disk() == {} and book.lines == []


class HttpEngine:
    """A Docker engine at the HTTP level, on a unix socket: the docker SDK's own client talks to it, so the SDK's
    reading of the event stream is part of what is tested. `/events` sends, as one HTTP chunk each, the bytes the
    test puts in `chunks`, and stays open until the test puts None."""

    def __init__(self, path: Path, root: Path) -> None:
        self.chunks: queue.Queue[bytes | None] = queue.Queue()
        self.root = root
        self.streams = 0
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass

            def do_GET(self) -> None:  # noqa: N802 - the base class's name
                path = urllib.parse.urlsplit(self.path).path
                if path.endswith("/events"):
                    engine.streams += 1
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    while (chunk := engine.chunks.get()) is not None:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    self.close_connection = True
                    return
                answers: dict[str, Any] = {
                    "/_ping": "OK", "/version": {"ApiVersion": "1.41", "MinAPIVersion": "1.12", "Version": "20.10.24"},
                    "/info": {"DockerRootDir": str(engine.root)}, "/containers/json": []}
                name = "/" + path.rsplit("/", 1)[-1] if path.count("/") > 1 or path == "/_ping" else path
                name = "/containers/json" if path.endswith("/containers/json") else name
                if name not in answers:
                    self.send_error(404)
                    return
                answer = answers[name]
                body = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain" if isinstance(answer, str) else "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = socketserver.ThreadingUnixStreamServer(str(path), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.chunks.put(None)
        self.server.shutdown()
        self.server.server_close()


def event_chunk(action: str, container_id: str) -> bytes:
    """An event as the engine sends it: one JSON object and a newline, one HTTP chunk."""
    return json.dumps(event(action, container_id)).encode() + b"\n"


def test_events_are_read_however_the_engines_bytes_are_cut_and_what_is_not_one_costs_one_line() -> None:
    bad: list[tuple[str, int]] = []
    splitter = fleet_events.EventSplitter(lambda text, size: bad.append((text, size)))
    one = json.dumps(event("create", ID_A)).replace("n_aa", "n_\u00e9").encode() + b"\n"
    # An event cut anywhere, even inside a character of two bytes, is read once its newline arrives.
    for cut in range(1, len(one)):
        got = splitter.feed(one[:cut]) + splitter.feed(one[cut:])
        assert [e["Actor"]["Attributes"]["name"] for e in got] == ["n_\u00e9"], cut
    assert bad == []
    # Two in one chunk; one without its newline (read at once: it is complete); then junk, one line each.
    assert [e["Action"] for e in splitter.feed(json.dumps(event("start", ID_A)).encode() + b"\n" +
                                               json.dumps(event("die", ID_A)).encode())] == ["start", "die"]
    assert splitter.feed(b"\n") == [] and bad == []
    assert splitter.feed(b"garbage {\"also\": garbage\n") == [] and len(bad) == 1
    assert "garbage" in bad[0][0] and bad[0][1] == len("garbage {\"also\": garbage")
    assert [e["Action"] for e in splitter.feed(b"junk" + json.dumps(event("destroy", ID_A)).encode() + b"\n")] \
        == ["destroy"] and len(bad) == 2 and bad[1][0] == "junk"
    assert splitter.feed(b'"a string" 42 null\n') == [] and len(bad) == 3  # JSON, but no event
    # Bytes that never end a line are not kept for ever.
    assert splitter.feed(b"x" * (fleet_events.MAX_PENDING + 1)) == [] and len(bad) == 4
    assert bad[3][1] == fleet_events.MAX_PENDING + 1 and len(bad[3][0]) == 200
    assert [e["Action"] for e in splitter.feed(json.dumps(event("create", ID_B)).encode() + b"\n")] == ["create"]
    assert len(bad) == 4


def test_a_malformed_chunk_on_the_event_stream_costs_that_chunk_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes that are not an event, on a stream the engine keeps open: each costs itself and one line, and the
    `create` after it still places its hold at once (the docker SDK's decoder kept every later event behind the
    first bad chunk, until the stream closed)."""
    ids = [c * 64 for c in "abcdef"]
    for n, container in enumerate(ids):
        engine_dir(tmp_path / "containers", container, attrs([gpus(str(n % 3))]))
    engine = HttpEngine(tmp_path / "docker.sock", tmp_path)
    connects = [0]
    real_connect = fleet_engine.connect

    def connect() -> Any:
        connects[0] += 1
        if connects[0] > 1:  # the stream has ended: the test is over
            raise KeyboardInterrupt
        return real_connect()

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'docker.sock'}")
    monkeypatch.setattr(fleet_engine, "connect", connect)
    monkeypatch.setattr(fleet_watch, "ENGINE_RETRY_S", (0.0,))
    monkeypatch.setattr("forge_load.commands.host_gpus.host_uuids", lambda: UUIDS)
    out = io.StringIO()
    args = build_parser().parse_args(["watch", "--hold-dir", str(tmp_path / "holds")])
    result: list[int] = []
    runner = threading.Thread(target=lambda: result.append(cmd_watch(args, out)), daemon=True)
    runner.start()
    book = Book(tmp_path / "holds")

    def wait_held(container: str) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if any(holder == "docker-" + container[:12] for _, holder in book.on_disk()):
                return
            time.sleep(0.02)
        raise AssertionError(f"no hold for {container[:12]} while the stream is open:\n{out.getvalue()}")

    try:
        deadline = time.monotonic() + 30
        while "event=engine state=connected" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "event=engine state=connected" in out.getvalue(), out.getvalue()
        malformed = [b"this is not JSON\n",  # a line of text
                     b'{"Type": "container", "Action": "crea\n',  # an event cut short
                     b"\xff\xfe\x00 binary\n",  # not even UTF-8
                     b"[1, 2]\n",  # JSON, but not an event
                     b'{"Type": "container", "Action": "create", "Actor": "nobody"}\n',  # an event of odd shape
                     b"no newline, and an event right behind it: "]
        for bad, container in zip(malformed, ids, strict=True):
            engine.chunks.put(bad)
            engine.chunks.put(event_chunk("create", container))
            wait_held(container)
        notes = [line for line in out.getvalue().splitlines() if "event=note" in line]
        assert len(notes) == len(malformed), notes  # one line each
        assert "not an event" in notes[0] and "this is not JSON" in notes[0], notes
        assert "event=engine state=lost" not in out.getvalue() and engine.streams == 1  # the stream stayed open
    finally:
        engine.close()
        runner.join(30)
    assert result == [0], out.getvalue()


# --- the command line and `up` ----------------------------------------------------------------------------

def _opts(**changes: Any) -> Any:
    base = dict(image="forge-load:latest", prefix="forge_load_gpu_", simulate=False, target=None, env=(),
                restart="unless-stopped", log_max_size="3m", log_max_file=3, pid_host=True)
    base.update(changes)
    return plan.Options(**base)


@pytest.mark.parametrize(("args", "flag"), [(["--hold-dir", "relative"], "--hold-dir"),
                                            (["--created-hold", "0"], "--created-hold")])
def test_watch_bad_input_is_one_line_and_exit_2(args: list[str], flag: str) -> None:
    proc = run_fleet("watch", *args, env={"DOCKER_HOST": "unix:///nonexistent.sock"}, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"forge-load fleet: {flag}=") and len(proc.stderr.strip().splitlines()) == 1



# --- with the real engine -----------------------------------------------------------------------------------

BASE_IMAGE = os.environ.get("FORGE_BASE_IMAGE", "forge-base:bookworm")  # python3, nothing else (docker_engine.sh)
DRIVER_DIR = "/usr/lib/x86_64-linux-gnu"  # where the NVIDIA toolkit mounts the driver's libraries
DRIVER_JOB = ROOT / "scripts" / "driver_job.py"
FOREIGN_JOB = ROOT / "scripts" / "foreign_job.py"


class WatchProcess:
    """`forge-load fleet watch` as a process on this host (its NVML: the virtual GPU's), its lines as they come."""

    def __init__(self, env: dict[str, str], hold_dir: Path, created_hold_s: float = 60.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "forge_load", "fleet", "watch", "--hold-dir", str(hold_dir), "--created-hold",
             str(created_hold_s)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait(self, *parts: str, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if all(part in line for part in parts):
                    return line
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no line with {parts} within {timeout_s} s:\n" + "\n".join(self.lines[-30:]))

    def with_(self, *parts: str) -> list[str]:
        return [line for line in self.lines if all(part in line for part in parts)]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self.reader.join(10)


def line_time(line: str) -> float:
    return float(line.split()[0].removeprefix("t="))


def container_id(name: str) -> str:
    proc = docker_cli("inspect", "--format", "{{.Id}}", name)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.fixture
def names(docker_client: Any) -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    remove_containers(docker_client, names=made)


@pytest.fixture(scope="session")
def base_image(docker_client: Any) -> str:
    """The base image, on an engine where `docker run --gpus` runs (its `nvidia` driver registered)."""
    image(docker_client, BASE_IMAGE)
    proc = docker_cli("run", "--rm", "--gpus", "device=0", BASE_IMAGE, "true")
    if proc.returncode != 0:
        _unavailable(f"`docker run --gpus device=0` fails on this engine ({proc.stderr.strip()[-200:]}): an engine "
                     "started before scripts/docker_engine.sh put its stand-in nvidia-container-runtime-hook on "
                     "dockerd's PATH? Restart it: scripts/docker_engine.sh stop, then start")
    return BASE_IMAGE


@pytest.mark.docker
def test_watch_on_the_engine(docker_client: Any, base_image: str, vgpu: VgpuFactory, tmp_path: Path,
                             names: list[str]) -> None:
    uuids = vgpu(gpus=2).uuids()
    env = vgpu.made[0].env()
    hold_dir = tmp_path / "holds"
    watcher = WatchProcess(env, hold_dir, created_hold_s=3.0)
    try:
        watcher.wait("event=engine state=connected")
        # A container asking for GPU 1 finds its hold there 0.5 s after its first instruction (the goal
        # for a job's context; the lead test prints how early it really is); released when it dies.
        job = unique_name("job")
        names.append(job)
        proc = docker_cli("run", "--name", job, "--gpus", "device=1", "-v", f"{hold_dir}:/holds:ro", base_image,
                          "sh", "-c", "sleep 0.5; ls /holds")
        assert proc.returncode == 0, proc.stderr
        holder = "docker-" + container_id(job)[:12]
        assert proc.stdout.split() == [f"hold.{uuids[1]}.{holder}.json"], proc.stdout
        watcher.wait(f"holder={holder}", "event=release", "why=died")
        assert watcher.with_(f"container={job}") == watcher.with_(f"holder={holder}")
        assert len(watcher.with_(f"holder={holder}")) == 2  # one line for the hold, one for the release
        assert list(hold_dir.iterdir()) == []

        # Ours and GPU monitors: never held for, whatever they ask.
        for role in ("gpu-filler", "gpu-monitor"):
            name = unique_name(role.replace("-", "_"))
            names.append(name)
            proc = docker_cli("run", "--name", name, "--gpus", "all", "--label", f"io.forge_load.role={role}",
                              base_image, "true")
            assert proc.returncode == 0, proc.stderr
        # Created and never started: held for --created-hold, then released; started later: held again.
        waiting = unique_name("created")
        names.append(waiting)
        assert docker_cli("create", "--name", waiting, "--gpus", "all", base_image, "sleep", "1").returncode == 0
        holder = "docker-" + container_id(waiting)[:12]
        hold = watcher.wait(f"holder={holder}", "event=hold", "why=create")
        assert f"gpus={uuids[0]},{uuids[1]}" in hold
        release = watcher.wait(f"holder={holder}", "event=release", "why=never started", timeout_s=15)
        assert 2.5 < line_time(release) - line_time(hold) < 8.0  # 3 s, then the next second's check
        assert docker_cli("start", waiting).returncode == 0
        watcher.wait(f"holder={holder}", "event=hold", "why=start")
        watcher.wait(f"holder={holder}", "event=release", "why=died")
        assert not [line for line in watcher.lines if "gpu_filler" in line or "gpu_monitor" in line]

        # Reconciliation: the watcher killed; meanwhile one container goes, another comes.
        gone, came = unique_name("gone"), unique_name("came")
        names.extend([gone, came])
        assert docker_cli("run", "-d", "--name", gone, "--gpus", "device=0", base_image, "sleep", "120").returncode == 0
        gone_holder = "docker-" + container_id(gone)[:12]
        watcher.wait(f"holder={gone_holder}", "event=hold")
    finally:
        watcher.kill()
    assert (hold_dir / f"hold.{uuids[0]}.{gone_holder}.json").exists()
    assert docker_cli("rm", "-f", gone).returncode == 0
    assert docker_cli("run", "-d", "--name", came, "--gpus", "device=1", base_image, "sleep", "120").returncode == 0
    came_holder = "docker-" + container_id(came)[:12]
    holds.place(str(hold_dir), holds.Hold(uuids[0], "slurm-7", "Slurm job 7", time.time()))
    watcher = WatchProcess(env, hold_dir)
    try:
        watcher.wait("event=engine state=connected")
        assert watcher.with_(f"holder={gone_holder}", "event=release", "why=reconciled")
        assert watcher.with_(f"holder={came_holder}", "event=hold", "why=reconciled")
        assert sorted(p.name for p in hold_dir.iterdir()) == sorted(
            [f"hold.{uuids[1]}.{came_holder}.json", f"hold.{uuids[0]}.slurm-7.json"])
        assert docker_cli("rm", "-f", came).returncode == 0
        watcher.wait(f"holder={came_holder}", "event=release")
        watcher.proc.terminate()  # as `docker stop` does: a line, exit 0
        assert watcher.proc.wait(30) == 0
        watcher.wait("event=stop holds stay as they are")
    finally:
        watcher.kill()
    assert [p.name for p in hold_dir.iterdir()] == [f"hold.{uuids[0]}.slurm-7.json"]


WATCH_IMAGE = "forge-load-watch:test"


@pytest.fixture(scope="session")
def watch_image(docker_client: Any, base_image: str) -> str:
    """deploy/docker-watch/Dockerfile, built on the test engine's base image (as docker_engine.sh builds ours)."""
    args = ["build", "-q", "--network", "host", "--build-arg", f"BASE_IMAGE={base_image}", "-f",
            str(ROOT / "deploy" / "docker-watch" / "Dockerfile"), "-t", WATCH_IMAGE, str(ROOT)]
    if os.path.exists("/etc/ssl/certs/ca-certificates.crt"):
        args[1:1] = ["--build-arg", "PIP_CERT=/etc/ssl/certs/ca-certificates.crt"]
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "DOCKER_BUILDKIT": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return WATCH_IMAGE


@pytest.mark.docker
def test_watch_in_a_container(docker_client: Any, base_image: str, watch_image: str, vgpu_lib_dir: Path,
                              shared_dir: Path, names: list[str]) -> None:
    """The image of deploy/docker-watch with the socket, the hold directory and the engine's container files
    mounted (NVML: the virtual GPU's library and state): a container asking for GPU 1 finds its hold 0.5 s after
    its first instruction, read from the engine's files (no inspect)."""
    gpu = VirtualGpu(shared_dir / "gpu", gpus=2, lib_dir=vgpu_lib_dir)
    uuids = gpu.uuids()
    hold_dir = shared_dir / "holds"
    socket = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock").removeprefix("unix://")
    containers_dir = os.path.join(docker_client.info()["DockerRootDir"], "containers")
    watch = unique_name("watch")
    names.append(watch)
    proc = docker_cli("run", "-d", "--name", watch, "-v", f"{socket}:/var/run/docker.sock",
                      "-v", f"{hold_dir}:{hold_dir}", "-v", f"{containers_dir}:{containers_dir}:ro",
                      "-v", f"{gpu.library_dir / 'libnvidia-ml.so.1'}:{DRIVER_DIR}/libnvidia-ml.so.1:ro",
                      "-v", f"{gpu.state_dir}:{gpu.state_dir}", "-e", f"VGPU_STATE={gpu.state_dir}",
                      watch_image, "--hold-dir", str(hold_dir))
    assert proc.returncode == 0, proc.stderr

    def logs() -> str:
        return docker_cli("logs", watch).stdout

    deadline = time.monotonic() + 60
    while "state=connected" not in logs():
        assert time.monotonic() < deadline, logs() + docker_cli("logs", watch).stderr
        time.sleep(0.2)
    assert f"gpus={uuids[0]},{uuids[1]}" in logs() and "cannot be read here" not in logs(), logs()
    job = unique_name("job")
    names.append(job)
    proc = docker_cli("run", "--name", job, "--gpus", "device=1", "-v", f"{hold_dir}:/holds:ro", base_image,
                      "sh", "-c", "sleep 0.5; ls /holds")
    holder = "docker-" + container_id(job)[:12]
    assert proc.stdout.split() == [f"hold.{uuids[1]}.{holder}.json"], proc.stdout + logs()
    while f"event=release holder={holder}" not in logs():
        assert time.monotonic() < deadline, logs()
        time.sleep(0.2)
    assert list(hold_dir.iterdir()) == []


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory the containers' users reach (pytest's tmp dirs are private): the virtual GPU, the holds."""
    parent = Path(tempfile.mkdtemp(prefix="forge-dockerw-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
    parent.chmod(0o755)
    try:
        yield parent
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def vgpu_args(gpu: VirtualGpu) -> list[str]:
    lib = gpu.library_dir
    return ["-v", f"{lib / 'libcuda.so.1'}:{DRIVER_DIR}/libcuda.so.1:ro",
            "-v", f"{lib / 'libnvidia-ml.so.1'}:{DRIVER_DIR}/libnvidia-ml.so.1:ro",
            "-v", f"{gpu.state_dir}:{gpu.state_dir}", "-e", f"VGPU_STATE={gpu.state_dir}",
            "-v", f"{DRIVER_JOB}:/opt/driver_job.py:ro", "-v", f"{FOREIGN_JOB}:/opt/foreign_job.py:ro"]


def job_lines(stdout: str) -> dict[str, dict[str, Any]]:
    return {e["event"]: e for e in (json.loads(line) for line in stdout.splitlines() if line.startswith("{"))}


@pytest.mark.docker
def test_a_gpu_container_finds_its_gpus_filler_drained_before_its_context(
        docker_client: Any, base_image: str, forge_image: Any, vgpu_lib_dir: Path, shared_dir: Path,
        names: list[str]) -> None:
    """One filler process on a 2-GPU virtual GPU, the watcher, and containers asking for GPU 1 (`--gpus
    device=1`) that run CUDA jobs: the driver-API job opens its context 0.5 s after the container's first
    instruction; scripts/foreign_job.py (numba) after its imports. For each, by the virtual GPU's record: our
    last kernel on GPU 1 ended before the job's context creation began (the lead time, printed), none of ours
    ran there while the container lived, and GPU 0 kept filling."""
    gpu = VirtualGpu(shared_dir / "gpu", gpus=2, lib_dir=vgpu_lib_dir)
    uuids = gpu.uuids()
    hold_dir = shared_dir / "holds"
    hold_dir.mkdir(mode=0o755)
    env = gpu.env({k: v for k, v in os.environ.items() if not k.startswith("FORGE_")} |
                  {"DOCKER_HOST": os.environ.get("DOCKER_HOST", ""), "FORGE_RESUME_AFTER": "2"})
    filler_log = shared_dir / "filler.log"
    with open(filler_log, "w") as out:
        filler = subprocess.Popen([sys.executable, "-m", "forge_load", "--log-format", "json", "--gpus", "all",
                                   "--target", "0.5", "--log-interval", "1", "--duration", "900", "--hold-dir",
                                   str(hold_dir)], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    host_pidns = os.stat("/proc/self/ns/pid").st_ino
    watcher = WatchProcess(env, hold_dir)

    def ours(device: int) -> list[Kernel]:
        return [k for k in gpu.kernels() if k.pid == filler.pid and k.pidns == host_pidns and k.device == device]

    def filling(device: int, after_s: float, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(k.start > after_s for k in ours(device)):
            assert time.monotonic() < deadline and filler.poll() is None, "\n".join(
                [line for line in filler_log.read_text().splitlines() if '"status"' not in line][-20:])
            time.sleep(0.2)

    jobs = [("driver", 0.5)] * 4 + [("numba", None)] * 2
    results = []
    try:
        filling(0, 0, 180)
        filling(1, time.time() + 1.0, 60)
        watcher.wait("event=engine state=connected")
        for kind, after_s in jobs:
            filling(1, time.time() + 0.5, 30)  # GPU 1 is filling when the container comes
            name = unique_name(f"lead_{kind}")
            names.append(name)
            t0 = 'export JOB_T0=$(date +%s.%N); echo "{\\"event\\": \\"t0\\", \\"t\\": $JOB_T0}"; '
            if kind == "driver":
                command = [base_image, "sh", "-c",
                           t0 + f"exec python3 /opt/driver_job.py run {uuids[1]} --after {after_s} --seconds 1"]
            else:  # a container of our image that is not a filler says so with its role label
                command = ["--label", "io.forge_load.role=test-job", "--entrypoint", "sh", IMAGE, "-c",
                           t0 + f"n=$(python /opt/driver_job.py index {uuids[1]}) && exec python "
                           "/opt/foreign_job.py --backend numba --gpu $n --seconds 2"]
            proc = docker_cli("run", "--name", name, "--gpus", "device=1", *vgpu_args(gpu), *command, timeout=300)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
            holder = "docker-" + container_id(name)[:12]
            hold = watcher.wait(f"holder={holder}", "event=hold")
            release = watcher.wait(f"holder={holder}", "event=release", "why=died")
            assert f"gpus={uuids[1]} " in hold, hold
            lines = job_lines(proc.stdout)
            begin_s = lines["context"]["wall_time_begin"]
            before = [k for k in ours(1) if k.start < begin_s]
            lead_s = begin_s - max(k.end for k in before)
            during = [k.start - begin_s for k in ours(1) if begin_s <= k.start <= line_time(release)]
            gpu0 = [k for k in ours(0) if begin_s <= k.start <= line_time(release)]
            results.append((kind, begin_s - lines["t0"]["t"], line_time(hold) - lines["t0"]["t"], lead_s,
                            len(gpu0)))
            assert lead_s > 0, (kind, lead_s)
            assert not during, f"our kernels started {during[:5]} s after the job's context began, on its GPU"
            assert gpu0, "GPU 0 stopped filling"
        assert not [line for line in watcher.lines if "event=error" in line], watcher.lines
    finally:
        watcher.kill()
        filler.terminate()
        filler.wait(60)
    print("\ncontainer  context_after_first_instruction_s  hold_after_first_instruction_s  lead_time_s  "
          "gpu0_kernels_meanwhile   (virtual GPU, this machine)")
    for kind, context_s, hold_s, lead_s, gpu0_count in results:
        print(f"{kind:<9}  {context_s:>33.3f}  {hold_s:>30.3f}  {lead_s:>11.3f}  {gpu0_count:>22}")
