"""`forge-load fleet watch` (forge_load/fleet/watch.py, docs/docker-watch.md): container events into holds.

First the logic against fake events and a fake engine (no engine needed): what a container asks for, the holds
that follow its life, the labels that are never held for, reconciliation, and the order of events while an
inspect is on its way, the event stream's bytes, the command line. With the real engine:
tests/test_docker_watch_engine.py.
"""

from __future__ import annotations

import http.server
import io
import json
import queue
import socketserver
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_fleet import run_fleet

from forge_load.commands.fleet import build_parser, cmd_watch
from forge_load.fleet import engine as fleet_engine
from forge_load.fleet import events as fleet_events
from forge_load.fleet import plan
from forge_load.fleet import watch as fleet_watch
from forge_load.steering import dockerwatch, holds
from forge_load.steering.dockerwatch import DockerHolds, Request, Seen, gpu_request, resolve

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


def test_a_log_that_cannot_be_written_loses_its_lines_not_the_watch(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """stdout gone under `forge-load fleet watch` (its dispatcher turns a failed write into OutputLost, past the
    commands' own handlers): the holds go on being placed, from every thread, without their lines."""
    from forge_load.log import OutputLost

    container = "a" * 64
    engine_dir(tmp_path / "containers", container, attrs([gpus("0")]))
    engine = HttpEngine(tmp_path / "docker.sock", tmp_path)
    connects = [0]
    real_connect = fleet_engine.connect

    def connect() -> Any:
        connects[0] += 1
        if connects[0] > 1:
            raise KeyboardInterrupt
        return real_connect()

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'docker.sock'}")
    monkeypatch.setattr(fleet_engine, "connect", connect)
    monkeypatch.setattr(fleet_watch, "ENGINE_RETRY_S", (0.0,))
    monkeypatch.setattr("forge_load.commands.host_gpus.host_uuids", lambda: UUIDS)
    written: list[str] = []

    class Gone(io.StringIO):
        def write(self, text: str) -> int:
            written.append(text)
            raise OutputLost(OSError(32, "Broken pipe"))

    args = build_parser().parse_args(["watch", "--hold-dir", str(tmp_path / "holds")])
    result: list[int] = []
    runner = threading.Thread(target=lambda: result.append(cmd_watch(args, Gone())), daemon=True)
    runner.start()
    book = Book(tmp_path / "holds")
    try:
        deadline = time.monotonic() + 30
        while not engine.streams and time.monotonic() < deadline:
            time.sleep(0.02)
        engine.chunks.put(event_chunk("create", container))
        while not book.on_disk() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [holder for _, holder in book.on_disk()] == ["docker-" + container[:12]]
        assert written  # its lines were tried, and lost
    finally:
        engine.close()
        runner.join(30)
    assert result == [0]


# --- the command line and `up` ----------------------------------------------------------------------------

def _opts(**changes: Any) -> Any:
    base = dict(image="forge-load:latest", prefix="forge_load_gpu_", simulate=False, target=None, env=(),
                restart="unless-stopped", log_max_size="3m", log_max_file=3, pid_host=True)
    base.update(changes)
    return plan.Options(**base)


@pytest.mark.parametrize(("args", "flag"), [(["--hold-dir", "a\nb"], "--hold-dir"),
                                            (["--created-hold", "0"], "--created-hold")])
def test_watch_bad_input_is_one_line_and_exit_2(args: list[str], flag: str) -> None:
    proc = run_fleet("watch", *args, env={"DOCKER_HOST": "unix:///nonexistent.sock"}, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"forge-load fleet: {flag}=") and len(proc.stderr.strip().splitlines()) == 1
