"""The metrics server under abuse, on loopback only and bounded in count and time: methods other than GET and
HEAD, unknown paths, malformed and oversized request heads, idle and trickling (slowloris) connections, more
connections than the cap, and shutdown with connections open."""

from __future__ import annotations

import errno
import http.client
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from forge_load.control.status import GpuSlots
from forge_load.service import http_server

ROOT = Path(__file__).resolve().parents[1]

# Short limits keep these tests quick; the defaults are the documented ones and are checked once below.
QUICK = http_server.ServerLimits(request_timeout_s=1.0, max_connections=8, max_head_bytes=8192)


class FakeClock:
    def __call__(self) -> float:
        return 100.0


@contextmanager
def server(limits: http_server.ServerLimits = QUICK,
           gpu_slots: GpuSlots | None = None) -> Iterator[http_server.MetricsServer]:
    gpu_slots = gpu_slots or GpuSlots(clock=FakeClock())
    if not gpu_slots.slots:
        gpu_slots.add("0").beat()
    running = http_server.serve(gpu_slots, "127.0.0.1", 0, limits=limits)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture(scope="module")
def shared() -> Iterator[http_server.MetricsServer]:
    """One server for the tests that leave nothing behind."""
    with server() as running:
        yield running


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    return sock


def read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float | None]:
    """What the server sent, and seconds until it closed the connection (None: still open after limit_s)."""
    started_s = time.monotonic()
    data = b""
    while True:
        left_s = limit_s - (time.monotonic() - started_s)
        if left_s <= 0:
            return data, None
        sock.settimeout(left_s)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return data, None
        except ConnectionResetError:
            return data, time.monotonic() - started_s
        if not chunk:
            return data, time.monotonic() - started_s
        data += chunk


def request(port: int, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def conn_threads(port: int) -> int:
    return sum(1 for t in threading.enumerate() if t.name == f"metrics-{port}-conn" and t.is_alive())


def closed_by_server(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def wait_for(condition: object, limit_s: float) -> bool:
    deadline_s = time.monotonic() + limit_s
    while time.monotonic() < deadline_s:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return bool(condition())  # type: ignore[operator]


def test_the_metrics_reference_states_the_limits() -> None:
    # The server's table in docs/metrics.md (scripts/gen_docs.py), row by row.
    limits = http_server.ServerLimits()
    page = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    table = page[page.index("## The HTTP server"):]
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|$", table, re.M))
    assert rows["time to send the whole request head, and to write each answer"] == f"{limits.request_timeout_s:g} s"
    assert rows["connections served at once"] == str(limits.max_connections)
    assert rows["largest request head (beyond it: `431`)"] == f"{limits.max_head_bytes // 1024} KiB"
    assert rows["shutdown: the accept loop's poll"] == f"{http_server.POLL_INTERVAL_S:g} s"


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "BREW"])
@pytest.mark.parametrize("path", ["/metrics", "/", "/health", "/healthz"])
def test_methods_other_than_get_and_head_are_405_with_allow(shared: http_server.MetricsServer, method: str,
                                                            path: str) -> None:
    status, headers, body = request(shared.port, method, path)
    assert status == 405, (method, path, status, body)
    assert headers.get("allow") == "GET, HEAD"
    assert b"GET" in body


def test_head_answers_like_get_without_a_body(shared: http_server.MetricsServer) -> None:
    get_status, get_headers, get_body = request(shared.port, "GET", "/metrics")
    status, headers, body = request(shared.port, "HEAD", "/metrics")
    assert (status, body) == (get_status, b"") == (200, b"")
    assert headers["content-type"] == get_headers["content-type"]
    assert int(headers["content-length"]) > 0 and b"forge_load_up" in get_body
    status, _, body = request(shared.port, "HEAD", "/health")
    assert (status, body) == (200, b"")


@pytest.mark.parametrize("method", ["GET", "HEAD", "POST"])
def test_unknown_paths_are_404(shared: http_server.MetricsServer, method: str) -> None:
    for path in ("/nothing", "/metrics/x", "/../etc/passwd", "/%00"):
        status, _, _ = request(shared.port, method, path)
        assert status == 404, (method, path)


def test_a_request_in_small_pieces_within_the_timeout_is_answered(shared: http_server.MetricsServer) -> None:
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nUser-Agent: kube-probe/1.30\r\nAccept: */*\r\n\r\n"
    with connect(shared.port) as sock:
        for i in range(0, len(head), 3):
            sock.sendall(head[i:i + 3])
            time.sleep(0.002)
        data, closed_after_s = read_until_closed(sock, limit_s=3.0)
    assert data.startswith(b"HTTP/1.0 200") and b"\r\n\r\nok\n" in data, data[:200]
    assert closed_after_s is not None


def test_a_body_is_not_read_and_a_post_is_405(shared: http_server.MetricsServer) -> None:
    with connect(shared.port) as sock:
        sock.sendall(b"POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello")
        data, closed_after_s = read_until_closed(sock, limit_s=3.0)
    assert data.startswith(b"HTTP/1.0 405") and b"Allow: GET, HEAD" in data, data[:200]


MALFORMED = {
    "tls hello": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(32)),
    "binary": b"\x00\xff\xfe\xfd" * 16,
    "one word": b"GARBAGE\r\n\r\n",
    "no target": b"GET\r\n\r\n",
    "http/0.9": b"GET /metrics\r\n\r\n",
    "four words": b"GET / HTTP/1.1 extra\r\n\r\n",
    "bad version": b"GET / HTTP/x.y\r\n\r\n",
    "future version": b"GET / HTTP/9.9\r\n\r\n",
    "control in method": b"G\x01T / HTTP/1.1\r\n\r\n",
    "blank lines": b"\r\n\r\n\r\n\r\n",
    "bad header": b"GET /metrics HTTP/1.1\r\n: no name\r\n\x00\x01\r\n\r\n",
    "huge target": b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\n\r\n",
    "huge header": b"GET /metrics HTTP/1.1\r\nX-A: " + b"a" * 100_000 + b"\r\n\r\n",
    "many headers": b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"b" * 500) for i in range(90))
    + b"\r\n",
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_requests_are_answered_4xx_or_closed_at_once(shared: http_server.MetricsServer, name: str) -> None:
    with connect(shared.port) as sock:
        with suppress(OSError):  # the server may close before it has read everything
            sock.sendall(MALFORMED[name])
        data, closed_after_s = read_until_closed(sock, limit_s=3.0)
    # At once: well before the request timeout, which only a silent client waits for.
    assert closed_after_s is not None and closed_after_s < 0.8, (name, closed_after_s, data[:80])
    # An error status: 4xx, or 505 for a version we do not speak.
    assert data == b"" or data.startswith((b"HTTP/1.0 4", b"HTTP/1.1 4", b"HTTP/1.0 505")), (name, data[:80])
    assert len(data) < 4096


def test_an_idle_connection_is_closed_after_the_request_timeout() -> None:
    with server() as running:
        with connect(running.port) as sock:
            data, closed_after_s = read_until_closed(sock, limit_s=3.0)
    assert data == b""
    assert closed_after_s is not None and 0.8 <= closed_after_s <= 2.0, closed_after_s


def test_a_trickling_request_is_cut_at_the_request_timeout() -> None:
    # Slowloris: one header byte every 0.1 s keeps every single read short, but the whole head must arrive
    # within the request timeout.
    with server() as running:
        with connect(running.port) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")
            started_s = time.monotonic()
            closed_after_s = None
            while time.monotonic() - started_s < 3.0:
                try:
                    sock.sendall(b"X")
                except OSError:
                    closed_after_s = time.monotonic() - started_s
                    break
                sock.settimeout(0.1)
                try:
                    if sock.recv(4096) == b"":
                        closed_after_s = time.monotonic() - started_s
                        break
                except TimeoutError:
                    pass
                except ConnectionResetError:
                    closed_after_s = time.monotonic() - started_s
                    break
    assert closed_after_s is not None and closed_after_s <= 2.0, closed_after_s


def test_connections_beyond_the_cap_cost_no_thread_and_metrics_still_answer() -> None:
    limits = http_server.ServerLimits(request_timeout_s=5.0, max_connections=8)
    held: list[socket.socket] = []
    with server(limits) as running:
        try:
            for _ in range(100):
                held.append(connect(running.port))
                assert conn_threads(running.port) <= 2 * limits.max_connections
            # The oldest silent ones made room: at most the cap stay open, and that at once, not at the timeout.
            assert wait_for(lambda: sum(map(closed_by_server, held)) >= len(held) - limits.max_connections, 2.0), \
                sum(map(closed_by_server, held))
            assert wait_for(lambda: conn_threads(running.port) <= limits.max_connections, 1.0)
            assert not any(map(closed_by_server, held[-limits.max_connections:]))  # the newest stay
            # A cap's worth of silent connections does not keep a scraper out.
            for _ in range(3):
                status, _, body = request(running.port, "GET", "/metrics")
                assert status == 200 and b"forge_load_up" in body
            assert request(running.port, "GET", "/health")[0] == 200
        finally:
            for sock in held:
                sock.close()


def test_when_every_connection_is_busy_a_new_one_is_refused_at_once() -> None:
    gpu_slots = GpuSlots(clock=FakeClock())
    gpu_slots.add("0").beat()
    release = threading.Event()
    real_health = gpu_slots.health

    def slow_health() -> tuple[bool, str]:
        release.wait(5.0)
        return real_health()

    gpu_slots.health = slow_health  # type: ignore[method-assign]
    limits = http_server.ServerLimits(request_timeout_s=5.0, max_connections=4)
    busy: list[socket.socket] = []
    with server(limits, gpu_slots) as running:
        try:
            for _ in range(limits.max_connections):
                sock = connect(running.port)
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                busy.append(sock)
            assert wait_for(lambda: conn_threads(running.port) == limits.max_connections, 2.0)
            with connect(running.port) as extra:
                with suppress(OSError):
                    extra.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                data, closed_after_s = read_until_closed(extra, limit_s=2.0)
            assert closed_after_s is not None and closed_after_s < 0.5, closed_after_s
            assert data == b"" or data.startswith(b"HTTP/1.0 503"), data[:80]
            assert conn_threads(running.port) == limits.max_connections
        finally:
            release.set()
            for sock in busy:
                data, _ = read_until_closed(sock, limit_s=2.0)
                assert data.startswith(b"HTTP/1.0 200"), data[:80]
                sock.close()


def test_close_is_fast_with_connections_open_and_ends_them() -> None:
    gpu_slots = GpuSlots(clock=FakeClock())
    gpu_slots.add("0").beat()
    running = http_server.serve(gpu_slots, "127.0.0.1", 0, limits=http_server.ServerLimits(max_connections=64))
    held: list[socket.socket] = []
    try:
        for i in range(60):
            sock = connect(running.port)
            if i % 2:
                sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")  # a head begun, never finished
            held.append(sock)
        assert wait_for(lambda: conn_threads(running.port) == 60, 2.0)
        started_s = time.monotonic()
        running.close()
        assert time.monotonic() - started_s < 1.0
        for sock in held:
            _, closed_after_s = read_until_closed(sock, limit_s=1.0)
            assert closed_after_s is not None
        assert wait_for(lambda: conn_threads(running.port) == 0, 1.0)
        with pytest.raises(OSError):
            connect(running.port).close()
    finally:
        for sock in held:
            sock.close()


# --- out of file descriptors ------------------------------------------------------------------------------------

def test_out_of_descriptors_the_accept_loop_backs_off_and_says_so_once(capsys: pytest.CaptureFixture[str]) -> None:
    """accept() failing with EMFILE leaves the connection in the backlog: a loop that retried at once would spin.
    Counted, not timed: in one second at most a back-off's worth of tries (a busy machine makes fewer)."""
    with server() as running:
        tries: list[float] = []
        real_accept = running.server._accept

        def out_of_descriptors() -> tuple[socket.socket, object]:
            tries.append(time.monotonic())
            raise OSError(errno.EMFILE, "Too many open files")

        running.server._accept = out_of_descriptors  # type: ignore[method-assign]
        with connect(running.port) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\n\r\n")
            time.sleep(1.0)
            assert 1 <= len(tries) <= 1.0 / http_server.ACCEPT_BACKOFF_S + 2, f"{len(tries)} accept() calls in 1 s"
            running.server._accept = real_accept  # type: ignore[method-assign]
            data, _ = read_until_closed(sock, limit_s=3.0)
        assert data.startswith(b"HTTP/1.0 200"), data[:80]  # served once descriptors are there again
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "Too many open files" in err[0] and "metrics" in err[0], err


_RESERVE_CHILD = r"""
import os, resource, socket, sys, time
from forge_load.service import http_server
from forge_load.control.status import GpuSlots
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, hard))
gpu_slots = GpuSlots()
gpu_slots.add("0").beat()
limits = http_server.ServerLimits(request_timeout_s=30.0, max_connections=1000)
running = http_server.serve(gpu_slots, "127.0.0.1", 0, limits)
print(running.port, flush=True)
sys.stdin.readline()  # the clients are connected
opened = []
try:
    while len(opened) < FD_LIMIT:
        opened.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
print(len(opened), flush=True)
"""


def test_connections_leave_the_filler_its_reserve_of_descriptors() -> None:
    """A server in a process limited to 256 descriptors, with 300 half-sent requests held open (a cap far above
    what the limit allows): the newest connections are refused or take a silent one's place, a scraper still gets
    its answer, and the process can still open the reserve."""
    limit = 256
    child = subprocess.Popen([sys.executable, "-c", _RESERVE_CHILD.replace("FD_LIMIT", str(limit))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert child.stdin is not None and child.stdout is not None
    held: list[socket.socket] = []
    try:
        port = int(child.stdout.readline())
        for _ in range(300):
            sock = connect(port)
            with suppress(OSError):
                sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
            held.append(sock)
        def refused(sock: socket.socket) -> bool:  # answered 503 (or closed) at once
            sock.setblocking(False)
            try:
                return sock.recv(16, socket.MSG_PEEK) in (b"", b"HTTP/1.0 503 Ser")
            except BlockingIOError:
                return False
            except ConnectionResetError:
                return True

        assert wait_for(lambda: sum(map(refused, held)) >= 300 - (limit - http_server.MIN_RESERVED_FDS), 5.0)
        # The silent ones do not keep a scraper out: it takes the place of the one that waited longest.
        assert request(port, "GET", "/health")[0] == 200
        time.sleep(0.5)  # the evicted connections' threads end, and their descriptors are free again
        child.stdin.write("go\n")
        child.stdin.flush()
        free = int(child.stdout.readline())
    finally:
        for sock in held:
            sock.close()
        child.kill()
        child.wait(timeout=10)
    assert free >= http_server.reserved_fds_for(limit) - 2, f"only {free} descriptors left of {limit}"


def test_the_reserve_is_a_quarter_of_the_limit_and_at_least_the_minimum() -> None:
    assert http_server.reserved_fds_for(None) == http_server.reserved_fds_for(100) == http_server.MIN_RESERVED_FDS
    assert http_server.reserved_fds_for(1024) == 256 and http_server.reserved_fds_for(1 << 20) == 1 << 18
