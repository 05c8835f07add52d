"""The metrics server: `/metrics` (metrics.py's registry) and `/health` over HTTP, hardened against the clients
it meets (slow, malformed, too many): a request head read within limits, connections bounded by the process's
descriptors, one line on stderr for what goes wrong, never a traceback."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import IO, Any, cast
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer, make_server

from forge_load.config.values import ConfigError
from forge_load.control.status import GpuSlots
from forge_load.log import say
from forge_load.service.metrics import make_registry
from forge_load.service.runtime import open_files_limit

# How often the accept loop looks for a shutdown request: close() returns within this.
POLL_INTERVAL_S = 0.2
# Out of descriptors (or kernel memory), accept() fails while the connection waits in the backlog, so the loop
# would retry at once, for ever: it waits this long between tries instead.
ACCEPT_BACKOFF_S = 0.2
# The host's errors, not the client's: accept() is tried again after the back-off.
HOST_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# The descriptors the server never takes, of the process's limit (RLIMIT_NOFILE): the filler's own work (the
# pause file, the heartbeat, a GPU's CUDA context at start-up) must find them free whatever clients do.
MIN_RESERVED_FDS = 64


ALLOWED_METHODS = ("GET", "HEAD")
HEALTH_PATHS = ("/health", "/healthz")
METRICS_PATHS = ("/metrics", "/")


def make_app(registry: Any, gpu_slots: GpuSlots) -> Callable[..., Iterable[bytes]]:
    """WSGI app: /metrics (and /) the exposition, /health 200 or 503 with one line per GPU; GET and HEAD only."""
    from prometheus_client import make_wsgi_app

    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        method = environ.get("REQUEST_METHOD", "GET")
        text = [("Content-Type", "text/plain; charset=utf-8")]
        if path not in HEALTH_PATHS and path not in METRICS_PATHS:
            start_response("404 Not Found", text)
            return [b"not found: see /metrics and /health\n"]
        if method not in ALLOWED_METHODS:
            start_response("405 Method Not Allowed", [("Allow", ", ".join(ALLOWED_METHODS)), *text])
            return [b"method not allowed: GET and HEAD only\n"]
        if path in HEALTH_PATHS:
            ok, body = gpu_slots.health()
            status = "200 OK" if ok else "503 Service Unavailable"
            headers, data = [*text, ("Cache-Control", "no-store")], body.encode()
        else:
            answered: list[tuple[str, list[tuple[str, str]]]] = []
            chunks = metrics_app({**environ, "REQUEST_METHOD": "GET"},
                                 lambda status, headers, exc_info=None: answered.append((status, headers)))
            data = b"".join(chunks)
            (status, headers), = answered
        headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
        start_response(status, [*headers, ("Content-Length", str(len(data)))])
        return [b""] if method == "HEAD" else [data]

    return app


@dataclass(frozen=True)
class ServerLimits:
    """What one client can cost the server, in time, memory and threads (docs/metrics.md, generated from this)."""

    request_timeout_s: float = 5.0  # to send the whole request head; also for each write of the answer
    max_connections: int = 32  # connections served at once, one thread each
    max_head_bytes: int = 8192  # request line and headers; there is no body to read
    reserved_fds: int | None = None  # descriptors left to the filler; None: reserved_fds_for(the soft limit)


def _open_descriptors() -> int:
    """How many descriptors the process has open now (Linux's /proc; elsewhere a guess of a fresh process's)."""
    try:
        return max(len(os.listdir("/proc/self/fd")) - 1, 0)  # less the one listdir itself held
    except OSError:
        return 16


def reserved_fds_for(limit: int | None) -> int:
    """A quarter of the limit, and at least MIN_RESERVED_FDS: as much as a filler of eight GPUs opens at start."""
    return MIN_RESERVED_FDS if limit is None else max(MIN_RESERVED_FDS, limit // 4)


# A request line: a method token, a target of visible characters, an HTTP version; a header: name ":" value.
_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_REQUEST_LINE = re.compile(rb"(?P<method>" + _TOKEN + rb") [\x21-\x7e]+ HTTP/(?P<version>\d\.\d)\r?\n")
_HEADER_LINE = re.compile(_TOKEN + rb":[\t\x20-\x7e\x80-\xff]*\r?\n")
_REQUEST_START = re.compile(_TOKEN + rb"(?: |$)")


@dataclass(frozen=True)
class HeadVerdict:
    head: bytes | None  # the whole head (request line, headers, blank line) when it is good
    error: str = ""  # else the status to answer, as "400 Bad Request"
    text: str = ""


class HeadReader:
    """Takes a request head as it arrives and checks each line once, as soon as it is complete.

    feed() returns None while more is needed, then a HeadVerdict.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.data = b""
        self._checked = 0  # every line before this offset is whole and valid

    def feed(self, chunk: bytes) -> HeadVerdict | None:
        self.data += chunk
        while (newline := self.data.find(b"\n", self._checked)) >= 0:
            line = self.data[self._checked:newline + 1]
            first = self._checked == 0
            self._checked = newline + 1
            if first:
                match = _REQUEST_LINE.fullmatch(line)
                if match is None:
                    return HeadVerdict(None, "400 Bad Request", "malformed request line")
                if match["version"] not in (b"1.0", b"1.1"):
                    return HeadVerdict(None, "505 HTTP Version Not Supported", "HTTP/1.0 and HTTP/1.1 only")
            elif line in (b"\r\n", b"\n"):
                return HeadVerdict(self.data[:self._checked])
            elif not _HEADER_LINE.fullmatch(line):
                return HeadVerdict(None, "400 Bad Request", "malformed header line")
        if self._checked == 0 and not _REQUEST_START.match(self.data):  # binary, TLS: no need to wait
            return HeadVerdict(None, "400 Bad Request", "malformed request line")
        if len(self.data) >= self.max_bytes:
            return HeadVerdict(None, "431 Request Header Fields Too Large", f"request head over {self.max_bytes} bytes")
        return None


@dataclass
class _Connection:
    sock: socket.socket
    accepted_s: float
    idle: bool = True  # no complete request head yet
    evicted: bool = False


def _plain_answer(status: str, text: str) -> bytes:
    body = (text + "\n").encode()
    return (f"HTTP/1.0 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


class _Server(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most `connection_cap` of them: `limits.max_connections`, or fewer where the
    process's limit on open files leaves room for fewer beside the filler's reserve (set_limits).

    At the cap, a new connection takes the place of the one that has waited longest without sending a
    complete request (so silent clients cannot keep a scraper out); when every one is busy answering, the new
    one gets 503 and is closed. The accept loop never waits on a client.
    """

    daemon_threads = True  # a slow scraper must not hold the process open at exit
    request_queue_size = 64
    limits = ServerLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, _Connection] = {}
        self._closing = False
        self._closed = threading.Event()  # wakes the accept loop's back-off at close()
        self._host_error: str | None = None  # said once, until accept() works again
        self.connection_cap = self.limits.max_connections  # lowered by set_limits() to fit the open-files limit
        self.fd_ceiling: int | None = None  # a connection given a descriptor at or above this is refused
        super().__init__(*args, **kwargs)

    def set_limits(self, limits: ServerLimits) -> None:
        self.limits = limits
        limit = open_files_limit()
        reserved = limits.reserved_fds if limits.reserved_fds is not None else reserved_fds_for(limit)
        self.connection_cap = limits.max_connections
        self.fd_ceiling = None
        if limit is not None:
            # Each connection costs a descriptor, and an evicted one keeps its own until its thread ends (the
            # server holds at most twice the cap): the cap leaves the reserve free of what is open now. Should
            # the filler's own work use more, the last half of the reserve is never handed to a client anyway.
            room = limit - reserved - _open_descriptors()
            self.connection_cap = max(1, min(limits.max_connections, room // 2))
            self.fd_ceiling = limit - reserved // 2

    def _accept(self) -> tuple[socket.socket, Any]:
        return self.socket.accept()

    def get_request(self) -> tuple[socket.socket, Any]:
        """The next connection; out of descriptors or memory, one stderr line and a back-off, never a spin."""
        try:
            request, address = self._accept()
        except OSError as error:
            if error.errno in HOST_ERRNOS:
                if self._host_error is None:
                    self._host_error = error.strerror or str(error)
                    say(f"forge-load: warning: metrics: cannot accept a connection ({self._host_error}): trying "
                         f"again every {ACCEPT_BACKOFF_S:g} s, said once")
                self._closed.wait(ACCEPT_BACKOFF_S)
            raise  # socketserver drops this round and polls again
        self._host_error = None
        return request, address

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            admitted = (self.fd_ceiling is None or request.fileno() < self.fd_ceiling) and self._admit()
            if admitted:
                self._connections[request] = _Connection(request, time.monotonic())
        if not admitted:
            self._refuse(request)
            return
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                  name=f"metrics-{self.server_address[1]}-conn", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no thread to be had: this client is refused, the server goes on
            with self._lock:
                self._connections.pop(request, None)
            self._refuse(request)

    def _admit(self) -> bool:
        """Under the lock: room for one more connection, made by evicting a silent one if need be."""
        if self._closing:
            return False
        cap = self.connection_cap
        live = [c for c in self._connections.values() if not c.evicted]
        if len(live) < cap:
            return True
        idle = [c for c in live if c.idle]
        # An evicted connection's thread ends within moments; until then it counts against a hard limit.
        if not idle or len(self._connections) >= 2 * cap:
            return False
        oldest = min(idle, key=lambda c: c.accepted_s)
        oldest.evicted = True
        with contextlib.suppress(OSError):
            oldest.sock.shutdown(socket.SHUT_RDWR)  # its thread's read returns at once
        return True

    def _refuse(self, request: socket.socket) -> None:
        with contextlib.suppress(OSError):
            request.setblocking(False)
            request.send(_plain_answer("503 Service Unavailable", "too many connections"))
        self.shutdown_request(request)

    def head_complete(self, request: socket.socket) -> bool:
        """The connection's request head is in, so it is no longer idle; False if it was evicted meanwhile."""
        with self._lock:
            connection = self._connections.get(request)
            if connection is None or connection.evicted:
                return False
            connection.idle = False
            return True

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - as socketserver's own: one client's trouble ends its thread only
            self.handle_error(request, client_address)
        finally:
            with self._lock:  # before closing, so no one shuts down a descriptor already reused
                self._connections.pop(request, None)
            self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        _report(sys.exc_info()[1])

    def close_connections(self) -> None:
        """No new connections from now on; every open one is shut down, so its thread ends at once."""
        with self._lock:
            self._closing = True
            self._closed.set()
            for connection in self._connections.values():
                with contextlib.suppress(OSError):
                    connection.sock.shutdown(socket.SHUT_RDWR)


class _Server6(_Server):
    address_family = socket.AF_INET6


def _report(error: BaseException | None) -> None:
    """One stderr line for a bug while answering; a client that went away or timed out is not worth one."""
    if error is not None and not isinstance(error, OSError):
        say(f"forge-load: metrics: error answering a request: {type(error).__name__}: {str(error)!r}")


class _ServerHandler(ServerHandler):
    request_handler: WSGIRequestHandler | None = None  # wsgiref sets this back-pointer for its logging

    def log_exception(self, exc_info: Any) -> None:
        _report(exc_info[1])


class _QuietHandler(WSGIRequestHandler):
    """One request per connection; its head is read and checked within the server's limits first."""

    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # a line per scrape and probe would bury the filler's own lines in `docker logs`

    def handle(self) -> None:
        head = self._read_head()
        if head is None:
            return
        request = io.BytesIO(head)
        socket_rfile, self.rfile = self.rfile, request
        socket_rfile.close()  # never read: the head came from the socket directly
        self.raw_requestline = request.readline()
        if not self.parse_request():  # it has answered with an error
            return
        answer = cast(IO[bytes], self.wfile)  # a socket file: typeshed calls it a BufferedIOBase
        handler = _ServerHandler(request, answer, self.get_stderr(), self.get_environ(), multithread=False)
        handler.request_handler = self
        app = self.server.get_app()
        if app is not None:
            handler.run(app)

    def _read_head(self) -> bytes | None:
        """The request line and headers, checked; None when an error was answered or the client is gone."""
        limits = self.server.limits
        sock: socket.socket = self.request
        deadline_s = time.monotonic() + limits.request_timeout_s
        reader = HeadReader(limits.max_head_bytes)
        while True:
            left_s = deadline_s - time.monotonic()
            if left_s <= 0:
                return None  # too slow, whether silent or trickling: closed without an answer
            try:
                sock.settimeout(left_s)
                chunk = sock.recv(4096)
            except OSError:
                return None
            if not chunk:
                return None
            verdict = reader.feed(chunk)
            if verdict is not None:
                break
        sock.settimeout(limits.request_timeout_s)  # for each write of the answer
        if verdict.head is None:
            with contextlib.suppress(OSError):
                sock.sendall(_plain_answer(verdict.error, verdict.text))
            return None
        return verdict.head if self.server.head_complete(sock) else None


@dataclass
class MetricsServer:
    server: _Server
    thread: threading.Thread
    addr: str
    port: int  # the bound port (FORGE_METRICS_PORT=0 picks a free one)

    def close(self) -> None:
        """Stop accepting and end every open connection: returns within the accept loop's poll interval."""
        self.server.close_connections()
        self.server.shutdown()
        self.server.server_close()


def serve(gpu_slots: GpuSlots, addr: str, port: int, limits: ServerLimits = ServerLimits()) -> MetricsServer:
    """Start serving in a daemon thread. ConfigError (exit 2) when the client is missing or the port is taken."""
    registry = make_registry(gpu_slots)
    server_class = _Server6 if ":" in addr else _Server
    try:
        server = make_server(addr, port, make_app(registry, gpu_slots), server_class=server_class,
                             handler_class=_QuietHandler)
    except OSError as error:
        raise ConfigError(
            f"FORGE_METRICS_PORT={port} is not usable: cannot listen on {addr}:{port} ({error.strerror or error}): "
            "expected a free port (or FORGE_METRICS_ADDR an address of this host)"
        ) from None
    server.set_limits(limits)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": POLL_INTERVAL_S}, name="metrics",
                              daemon=True)
    thread.start()
    return MetricsServer(server, thread, addr, int(server.server_address[1]))
