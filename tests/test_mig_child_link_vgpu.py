"""A MIG device filled in a child process (`--gpus all`, or a GPU in MIG mode named as a whole) is steered and shown
as a filler in the process itself is (docs/operating.md, GPUs in MIG mode): the kubelet's assignment of its MIG
device holds it (the parent asks the kubelet and passes the holds on), and /metrics shows its own state and readings
(its status reports), on the virtual GPU with the real protocol (tests/test_kubelet.py's test kubelet)."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.prometheus_harness import wait_for
from tests.test_mig_all_vgpu import FORGE_LOAD, _lines
from tests.test_vgpu import ROOT
from vgpu.pytest_plugin import VgpuFactory

pytest.importorskip("grpc")
from bench.kubelet import TestKubelet  # noqa: E402 - needs grpc


def _scrape(port: int) -> dict[tuple[str, str, str], float]:
    """(name, the MIG device's GPU_I_ID, state or '') -> value, for every series of /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(sample.name, sample.labels.get("GPU_I_ID", ""), sample.labels.get("state", "")): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


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
            wait_for("kernels on both MIG devices",
                     lambda: {k.mig for k in gpu.kernels()} == {m.gi for m in migs} or None, 60, every_s=0.1)
            # Each child's own readings reach /metrics: its multiplier, not the 0 of a status it never sent
            wait_for("each child's multiplier in /metrics",
                     lambda: (all(v > 0 for (name, _, _), v in _scrape(port).items() if name == "forge_load_multiplier")
                              and sum(name == "forge_load_multiplier" for (name, _, _) in _scrape(port)) == 2) or None,
                     10, every_s=0.1)
            server.assign("ml", "train", "main", "nvidia.com/mig-3g.40gb", [migs[0].uuid])
            assigned_s = time.time()
            held = [v for (name, _, state), v in _scrape(port).items() if name == "forge_load_state" and state]
            assert held  # the series are there
            wait_for("one MIG device held in /metrics",
                     lambda: sum(v for (name, _, state), v in _scrape(port).items()
                                 if name == "forge_load_state" and state == "held") == 1.0 or None, 5, every_s=0.1)
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
