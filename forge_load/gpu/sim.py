"""A simulated GPU in virtual time: it stands in for nvml.py (SimProbe) and for the launch side of the
Worker (SimLauncher). The Monitor, controller, policy and logging that run against it are the real ones.

The model:
- NVML utilization: every `window_s` (phase drawn from the seed) a sample of the share of the window
  during which any kernel ran, ours or foreign, rounded to a whole percent as NVML reports it.
- Our kernels run one after another on one stream (a launch call may queue several back to back). A burn kernel
  takes a launch overhead plus one wave time per wave, waves = ceil(grid blocks / (SMs x resident blocks per SM));
  a lean one a launch overhead plus its quanta of sleep, each SLEEP_RATIO of its request (nanosleep promises only
  0 to 2x); both with a little seeded jitter.
- A foreign job takes its device memory at the start of its interval (its context) and GPU time while
  it runs: busy for `foreign_load_ratio` of every 20-ms period. It shows in the process list unless
  hidden (a container without --pid=host). Foreign and own kernels overlap, which makes the foreign
  share look smallest (the union), the hardest case for the utilization signal.
- Board power (a model, docs/design.md §15): BARE_IDLE_POWER_W, plus CONTEXT_POWER_W while a context is open (ours,
  or a foreign job's), plus what the kernel that runs draws: a lean kernel LIGHT_SM_W for each SM with a warp of it
  resident, a burn kernel or a foreign job's the board's limit (MAX_POWER_W, full waves of arithmetic). NVML's
  reading is its mean over the last second, the energy counter its integral from the start, and the enforced power
  limit MAX_POWER_W.

Long runs stay flat: our kernels are kept only as far back as a query can reach (the driver's sample
buffer, the power window), and the foreign jobs are looked up by bisection, so each query costs what the
kernels and jobs near it cost, however long the run and however many jobs.
"""

from __future__ import annotations

import math
import os
import random
import threading
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Protocol

from forge_load.config.sim import SimConfig, sim_uuid
from forge_load.control.probe import Activity, DeviceInfo, GpuFailedError, GpuProcess, UtilSample
from forge_load.control.shape import LEAN, Shape
from forge_load.control.worker import Completed

RESIDENT_BLOCKS_PER_SM = 8  # 256-thread blocks, 2048 threads per SM
WAVE_S = 0.0001  # about one wave of 8 x 256-thread burn blocks per SM (kernels.BURN_ITERS) on Hopper
LAUNCH_OVERHEAD_S = 0.000008
LAUNCH_LATENCY_S = 0.000005
JITTER_RATIO = 0.02
CONTEXT_MIB = 512.0  # a CUDA 12 context on a Hopper-class GPU is of this order
FOREIGN_PERIOD_S = 0.020
FOREIGN_PID_BASE = 40000
BUFFERED_SAMPLES = 100
POWER_WINDOW_S = 1.0  # power is drawn from the busy share of the last second
HISTORY_SLACK_S = 1.0  # a poll may come a little after the clock it reads
# The power model's figures (docs/design.md §15; every power the simulated GPU reports is this model's):
IDLE_POWER_W = 70.0  # an H100 SXM with a context and nothing running (P0)
CONTEXT_POWER_W = 38.0  # what a context adds over bare idle: 26-50 W on HBM GPUs (arXiv 2605.23918)
BARE_IDLE_POWER_W = IDLE_POWER_W - CONTEXT_POWER_W
LIGHT_SM_W = 1.97 / 80  # AccelWattch's Volta (80 SMs): 1.97 W of static power for a light load on every SM
MAX_POWER_W = 700.0  # the board's limit, which arithmetic in full waves reaches
SLEEP_QUANTUM_S = 10e-6  # the lean kernel's request (burn_image.SLEEP_QUANTUM_NS)
SLEEP_RATIO = 1.2  # what a quantum really lasts, over its request: the Worker has to learn it


class Clock(Protocol):
    """What the simulated GPU reads its time from: a VirtualClock, or in tests the wall clock."""

    def now(self) -> float: ...


class VirtualClock:
    def __init__(self, start_s: float = 0.0) -> None:
        self.t_s = start_s

    def now(self) -> float:
        return self.t_s

    def advance_to(self, t_s: float) -> None:
        self.t_s = max(self.t_s, t_s)


@dataclass(frozen=True)
class ForeignJob:
    start_s: float
    end_s: float
    pid: int
    phase_s: float
    hidden: bool = False  # left out of the process list (--sim-foreign-hidden)


class JobTimeline:
    """Foreign jobs sorted by start, found by bisection: a query looks only at the jobs near it."""

    def __init__(self, jobs: list[ForeignJob]) -> None:
        self.jobs = sorted(jobs, key=lambda job: job.start_s)
        self._starts = [job.start_s for job in self.jobs]
        # The latest end among the jobs up to each one: nondecreasing, so it bisects even if jobs overlap.
        self._ends_so_far: list[float] = []
        latest_s = float("-inf")
        for job in self.jobs:
            latest_s = max(latest_s, job.end_s)
            self._ends_so_far.append(latest_s)

    def near(self, a_s: float, b_s: float) -> list[ForeignJob]:
        """The jobs that may overlap [a_s, b_s] (a superset only where jobs overlap each other)."""
        return self.jobs[bisect_right(self._ends_so_far, a_s):bisect_right(self._starts, b_s)]


class SimGpu:
    def __init__(self, config: SimConfig, clock: Clock, index: int = 0,
                 keep_history: bool = False) -> None:
        self.config = config
        self.clock = clock
        self.index = index
        self.window_s = config.window_s
        rng = random.Random(config.seed * 1000 + index)
        self._rng = rng
        self._sample_phase_s = rng.uniform(0.0, config.window_s)
        jobs = [ForeignJob(a, b, FOREIGN_PID_BASE + i, rng.uniform(0.0, FOREIGN_PERIOD_S))
                for i, (a, b) in enumerate(config.foreign_s)]
        jobs += [ForeignJob(a, b, FOREIGN_PID_BASE + len(jobs) + i, rng.uniform(0.0, FOREIGN_PERIOD_S), hidden=True)
                 for i, (a, b) in enumerate(config.foreign_hidden_s)]
        if config.foreign_gpus is not None and index not in config.foreign_gpus:
            jobs = []
        self.timeline = JobTimeline(jobs)
        self.jobs = self.timeline.jobs
        self.lost = False
        self.lost_at_s: float | None = dict(config.fail_gpus).get(index)  # --sim-fail-gpu
        # How far back any query reaches: the oldest buffered sample's window, or the power window.
        self.history_s = max((BUFFERED_SAMPLES + 1) * self.window_s, POWER_WINDOW_S) + HISTORY_SLACK_S
        self.keep_history = keep_history  # everything, for tests and the benchmark that score a run afterwards
        # Our kernels, back to back on one stream: starts, ends, the busy seconds before each one, and the watts
        # each draws above the context's idle. Locked, since with the wall clock the Monitor's thread reads them
        # while the Worker's adds.
        self._lock = threading.Lock()
        self._starts: list[float] = []
        self._ends: list[float] = []
        self._busy_before: list[float] = [0.0]
        self._watts: list[float] = []
        # Our context's spans (open, close); the last is open while a launcher holds it.
        self._contexts: list[tuple[float, float]] = []
        self._kept_from_s = float("-inf")  # every kernel that ran after this is still in the lists
        # The energy counter, integrated up to _energy_t_s: advanced by queries, and before kernels are dropped.
        self._energy_lock = threading.Lock()
        self._energy_j = 0.0
        self._energy_t_s = clock.now()
        self.info = DeviceInfo(index=index, uuid=sim_uuid(config.seed, index),
                               name=f"Simulated GPU ({config.sms} SMs)", memory_total_mib=81559.0,
                               driver_version="simulated", mig_enabled=False)

    def check(self) -> None:
        """Raise as NVML does once the GPU is lost (`--sim-fail-gpu`), from then on."""
        if self.lost_at_s is not None and self.clock.now() >= self.lost_at_s:
            self.lost = True
        if self.lost:
            when = f" (--sim-fail-gpu {self.index}@{self.lost_at_s:g})" if self.lost_at_s is not None else ""
            raise GpuFailedError(f"GPU {self.index} ({self.info.uuid}) was lost: simulated failure{when}")

    # --- our context ------------------------------------------------------------------------------
    @property
    def context_open(self) -> bool:
        return bool(self._contexts) and self._contexts[-1][1] == math.inf

    @context_open.setter
    def context_open(self, is_open: bool) -> None:
        now_s = self.clock.now()
        if is_open and not self.context_open:
            self._contexts.append((now_s, math.inf))
        elif not is_open and self.context_open:
            self.energy_j(now_s)  # counted up to here with the context open
            self._contexts[-1] = (self._contexts[-1][0], now_s)
            del self._contexts[:-2]  # the counter is integrated up to now: older spans are never asked again

    # --- our kernels -------------------------------------------------------------------------------
    def kernel_s(self, grid_blocks: int, quanta: int | None = None) -> float:
        """A burn kernel's length (its waves), or with `quanta` a lean kernel's (its sleep), jittered."""
        if quanta is None:
            waves = math.ceil(grid_blocks / (self.config.sms * RESIDENT_BLOCKS_PER_SM))
            length_s = LAUNCH_OVERHEAD_S + WAVE_S * waves
        else:
            length_s = LAUNCH_OVERHEAD_S + quanta * SLEEP_QUANTUM_S * SLEEP_RATIO
        return length_s * (1.0 + self._rng.uniform(-JITTER_RATIO, JITTER_RATIO))

    def kernel_watts(self, grid_blocks: int, quanta: int | None = None) -> float:
        """What one of our kernels draws above the context's idle: a lean one its SMs' light load, a burn one
        arithmetic to the board's limit."""
        if quanta is None:
            return MAX_POWER_W - IDLE_POWER_W
        return LIGHT_SM_W * min(grid_blocks, self.config.sms)

    def run_kernel(self, submit_s: float, grid_blocks: int, quanta: int | None = None) -> tuple[float, float]:
        """Queue one kernel of ours: a burn kernel of `grid_blocks` blocks, or with `quanta` a lean one of
        `grid_blocks` warps that sleep that many quanta."""
        if not self.keep_history and submit_s - self._energy_t_s > self.history_s / 2:
            self.energy_j(submit_s - self.history_s / 2)  # before the kernels it needs are dropped
        start_s = max(submit_s + LAUNCH_LATENCY_S, self._ends[-1] if self._ends else 0.0)
        end_s = start_s + self.kernel_s(grid_blocks, quanta)
        with self._lock:
            self._starts.append(start_s)
            self._ends.append(end_s)
            self._busy_before.append(self._busy_before[-1] + (end_s - start_s))
            self._watts.append(self.kernel_watts(grid_blocks, quanta))
            if not self.keep_history:
                self._forget_before(submit_s - self.history_s)
        return start_s, end_s

    def _forget_before(self, t_s: float) -> None:
        """Drop the kernels that ended before `t_s`, in halves, so the cost per kernel stays constant."""
        cut = bisect_right(self._ends, t_s)
        if cut > len(self._ends) // 2:
            del self._starts[:cut], self._ends[:cut], self._busy_before[:cut], self._watts[:cut]
            self._kept_from_s = t_s

    def own_busy_s(self, a_s: float, b_s: float) -> float:
        """Seconds of [a_s, b_s] during which one of our kernels ran (they never overlap each other)."""
        with self._lock:
            return self._own_busy_s(a_s, b_s)

    def _own_busy_s(self, a_s: float, b_s: float) -> float:
        if a_s < self._kept_from_s:  # a wrong answer would pass silently: refuse it
            raise LookupError(f"kernels before {self._kept_from_s:.3f} s were dropped (history {self.history_s:.1f} "
                              f"s); asked from {a_s:.3f} s: use keep_history to score a run afterwards")
        lo, hi = bisect_right(self._ends, a_s), bisect_left(self._starts, b_s)
        if lo >= hi:
            return 0.0
        total_s = self._busy_before[hi] - self._busy_before[lo]
        return total_s - max(a_s - self._starts[lo], 0.0) - max(self._ends[hi - 1] - b_s, 0.0)

    # --- foreign jobs ------------------------------------------------------------------------------
    def active_jobs(self, t_s: float) -> list[ForeignJob]:
        return [job for job in self.timeline.near(t_s, t_s) if job.start_s <= t_s < job.end_s]

    def foreign_busy_s(self, a_s: float, b_s: float) -> float:
        return self._foreign_busy_s(self.timeline.near(a_s, b_s), a_s, b_s)

    def _foreign_busy_s(self, jobs: list[ForeignJob], a_s: float, b_s: float) -> float:
        total = 0.0
        for job in jobs:
            lo, hi = max(a_s, job.start_s), min(b_s, job.end_s)
            if hi > lo:
                total += _periodic_on_s(hi - job.start_s - job.phase_s, self.config.foreign_load_ratio) \
                    - _periodic_on_s(lo - job.start_s - job.phase_s, self.config.foreign_load_ratio)
        return total

    # --- what NVML would report ------------------------------------------------------------------
    def busy_ratio(self, a_s: float, b_s: float) -> float:
        """Share of [a_s, b_s] during which any kernel ran (the union of ours and foreign)."""
        jobs = self.timeline.near(a_s, b_s)
        with self._lock:
            union_s = self._own_busy_s(a_s, b_s)  # first: it refuses a window older than the history
            if jobs:
                overlap_s = 0.0
                for i in range(bisect_right(self._ends, a_s), bisect_left(self._starts, b_s)):
                    overlap_s += self._foreign_busy_s(jobs, max(self._starts[i], a_s), min(self._ends[i], b_s))
                union_s += self._foreign_busy_s(jobs, a_s, b_s) - overlap_s
        return min(max(union_s / (b_s - a_s), 0.0), 1.0)

    def energy_in_j(self, a_s: float, b_s: float) -> float:
        """The board's energy over [a_s, b_s] by the power model (the module's docstring): bare idle, the context
        while one is open, and the kernel that runs; where a foreign job's kernels overlap ours, theirs."""
        jobs = self.timeline.near(a_s, b_s)
        span_s = b_s - a_s
        with self._lock:
            ours_j = 0.0
            for i in range(bisect_right(self._ends, a_s), bisect_left(self._starts, b_s)):
                lo, hi = max(self._starts[i], a_s), min(self._ends[i], b_s)
                ours_j += self._watts[i] * (hi - lo - (self._foreign_busy_s(jobs, lo, hi) if jobs else 0.0))
        foreign_j = (MAX_POWER_W - IDLE_POWER_W) * self._foreign_busy_s(jobs, a_s, b_s) if jobs else 0.0
        spans = [(max(a, a_s), min(b, b_s)) for a, b in self._contexts if a < b_s and b > a_s]
        spans += [(max(job.start_s, a_s), min(job.end_s, b_s)) for job in jobs if job.start_s < b_s and job.end_s > a_s]
        return BARE_IDLE_POWER_W * span_s + CONTEXT_POWER_W * _union_s(spans) + ours_j + foreign_j

    def energy_j(self, t_s: float) -> float:
        """The energy counter at `t_s` (from 0): the integral of the power model, so its 1-s mean is what power_w
        reports."""
        with self._energy_lock:
            if t_s > self._energy_t_s:
                self._energy_j += self.energy_in_j(self._energy_t_s, t_s)
                self._energy_t_s = t_s
            return self._energy_j

    def samples(self, after_s: float, until_s: float) -> list[UtilSample]:
        w = self.window_s
        k = max(math.floor((after_s - self._sample_phase_s) / w) + 1, 1)
        out = []
        while (t := self._sample_phase_s + k * w) <= until_s:
            if t > after_s:
                out.append(UtilSample(t, round(100 * self.busy_ratio(t - w, t)) / 100))
            k += 1
        return out

    def memory_used_mib(self, t_s: float) -> float:
        own_mib = CONTEXT_MIB if self.context_open else 0.0
        # memory_info v2's `used`, which excludes the driver's reservation: contexts and allocations only
        return own_mib + self.config.foreign_mem_mib * len(self.active_jobs(t_s))


class SimProbe:
    """The Probe protocol on the simulated GPU."""

    sample_clock = "virtual"

    def __init__(self, gpu: SimGpu, own_pid: int | None = None) -> None:
        self.gpu = gpu
        self.info = gpu.info
        self.own_pid = os.getpid() if own_pid is None else own_pid

    def utilization_samples(self, since_s: float) -> list[UtilSample] | None:
        self.gpu.check()
        now_s = self.gpu.clock.now()
        # The driver keeps only a short buffer of samples.
        return self.gpu.samples(max(since_s, now_s - BUFFERED_SAMPLES * self.gpu.window_s), now_s)

    def utilization_ratio(self) -> float | None:
        # As NVML's GetUtilizationRates: the latest window's, which before any window has ended is an idle one.
        now_s = self.gpu.clock.now()
        latest = self.gpu.samples(now_s - self.gpu.window_s, now_s)
        return latest[-1].ratio if latest else 0.0

    def memory_used_mib(self) -> float | None:
        self.gpu.check()
        return self.gpu.memory_used_mib(self.gpu.clock.now())

    def processes(self) -> list[GpuProcess] | None:
        procs = [GpuProcess(self.own_pid, CONTEXT_MIB)] if self.gpu.context_open else []
        if not self.gpu.config.hide_foreign:
            procs += [GpuProcess(job.pid, self.gpu.config.foreign_mem_mib)
                      for job in self.gpu.active_jobs(self.gpu.clock.now()) if not job.hidden]
        return procs

    def power_w(self) -> float | None:
        now_s = self.gpu.clock.now()
        return self.gpu.energy_in_j(now_s - POWER_WINDOW_S, now_s) / POWER_WINDOW_S  # before the start, bare idle

    def energy_j(self) -> float | None:
        self.gpu.check()
        return self.gpu.energy_j(self.gpu.clock.now())

    def power_limit_w(self) -> float | None:
        return MAX_POWER_W

    def temperature_c(self) -> float | None:
        power_w = self.power_w() or IDLE_POWER_W
        return 30.0 + 40.0 * max(power_w - IDLE_POWER_W, 0.0) / (MAX_POWER_W - IDLE_POWER_W)

    def activity(self) -> Activity | None:
        return None  # the simulated GPU has no GPM (info.gpm is False)

    def close(self) -> None:
        pass


class SimLauncher:
    """The Launcher protocol on the simulated GPU: kernels of the shape (control/shape.py) are queued on the GPU's
    timeline."""

    def __init__(self, gpu: SimGpu, shape: str = LEAN, metric: str = "utilization") -> None:
        self.gpu = gpu
        self.sm_count = gpu.config.sms
        self.shape = Shape.for_metric(shape, metric, self.sm_count)
        self._pending: list[tuple[float, float, int, int]] = []
        gpu.context_open = True

    def describe(self) -> dict[str, object]:
        return {}

    def launch(self, multiplier: int, now_s: float, count: int = 1) -> None:
        quanta = multiplier if self.shape.lean else None
        blocks = self.shape.blocks(multiplier)
        start_s, end_s = self.gpu.run_kernel(now_s, blocks, quanta)
        for _ in range(count - 1):  # queued behind the first, so they run back to back
            end_s = self.gpu.run_kernel(now_s, blocks, quanta)[1]
        self._pending.append((start_s, end_s, multiplier, count))

    def poll(self, now_s: float) -> list[Completed]:
        done = [Completed(a, b, m, n, (b - a) / n if n > 1 else None) for a, b, m, n in self._pending if b <= now_s]
        self._pending = self._pending[len(done):]
        return done

    def close(self) -> None:
        self._pending.clear()
        self.gpu.context_open = False


def _union_s(spans: list[tuple[float, float]]) -> float:
    """The length of the union of these intervals."""
    total_s, reach_s = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > reach_s:
            total_s += b - max(a, reach_s)
            reach_s = b
    return total_s


def _periodic_on_s(t_s: float, duty_ratio: float) -> float:
    """Time a square wave (on for the first `duty_ratio` of every period) has been on from 0 to t."""
    periods, rest_s = divmod(t_s, FOREIGN_PERIOD_S)
    return periods * duty_ratio * FOREIGN_PERIOD_S + min(rest_s, duty_ratio * FOREIGN_PERIOD_S)
