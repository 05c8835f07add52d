"""The virtual GPU as a container sees it: with NVIDIA_VISIBLE_DEVICES (as the NVIDIA container toolkit sets it),
NVML and CUDA show only those GPUs, numbered from 0 in the host's order; so a host's index means nothing there and a
UUID does, and a filler in such a container honours holds by UUID."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.host_paths import settings_free
from tests.test_real_path import ROOT, Run, finish, wait_for
from tests.test_vgpu import CUDA_ORDER
from vgpu.pytest_plugin import VgpuFactory

NVML_VIEW = r'''
import json
import pynvml as n
n.nvmlInit()
count = n.nvmlDeviceGetCount()
handles = [n.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
uuids = [n.nvmlDeviceGetUUID(h) for h in handles]
indices = [n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByUUID(u)) for u in uuids]
hidden = {}
for u in json.loads(input()):
    try:
        n.nvmlDeviceGetHandleByUUID(u)
    except n.NVMLError_NotFound:
        hidden[u] = "not found"
try:
    n.nvmlDeviceGetHandleByIndex(count)
    beyond = "found"
except n.NVMLError_InvalidArgument:
    beyond = "invalid argument"
print(json.dumps({"uuids": uuids, "indices": indices, "hidden": sorted(hidden), "beyond": beyond}))
'''


@pytest.mark.parametrize("visible, expected", [
    (None, [0, 1, 2]),          # no container: the host's view
    ("all", [0, 1, 2]),
    ("1", [1]),
    ("UUID2,0", [0, 2]),        # numbered in the host's order, not the list's
    ("2,7", [2]),               # an entry that names no GPU is left out
    ("none", []),
])
def test_nvml_and_cuda_show_only_the_containers_gpus_numbered_from_0(vgpu: VgpuFactory, visible: str | None,
                                                                     expected: list[int]) -> None:
    gpu = vgpu(gpus=3, fastest_first=[2, 0, 1])
    uuids = gpu.uuids()
    shown = None if visible is None else visible.replace("UUID2", uuids[2])
    env = gpu.env({k: v for k, v in os.environ.items() if k not in ("CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES")},
                  visible=shown)
    nvml = subprocess.run([sys.executable, "-c", NVML_VIEW], env=env, cwd=ROOT, input=json.dumps(uuids),
                          capture_output=True, text=True, timeout=60, check=False)
    assert nvml.returncode == 0, nvml.stderr
    view = json.loads(nvml.stdout)
    assert view == {"uuids": [uuids[i] for i in expected], "indices": list(range(len(expected))),
                    "hidden": sorted(u for i, u in enumerate(uuids) if i not in expected),
                    "beyond": "invalid argument"}
    cuda = subprocess.run([sys.executable, "-c", CUDA_ORDER], env={**env, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    if not expected:
        assert cuda.returncode != 0  # no device: cuInit fails as the driver's does
        return
    assert cuda.returncode == 0, cuda.stderr
    assert json.loads(cuda.stdout)["uuids"] == [uuids[i] for i in expected]
    if visible == "UUID2,0":  # CUDA's ordinals count within the container too
        fastest = subprocess.run([sys.executable, "-c", CUDA_ORDER], env={**env, "CUDA_VISIBLE_DEVICES": "1"},
                                 cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
        assert json.loads(fastest.stdout)["uuids"] == [uuids[0]]  # FASTEST_FIRST [2, 0]: ordinal 1 is host 0


def test_a_filler_in_a_container_honours_a_hold_placed_by_uuid_on_the_host(vgpu: VgpuFactory, tmp_path: Path) -> None:
    gpu = vgpu(gpus=2)
    uuids = gpu.uuids()
    hold_dir = tmp_path / "holds"
    hold_dir.mkdir()
    clean = settings_free()
    # The container has the host's GPU 1 only: to it, that is GPU 0.
    proc = subprocess.Popen([sys.executable, "-m", "forge_load", "--log-format", "json", "--gpu", "0",
                             "--duration", "6", "--log-interval", "0.5", "--hold-dir", str(hold_dir)],
                            env=gpu.env(clean, visible="1"), cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    run = Run(gpu, proc, time.time())
    try:
        start = wait_for(run, "start")
        wait_for(run, "status")
        hold = subprocess.run([sys.executable, "-m", "forge_load", "hold", "--gpu", uuids[1], "--holder", "job-7",
                               "--wait", "5", "--hold-dir", str(hold_dir)],
                              env=gpu.env(clean), cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
        held_s = time.time()
        assert hold.returncode == 0, hold.stderr
        time.sleep(1.5)
        released_s = time.time()
        release = subprocess.run([sys.executable, "-m", "forge_load", "release", "--holder", "job-7", "--hold-dir",
                                  str(hold_dir)], env=gpu.env(clean), cwd=ROOT, capture_output=True, text=True,
                                 timeout=60, check=False)
        assert release.returncode == 0, release.stderr
        assert finish(run) == 0, run.stderr[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert (start["gpu"], start["uuid"]) == (0, uuids[1])
    ours = [k for k in gpu.kernels() if k.pid == proc.pid]
    assert ours and {k.device for k in ours} == {1}  # the host's GPU 1, as the virtual GPU records it
    assert [k for k in ours if k.submit < released_s and k.end > held_s] == []
    assert any(k.start > released_s for k in ours)
    (held_line,) = run.of("hold")
    assert (held_line["gpu"], held_line["uuid"], held_line["holder"]) == (0, uuids[1], "job-7")
