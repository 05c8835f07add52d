#!/usr/bin/env python3
"""A soak on the simulated GPU: many virtual hours with job churn and a lost GPU.

    python3 scripts/sim_soak.py [--hours 24] [--out DIR] [--no-tracemalloc] [--help for the rest]

Two simulated GPUs fill from one process (`--gpus all`), flat out in virtual time (`--sim-speed 0`).
Foreign jobs of very different lengths (seconds to half an hour) come and go on both, some of them hidden
from the process list; GPU 1 is lost after ten virtual minutes. The run passes when:

- every job is exactly one yield and one resume on each GPU still running (jobs are separated by more than
  FORGE_RESUME_AFTER), seen at the job's start and resumed FORGE_RESUME_AFTER after its end;
- GPU 1's loss is one `error` line, and the process exits 4 at the end;
- GPU 0 keeps filling between jobs to the end;
- memory is flat: the simulated GPU's kernel lists stay within the history a query can reach, and the
  peaks of the Python heap (tracemalloc) and of the interpreter's allocated blocks in the second half of
  the run are those of the first.

It also times one Monitor poll's worth of simulated NVML queries against simulated GPUs with 10 to 100,000
foreign jobs: a query must look only at the jobs near it (at most 2 here), whatever their number.

It prints its tables and writes results.json and results.md under --out. Every number is of the simulated GPU
in virtual time; wall and CPU seconds are those of this machine running the simulation.
tests/test_sim_soak.py runs a short version of the same scenario.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import random
import sys
import threading
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TextIO, cast

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from forge_load.config.load import load_config  # noqa: E402
from forge_load.config.settings import Config  # noqa: E402
from forge_load.config.sim import SimConfig  # noqa: E402
from forge_load.control.filler import Controls  # noqa: E402
from forge_load.control.status import GpuSlot, GpuSlots  # noqa: E402
from forge_load.gpu.sim import POWER_WINDOW_S, SimGpu, SimProbe, VirtualClock  # noqa: E402
from forge_load.service import gpu_threads, runtime  # noqa: E402

FAIL_GPU = 1
YIELD_WITHIN_S = 0.5  # from a job's start (its context) to our yield line
RESUME_WITHIN_S = 3.0  # beyond FORGE_RESUME_AFTER after a job's end: the last NVML windows must clear first
HEAP_SLACK_MIB = 1.0  # the late peak may exceed the early one by this much (the log records kept here)
BLOCKS_SLACK_RATIO = 0.05


@dataclass(frozen=True)
class Job:
    start_s: float
    end_s: float
    hidden: bool


def schedule(hours: float, resume_after_s: float, seed: int = 1, longest_s: float = 1800.0,
             longest_gap_s: float = 60.0) -> list[Job]:
    """Jobs of 2 s to `longest_s` (short, medium and long ones alike), a third of them hidden, each starting
    5 s to `longest_gap_s` after the previous one's resume."""
    rng = random.Random(seed)
    jobs: list[Job] = []
    t_s = 60.0
    last_end_s = hours * 3600.0 - resume_after_s - RESUME_WITHIN_S - 30.0  # the last resume is seen
    while True:
        length_s = rng.choice((rng.uniform(2.0, 30.0), rng.uniform(30.0, longest_s / 6), rng.uniform(longest_s / 6,
                                                                                                   longest_s)))
        start_s, end_s = round(t_s, 1), round(t_s + length_s, 1)
        if end_s > last_end_s:
            return jobs
        jobs.append(Job(start_s, end_s, hidden=rng.random() < 1 / 3))
        t_s = end_s + resume_after_s + RESUME_WITHIN_S + rng.uniform(5.0, longest_gap_s)


def soak_config(hours: float, jobs: list[Job], fail_at_s: float, target: float, resume_after_s: float) -> Config:
    def spans(hidden: bool) -> str:
        return ",".join(f"{j.start_s:g}-{j.end_s:g}" for j in jobs if j.hidden == hidden) or "none"

    flags = (f"--simulate --sim-speed 0 --log-format json --sim-gpus 2 --gpus all --duration {hours * 3600:g} "
             f"--sim-fail-gpu {FAIL_GPU}@{fail_at_s:g} --target {target:g} --boost-after 0 "
             f"--resume-after {resume_after_s:g} --log-interval 600 "
             f"--sim-foreign {spans(False)} --sim-foreign-hidden {spans(True)}")
    return load_config(flags.split(), env={})


@dataclass
class Period:
    """What one period of GPU 0's virtual time (an hour, unless asked otherwise) cost."""

    index: int
    start_s: float
    kernels_kept_max: list[int] = field(default_factory=lambda: [0, 0])  # per GPU: longest kernel list
    heap_peak_mib: float | None = None  # tracemalloc's peak within the period
    blocks_max: int = 0  # sys.getallocatedblocks(), sampled every virtual minute of GPU 0
    wall_s: float = 0.0
    cpu_s: float = 0.0


class Event(NamedTuple):
    gpu: int
    event: str
    t: float
    signals: str
    reason: str
    yields: int  # on the stop line
    own_busy_s: float  # on the stop line


class Sink:
    """The log stream: keeps each line's few fields the checks need (not the lines, which would grow)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def write(self, text: str) -> int:
        for line in text.splitlines():
            e = json.loads(line)
            self.events.append(Event(-1 if e.get("gpu") is None else int(e["gpu"]), str(e["event"]), float(e["t"]),
                                     str(e.get("signals") or ""), str(e.get("reason") or ""),
                                     int(e.get("yields") or 0), float(e.get("own_busy_s") or 0.0)))
        return len(text)

    def flush(self) -> None:
        pass


class Sampler:
    """The fillers' heartbeat (once per loop second of each GPU): samples memory per period of GPU 0's time."""

    def __init__(self, gpu_slots: GpuSlots, trace: bool, period_s: float) -> None:
        self.fleet = gpu_slots
        self.trace = trace
        self.period_s = period_s
        self.rows: list[Period] = []
        self._last_minute = -1
        self._period_wall_s = time.perf_counter()
        self._period_cpu_s = time.process_time()
        self._lock = threading.Lock()
        self.runtimes: dict[str, runtime.Runtime] = {}

    def started(self, slot: GpuSlot, rt: runtime.Runtime) -> None:
        """run_gpus's on_start: keep each GPU's runtime to look inside."""
        with self._lock:
            self.runtimes[slot.requested] = rt

    def __call__(self) -> None:
        slots = self.fleet.slots
        runtimes = [self.runtimes.get(slot.requested) for slot in slots[:2]]
        if len(slots) < 2 or runtimes[0] is None:
            return
        with self._lock:
            rt = runtimes[0]
            index = int(rt.now() // self.period_s)
            while len(self.rows) <= index:
                self._close_period()
                self.rows.append(Period(len(self.rows), len(self.rows) * self.period_s))
            row = self.rows[index]
            for i, gpu_rt in enumerate(runtimes):
                if gpu_rt is not None:
                    gpu: SimGpu = gpu_rt.probe.gpu  # type: ignore[attr-defined]
                    row.kernels_kept_max[i] = max(row.kernels_kept_max[i], len(gpu._starts), len(gpu._ends))
            minute = int(rt.now() // 60)
            if minute != self._last_minute:
                self._last_minute = minute
                row.blocks_max = max(row.blocks_max, sys.getallocatedblocks())

    def _close_period(self) -> None:
        wall_s, cpu_s = time.perf_counter(), time.process_time()
        if self.rows:
            row = self.rows[-1]
            row.wall_s, row.cpu_s = wall_s - self._period_wall_s, cpu_s - self._period_cpu_s
            if self.trace:
                row.heap_peak_mib = tracemalloc.get_traced_memory()[1] / 2**20
        if self.trace:
            tracemalloc.reset_peak()
        self._period_wall_s, self._period_cpu_s = wall_s, cpu_s

    def finish(self) -> None:
        with self._lock:
            self._close_period()


@dataclass
class Soak:
    hours: float
    target: float
    resume_after_s: float
    fail_at_s: float
    jobs: list[Job]
    exit_code: int
    events: list[Event]
    rows: list[Period]
    history_s: float
    wall_s: float
    cpu_s: float

    def of(self, gpu: int, event: str) -> list[Event]:
        return [e for e in self.events if e.gpu == gpu and e.event == event]

    def filling_s(self) -> float:
        """GPU 0's virtual seconds free of jobs and of the wait after each: the time it should fill."""
        return self.hours * 3600.0 - sum(j.end_s - j.start_s + self.resume_after_s for j in self.jobs)


def run_soak(hours: float = 24.0, target: float = 0.5, resume_after_s: float = 20.0, fail_at_s: float = 600.0,
             trace: bool = True, seed: int = 1, period_s: float = 3600.0, longest_s: float = 1800.0,
             longest_gap_s: float = 60.0) -> Soak:
    jobs = schedule(hours, resume_after_s, seed, longest_s, longest_gap_s)
    config = soak_config(hours, jobs, fail_at_s, target, resume_after_s)
    gpu_slots = GpuSlots(simulated=True)
    sink, sampler = Sink(), Sampler(gpu_slots, trace, period_s)
    if trace:
        tracemalloc.start()
    wall_s, cpu_s = time.perf_counter(), time.process_time()
    try:
        stream = cast(TextIO, sink)  # EventLog needs only write() and flush()
        code = gpu_threads.run_gpus(config, stream, threading.Event(), threading.Event(), gpu_slots,
                                    Controls(heartbeat=sampler), on_start=sampler.started)
        sampler.finish()
    finally:
        if trace:
            tracemalloc.stop()
    history_s = SimGpu(config.sim, VirtualClock()).history_s
    return Soak(hours, target, resume_after_s, fail_at_s, jobs, code, sink.events, sampler.rows, history_s,
                time.perf_counter() - wall_s, time.process_time() - cpu_s)


def kernel_bound(history_s: float) -> int:
    """The longest kernel list the history allows: the lists are cut in halves, so up to twice the history,
    of kernels at least 1 ms long (the controller keeps ours near 2 ms)."""
    return int(2 * history_s / 0.001)


def verify(soak: Soak) -> list[str]:
    """Every way the soak can fail, one line each; empty when it passed."""
    problems: list[str] = []
    if soak.exit_code != 4:
        problems.append(f"exit code {soak.exit_code}, expected 4 (GPU {FAIL_GPU} was lost)")
    errors = soak.of(FAIL_GPU, "error")
    if len(errors) != 1 or "was lost" not in errors[0].reason or abs(errors[0].t - soak.fail_at_s) > 0.5:
        problems.append(f"GPU {FAIL_GPU}: expected one error line at {soak.fail_at_s:g} s, got {errors}")
    late = [e for e in soak.events if e.gpu == FAIL_GPU and e.t > soak.fail_at_s + 0.5]
    if late:
        problems.append(f"GPU {FAIL_GPU} logged after it was lost: {late[:3]}")
    stops = soak.of(0, "stop")
    if soak.of(0, "error") or len(stops) != 1 or stops[0].reason != "duration reached":
        problems.append(f"GPU 0 did not run to the end: {soak.of(0, 'error') or stops}")
    elif stops[0].yields != len(soak.jobs):
        problems.append(f"GPU 0's stop line counts {stops[0].yields} yields for {len(soak.jobs)} jobs")
    elif abs(stops[0].own_busy_s - soak.target * soak.filling_s()) > 0.1 * soak.target * soak.filling_s():
        problems.append(f"GPU 0 was busy {stops[0].own_busy_s:.0f} s of its own, expected {soak.target:g} of the "
                        f"{soak.filling_s():.0f} s free of jobs, within 10 %")

    for gpu, until_s in ((0, soak.hours * 3600.0), (FAIL_GPU, soak.fail_at_s)):
        yields, resumes = soak.of(gpu, "yield"), soak.of(gpu, "resume")
        started = [j for j in soak.jobs if j.start_s < until_s]
        resumed = [j for j in soak.jobs if j.end_s + soak.resume_after_s + RESUME_WITHIN_S < until_s]
        if len(yields) != len(started) or len(resumes) != len(resumed):
            problems.append(f"GPU {gpu}: {len(yields)} yields and {len(resumes)} resumes for {len(started)} jobs "
                            f"started and {len(resumed)} ended before {until_s:g} s")
            continue
        for job, y in zip(started, yields):
            signals = "memory" if job.hidden else "process,memory"
            if not job.start_s <= y.t <= job.start_s + YIELD_WITHIN_S or y.signals != signals:
                problems.append(f"GPU {gpu}: job {job} yielded at {y.t:g} s on {y.signals!r}, expected within "
                                f"{YIELD_WITHIN_S:g} s on {signals!r}")
        for job, r in zip(resumed, resumes):
            due_s = job.end_s + soak.resume_after_s
            if not due_s <= r.t <= due_s + RESUME_WITHIN_S:
                problems.append(f"GPU {gpu}: job {job} resumed at {r.t:g} s, expected {due_s:g} to "
                                f"{due_s + RESUME_WITHIN_S:g} s")

    bound = kernel_bound(soak.history_s)
    longest = max((max(row.kernels_kept_max) for row in soak.rows), default=0)
    if longest > bound:
        problems.append(f"kernel lists grew to {longest}, over {bound} ({soak.history_s:.1f} s of history)")
    # Flat: the second half's peaks are those of the first. Period 0 is left out: it holds the start and
    # GPU 1's life. Peaks, not means, since a period spent yielding holds fewer kernels than one filling.
    periods = [row for row in soak.rows if row.start_s >= soak.fail_at_s]
    first_half, second_half = periods[:len(periods) // 2], periods[len(periods) // 2:]
    if not first_half or not second_half:
        problems.append(f"too short to judge memory: {len(periods)} periods after GPU {FAIL_GPU} was lost")
        return problems
    blocks_early = max(p.blocks_max for p in first_half)
    blocks_late = max(p.blocks_max for p in second_half)
    if blocks_late > blocks_early * (1 + BLOCKS_SLACK_RATIO):
        problems.append(f"allocated blocks grew from {blocks_early} (periods {first_half[0].index}-"
                        f"{first_half[-1].index}) to {blocks_late} (periods {second_half[0].index}-"
                        f"{second_half[-1].index})")
    heaps_early = [p.heap_peak_mib for p in first_half if p.heap_peak_mib is not None]
    heaps_late = [p.heap_peak_mib for p in second_half if p.heap_peak_mib is not None]
    if heaps_early and heaps_late and max(heaps_late) > max(heaps_early) + HEAP_SLACK_MIB:
        problems.append(f"heap peak grew from {max(heaps_early):.2f} MiB to {max(heaps_late):.2f} MiB")
    return problems


@dataclass
class QueryCost:
    jobs: int
    looked_at_max: int  # jobs a query looked at (JobTimeline.near), at most
    poll_us: float  # wall microseconds for one poll's queries, mean


def query_cost(job_counts: tuple[int, ...] = (10, 1_000, 100_000), polls: int = 3000) -> list[QueryCost]:
    """One Monitor poll's queries (samples, processes, memory, power) at random times, per number of jobs.

    The jobs are 1 to 7 s long, 10 s apart; 1/6-s windows; no kernels of ours (their cost is the history's).
    """
    rows = []
    for count in job_counts:
        spans = tuple((10.0 * i, 10.0 * i + 1.0 + i % 7) for i in range(count))
        clock = VirtualClock()
        gpu = SimGpu(SimConfig(foreign_s=spans), clock)
        probe = SimProbe(gpu, own_pid=1)
        rng = random.Random(count)
        times = sorted(rng.uniform(1.0, 10.0 * count) for _ in range(polls))
        looked_at = 0
        started_s = time.perf_counter()
        for t_s in times:
            clock.advance_to(t_s)
            probe.utilization_samples(t_s - 0.1)
            probe.processes()
            probe.memory_used_mib()
            probe.power_w()
        elapsed_s = time.perf_counter() - started_s
        for t_s in times:
            looked_at = max(looked_at, len(gpu.timeline.near(t_s - POWER_WINDOW_S, t_s)))
        rows.append(QueryCost(count, looked_at, elapsed_s / polls * 1e6))
    return rows


def cost_table(rows: list[QueryCost]) -> str:
    lines = ["| foreign jobs | jobs a query looks at (max) | one poll's queries (µs, mean) |", "|---|---|---|"]
    lines += [f"| {r.jobs} | {r.looked_at_max} | {r.poll_us:.1f} |" for r in rows]
    return "\n".join(lines)


def table(soak: Soak) -> str:
    lines = ["| virtual time (s) | kernels kept, GPU 0 / GPU 1 (max) | heap peak (MiB, tracemalloc) | "
             "allocated blocks (max) | wall s | CPU s |", "|---|---|---|---|---|---|"]
    for row in soak.rows:
        heap = "n/a" if row.heap_peak_mib is None else f"{row.heap_peak_mib:.2f}"
        lines.append(f"| {row.start_s:g} | {row.kernels_kept_max[0]} / {row.kernels_kept_max[1]} | {heap} | "
                     f"{row.blocks_max} | {row.wall_s:.1f} | {row.cpu_s:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=24.0, help="virtual hours (default 24)")
    parser.add_argument("--target", type=float, default=0.5, help="FORGE_TARGET (default 0.5)")
    parser.add_argument("--resume-after", type=float, default=20.0, help="FORGE_RESUME_AFTER (default 20)")
    parser.add_argument("--fail-at", type=float, default=600.0, help="virtual second GPU 1 is lost (default 600)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the job schedule (default 1)")
    parser.add_argument("--period", type=float, default=3600.0, help="virtual seconds per table row (default 3600)")
    parser.add_argument("--no-tracemalloc", action="store_true", help="skip the heap measure (runs faster)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where results go (default docs/benchmarks/sim_soak_<date>/)")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = REPO / "docs" / "benchmarks" / f"sim_soak_{datetime.date.today().isoformat()}"
    soak = run_soak(args.hours, args.target, args.resume_after, args.fail_at, not args.no_tracemalloc, args.seed,
                    args.period)
    costs = query_cost()
    problems = verify(soak)
    for cost in costs:  # judged by what a query looks at; the times are for reading, not judging
        if cost.looked_at_max > 2:
            problems.append(f"with {cost.jobs} jobs, a query looked at {cost.looked_at_max} of them")
    hidden = sum(j.hidden for j in soak.jobs)
    summary = (f"Simulated GPUs (virtual time), {soak.hours:g} virtual hours, target {soak.target:g}, "
               f"{len(soak.jobs)} foreign jobs ({hidden} hidden from the process list), GPU {FAIL_GPU} lost at "
               f"{soak.fail_at_s:g} s; exit code {soak.exit_code}; {soak.wall_s:.0f} s wall, {soak.cpu_s:.0f} s CPU "
               f"on {platform.machine()} Python {platform.python_version()}. Kernel history: "
               f"{soak.history_s:.1f} s, bound {kernel_bound(soak.history_s)} kernels.")
    verdict = "PASS" if not problems else "FAIL:\n" + "\n".join(f"- {p}" for p in problems)
    text = (f"{summary}\n\n{table(soak)}\n\nSimulated NVML queries against the number of foreign jobs:\n\n"
            f"{cost_table(costs)}\n\n{verdict}\n")
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(f"# Soak on the simulated GPU\n\n`python3 scripts/sim_soak.py "
                                         f"{' '.join(argv if argv is not None else sys.argv[1:])}`\n\n{text}")
    results: dict[str, Any] = {
        "simulated": True, "hours": soak.hours, "target": soak.target, "resume_after_s": soak.resume_after_s,
        "fail_gpu": FAIL_GPU, "fail_at_s": soak.fail_at_s, "seed": args.seed, "exit_code": soak.exit_code,
        "jobs": [dataclasses.asdict(j) for j in soak.jobs], "history_s": soak.history_s,
        "kernel_bound": kernel_bound(soak.history_s), "rows": [dataclasses.asdict(r) for r in soak.rows],
        "query_cost": [dataclasses.asdict(c) for c in costs], "period_s": args.period, "wall_s": soak.wall_s,
        "cpu_s": soak.cpu_s, "problems": problems,
        "python": platform.python_version(), "machine": platform.machine(),
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
