"""`forge-load fleet watch` with the real engine of tests/docker_support.py (tests marked `docker`; the logic against
fake events and a fake engine is tests/test_docker_watch.py): the watcher as a process, in its own container, and a
2-GPU virtual GPU where a container running a CUDA job on GPU 1 finds GPU 1's filler drained before its context
exists while GPU 0 keeps filling.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from docker_support import (
    IMAGE,
    ROOT,
    _unavailable,
    docker_cli,
    docker_client,
    forge_image,
    image,
    remove_containers,
    unique_name,
)

from forge_load.steering import holds
from tests.host_paths import settings_free
from vgpu import Kernel, VirtualGpu
from vgpu.pytest_plugin import VgpuFactory

__all__ = ["docker_client", "forge_image"]  # fixtures, imported for pytest

BASE_IMAGE = os.environ.get("FORGE_BASE_IMAGE", "forge-base:bookworm")  # python3, nothing else (docker_engine.sh)
DRIVER_DIR = "/usr/lib/x86_64-linux-gnu"  # where the NVIDIA toolkit mounts the driver's libraries
DRIVER_JOB = ROOT / "scripts" / "driver_job.py"
FOREIGN_JOB = ROOT / "scripts" / "foreign_job.py"


class WatchProcess:
    """`forge-load fleet watch` as a process on this host (its NVML: the virtual GPU's), its lines as they come."""

    def __init__(self, env: dict[str, str], hold_dir: Path, created_hold_s: float = 60.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "forge_load", "fleet", "watch", "--hold-dir", str(hold_dir), "--created-hold",
             str(created_hold_s)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait(self, *parts: str, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if all(part in line for part in parts):
                    return line
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no line with {parts} within {timeout_s} s:\n" + "\n".join(self.lines[-30:]))

    def with_(self, *parts: str) -> list[str]:
        return [line for line in self.lines if all(part in line for part in parts)]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self.reader.join(10)


def line_time(line: str) -> float:
    return float(line.split()[0].removeprefix("t="))


def container_id(name: str) -> str:
    proc = docker_cli("inspect", "--format", "{{.Id}}", name)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.fixture
def names(docker_client: Any) -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    remove_containers(docker_client, names=made)


@pytest.fixture(scope="session")
def base_image(docker_client: Any) -> str:
    """The base image, on an engine where `docker run --gpus` runs (its `nvidia` driver registered)."""
    image(docker_client, BASE_IMAGE)
    proc = docker_cli("run", "--rm", "--gpus", "device=0", BASE_IMAGE, "true")
    if proc.returncode != 0:
        _unavailable(f"`docker run --gpus device=0` fails on this engine ({proc.stderr.strip()[-200:]}): an engine "
                     "started before scripts/docker_engine.sh put its stand-in nvidia-container-runtime-hook on "
                     "dockerd's PATH? Restart it: scripts/docker_engine.sh stop, then start")
    return BASE_IMAGE


@pytest.mark.docker
def test_watch_on_the_engine(docker_client: Any, base_image: str, vgpu: VgpuFactory, tmp_path: Path,
                             names: list[str]) -> None:
    uuids = vgpu(gpus=2).uuids()
    env = vgpu.made[0].env()
    hold_dir = tmp_path / "holds"
    watcher = WatchProcess(env, hold_dir, created_hold_s=3.0)
    try:
        watcher.wait("event=engine state=connected")
        # A container asking for GPU 1 finds its hold there 0.5 s after its first instruction (the goal
        # for a job's context; the lead test prints how early it really is); released when it dies.
        job = unique_name("job")
        names.append(job)
        proc = docker_cli("run", "--name", job, "--gpus", "device=1", "-v", f"{hold_dir}:/holds:ro", base_image,
                          "sh", "-c", "sleep 0.5; ls /holds")
        assert proc.returncode == 0, proc.stderr
        holder = "docker-" + container_id(job)[:12]
        assert proc.stdout.split() == [f"hold.{uuids[1]}.{holder}.json"], proc.stdout
        watcher.wait(f"holder={holder}", "event=release", "why=died")
        assert watcher.with_(f"container={job}") == watcher.with_(f"holder={holder}")
        assert len(watcher.with_(f"holder={holder}")) == 2  # one line for the hold, one for the release
        assert list(hold_dir.iterdir()) == []

        # Ours and GPU monitors: never held for, whatever they ask.
        for role in ("gpu-filler", "gpu-monitor"):
            name = unique_name(role.replace("-", "_"))
            names.append(name)
            proc = docker_cli("run", "--name", name, "--gpus", "all", "--label", f"io.forge_load.role={role}",
                              base_image, "true")
            assert proc.returncode == 0, proc.stderr
        # Created and never started: held for --created-hold, then released; started later: held again.
        waiting = unique_name("created")
        names.append(waiting)
        assert docker_cli("create", "--name", waiting, "--gpus", "all", base_image, "sleep", "1").returncode == 0
        holder = "docker-" + container_id(waiting)[:12]
        hold = watcher.wait(f"holder={holder}", "event=hold", "why=create")
        assert f"gpus={uuids[0]},{uuids[1]}" in hold
        release = watcher.wait(f"holder={holder}", "event=release", "why=never started", timeout_s=15)
        assert 2.5 < line_time(release) - line_time(hold) < 8.0  # 3 s, then the next second's check
        assert docker_cli("start", waiting).returncode == 0
        watcher.wait(f"holder={holder}", "event=hold", "why=start")
        watcher.wait(f"holder={holder}", "event=release", "why=died")
        assert not [line for line in watcher.lines if "gpu_filler" in line or "gpu_monitor" in line]

        # Reconciliation: the watcher killed; meanwhile one container goes, another comes.
        gone, came = unique_name("gone"), unique_name("came")
        names.extend([gone, came])
        assert docker_cli("run", "-d", "--name", gone, "--gpus", "device=0", base_image, "sleep", "120").returncode == 0
        gone_holder = "docker-" + container_id(gone)[:12]
        watcher.wait(f"holder={gone_holder}", "event=hold")
    finally:
        watcher.kill()
    assert (hold_dir / f"hold.{uuids[0]}.{gone_holder}.json").exists()
    assert docker_cli("rm", "-f", gone).returncode == 0
    assert docker_cli("run", "-d", "--name", came, "--gpus", "device=1", base_image, "sleep", "120").returncode == 0
    came_holder = "docker-" + container_id(came)[:12]
    holds.place(str(hold_dir), holds.Hold(uuids[0], "slurm-7", "Slurm job 7", time.time()))
    watcher = WatchProcess(env, hold_dir)
    try:
        watcher.wait("event=engine state=connected")
        assert watcher.with_(f"holder={gone_holder}", "event=release", "why=reconciled")
        assert watcher.with_(f"holder={came_holder}", "event=hold", "why=reconciled")
        assert sorted(p.name for p in hold_dir.iterdir()) == sorted(
            [f"hold.{uuids[1]}.{came_holder}.json", f"hold.{uuids[0]}.slurm-7.json"])
        assert docker_cli("rm", "-f", came).returncode == 0
        watcher.wait(f"holder={came_holder}", "event=release")
        watcher.proc.terminate()  # as `docker stop` does: a line, exit 0
        assert watcher.proc.wait(30) == 0
        watcher.wait("event=stop holds stay as they are")
    finally:
        watcher.kill()
    assert [p.name for p in hold_dir.iterdir()] == [f"hold.{uuids[0]}.slurm-7.json"]


WATCH_IMAGE = "forge-load-watch:test"


@pytest.fixture(scope="session")
def watch_image(docker_client: Any, base_image: str) -> str:
    """deploy/docker-watch/Dockerfile, built on the test engine's base image (as docker_engine.sh builds ours)."""
    args = ["build", "-q", "--network", "host", "--build-arg", f"BASE_IMAGE={base_image}", "-f",
            str(ROOT / "deploy" / "docker-watch" / "Dockerfile"), "-t", WATCH_IMAGE, str(ROOT)]
    if os.path.exists("/etc/ssl/certs/ca-certificates.crt"):
        args[1:1] = ["--build-arg", "PIP_CERT=/etc/ssl/certs/ca-certificates.crt"]
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "DOCKER_BUILDKIT": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return WATCH_IMAGE


@pytest.mark.docker
def test_watch_in_a_container(docker_client: Any, base_image: str, watch_image: str, vgpu_lib_dir: Path,
                              shared_dir: Path, names: list[str]) -> None:
    """The image of deploy/docker-watch with the socket, the hold directory and the engine's container files
    mounted (NVML: the virtual GPU's library and state): a container asking for GPU 1 finds its hold 0.5 s after
    its first instruction, read from the engine's files (no inspect)."""
    gpu = VirtualGpu(shared_dir / "gpu", gpus=2, lib_dir=vgpu_lib_dir)
    uuids = gpu.uuids()
    hold_dir = shared_dir / "holds"
    socket = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock").removeprefix("unix://")
    containers_dir = os.path.join(docker_client.info()["DockerRootDir"], "containers")
    watch = unique_name("watch")
    names.append(watch)
    proc = docker_cli("run", "-d", "--name", watch, "-v", f"{socket}:/var/run/docker.sock",
                      "-v", f"{hold_dir}:{hold_dir}", "-v", f"{containers_dir}:{containers_dir}:ro",
                      "-v", f"{gpu.library_dir / 'libnvidia-ml.so.1'}:{DRIVER_DIR}/libnvidia-ml.so.1:ro",
                      "-v", f"{gpu.state_dir}:{gpu.state_dir}", "-e", f"VGPU_STATE={gpu.state_dir}",
                      watch_image, "--hold-dir", str(hold_dir))
    assert proc.returncode == 0, proc.stderr

    def logs() -> str:
        return docker_cli("logs", watch).stdout

    deadline = time.monotonic() + 60
    while "state=connected" not in logs():
        assert time.monotonic() < deadline, logs() + docker_cli("logs", watch).stderr
        time.sleep(0.2)
    assert f"gpus={uuids[0]},{uuids[1]}" in logs() and "cannot be read here" not in logs(), logs()
    job = unique_name("job")
    names.append(job)
    proc = docker_cli("run", "--name", job, "--gpus", "device=1", "-v", f"{hold_dir}:/holds:ro", base_image,
                      "sh", "-c", "sleep 0.5; ls /holds")
    holder = "docker-" + container_id(job)[:12]
    assert proc.stdout.split() == [f"hold.{uuids[1]}.{holder}.json"], proc.stdout + logs()
    while f"event=release holder={holder}" not in logs():
        assert time.monotonic() < deadline, logs()
        time.sleep(0.2)
    assert list(hold_dir.iterdir()) == []


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory the containers' users reach (pytest's tmp dirs are private): the virtual GPU, the holds."""
    parent = Path(tempfile.mkdtemp(prefix="forge-dockerw-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
    parent.chmod(0o755)
    try:
        yield parent
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def vgpu_args(gpu: VirtualGpu) -> list[str]:
    lib = gpu.library_dir
    return ["-v", f"{lib / 'libcuda.so.1'}:{DRIVER_DIR}/libcuda.so.1:ro",
            "-v", f"{lib / 'libnvidia-ml.so.1'}:{DRIVER_DIR}/libnvidia-ml.so.1:ro",
            "-v", f"{gpu.state_dir}:{gpu.state_dir}", "-e", f"VGPU_STATE={gpu.state_dir}",
            "-v", f"{DRIVER_JOB}:/opt/driver_job.py:ro", "-v", f"{FOREIGN_JOB}:/opt/foreign_job.py:ro"]


def job_lines(stdout: str) -> dict[str, dict[str, Any]]:
    return {e["event"]: e for e in (json.loads(line) for line in stdout.splitlines() if line.startswith("{"))}


@pytest.mark.docker
def test_a_gpu_container_finds_its_gpus_filler_drained_before_its_context(
        docker_client: Any, base_image: str, forge_image: Any, vgpu_lib_dir: Path, shared_dir: Path,
        names: list[str]) -> None:
    """One filler process on a 2-GPU virtual GPU, the watcher, and containers asking for GPU 1 (`--gpus
    device=1`) that run CUDA jobs: the driver-API job opens its context 0.5 s after the container's first
    instruction; in a container of our image (which holds no numba) it opens it 1 s after, as a framework's
    imports would delay it. For each, by the virtual GPU's record: our last kernel on GPU 1 ended before the
    job's context creation began (the lead time, printed), none of ours ran there while the container lived, and
    GPU 0 kept filling."""
    gpu = VirtualGpu(shared_dir / "gpu", gpus=2, lib_dir=vgpu_lib_dir)
    uuids = gpu.uuids()
    hold_dir = shared_dir / "holds"
    hold_dir.mkdir(mode=0o755)
    env = gpu.env(settings_free() |
                  {"DOCKER_HOST": os.environ.get("DOCKER_HOST", ""), "FORGE_RESUME_AFTER": "2"})
    filler_log = shared_dir / "filler.log"
    with open(filler_log, "w") as out:
        filler = subprocess.Popen([sys.executable, "-m", "forge_load", "--log-format", "json", "--gpus", "all",
                                   "--target", "0.5", "--log-interval", "1", "--duration", "900", "--hold-dir",
                                   str(hold_dir)], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    host_pidns = os.stat("/proc/self/ns/pid").st_ino
    watcher = WatchProcess(env, hold_dir)

    def ours(device: int) -> list[Kernel]:
        return [k for k in gpu.kernels() if k.pid == filler.pid and k.pidns == host_pidns and k.device == device]

    def filling(device: int, after_s: float, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(k.start > after_s for k in ours(device)):
            assert time.monotonic() < deadline and filler.poll() is None, "\n".join(
                [line for line in filler_log.read_text().splitlines() if '"status"' not in line][-20:])
            time.sleep(0.2)

    jobs = [("driver", 0.5)] * 4 + [("image", 1.0)] * 2
    results = []
    try:
        filling(0, 0, 180)
        filling(1, time.time() + 1.0, 60)
        watcher.wait("event=engine state=connected")
        for kind, after_s in jobs:
            filling(1, time.time() + 0.5, 30)  # GPU 1 is filling when the container comes
            name = unique_name(f"lead_{kind}")
            names.append(name)
            t0 = 'export JOB_T0=$(date +%s.%N); echo "{\\"event\\": \\"t0\\", \\"t\\": $JOB_T0}"; '
            if kind == "driver":
                command = [base_image, "sh", "-c",
                           t0 + f"exec python3 /opt/driver_job.py run {uuids[1]} --after {after_s} --seconds 1"]
            else:  # a container of our image that is not a filler says so with its role label
                command = ["--label", "io.forge_load.role=test-job", "--entrypoint", "sh", IMAGE, "-c",
                           t0 + f"exec python /opt/driver_job.py run {uuids[1]} --after {after_s} --seconds 2"]
            proc = docker_cli("run", "--name", name, "--gpus", "device=1", *vgpu_args(gpu), *command, timeout=300)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
            holder = "docker-" + container_id(name)[:12]
            hold = watcher.wait(f"holder={holder}", "event=hold")
            release = watcher.wait(f"holder={holder}", "event=release", "why=died")
            assert f"gpus={uuids[1]} " in hold, hold
            lines = job_lines(proc.stdout)
            begin_s = lines["context"]["wall_time_begin"]
            before = [k for k in ours(1) if k.start < begin_s]
            lead_s = begin_s - max(k.end for k in before)
            during = [k.start - begin_s for k in ours(1) if begin_s <= k.start <= line_time(release)]
            gpu0 = [k for k in ours(0) if begin_s <= k.start <= line_time(release)]
            results.append((kind, begin_s - lines["t0"]["t"], line_time(hold) - lines["t0"]["t"], lead_s,
                            len(gpu0)))
            assert lead_s > 0, (kind, lead_s)
            assert not during, f"our kernels started {during[:5]} s after the job's context began, on its GPU"
            assert gpu0, "GPU 0 stopped filling"
        assert not [line for line in watcher.lines if "event=error" in line], watcher.lines
    finally:
        watcher.kill()
        filler.terminate()
        filler.wait(60)
    print("\ncontainer  context_after_first_instruction_s  hold_after_first_instruction_s  lead_time_s  "
          "gpu0_kernels_meanwhile   (virtual GPU, this machine)")
    for kind, context_s, hold_s, lead_s, gpu0_count in results:
        print(f"{kind:<9}  {context_s:>33.3f}  {hold_s:>30.3f}  {lead_s:>11.3f}  {gpu0_count:>22}")
