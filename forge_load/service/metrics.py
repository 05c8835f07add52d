"""Prometheus metrics from the GPU slots' status (status.py); http_server.py serves them, and `/health`.

Metrics are read from each filler's status snapshot at scrape time (a custom collector), so the run loops do
no metrics work at all.

prometheus_client is optional (the `[metrics]` extra): this module imports it only when the server starts,
so forge_load runs without it while FORGE_METRICS_PORT is unset.
"""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any

from forge_load import __version__
from forge_load.config.values import ConfigError
from forge_load.control.status import STATES, GpuSlot, GpuSlots

MIB_BYTES = 1024 * 1024
# dcgm-exporter's label names (case included) on every per-GPU series, so `on(UUID, GPU_I_ID)` joins our series
# with DCGM_FI_* ones, for a whole GPU and a MIG device alike (gpu_labels gives their values).
GPU_LABELS = ["gpu", "UUID", "GPU_I_ID", "GPU_I_PROFILE"]
# name (as exposed) -> (type, help). docs/metrics.md (scripts/gen_docs.py) and the dashboard test read this.
METRICS: dict[str, tuple[str, str]] = {
    "forge_load_build_info": ("gauge", "Always 1; labels: version, python_version, simulated"),
    "forge_load_gpu_info": ("gauge", "Always 1 per GPU or MIG device filled; labels gpu, UUID, GPU_I_ID, "
                                     "GPU_I_PROFILE, modelName, hostname (the node)"),
    "forge_load_mig_info": ("gauge", "Always 1 per MIG device filled; labels gpu, UUID (its GPU's), GPU_I_ID, "
                                     "GPU_I_PROFILE, as on every series, and mig_uuid: the MIG device's own UUID "
                                     "(MIG-...), as the logs, holds and forge-load status name it"),
    "forge_load_up": ("gauge", "1 while this GPU's filler loop is alive and fresh (what /health checks), else 0"),
    "forge_load_state": ("gauge", "1 for the GPU's current state (label state), 0 for the others"),
    "forge_load_target_ratio": ("gauge", "What the filler holds the held metric (forge_load_metric_ratio) at now: "
                                         "the target, the boost target when boosted, 0 while yielding"),
    "forge_load_metric_ratio": ("gauge", "The held metric over its latest 2 s, ours and foreign; label metric: "
                                         "FORGE_METRIC (utilization: NVML's, or GPM's graphics activity where NVML has "
                                         "none; sm_activity, gr_activity: GPM's)"),
    "forge_load_own_metric_ratio": ("gauge", "Our own share of the held metric over its latest 2 s (our kernels' "
                                             "busy share, timed with CUDA events); label metric"),
    "forge_load_device_utilization_ratio": ("gauge", "Device utilization (NVML) in the latest sample window, "
                                                     "ours and foreign; on a MIG device, where NVML has none, GPM's "
                                                     "graphics activity over the latest 2 s"),
    "forge_load_own_utilization_ratio": ("gauge", "Share of the latest sample window (on a MIG device: 2 s) our "
                                                  "own kernels ran"),
    "forge_load_foreign_utilization_ratio": ("gauge", "Device utilization beyond our own in the latest sample "
                                                      "window (a foreign job's)"),
    "forge_load_multiplier": ("gauge", "Size of each of our launches: sleep quanta (lean shape) or blocks per SM "
                                       "(burn); 0 while not launching"),
    "forge_load_process_gpu_memory_bytes": ("gauge", "Device memory our process holds on this GPU"),
    "forge_load_yields_total": ("counter", "Times the filler stepped aside for a foreign job"),
    "forge_load_yielding_seconds_total": ("counter", "Seconds spent stepped aside"),
    "forge_load_own_busy_seconds_total": ("counter", "Seconds our own kernels ran on the GPU"),
    "forge_load_power_watts": ("gauge", "Board power, NVML's reading (a 1-s mean on Ampere and newer GPUs)"),
    "forge_load_power_cap_watts": ("gauge", "The power cap (FORGE_MAX_POWER_W); absent when there is none"),
    "forge_load_power_capped": ("gauge", "1 while the power cap holds the filler's duty below what its target asks, "
                                         "else 0"),
    "forge_load_energy_joules_total": ("counter", "The whole device's energy (NVML) while this filler was filling: "
                                                  "idle power and anything else on the GPU included, not ours alone"),
    "forge_load_holds": ("gauge", "Holds (forge-load hold) this GPU's filler honours now; state is held while > 0"),
    "forge_load_holds_begun_total": ("counter", "Holds this GPU's filler began to honour since it started"),
}


def gpu_labels(slot: GpuSlot) -> list[str]:
    """The values of GPU_LABELS for a slot's series, as dcgm-exporter labels its GPU or MIG device: a MIG device
    by its GPU's index and UUID, its GPU instance ID and profile (docs/design.md §12); two of one GPU differ by
    GPU_I_ID. A whole GPU's GPU_I_ID and GPU_I_PROFILE are empty: Prometheus stores an empty label as no label,
    so whole-GPU series and queries are what they were before MIG devices had these labels."""
    index = "" if slot.index is None else str(slot.index)  # a MIG device's index is its GPU's (nvml._index_of)
    info = slot.info
    if info is None or info.gpu_instance is None or not info.gpu_uuid:
        # Not open yet, a whole GPU, or a MIG device whose GPU NVML did not name: its own UUID is its only key.
        return [index, slot.uuid, "", ""]
    return [index, info.gpu_uuid, str(info.gpu_instance), info.mig_profile]


class FillerCollector:
    """A prometheus_client collector over a GpuSlots, read at scrape time."""

    def __init__(self, gpu_slots: GpuSlots, hostname: str | None = None) -> None:
        self.gpu_slots = gpu_slots
        # dcgm-exporter's hostname (lowercase since its #655): the node (NODE_NAME, the downward API, in a pod).
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
        build.add_metric([__version__, platform.python_version(), str(self.gpu_slots.simulated).lower()], 1.0)
        info = family("forge_load_gpu_info", ["modelName", "hostname"])
        mig = family("forge_load_mig_info", ["mig_uuid"])
        up, state = family("forge_load_up"), family("forge_load_state", ["state"])
        target, util = family("forge_load_target_ratio"), family("forge_load_device_utilization_ratio")
        held, held_own = (family("forge_load_metric_ratio", ["metric"]),
                          family("forge_load_own_metric_ratio", ["metric"]))
        own, foreign = family("forge_load_own_utilization_ratio"), family("forge_load_foreign_utilization_ratio")
        multiplier, memory = family("forge_load_multiplier"), family("forge_load_process_gpu_memory_bytes")
        yields, yielding = family("forge_load_yields_total"), family("forge_load_yielding_seconds_total")
        busy = family("forge_load_own_busy_seconds_total")
        power, cap = family("forge_load_power_watts"), family("forge_load_power_cap_watts")
        capped, energy = family("forge_load_power_capped"), family("forge_load_energy_joules_total")
        holds, begun = family("forge_load_holds"), family("forge_load_holds_begun_total")

        for slot in self.gpu_slots.slots:
            labels = gpu_labels(slot)
            snapshot = slot.snapshot()
            current = snapshot.state if snapshot is not None and slot.status == "running" else slot.status
            up.add_metric(labels, 1.0 if slot.health(self.gpu_slots.max_age_s)[0] else 0.0)
            for name in STATES:
                state.add_metric([*labels, name], 1.0 if name == current else 0.0)
            if snapshot is None:
                continue
            info.add_metric([*labels, slot.model, self.hostname], 1.0)
            if slot.info is not None and slot.info.gpu_instance is not None:
                mig.add_metric([*labels, slot.uuid], 1.0)
            yields.add_metric(labels, float(snapshot.yields))
            yielding.add_metric(labels, snapshot.yielding_s)
            busy.add_metric(labels, snapshot.own_busy_s)
            energy.add_metric(labels, snapshot.energy_j)
            begun.add_metric(labels, float(snapshot.holds_begun))
            if slot.status != "running":
                continue  # a stopped or failed GPU's last readings would read as current
            target.add_metric(labels, snapshot.holding)
            for family_, value in ((held, snapshot.metric_ratio), (held_own, snapshot.metric_own_ratio)):
                if value is not None:
                    family_.add_metric([*labels, snapshot.metric], value)
            multiplier.add_metric(labels, float(snapshot.multiplier))
            for family_, value in ((util, snapshot.util_ratio), (own, snapshot.own_ratio),
                                   (foreign, snapshot.foreign_ratio)):
                if value is not None:
                    family_.add_metric(labels, value)
            if snapshot.own_mem_mib is not None:
                memory.add_metric(labels, snapshot.own_mem_mib * MIB_BYTES)
            if snapshot.power_w is not None:
                power.add_metric(labels, snapshot.power_w)
            if snapshot.power_cap_w is not None:
                cap.add_metric(labels, snapshot.power_cap_w)
            capped.add_metric(labels, 1.0 if snapshot.power_capped else 0.0)
            holds.add_metric(labels, float(snapshot.holds))
        yield from (build, info, mig, up, state, target, held, held_own, util, own, foreign, multiplier, memory, yields,
                    yielding, busy, power, cap, capped, energy, holds, begun)


# --- the registry ---------------------------------------------------------------------------------------------

def require_prometheus_client() -> ModuleType:
    """prometheus_client, or a ConfigError (exit 2) that says how to get it."""
    try:
        import prometheus_client
    except ImportError as error:
        raise ConfigError(
            f"FORGE_METRICS_PORT (--metrics-port) is set but prometheus_client cannot be imported ({error}): "
            "expected `pip install 'forge-load[metrics]'` (or prometheus_client), or leave FORGE_METRICS_PORT unset"
        ) from None
    module: ModuleType = prometheus_client
    return module


def make_registry(gpu_slots: GpuSlots) -> Any:
    """A registry of our own (not prometheus_client's global one) holding only forge_load's metrics."""
    prometheus_client = require_prometheus_client()
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(FillerCollector(gpu_slots))
    return registry
