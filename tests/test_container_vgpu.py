"""The image in real mode (no --simulate) on the virtual GPU: its two libraries bind-mounted where the NVIDIA
container toolkit puts the driver's, the shared state mounted, and a foreign CUDA job in a second container.

Needs the Docker engine and image of tests/docker_support.py (scripts/docker_engine.sh start), and the virtual
GPU's libraries (a C compiler). Both containers run in their own PID namespaces (no --pid=host), so NVML shows
each only itself: the filler has to see the foreign job by its memory and utilization.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from docker_support import (
    IMAGE,
    ROOT,
    docker_cli,
    docker_client,
    forge_image,
    image_prune,
    remove_containers,
    unique_name,
)

from vgpu import VirtualGpu

__all__ = ["docker_client", "forge_image"]  # fixtures, imported for pytest

DRIVER_DIR = "/usr/lib/x86_64-linux-gnu"  # where the toolkit mounts libcuda.so.1 and libnvidia-ml.so.1
RESUME_AFTER_S = 4.0
YIELD_LIMIT_S = 0.5  # from the foreign context to our last kernel's start; generous for a 2-core CI machine


@pytest.fixture
def shared_gpu(vgpu_lib_dir: Path) -> Iterator[VirtualGpu]:
    """A virtual GPU whose state the containers' non-root user can reach (pytest's tmp dirs are private)."""
    parent = Path(tempfile.mkdtemp(prefix="forge-vgpu-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
    parent.chmod(0o755)
    try:
        yield VirtualGpu(parent / "gpu", lib_dir=vgpu_lib_dir)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture
def names(docker_client: Any) -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    remove_containers(docker_client, names=made)


def gpu_args(gpu: VirtualGpu) -> list[str]:
    lib = gpu.library_dir
    return ["-v", f"{lib / 'libcuda.so.1'}:{DRIVER_DIR}/libcuda.so.1:ro",
            "-v", f"{lib / 'libnvidia-ml.so.1'}:{DRIVER_DIR}/libnvidia-ml.so.1:ro",
            "-v", f"{gpu.state_dir}:{gpu.state_dir}", "-e", f"VGPU_STATE={gpu.state_dir}"]


def events(name: str) -> list[dict[str, Any]]:
    out = docker_cli("logs", name).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def cuda_libraries_mapped(name: str) -> set[str]:
    """The shared objects of the CUDA wheels and llvmlite that the container's PID 1 has mapped, relative to
    site-packages."""
    proc = docker_cli("exec", name, "cat", "/proc/1/maps")
    assert proc.returncode == 0, proc.stderr
    paths = {line.split(maxsplit=5)[5] for line in proc.stdout.splitlines() if len(line.split(maxsplit=5)) == 6}
    relative = {p.split("/site-packages/", 1)[1] for p in paths if "/site-packages/" in p}
    return {p for p in relative if p.startswith(("nvidia/", "llvmlite/")) and ".so" in p}


def wait_for(predicate: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@pytest.mark.docker
def test_real_mode_container_on_the_virtual_gpu_yields_to_a_foreign_container(
        docker_client: Any, forge_image: Any, shared_gpu: VirtualGpu, names: list[str]) -> None:
    gpu = shared_gpu
    filler = unique_name("vgpu_filler")
    names.append(filler)
    proc = docker_cli("run", "-d", "--name", filler, *gpu_args(gpu), "-e", "FORGE_LOG_FORMAT=json",
                      "-e", "FORGE_LOG_INTERVAL=1", "-e", f"FORGE_RESUME_AFTER={RESUME_AFTER_S}", IMAGE)
    assert proc.returncode == 0, proc.stderr
    filling = wait_for(lambda: [e for e in events(filler) if e["event"] == "status" and e["state"] == "filling"],
                       180, "the filler's first status line while filling")
    start = events(filler)[0]
    assert start["event"] == "start" and "simulated" not in start, start
    assert start["gpu_name"] == "Virtual GPU (H100-like)" and start["driver"].endswith("-virtual"), start
    assert start["uuid"] == gpu.uuids()[0] and start["sm_count"] == 132
    assert filling

    foreign = unique_name("vgpu_foreign")
    names.append(foreign)
    # The image holds no compiler (no numba): the foreign job is a driver-API job, ctypes and libcuda alone.
    job = docker_cli("run", "--name", foreign, *gpu_args(gpu), "-v",
                     f"{ROOT / 'scripts' / 'driver_job.py'}:/opt/driver_job.py:ro", "--entrypoint", "sh",
                     IMAGE, "-c", "JOB_T0=$(date +%s.%N) exec python /opt/driver_job.py run "
                     f"{gpu.uuids()[0]} --seconds 5", timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    lines = {e["event"]: e for e in map(json.loads, job.stdout.splitlines())}
    begin_s, context_s, done_s = (lines["context"]["wall_time_begin"], lines["context"]["wall_time"],
                                  lines["done"]["wall_time"])

    wait_for(lambda: any(e["event"] == "resume" for e in events(filler)), 60, "the filler to resume")
    # Started, loaded its kernel, filled, yielded and resumed: what it has mapped by now is what the image must keep
    # (scripts/image_prune.py's RUNTIME_FILES, which leaves the rest of the CUDA wheels out).
    expected = {p for paths in image_prune().RUNTIME_FILES.values() for p in paths if ".so" in p}
    assert cuda_libraries_mapped(filler) == expected, "measure again: scripts/runtime_files.py"
    stop = docker_cli("stop", filler)
    assert stop.returncode == 0
    state = docker_client.api.inspect_container(filler)["State"]
    log = events(filler)
    assert state["ExitCode"] == 0, log[-3:]

    yields = [e for e in log if e["event"] == "yield"]
    assert yields, [e["event"] for e in log]
    assert "memory" in yields[0]["signals"] or "utilization" in yields[0]["signals"], yields[0]
    # The virtual GPU's own record: which kernels ran when, per process (both containers' main process is PID 1).
    kernels = gpu.kernels()
    ours_ns = {k.pidns for k in kernels if k.start < context_s}
    assert len(ours_ns) == 1, "only the filler ran kernels before the foreign job"
    ours = [k for k in kernels if k.pidns in ours_ns]
    theirs = [k for k in kernels if k.pidns not in ours_ns]
    assert theirs and min(k.start for k in theirs) >= context_s - 0.05
    last = max((k for k in ours if k.start < done_s), key=lambda k: k.start)
    print(f"yield: signals {yields[0]['signals']}; the foreign context was made from {begin_s:.3f} to "
          f"{context_s:.3f}; our last kernel before the job ended ran {last.start - begin_s:+.3f} to "
          f"{last.end - begin_s:+.3f} s from its beginning")
    late = [k.start - context_s for k in ours if context_s + YIELD_LIMIT_S < k.start < done_s]
    assert not late, f"our kernels started {late[:5]} s after the foreign context, while it ran"
    resumed = [k for k in ours if k.start > done_s]
    assert resumed and min(k.start for k in resumed) >= done_s + RESUME_AFTER_S - 0.5


@pytest.mark.docker
def test_container_without_the_state_says_no_gpu(docker_client: Any, forge_image: Any, shared_gpu: VirtualGpu,
                                                 names: list[str]) -> None:
    """The libraries mounted but no virtual GPU state reachable: exit 3 with the hint, as with no driver."""
    name = unique_name("vgpu_nostate")
    names.append(name)
    lib = shared_gpu.library_dir
    proc = docker_cli("run", "--name", name, "-v", f"{lib / 'libcuda.so.1'}:{DRIVER_DIR}/libcuda.so.1:ro",
                      "-v", f"{lib / 'libnvidia-ml.so.1'}:{DRIVER_DIR}/libnvidia-ml.so.1:ro", IMAGE, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no usable GPU" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
