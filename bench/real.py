"""A benchmark run on a real GPU (or the virtual one): what its scenarios share, and the processes they start. The
filler is `python -m forge_load` as users run it, in a child process; NVML is read here by the Sampler, in the
bench process, which opens no CUDA context of its own; the foreign job is scripts/foreign_job.py."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import REPO, BenchError
from bench.analysis import first, status_series
from bench.runner import Child
from bench.sampler import Sampler


@dataclass
class RealRun:
    """A finished filler process: its log, and its clock (t = seconds since its start) against wall time."""

    events: list[dict[str, Any]]
    start_wall: float
    pid: int

    def wall(self, t: float) -> float:
        return self.start_wall + t

    def t(self, wall: float) -> float:
        return wall - self.start_wall


class RealBench:
    """What the scenarios of one real run share: the settings, NVML (`probe`, read by `sampler`), a scratch folder,
    and what earlier scenarios measured that later ones use (the foreign job's solo runs, the start line, how long
    a filler takes beyond its duration); and the processes they start, each with the same environment."""

    def __init__(self, args: argparse.Namespace, probe: Any, sampler: Sampler) -> None:
        self.args = args
        self.probe = probe
        self.sampler = sampler
        self.gpu = str(args.gpu)
        self.tmp = Path(tempfile.mkdtemp(prefix="forge_bench_"))
        self.solo: list[dict[str, Any]] = []
        self.start_event: dict[str, Any] = {}
        self.overhead_s = 8.0  # seconds a filler run takes beyond its duration (imports, CUDA, compiling)
        self.closers: list[Callable[[], None]] = []  # what a scenario opened for the run's length (power's reader)

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_") and k != "TARGET"}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        env.update(FORGE_GPU=self.gpu, FORGE_LOG_FORMAT="json", CUDA_DEVICE_ORDER="PCI_BUS_ID",
                   FORGE_HEARTBEAT_FILE=str(self.tmp / "heartbeat"), PYTHONUNBUFFERED="1")
        env.setdefault("CUDA_MODULE_LOADING", "LAZY")
        env.update(extra or {})
        return env

    def start_filler(self, target: float, controller: str, duration_s: float,
                     env_extra: dict[str, str] | None = None) -> Child:
        argv = [sys.executable, "-m", "forge_load", "--target", f"{target:g}", "--controller", controller,
                "--duration", f"{duration_s:g}", "--log-format", "json", "--log-interval", "1",
                "--boost-after", "0", "--resume-after", f"{self.args.resume_after:g}", *self.args.filler_args]
        child = Child(f"filler ({controller} at {target:g})", argv, self.env(env_extra))
        try:
            child.wait_for(lambda e: e.get("event") == "start", self.args.start_timeout, "its start line")
        except BaseException:
            child.stop(grace_s=5.0)
            raise
        self.sampler.watch.add(child.pid)
        return child

    def foreign(self, name: str, wait: bool) -> Child:
        argv = [sys.executable, str(REPO / "scripts" / "foreign_job.py"), "--gpu", self.gpu,
                "--seconds", f"{self.args.foreign_s:g}", *self.args.foreign_args] + (["--wait"] if wait else [])
        return Child(name, argv, self.env(), stdin=wait)

    def wait_idle(self, timeout_s: float = 20.0) -> None:
        """Wait until no process is on the GPU (the previous scenario's have exited)."""
        deadline = time.monotonic() + timeout_s
        while True:
            procs = self.probe.processes()
            if not procs:
                return
            if time.monotonic() > deadline:
                pids = ", ".join(str(p.pid) for p in procs)
                raise BenchError(f"the GPU is not idle: process(es) {pids} on it; the benchmark needs the "
                                 "GPU to itself")
            time.sleep(0.25)

    def finish(self, child: Child, timeout_s: float) -> RealRun:
        code = child.wait_exit(timeout_s)
        time.sleep(3 * self.sampler.interval_s)  # let the sampler read NVML's last samples of the run
        start = first(child.events, "start")
        assert start is not None
        error = first(child.events, "error")
        if code != 0 or error:
            raise BenchError(f"{child.name} exited with code {code}"
                             f"{': ' + str(error.get('reason')) if error else child.tail()}")
        return RealRun(child.events, float(start["wall_time"]), child.pid)

    def series(self, run: RealRun, end_t: float, target: float) -> dict[str, Any]:
        a, b = run.wall(0.0), run.wall(end_t)
        return {
            "target": target,
            "util": [[round(run.t(s.t_s), 4), s.ratio] for s in self.sampler.between("util", a, b)],
            "own": status_series(run.events, "own"),
            "foreign": status_series(run.events, "foreign"),
            "multiplier": status_series(run.events, "multiplier"),
            "power_w": [[round(run.t(t), 3), p] for t, p in self.sampler.between("power", a, b)],
        }
