"""Monitor: reads the probe on a monotonic schedule and publishes a Reading with the foreign verdict.

Each poll gathers what the signals judge (detectors.py): the processes on the GPU, device memory beyond ours
and the baseline, and each new sample window split into our own share and the rest.

NVML is asked by need (docs/design.md §7): device memory, the cheap query, at every poll; the process lists,
dear on a real driver, only when memory moved since they were last read (a new context costs hundreds of
MiB), otherwise every PROCESS_REFRESH_MIN_S, growing to PROCESS_REFRESH_MAX_S while nothing changes; power
and temperature about once a second, as often as NVML refreshes them (power at every poll only where there is
no energy counter to read instead); the energy counter at every poll. The sample buffer is asked only when a
new sample can be there (sampling.py).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from forge_load.control.detectors import (
    DEFAULT_THRESHOLDS,
    GPM_SIGNALS,
    RECENT_SAMPLES,
    SIGNALS,
    Observation,
    ShareSample,
    Signal,
    Thresholds,
)
from forge_load.control.probe import Activity, GpuProcess, Probe, UtilSample
from forge_load.control.sampling import SampleReader
from forge_load.control.worker import BusyLog

PROCESS_REFRESH_MIN_S = 1.0  # the process lists at least this often after something changed
PROCESS_REFRESH_MAX_S = 4.0  # ... and the gap doubles up to this while memory and the lists stay still
SLOW_READ_S = 1.0  # power and temperature: NVML refreshes them about once a second
# GPM: NVML asks for samples more than 100 ms apart (docs/design.md §12); a poll grid of 0.1 s meets it every other
# poll. A sample pair's readings are 5 a second, about NVML's utilization windows' rate.
ACTIVITY_EVERY_S = 0.19


@dataclass(frozen=True)
class ActivityShare:
    """GPM's readings over the span that ended at `t_s`, and our own busy share of that span (CUDA events)."""

    t_s: float
    span_s: float
    sm_ratio: float
    gr_ratio: float
    own_ratio: float


@dataclass(frozen=True)
class Reading:
    seq: int
    t_s: float
    window_s: float
    samples: tuple[ShareSample, ...]  # new since the previous reading
    memory_used_mib: float | None
    own_mem_mib: float | None  # the larger of the two estimates below
    own_mem_process_mib: float | None  # NVML's per-process count for our PID; None where not listed
    foreign_mem_mib: float | None
    foreign_pids: tuple[int, ...]
    signals: tuple[str, ...]  # which of process / memory / utilization / sm_activity fired
    reason: str | None  # what fired, for the log; None when every signal is clear
    power_w: float | None = None  # board power (NVML's reading: a 1-s mean on current GPUs)
    temperature_c: float | None = None
    energy_j: float | None = None  # the board's energy counter, where NVML offers one
    power_t_s: float | None = None  # when power and temperature were read (about once a second)
    activity: tuple[ActivityShare, ...] = ()  # GPM's, new since the previous reading (where the GPU has GPM)
    # NVML reports no utilization here (MIG) and GPM is there: its GRAPHICS_UTIL stands in for it (quantity.py)
    utilization_by_gpm: bool = False

    @property
    def foreign(self) -> bool:
        return self.reason is not None


class Monitor:
    """`own_mem_context_mib` is what our context added to the device's memory when it was created;
    `start_s` is when we started: samples of windows that began earlier only teach the window length;
    `own_sm_ratio` is the share of the SMs our kernels keep a warp on while they run (control/shape.py), so our own
    SM activity is our busy share times it."""

    def __init__(self, probe: Probe, busy_log: BusyLog, own_pid: int, baseline_mem_mib: float,
                 own_mem_context_mib: float, thresholds: Thresholds = DEFAULT_THRESHOLDS, poll_interval_s: float = 0.1,
                 start_s: float = float("-inf"), on_reading: Callable[[], None] | None = None,
                 signals: Sequence[tuple[str, Signal]] = SIGNALS, own_sm_ratio: float = 1.0) -> None:
        self.probe = probe
        self.busy_log = busy_log
        self.own_pid = own_pid
        self.baseline_mem_mib = baseline_mem_mib
        self.own_mem_context_mib = own_mem_context_mib
        self.thresholds = thresholds
        self.poll_interval_s = poll_interval_s
        self.start_s = start_s
        self.on_reading = on_reading
        self.signals = tuple(signals)
        self.own_sm_ratio = own_sm_ratio
        self.failure: Exception | None = None  # what ended run(): a GpuFailedError, or a bug
        self._lock = threading.Lock()
        self._latest: Reading | None = None
        self._seq = 0
        self._next_due_s: float | None = None
        self._samples = SampleReader(probe)
        self._pending: list[UtilSample] = []
        self._activity_pending: list[Activity] = []
        self._activity_due_s = float("-inf")
        self._unread_activity: list[ActivityShare] = []
        self._recent: deque[ShareSample] = deque(maxlen=RECENT_SAMPLES)
        self._recent_activity: deque[ShareSample] = deque(maxlen=RECENT_SAMPLES)  # GPM's SM activity against ours
        # The process lists are re-read when memory moved by half of what the memory signal fires on (a new
        # context moves it by hundreds of MiB), so both signals still see a new job at the same poll.
        self.memory_move_mib = thresholds.mem_mib / 2
        self._processes: list[GpuProcess] | None = None
        self._processes_mem_mib: float | None = None  # device memory when the lists were read
        self._processes_due_s = float("-inf")
        self._processes_gap_s = PROCESS_REFRESH_MIN_S
        self._slow_due_s = float("-inf")
        # Waking the reader (the GPU's loop) costs more CPU than the poll: while it fills, it is woken only by a
        # reading that changes what it does (the verdict); its next burst takes the rest (`take`).
        self.wake_every_reading = True
        self.woke = False  # whether the last step woke the reader
        self._unread: list[ShareSample] = []  # samples of the readings published since the last take()
        self._taken: Reading | None = None
        self._power_w: float | None = None
        self._power_t_s: float | None = None
        self._temperature_c: float | None = None
        self._processes_offered: bool | None = None  # at the latest poll (None: no poll yet)
        self._memory_offered: bool | None = None

    @property
    def window_s(self) -> float:
        return self._samples.window_s

    def sight(self) -> tuple[tuple[str, ...], dict[str, str]]:
        """(the signals that can see a foreign job on this GPU, the blind ones with why), from the latest poll.
        A signal switched off by a setting is in neither: that is the operator's choice, not the GPU's; nor is one
        that reads GPM on a GPU without it (before Hopper nothing but DCGM measures SM activity: no GPU of that
        kind is blind for lack of it, and its start line stays as it was)."""
        why_blind: dict[str, str] = {}
        if self._processes_offered is False:
            why_blind["process"] = "NVML answers no process-list query on this GPU (not supported)"
        if self._memory_offered is False:
            why_blind["memory"] = "NVML reports no device memory in use on this GPU (not supported)"
        if self._samples.blind and not self.probe.info.gpm:  # GPM's GRAPHICS_UTIL stands in for it (_poll)
            why_blind["utilization"] = "NVML reports no utilization on this GPU (not supported, as on MIG)"
        names = [name for name, _ in self.signals if (name in why_blind or name != "process"
                 or self.thresholds.use_process_list) and (name not in GPM_SIGNALS or self.probe.info.gpm)]
        return tuple(n for n in names if n not in why_blind), {n: why_blind[n] for n in names if n in why_blind}

    def latest(self) -> Reading | None:
        with self._lock:
            return self._latest

    def take(self) -> Reading | None:
        """The latest reading for its reader, with every sample published since the previous take(): a
        reading that did not wake the reader loses none."""
        with self._lock:
            latest = self._latest
            if latest is None or (self._taken is not None and self._taken.seq == latest.seq):
                return self._taken if latest is not None else None
            self._taken = dataclasses.replace(latest, samples=tuple(self._unread),
                                              activity=tuple(self._unread_activity))
            self._unread = []
            self._unread_activity = []
            return self._taken

    def step(self, now_s: float) -> float:
        """Poll once; returns when the next poll is due (a fixed grid, skipping missed slots)."""
        reading = self._poll(now_s)
        with self._lock:
            previous, self._latest = self._latest, reading
            self._unread.extend(reading.samples)
            self._unread_activity.extend(reading.activity)
        self.woke = (self.wake_every_reading or previous is None or reading.signals != previous.signals
                     or reading.foreign != previous.foreign)
        if self.on_reading is not None and self.woke:
            self.on_reading()
        due_s = now_s if self._next_due_s is None else self._next_due_s
        while due_s <= now_s:
            due_s += self.poll_interval_s
        self._next_due_s = due_s
        return due_s

    def run(self, now: Callable[[], float], stop: threading.Event) -> None:
        """Thread body on a real GPU: poll until `stop` is set or the GPU fails."""
        try:
            while not stop.is_set():
                due_s = self.step(now())
                stop.wait(max(due_s - now(), 0.0))
        except Exception as error:  # noqa: BLE001 - the filler raises it: lost GPU 4, bug 1, never silent
            self.failure = error
            if self.on_reading is not None:
                self.on_reading()

    def _poll(self, now_s: float) -> Reading:
        self._seq += 1
        samples = self._new_samples(now_s)
        shares = self._split(samples)
        activity = self._new_activity(now_s)
        if self._samples.blind:
            # Where NVML has no utilization (MIG), GPM's GRAPHICS_UTIL less our own share is the utilization
            # signal's input: the time any kernel ran, as NVML's utilization counts it.
            self._recent.extend(ShareSample(a.t_s, a.gr_ratio, a.own_ratio) for a in activity)
        # GPM's SM activity beyond our own share, wherever GPM is (whole GPU or MIG device): our kernels keep a warp
        # on `own_sm_ratio` of the SMs while they run (every SM for burn's full waves and lean's sm_activity layout,
        # one for lean's single warp), so our own SM activity is our busy share times that, less the tails of sleeps
        # or of last waves: never more, so our own load never looks foreign, and a job on the SMs ours leave idle
        # is seen.
        self._recent_activity.extend(ShareSample(a.t_s, a.sm_ratio, a.own_ratio * self.own_sm_ratio)
                                     for a in activity)
        used_mib = self.probe.memory_used_mib()
        processes = self._read_processes(now_s, used_mib)
        self._processes_offered = processes is not None
        self._memory_offered = used_mib is not None
        own_process_mib: float | None = None
        foreign_pids: tuple[int, ...] = ()
        if processes is not None:
            foreign_pids = tuple(sorted(p.pid for p in processes if p.pid != self.own_pid))
            own_process_mib = next((p.used_mib for p in processes if p.pid == self.own_pid
                                    and p.used_mib is not None), None)
        # The per-process count can miss part of our context; under-counting ourselves would read as
        # foreign memory on every poll, so the larger estimate wins.
        own_mem_mib = max(self.own_mem_context_mib, own_process_mib or 0.0)
        foreign_mem_mib = None
        if used_mib is not None:
            # A baseline that included a job which has since left comes down with it.
            self.baseline_mem_mib = min(self.baseline_mem_mib, used_mib - own_mem_mib)
            foreign_mem_mib = used_mib - own_mem_mib - self.baseline_mem_mib

        self._recent.extend(shares)
        seen = Observation(foreign_pids, foreign_mem_mib, tuple(self._recent), tuple(self._recent_activity))
        fired = [(name, reason) for name, signal in self.signals
                 if (reason := signal(seen, self.thresholds)) is not None]
        # The energy counter at every poll: the energy while filling is counted from reading to reading, and a
        # state change between two reads of it would put a second's energy on the wrong side. Without a
        # counter, the power readings are what is integrated: then power at every poll too.
        energy_j = self.probe.energy_j()
        if now_s >= self._slow_due_s:
            self._temperature_c = self.probe.temperature_c()
            self._slow_due_s = now_s + SLOW_READ_S
            self._power_w, self._power_t_s = self.probe.power_w(), now_s
        elif energy_j is None:
            self._power_w, self._power_t_s = self.probe.power_w(), now_s
        power_w, temperature_c = self._power_w, self._temperature_c
        return Reading(
            seq=self._seq, t_s=now_s, window_s=self.window_s, samples=tuple(shares),
            memory_used_mib=used_mib, own_mem_mib=own_mem_mib, own_mem_process_mib=own_process_mib,
            foreign_mem_mib=foreign_mem_mib,
            foreign_pids=foreign_pids, signals=tuple(name for name, _ in fired),
            reason="; ".join(reason for _, reason in fired) or None,
            power_w=power_w, temperature_c=temperature_c, energy_j=energy_j, power_t_s=self._power_t_s,
            activity=tuple(activity), utilization_by_gpm=self._samples.blind and self.probe.info.gpm,
        )

    def _read_processes(self, now_s: float, used_mib: float | None) -> list[GpuProcess] | None:
        """The process lists, read again when memory moved (or cannot be read) or when they are due."""
        moved = (used_mib is None or self._processes_mem_mib is None
                 or abs(used_mib - self._processes_mem_mib) >= self.memory_move_mib)
        if not moved and now_s < self._processes_due_s:
            return self._processes
        processes = self.probe.processes()
        pids = None if processes is None else sorted(p.pid for p in processes)
        before = None if self._processes is None else sorted(p.pid for p in self._processes)
        if moved or pids != before:
            self._processes_gap_s = PROCESS_REFRESH_MIN_S
        else:
            self._processes_gap_s = min(self._processes_gap_s * 2, PROCESS_REFRESH_MAX_S)
        self._processes = processes
        self._processes_mem_mib = used_mib
        self._processes_due_s = now_s + self._processes_gap_s
        return processes

    def _new_samples(self, now_s: float) -> list[UtilSample]:
        self._pending.extend(self._samples.read(now_s))
        # A window can be split into ours and foreign only once every kernel of ours in it is logged, and
        # only if it began after we started: our share of anything earlier is unknown.
        ready_until_s = self.busy_log.complete_until_s
        ready = [s for s in self._pending if s.t_s <= ready_until_s]
        self._pending = self._pending[len(ready):]
        return [s for s in ready if s.t_s - self.window_s >= self.start_s]

    def _new_activity(self, now_s: float) -> list[ActivityShare]:
        """GPM's readings whose span is wholly after our start and whose kernels of ours are all timed."""
        if not self.probe.info.gpm:
            return []
        if now_s >= self._activity_due_s:
            self._activity_due_s = now_s + ACTIVITY_EVERY_S
            got = self.probe.activity()
            if got is not None:
                self._activity_pending.append(got)
        ready_until_s = self.busy_log.complete_until_s
        ready = [a for a in self._activity_pending if a.t_s <= ready_until_s]
        self._activity_pending = self._activity_pending[len(ready):]
        return [ActivityShare(a.t_s, a.span_s, a.sm_ratio, a.gr_ratio,
                              min(self.busy_log.busy_s(a.t_s - a.span_s, a.t_s) / a.span_s, 1.0))
                for a in ready if a.t_s - a.span_s >= self.start_s and a.span_s > 0]

    def _split(self, samples: list[UtilSample]) -> list[ShareSample]:
        window_s = self.window_s
        return [ShareSample(s.t_s, s.ratio, min(self.busy_log.busy_s(s.t_s - window_s, s.t_s) / window_s, 1.0))
                for s in samples]
