"""The NVML sampling thread of a run on a real GPU, in the benchmark process (which opens no CUDA context).

Utilization samples are read as the filler's Monitor reads them (forge_load.control.sampling.SampleReader: the buffered
samples, the latest window where there are none), and put on the wall clock. Memory, power, the process list
and the CPU time of the watched processes are read alongside; where the GPU has GPM (Hopper and newer), so are
1-s GPM readings of SM_UTIL and GRAPHICS_UTIL, from this process's own sample pairs (NvmlProbe.activity), which
are independent of the filler's.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from bench.runner import cpu_ticks
from forge_load.control.probe import Probe, UtilSample
from forge_load.control.sampling import SampleReader

GPM_INTERVAL_S = 1.0  # one GPM reading a second: the 1-s readings the metric scenario judges


class Sampler(threading.Thread):
    """Reads NVML every `interval_s`: the device's utilization samples, memory, power, processes, and /proc CPU
    times of the pids in `watch`. Times are wall-clock."""

    def __init__(self, probe: Probe, interval_s: float = 0.1) -> None:
        super().__init__(daemon=True, name="nvml-sampler")
        self.probe = probe
        self.interval_s = interval_s
        self.reader = SampleReader(probe)
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.util: list[UtilSample] = []
        self.memory: list[tuple[float, float]] = []
        self.power: list[tuple[float, float]] = []
        self.processes: list[tuple[float, dict[int, float | None]]] = []
        self.cpu: dict[int, list[tuple[float, int]]] = {}
        self.gpm: list[tuple[float, float, float, float]] = []  # (end, span_s, SM_UTIL, GRAPHICS_UTIL ratios)
        self.read_gpm = probe.info.gpm  # nvmlGpmQueryDeviceSupport's answer
        self.watch: set[int] = set()
        self.failure: str | None = None

    def run(self) -> None:
        gpm_due_s = 0.0
        try:
            while not self.stop_event.is_set():
                mono = time.monotonic()
                now = time.time()
                offset = now - mono  # the probe's clock is monotonic: samples go on the wall clock
                fresh = [UtilSample(s.t_s + offset, s.ratio) for s in self.reader.read(mono)]
                memory = self.probe.memory_used_mib()
                power = self.probe.power_w()
                processes = self.probe.processes()
                activity = None
                if self.read_gpm and mono >= gpm_due_s:  # the first call only takes the first sample
                    gpm_due_s = mono + GPM_INTERVAL_S
                    activity = self.probe.activity()
                with self.lock:
                    if activity is not None:
                        self.gpm.append((activity.t_s + offset, activity.span_s, activity.sm_ratio,
                                         activity.gr_ratio))
                    self.util.extend(fresh)
                    if memory is not None:
                        self.memory.append((now, memory))
                    if power is not None:
                        self.power.append((now, power))
                    if processes is not None:
                        self.processes.append((now, {p.pid: p.used_mib for p in processes}))
                    for pid in list(self.watch):
                        ticks = cpu_ticks(pid)
                        if ticks is None:
                            self.watch.discard(pid)
                        else:
                            self.cpu.setdefault(pid, []).append((now, ticks))
                self.stop_event.wait(self.interval_s)
        except Exception as error:  # noqa: BLE001 - reported with the results
            self.failure = f"{type(error).__name__}: {error}"

    def between(self, name: str, a: float, b: float) -> list[Any]:
        with self.lock:
            items = list(getattr(self, name))
        if name == "util":
            return [s for s in items if a <= s.t_s <= b]
        return [x for x in items if a <= x[0] <= b]

    def foreign_pids(self, ours: set[int], a: float, b: float) -> set[int]:
        return {pid for _, procs in self.between("processes", a, b) for pid in procs if pid not in ours}
