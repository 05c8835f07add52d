"""What operators see from outside the process: each GPU's status, Prometheus metrics and `/health`.

One GpuSlot per filler: its run thread writes it, the HTTP server's threads read it. Metrics are read from
the live fillers at scrape time (a custom collector), so the run loops do no metrics work at all.

prometheus_client is optional (the `[metrics]` extra): this module imports it only when the server starts,
so forge_load runs without it while FORGE_METRICS_PORT is unset.
"""

from __future__ import annotations

import os
import platform
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from types import ModuleType
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from forge_load import __version__
from forge_load.config import ConfigError
from forge_load.probe import NoGpuError

if TYPE_CHECKING:
    from forge_load.app import Runtime

MIB_BYTES = 1024 * 1024
# Every value forge_load_state's `state` label takes; exactly one is 1 per GPU.
STATES = ("starting", "filling", "yielding", "boosted", "stopped", "failed")
# dcgm-exporter's label names (case included), so `on(UUID)` joins our series with DCGM_FI_* ones.
GPU_LABELS = ["gpu", "UUID"]

# name (as exposed) -> (type, help). The README's metric table and the dashboard test read this.
METRICS: dict[str, tuple[str, str]] = {
    "forge_load_build_info": ("gauge", "Always 1; labels: version, python_version, simulated"),
    "forge_load_gpu_info": ("gauge", "Always 1 per GPU; labels gpu, UUID, modelName, Hostname (the node)"),
    "forge_load_up": ("gauge", "1 while this GPU's filler loop is alive and fresh (what /health checks), else 0"),
    "forge_load_state": ("gauge", "1 for the GPU's current state (label state), 0 for the others"),
    "forge_load_target_ratio": ("gauge", "Utilization the filler holds now: the target, the boost target "
                                         "when boosted, 0 while yielding"),
    "forge_load_device_utilization_ratio": ("gauge", "Device utilization (NVML) in the latest sample window, "
                                                     "ours and foreign"),
    "forge_load_own_utilization_ratio": ("gauge", "Share of the latest sample window our own kernels ran"),
    "forge_load_foreign_utilization_ratio": ("gauge", "Device utilization beyond our own in the latest sample "
                                                      "window (a foreign job's)"),
    "forge_load_multiplier": ("gauge", "Blocks per SM in each of our launches; 0 while not launching"),
    "forge_load_process_gpu_memory_bytes": ("gauge", "Device memory our process holds on this GPU"),
    "forge_load_yields_total": ("counter", "Times the filler stepped aside for a foreign job"),
    "forge_load_yielding_seconds_total": ("counter", "Seconds spent stepped aside"),
    "forge_load_own_busy_seconds_total": ("counter", "Seconds our own kernels ran on the GPU"),
}


class GpuSlot:
    """One GPU's filler as seen from outside the process."""

    def __init__(self, requested: str, clock: Callable[[], float] = time.monotonic,
                 fleet: Fleet | None = None) -> None:
        self.requested = requested  # the index or UUID asked for, until the GPU is open
        self.clock = clock
        self.fleet = fleet
        self.runtime: Runtime | None = None
        self.index: int | None = int(requested) if requested.isdigit() else None
        self.uuid = "" if requested.isdigit() else requested
        self.model = ""
        self.status = "starting"  # starting -> running -> stopped | failed
        self.reason: str | None = None
        self.exit_code = 0
        self.last_beat_s: float | None = None

    def attach(self, runtime: Runtime) -> None:
        """The GPU is open and its filler built. NoGpuError if another slot already fills this GPU."""
        if self.fleet is not None:
            self.fleet.claim(self, runtime.info.uuid)
        self.runtime = runtime
        self.index, self.uuid, self.model = runtime.info.index, runtime.info.uuid, runtime.info.name
        self.status = "running"

    def beat(self) -> None:
        """Called by the filler's loop (at most once per loop second): the loop is alive."""
        self.last_beat_s = self.clock()

    def stopped(self) -> None:
        self.status = "stopped"

    def failed(self, reason: str, exit_code: int) -> None:
        self.reason, self.exit_code, self.status = reason, exit_code, "failed"

    @property
    def state(self) -> str:
        """One of STATES."""
        if self.status == "running" and self.runtime is not None:
            return self.runtime.filler.state.value
        return self.status

    @property
    def labels(self) -> list[str]:
        return ["" if self.index is None else str(self.index), self.uuid]

    @property
    def name(self) -> str:
        index = "?" if self.index is None else str(self.index)
        return f"gpu {index} {self.uuid or '(' + self.requested + ')'}"

    def health(self, max_age_s: float) -> tuple[bool, str]:
        """(alive and fresh, one line for /health)."""
        if self.status == "failed":
            return False, f"{self.name}: failed: {self.reason}"
        if self.status == "stopped":
            return False, f"{self.name}: stopped"
        if self.last_beat_s is None:
            return False, f"{self.name}: starting, no loop heartbeat yet"
        age_s = self.clock() - self.last_beat_s
        if age_s > max_age_s:
            return False, (f"{self.name}: {self.state}, loop stalled: last heartbeat {age_s:.0f} s ago "
                           f"(limit {max_age_s:g} s)")
        return True, f"{self.name}: {self.state}, loop heartbeat {age_s:.1f} s ago"


class Fleet:
    """The process's GPU slots; a process with one GPU has one."""

    def __init__(self, max_age_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 simulated: bool = False) -> None:
        self.max_age_s = max_age_s
        self.clock = clock
        self.simulated = simulated
        self.slots: list[GpuSlot] = []
        self._owners: dict[str, GpuSlot] = {}
        self._lock = threading.Lock()

    def add(self, requested: str) -> GpuSlot:
        slot = GpuSlot(requested, self.clock, self)
        self.slots = [*self.slots, slot]  # replaced, not appended, so readers iterate a stable list
        return slot

    def claim(self, slot: GpuSlot, uuid: str) -> None:
        """One filler per GPU: an index and a UUID naming the same GPU would each take the other for a job."""
        with self._lock:
            owner = self._owners.setdefault(uuid, slot)
        if owner is not slot:
            raise NoGpuError(f"{uuid} is named twice ({owner.requested!r} and {slot.requested!r} in "
                             "FORGE_GPUS): it is filled once, by the first")

    def health(self) -> tuple[bool, str]:
        """(every filler alive and fresh, the /health body: a verdict line, then one line per GPU)."""
        slots = self.slots
        if not slots:
            return False, "unhealthy: no GPU started yet\n"
        results = [slot.health(self.max_age_s) for slot in slots]
        bad = sum(not ok for ok, _ in results)
        verdict = "ok" if not bad else f"unhealthy: {bad} of {len(results)} GPUs"
        return not bad, "\n".join([verdict, *(line for _, line in results)]) + "\n"


class FillerCollector:
    """A prometheus_client collector over a Fleet, read at scrape time."""

    def __init__(self, fleet: Fleet, hostname: str | None = None) -> None:
        self.fleet = fleet
        # dcgm-exporter's Hostname: the node's name (NODE_NAME from the downward API in a pod).
        self.hostname = hostname or os.environ.get("NODE_NAME") or socket.gethostname()

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        def family(name: str, extra_labels: Iterable[str] = ()) -> Any:
            kind, help_text = METRICS[name]
            if kind == "counter":
                return CounterMetricFamily(name.removesuffix("_total"), help_text, labels=[*GPU_LABELS, *extra_labels])
            return GaugeMetricFamily(name, help_text, labels=[*GPU_LABELS, *extra_labels])

        build = GaugeMetricFamily("forge_load_build_info", METRICS["forge_load_build_info"][1],
                                  labels=["version", "python_version", "simulated"])
        build.add_metric([__version__, platform.python_version(), str(self.fleet.simulated).lower()], 1.0)
        info = family("forge_load_gpu_info", ["modelName", "Hostname"])
        up, state = family("forge_load_up"), family("forge_load_state", ["state"])
        target, util = family("forge_load_target_ratio"), family("forge_load_device_utilization_ratio")
        own, foreign = family("forge_load_own_utilization_ratio"), family("forge_load_foreign_utilization_ratio")
        multiplier, memory = family("forge_load_multiplier"), family("forge_load_process_gpu_memory_bytes")
        yields, yielding = family("forge_load_yields_total"), family("forge_load_yielding_seconds_total")
        busy = family("forge_load_own_busy_seconds_total")

        for slot in self.fleet.slots:
            labels = slot.labels
            current = slot.state
            up.add_metric(labels, 1.0 if slot.health(self.fleet.max_age_s)[0] else 0.0)
            for name in STATES:
                state.add_metric([*labels, name], 1.0 if name == current else 0.0)
            rt = slot.runtime
            if rt is None:
                continue
            info.add_metric([*labels, slot.model, self.hostname], 1.0)
            filler = rt.filler
            yields.add_metric(labels, float(filler.yields))
            yielding.add_metric(labels, filler.seconds_yielding(rt.now()))
            busy.add_metric(labels, rt.worker.busy_log.total_busy_s)
            if slot.status != "running":
                continue  # a stopped or failed GPU's last readings would read as current
            target.add_metric(labels, filler.policy.current_target_ratio)
            plan = filler.worker.plan
            multiplier.add_metric(labels, float(plan.multiplier if plan.duty_ratio > 0 else 0))
            share = filler.last_share
            if share is not None:
                util.add_metric(labels, share.util_ratio)
                own.add_metric(labels, share.own_ratio)
                foreign.add_metric(labels, share.foreign_ratio)
            reading = filler.last
            if reading is not None and reading.own_mem_mib is not None:
                memory.add_metric(labels, reading.own_mem_mib * MIB_BYTES)
        yield from (build, info, up, state, target, util, own, foreign, multiplier, memory, yields, yielding, busy)


# --- the HTTP server ----------------------------------------------------------------------------------------

def require_prometheus_client() -> ModuleType:
    """prometheus_client, or a ConfigError (exit 2) that says how to get it."""
    try:
        import prometheus_client
    except ImportError as error:
        raise ConfigError(
            f"FORGE_METRICS_PORT (--metrics-port) is set but prometheus_client cannot be imported ({error}): "
            "expected `pip install 'forge-load[metrics]'` (or prometheus_client), or leave FORGE_METRICS_PORT unset"
        ) from None
    return prometheus_client


def make_registry(fleet: Fleet) -> Any:
    """A registry of our own (not prometheus_client's global one) holding only forge_load's metrics."""
    prometheus_client = require_prometheus_client()
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(FillerCollector(fleet))
    return registry


def make_app(registry: Any, fleet: Fleet) -> Callable[..., Iterable[bytes]]:
    """WSGI app: /metrics (and /) the exposition, /health 200 or 503 with one line per GPU."""
    from prometheus_client import make_wsgi_app

    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if path in ("/health", "/healthz"):
            ok, body = fleet.health()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "text/plain; charset=utf-8"), ("Cache-Control", "no-store")])
            return [body.encode()]
        if path in ("/metrics", "/"):
            return metrics_app(environ, start_response)  # type: ignore[no-any-return]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: see /metrics and /health\n"]

    return app


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper must not hold the process open at exit


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # a line per scrape and probe would bury the filler's own lines in `docker logs`


@dataclass
class MetricsServer:
    server: WSGIServer
    thread: threading.Thread
    addr: str
    port: int  # the bound port (FORGE_METRICS_PORT=0 picks a free one)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve(fleet: Fleet, addr: str, port: int) -> MetricsServer:
    """Start serving in a daemon thread. ConfigError (exit 2) when the client is missing or the port is taken."""
    registry = make_registry(fleet)
    server_class = _Server6 if ":" in addr else _Server
    try:
        server = make_server(addr, port, make_app(registry, fleet), server_class=server_class,
                             handler_class=_QuietHandler)
    except OSError as error:
        raise ConfigError(
            f"FORGE_METRICS_PORT={port} is not usable: cannot listen on {addr}:{port} ({error.strerror or error}): "
            "expected a free port (or FORGE_METRICS_ADDR an address of this host)"
        ) from None
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5}, name="metrics",
                              daemon=True)
    thread.start()
    return MetricsServer(server, thread, addr, int(server.server_address[1]))
