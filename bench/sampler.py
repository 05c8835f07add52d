"""The NVML sampling thread of a run on a real GPU, in the benchmark process (which opens no CUDA context).

Utilization samples are read as the filler's Monitor reads them (forge_load.control.sampling.SampleReader: the buffered
samples, the latest window where there are none), and put on the wall clock. Memory, power, the process list
and the CPU time of the watched processes are read alongside.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from bench.runner import cpu_ticks
from forge_load.control.probe import Probe, UtilSample
from forge_load.control.sampling import SampleReader


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
        self.watch: set[int] = set()
        self.failure: str | None = None

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                mono = time.monotonic()
                now = time.time()
                offset = now - mono  # the probe's clock is monotonic: samples go on the wall clock
                fresh = [UtilSample(s.t_s + offset, s.ratio) for s in self.reader.read(mono)]
                memory = self.probe.memory_used_mib()
                power = self.probe.power_w()
                processes = self.probe.processes()
                with self.lock:
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
