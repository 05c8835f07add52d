"""GPU UUIDs are case-insensitive hex (docs/holds.md): a GPU named `GPU-5FD4...` by the hold command, by a hold
file's name or by the kubelet is the GPU NVML calls `GPU-5fd4...`, and its filler honours the hold. One function
says which (holds.canonical_gpu_uuid); these tests hold it to every way in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from forge_load.commands import hold as hold_command
from forge_load.service.kubelet import Assignment, KubeletHolds, nvml_resolver
from forge_load.steering import holds
from forge_load.steering.hold_watch import FillerHolds, HoldBoard, HoldWatch
from tests.fake_pynvml import FakeDevice, FakeNvml
from tests.host_paths import settings_free
from tests.test_real_path import ROOT, finish, forge, wait_for
from vgpu.pytest_plugin import VgpuFactory

GPU0 = "GPU-5fd4c9b1-0000-4000-8000-00000000abcd"  # as NVML spells it
GPU1 = "GPU-5fd4c9b1-0000-4000-8000-00000000abce"
UPPER0 = GPU0.upper()
MIG = "MIG-5fd4c9b1-0001-4000-8000-00000000abcd"


def command(argv: list[str], hold_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = hold_command.main([*argv, "--hold-dir", str(hold_dir)], env={}, uuids_of_host=lambda: [GPU0, GPU1])
    captured = capsys.readouterr()
    return code, captured.out.splitlines() + captured.err.splitlines()


def test_the_canonical_spelling_is_nvmls() -> None:
    for spelled in (UPPER0, "gpu-" + GPU0[4:].upper(), GPU0, "Gpu-5Fd4C9b1-0000-4000-8000-00000000aBcD"):
        assert holds.canonical_gpu_uuid(spelled) == GPU0
    assert holds.canonical_gpu_uuid(MIG.upper()) == MIG
    assert holds.canonical_gpu_uuid("not-a-uuid") == "not-a-uuid"


def test_hold_gpu_in_capitals_is_honoured_by_the_filler_of_that_gpu(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, out = command(["hold", "--gpu", UPPER0, "--holder", "job-1"], tmp_path, capsys)
    assert code == 0 and out == [f"{GPU0} held by job-1"]
    watch = HoldWatch(str(tmp_path), GPU0)
    changes, problems = watch.check(0.0, time.time())
    assert [c.holder for c in changes] == ["job-1"] and watch.held and not problems
    code, out = command(["release", "--gpu", UPPER0, "--holder", "job-1"], tmp_path, capsys)
    assert code == 0 and out == [f"{GPU0} released by job-1"]
    watch.check(2.0, time.time())
    assert not watch.held


def test_a_hold_file_named_in_capitals_is_honoured_listed_and_released(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    name = f"hold.{UPPER0}.by-hand.json"
    holds.write_atomic(str(tmp_path), name, json.dumps(
        {"format": 1, "gpu": UPPER0, "holder": "by-hand", "reason": "typed", "since_unix_s": 1.0,
         "until_unix_s": None}).encode())
    watch = HoldWatch(str(tmp_path), GPU0)
    _, problems = watch.check(0.0, time.time())
    assert watch.held and watch.holders == ("by-hand",) and not problems
    assert not HoldWatch(str(tmp_path), GPU1).check(0.0, time.time())[0]  # and no other GPU
    code, out = command(["holds"], tmp_path, capsys)
    assert code == 0 and len(out) == 2 and out[1].startswith(f"{GPU0}  by-hand")
    code, out = command(["release", "--holder", "by-hand"], tmp_path, capsys)
    assert code == 0 and out == [f"{GPU0} released by by-hand"] and not (tmp_path / name).exists()


def test_hold_wait_in_capitals_sees_the_fillers_acknowledgement(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    filler = FillerHolds(str(tmp_path), GPU0, os.getpid(), time.time)
    stop = threading.Event()

    def run_filler() -> None:  # honours what it sees, drained at once
        while not stop.wait(0.02):
            filler.check(time.monotonic())
            filler.acknowledge(time.monotonic(), "held" if filler.held else "filling", drained=filler.held)

    thread = threading.Thread(target=run_filler)
    thread.start()
    try:
        time.sleep(0.1)  # it has acknowledged once: a live filler
        code, out = command(["hold", "--gpu", UPPER0, "--holder", "job-2", "--wait", "5"], tmp_path, capsys)
    finally:
        stop.set()
        thread.join()
    assert code == 0, out
    assert filler.held and filler.watch.holders == ("job-2",)


def test_a_kubelet_device_id_in_capitals_holds_the_gpu() -> None:
    fake = FakeNvml([FakeDevice(uuid=GPU0), FakeDevice(uuid=GPU1, mig_mode=1, migs=[FakeDevice(uuid=MIG)])])
    board = HoldBoard()
    client = KubeletHolds("/nonexistent", board, lambda line: None, nvml_resolver(fake.module),
                          wall_clock=lambda: 1000.0)
    board.replace(client.holds_of([Assignment("ml", "a", "main", "nvidia.com/gpu", f"{UPPER0}::2"),
                                   Assignment("ml", "b", "main", "nvidia.com/mig-1g.10gb", MIG.upper())], 5.0))
    assert [h.holder for h in board.holds_for(GPU0)] == ["k8s-ml_a_main"]
    assert [h.holder for h in board.holds_for(MIG)] == ["k8s-ml_b_main"]
    assert board.holds_for(GPU1) == ()  # not the MIG device's GPU: its other MIG devices go on filling
    assert board.holds_for(UPPER0) == board.holds_for(GPU0)


def test_hold_wait_in_capitals_stops_our_kernels_on_the_virtual_gpu(vgpu: VgpuFactory, tmp_path: Path) -> None:
    """A UUID typed in upper case, end to end: `hold --gpu GPU-<UPPER> --wait 5` exits 0, and the virtual GPU's record
    shows no kernel of ours on that GPU after it returned."""
    gpu = vgpu(gpus=1)
    hold_dir = tmp_path / "holds"
    hold_dir.mkdir()
    run = forge(gpu, "--duration", "8", "--log-interval", "0.5", "--hold-dir", str(hold_dir))
    try:
        wait_for(run, "status")
        env = gpu.env(settings_free())
        held = subprocess.run([sys.executable, "-m", "forge_load", "hold", "--gpu", gpu.uuids()[0].upper(),
                               "--holder", "caps", "--wait", "5", "--hold-dir", str(hold_dir)],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
        held_s = time.time()
        assert held.returncode == 0, held.stderr
        assert finish(run) == 0, run.stderr[-3000:]
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.communicate(timeout=30)
    assert [k for k in run.kernels(device=0) if k.end > held_s] == []
    (hold,) = run.of("hold")
    assert hold["holder"] == "caps"
