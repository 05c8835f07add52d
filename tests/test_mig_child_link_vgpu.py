"""A MIG device filled in a child process (`--gpus all`, or a GPU in MIG mode named as a whole) is steered and shown
as a filler in the process itself is (docs/operating.md, GPUs in MIG mode): the kubelet's assignment of its MIG
device holds it (the parent asks the kubelet and passes the holds on), and /metrics shows its own state and readings
(its status reports), on the virtual GPU with the real protocol (tests/test_kubelet.py's test kubelet)."""

from __future__ import annotations

import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.test_mig_all_vgpu import FORGE_LOAD, _lines
from tests.test_vgpu import ROOT
from vgpu.pytest_plugin import VgpuFactory

pytest.importorskip("grpc")
from bench.kubelet import TestKubelet  # noqa: E402 - needs grpc

SERIES = re.compile(r'^(forge_load_\w+)\{([^}]*)\} (\S+)$')


def _scrape(port: int) -> dict[tuple[str, str, str], float]:
    """(name, the series' UUID-like label of the MIG device, state or '') -> value, for the MIG devices' series."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    out: dict[tuple[str, str, str], float] = {}
    for line in text.splitlines():
        m = SERIES.match(line)
        if m is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m[2]))
        device = labels.get("mig_uuid") or labels.get("GPU_I_ID") or labels.get("UUID", "")
        out[(m[1], device, labels.get("state", ""))] = float(m[3])
    return out


def _wait(predicate: object, timeout_s: float) -> bool:
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


def test_the_kubelets_mig_assignment_holds_that_child_and_metrics_show_each_child(
        vgpu: VgpuFactory, tmp_path: Path) -> None:
    gpu = vgpu(mig=2)
    migs = gpu.mig_devices()
    socket_path = tmp_path / "kubelet.sock"
    with TestKubelet(socket_path) as server:
        env = gpu.env({**os.environ, "TMPDIR": str(tmp_path), "FORGE_KUBELET_SOCKET": str(socket_path),
                       "POD_NAMESPACE": "forge-load", "POD_NAME": "forge-load-x1"})
        env.pop("CUDA_VISIBLE_DEVICES", None)
        proc = subprocess.Popen([FORGE_LOAD, "--gpus", "all", "--log-format", "json", "--metrics-port", "0",
                                 "--metrics-addr", "127.0.0.1", "--duration", "20", "--hold-dir",
                                 str(tmp_path / "holds")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=ROOT)
        try:
            assert proc.stdout is not None
            port = int(next(line for line in proc.stdout if '"metrics"' in line).split('"port":')[1].split(",")[0])
            assert _wait(lambda: {k.mig for k in gpu.kernels()} == {m.gi for m in migs}, 60)
            # Each child's own readings reach /metrics: its multiplier, not the 0 of a status it never sent
            assert _wait(lambda: all(v > 0 for (name, _, _), v in _scrape(port).items()
                                     if name == "forge_load_multiplier")
                         and sum(name == "forge_load_multiplier" for (name, _, _) in _scrape(port)) == 2, 10)
            server.assign("ml", "train", "main", "nvidia.com/mig-3g.40gb", [migs[0].uuid])
            assigned_s = time.time()
            held = [v for (name, _, state), v in _scrape(port).items() if name == "forge_load_state" and state]
            assert held  # the series are there
            assert _wait(lambda: sum(v for (name, _, state), v in _scrape(port).items()
                                     if name == "forge_load_state" and state == "held") == 1.0, 5)
            time.sleep(1.5)
            late = [k for k in gpu.kernels() if k.mig == migs[0].gi and k.start > assigned_s + 1.0]
            assert late == []  # the assigned MIG device's child holds, within a second
            assert [k for k in gpu.kernels() if k.mig == migs[1].gi and k.start > assigned_s + 1.0]  # its sibling fills
        finally:
            proc.terminate()
            out, err = proc.communicate(timeout=60)
    lines = _lines(out)
    holds = [(line["uuid"], line["holder"]) for line in lines if line["event"] == "hold"]
    assert holds == [(migs[0].uuid, "k8s-ml_train_main")], out[-3000:] + err[-2000:]
