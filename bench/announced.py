"""The announced scenario: foreign jobs announced before they start (a hold by the Slurm prolog's command, the
kubelet's assignment, a DRA claim the kubelet lists, the Docker watch's hold from a container's create event) or
not at all (nvml, for comparison); how long before its context each announcement came, and whether a kernel of ours
ran beside the job. Real mode only: holds are files, and the announcements come in real time."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, Any

from bench import REPO, BenchError
from bench.analysis import announced_job, first, parse_events
from bench.real import RealBench
from bench.results import ANNOUNCED_LABELS, YIELD_TARGET, AnnouncedJob, AnnouncedMetrics, Quantity, Scenario, mean
from bench.runner import Child

if TYPE_CHECKING:
    from bench.kubelet import TestKubelet

BENCH_NAMESPACE = "bench"  # the test kubelet's namespace of the foreign jobs' pods
DRA_DRIVER, DRA_POOL = "gpu.nvidia.com", "bench-node"  # NVIDIA's DRA driver; its pool is the node's name
DRIVER_DIR = "/usr/lib/x86_64-linux-gnu"  # where the NVIDIA toolkit mounts the driver's libraries
DOCKER_CONTEXT_AFTER_S = 0.5  # a harsh case: the container's job opens its context 0.5 s in


def real_announced(bench: RealBench, path: str, controller: str) -> Scenario:
    """Foreign jobs on one path (ANNOUNCED_PATHS): the filler fills; the job is announced (or not, nvml); it
    creates its context and trains; the announcement ends; the filler resumes; again.

    hold: `forge-load hold --wait 2` (the Slurm prolog), then the waiting job's "go", then `forge-load
    release` (the epilog). kubelet: the test kubelet assigns the GPU's UUID to a pod, then the job's process
    starts; freed once it exits. dra: the same with a claim of NVIDIA's DRA driver naming the GPU as that driver
    does (`gpu-<minor>`, or its MIG name), which the filler resolves through NVML. docker: `docker run --gpus
    device=N` of a driver-API job that opens its context 0.5 s after the container's first instruction,
    `forge-load fleet watch` placing the hold from the create event and releasing it when the container dies.
    nvml: the waiting job's "go", nothing else."""
    args = bench.args
    bench.wait_idle()
    hold_dir = bench.tmp / f"holds_{path}"
    hold_dir.mkdir(mode=0o755, exist_ok=True)  # before the filler: it acknowledges only into a directory
    env_extra = {"FORGE_HOLD_DIR": str(hold_dir)}
    per_job = args.foreign_s + args.resume_after + args.start_timeout + 60.0
    kubelet: TestKubelet | None = None
    watcher: Child | None = None
    filler: Child | None = None
    jobs: list[tuple[float, float | None, int | None, float, float, float, int | None, int | None]] = []
    try:
        if path in ("kubelet", "dra"):
            from bench.kubelet import TestKubelet

            kubelet = TestKubelet(bench.tmp / "kubelet.sock").start()
            env_extra.update(FORGE_KUBELET_SOCKET=str(bench.tmp / "kubelet.sock"), POD_NAMESPACE=BENCH_NAMESPACE,
                             POD_NAME="forge-load-bench")
        if path == "docker":
            watcher = Child("docker watcher", [sys.executable, "-m", "forge_load", "fleet", "watch",
                                               "--hold-dir", str(hold_dir)], bench.env())
            watch_line(watcher, lambda line: "event=engine state=connected" in line, 60.0, "its connected line")
        dra_name = dra_device_name(bench.probe.info.uuid) if path == "dra" else ""
        filler = bench.start_filler(YIELD_TARGET, controller, args.warmup_s + args.announced_jobs * per_job,
                                   env_extra)
        start_wall = float((first(filler.events, "start") or {})["wall_time"])
        time.sleep(args.warmup_s)
        for i in range(args.announced_jobs):
            name = f"foreign job ({path}, {i + 1} of {args.announced_jobs})"
            answered: float | None = None
            code: int | None = None
            if path == "docker":
                assert watcher is not None
                began, context, end_wall, release_wall = docker_job(bench, watcher, i)
            else:
                listed = path in ("kubelet", "dra")  # the kubelet lists the job's GPU, then its process starts
                if path == "kubelet":
                    assert kubelet is not None
                    kubelet.assign(BENCH_NAMESPACE, f"job-{i + 1}", "main", "nvidia.com/gpu",
                                   [bench.probe.info.uuid])
                    began = time.time()
                elif path == "dra":
                    assert kubelet is not None
                    kubelet.claim(BENCH_NAMESPACE, f"job-{i + 1}", "main", f"job-{i + 1}-gpu",
                                  [(DRA_DRIVER, DRA_POOL, dra_name)])
                    began = time.time()
                job = bench.foreign(name, wait=not listed)
                try:
                    if not listed:
                        job.wait_for(lambda e: e.get("event") == "ready", args.start_timeout, "its ready line")
                        began = time.time()
                        if path == "hold":
                            code, began, answered = hold_command(
                                bench, "hold", hold_dir, "--gpu", bench.gpu, "--reason",
                                f"benchmark: announced job {i + 1}", "--wait", "2")
                        job.send("go")
                    context = job.wait_for(lambda e: e.get("event") == "context", args.start_timeout + 60.0,
                                           "its context line")
                    job.wait_exit(args.foreign_s + 120.0)
                    if job.proc.returncode != 0 or first(job.events, "done") is None:
                        raise BenchError(f"foreign_job.py exited with code {job.proc.returncode}{job.tail()}")
                    end_wall = job.exit_wall or time.time()
                finally:
                    job.stop(grace_s=5.0)
                if path == "hold":
                    _, release_wall, _ = hold_command(bench, "release", hold_dir, "--gpu", bench.gpu)
                elif path in ("kubelet", "dra"):
                    assert kubelet is not None
                    release_wall = time.time()
                    kubelet.free(BENCH_NAMESPACE, f"job-{i + 1}")
                else:
                    release_wall = end_wall
            if path == "nvml":
                began = float(context["wall_time_begin"])  # nobody announced it: its context is the first sign
            filler.wait_for(resumed_after(start_wall, release_wall), args.resume_after + 30.0,
                            "resume line after the release")
            begin_wall = float(context["wall_time_begin"])
            jobs.append((began, answered, code, begin_wall, release_wall, end_wall,
                         own_kernels(bench, filler.pid, answered, release_wall) if answered is not None else None,
                         own_kernels(bench, filler.pid, begin_wall, end_wall)))
    finally:
        if filler is not None:
            filler.stop()
        if watcher is not None:
            watcher.stop(grace_s=5.0)
        if kubelet is not None:
            kubelet.stop()
    assert filler is not None
    run = bench.finish(filler, 30.0)
    done = [announced_job(run.events, run.t(b), run.t(a) if a is not None else None, code, run.t(ctx),
                          run.t(rel), held, path=path, own_kernels_while_ran=ran)
            for b, a, code, ctx, rel, _, held, ran in jobs]
    metrics = announced_metrics(done, path, controller)
    end_t = max(e.get("t") or 0.0 for e in run.events)
    return Scenario(f"announced_{path}", metrics, bench.series(run, end_t, YIELD_TARGET))


def docker_job(bench: RealBench, watcher: Child, i: int) -> tuple[float, dict[str, Any], float, float]:
    """One `docker run --gpus device=N` of scripts/driver_job.py on the virtual GPU (its libraries and state
    mounted as the NVIDIA toolkit mounts the driver's): (run began, its context line, its exit, the watcher's
    release), in wall time."""
    state = os.environ.get("VGPU_STATE")
    lib = next((d for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)
                if d and (Path(d) / "libcuda.so.1").exists()), None)
    if not state or lib is None:
        raise BenchError("the docker path runs on the virtual GPU only (its libraries are mounted into the "
                         "container); on a real GPU the NVIDIA container toolkit would mount the driver's")
    name = f"forge_bench_{os.getpid()}_{i + 1}"
    t0 = 'export JOB_T0=$(date +%s.%N); '
    argv = ["docker", "run", "--rm", "--name", name, "--gpus", f"device={bench.probe.info.index}",
            "-v", f"{lib}/libcuda.so.1:{DRIVER_DIR}/libcuda.so.1:ro",
            "-v", f"{lib}/libnvidia-ml.so.1:{DRIVER_DIR}/libnvidia-ml.so.1:ro",
            "-v", f"{state}:{state}", "-e", f"VGPU_STATE={state}",
            "-v", f"{REPO / 'scripts' / 'driver_job.py'}:/opt/driver_job.py:ro", docker_base_image(), "sh", "-c",
            t0 + f"exec python3 /opt/driver_job.py run {bench.probe.info.uuid} --after {DOCKER_CONTEXT_AFTER_S:g} "
            f"--seconds {bench.args.foreign_s:g}"]
    began = time.time()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=bench.args.foreign_s + 120, check=False)
    except subprocess.TimeoutExpired as error:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60, check=False)
        raise BenchError(f"docker run {name} did not end in {bench.args.foreign_s + 120:g} s") from error
    end_wall = time.time()
    if proc.returncode != 0:
        raise BenchError(f"docker run {name} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    context = next((e for e in parse_events(proc.stdout.splitlines()) if e.get("event") == "context"), None)
    if context is None:
        raise BenchError(f"docker run {name}: no context line in its output: {proc.stdout.strip()[-300:]}")
    release = watch_line(watcher, lambda line: f"container={name} " in line and "event=release" in line,
                         30.0, f"release line for container {name}")
    return began, context, end_wall, float(release.split()[0].removeprefix("t="))


def dra_device_name(uuid: str) -> str:
    """The name NVIDIA's DRA driver gives the GPU (or MIG device) of this UUID (docs/design.md §13): `gpu-<minor>`,
    or `gpu-<parent minor>-mig-<profile ID>-<start>-<size>`, from NVML."""
    from forge_load.gpu.nvml_mig import gpus_by_minor

    for gpu in gpus_by_minor():
        if gpu.uuid == uuid:
            return f"gpu-{gpu.minor}"
        for mig in gpu.migs:
            if mig.uuid == uuid:
                return f"gpu-{gpu.minor}-mig-{mig.profile_id}-{mig.start}-{mig.size}"
    raise BenchError(f"NVML gives no minor number for {uuid}: the dra path cannot name it")


def hold_command(bench: RealBench, action: str, hold_dir: Path, *extra: str) -> tuple[int, float, float]:
    """`forge-load hold|release` as a Slurm prolog or epilog runs it: (exit code, began, answered) in wall time."""
    argv = [sys.executable, "-m", "forge_load", action, "--holder", "bench", "--hold-dir", str(hold_dir), *extra]
    began = time.time()
    try:
        proc = subprocess.run(argv, env=bench.env(), capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired as error:
        raise BenchError(f"forge-load {action} did not answer in 60 s") from error
    answered = time.time()
    if proc.returncode not in (0, 1):
        raise BenchError(f"forge-load {action} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return proc.returncode, began, answered


def own_kernels(bench: RealBench, pid: int, a_wall: float, b_wall: float) -> int | None:
    """Our kernels on the GPU in [a, b] by the virtual GPU's record; None on a real GPU (no such record)."""
    state = os.environ.get("VGPU_STATE")
    if not state:
        return None
    pidns = os.stat("/proc/self/ns/pid").st_ino  # the filler's; a container's process can have its PID
    index = str(bench.probe.info.index)
    n = 0
    for line in (Path(state) / "kernels.jsonl").read_text().splitlines():
        if line.strip():
            k = json.loads(line)
            if (k["pid"] == pid and k.get("pidns", pidns) == pidns and str(k["device"]) in (bench.gpu, index)
                    and k["end"] > a_wall and k["start"] < b_wall):
                n += 1
    return n


def docker_base_image() -> str:
    """The image the docker path runs its job in: python3 and nothing else (scripts/docker_engine.sh builds it)."""
    return os.environ.get("FORGE_BASE_IMAGE", "forge-base:bookworm")


def docker_unavailable() -> str | None:
    """Why the docker path cannot run here (None: it can): an engine that answers, with the `nvidia` driver
    registered, the base image, and the virtual GPU (whose libraries the container is given)."""
    if not os.environ.get("VGPU_STATE"):
        return "runs on the virtual GPU only (the container is given its libraries)"
    if shutil.which("docker") is None:
        return "no docker command-line client here"
    try:
        proc = subprocess.run(["docker", "run", "--rm", "--gpus", "device=0", docker_base_image(), "true"],
                              capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        return "the Docker engine did not answer `docker run --gpus device=0` in 60 s"
    if proc.returncode != 0:
        where = os.environ.get("DOCKER_HOST") or "the default socket"
        return (f"`docker run --gpus device=0 {docker_base_image()} true` fails at {where} "
                f"({(proc.stderr.strip().splitlines() or ['exit ' + str(proc.returncode)])[-1][:160]}); "
                "start an engine with: out=$(scripts/docker_engine.sh start) && eval \"$out\"")
    return None


def kubelet_unavailable() -> str | None:
    """Why the kubelet and dra paths cannot run here (None: they can): grpcio, which the test kubelet is served by."""
    try:
        import grpc  # noqa: F401
    except ImportError:
        return "grpcio is not installed (pip install grpcio)"
    return None


def announced_metrics(done: list[AnnouncedJob], path: str, controller: str) -> AnnouncedMetrics:
    leads = [j.lead_s.value for j in done]
    holds = [float(j.hold_s.value) for j in done if j.hold_s.value is not None]
    present = sorted(float(v) for v in leads if v is not None)
    complete = bool(present) and len(present) == len(leads)
    missing = None if complete else "a job without a lead time"
    ran = [j.own_kernels_while_ran.value for j in done]
    return AnnouncedMetrics(
        jobs=done,
        min_lead_s=Quantity.of(present[0] if complete else None, "s", missing),
        median_lead_s=Quantity.of(median(present) if complete else None, "s", missing),
        max_lead_s=Quantity.of(present[-1] if complete else None, "s", missing),
        every_lead_positive=bool(done) and all(v is not None and v > 0 for v in leads),
        own_kernels_while_ran=Quantity.of(sum(int(v) for v in ran if v is not None) if ran and None not in ran
                                          else None, "count",
                                          None if ran and None not in ran else "n/a: only the virtual GPU records "
                                          "every kernel"),
        mean_hold_s=Quantity.of(mean(holds), "s", None if holds else "n/a: no hold command on this path"),
        path=path, label=ANNOUNCED_LABELS[path], announced=path != "nvml",
        controller=controller, target=Quantity.of(YIELD_TARGET, "ratio"))


def watch_line(child: Child, predicate: Callable[[str], bool], timeout_s: float, what: str) -> str:
    """The first stdout line of `child` (a text log, as the Docker watcher's) matching `predicate`."""
    deadline = time.monotonic() + timeout_s
    with child.cond:
        while True:
            hit = next((line for line in child.text if predicate(line)), None)
            if hit is not None:
                return hit
            if child.exit_wall is not None:
                raise BenchError(f"{child.name} exited with code {child.proc.returncode} before {what}{child.tail()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"{child.name}: no {what} within {timeout_s:g} s{child.tail()}")
            child.cond.wait(min(left, 0.5))


def resumed_after(start_wall: float, after_wall: float) -> Callable[[dict[str, Any]], bool]:
    """A filler's `resume` line at or after a wall time (its `t` counts from its start)."""
    return lambda e: e.get("event") == "resume" and start_wall + e["t"] >= after_wall

