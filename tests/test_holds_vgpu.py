"""Holds on the virtual GPU (the unmodified cuda-bindings and pynvml path, real time): one filler process on two GPUs,
`forge-load hold --gpu 0 --wait` returns once GPU 0 has drained, and the virtual GPU's own record of every kernel
shows none of ours on GPU 0 from then until the release, while GPU 1 went on filling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.host_paths import settings_free
from tests.test_real_path import ROOT, finish, forge, wait_for
from vgpu.pytest_plugin import VgpuFactory


def command(gpu_env: dict[str, str], *args: str) -> tuple[int, float, str]:
    """A hold command on the host (the same virtual GPU's NVML): exit code, Unix time it returned, stderr."""
    proc = subprocess.run([sys.executable, "-m", "forge_load", *args], env=gpu_env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    return proc.returncode, time.time(), proc.stderr


def test_a_hold_drains_one_gpu_while_the_other_fills(vgpu: VgpuFactory, tmp_path: Path) -> None:
    gpu = vgpu(gpus=2)
    uuids = gpu.uuids()
    hold_dir = tmp_path / "holds"
    hold_dir.mkdir()
    env = gpu.env(settings_free())
    run = forge(gpu, "--gpus", "all", "--duration", "10", "--log-interval", "0.5", "--hold-dir", str(hold_dir),
                env={"FORGE_TARGET": "0.5"})
    try:
        for _ in range(4):
            wait_for(run, "status")  # both GPUs filling
        code, held_s, err = command(env, "hold", "--gpu", "0", "--holder", "test-1", "--reason", "a test",
                                    "--wait", "5", "--hold-dir", str(hold_dir))
        assert code == 0, err
        placed_s = json.loads((hold_dir / f"hold.{uuids[0]}.test-1.json").read_text())["since_unix_s"]
        ack = json.loads((hold_dir / f"filler.{os.geteuid()}" / f"{uuids[0]}.ack.json").read_text())
        legacy = json.loads((hold_dir / f"filler.{uuids[0]}.json").read_text())  # for earlier releases' commands
        title = Path(f"/proc/{run.proc.pid}/cmdline").read_bytes().rstrip(b"\0").decode()
        time.sleep(2.0)
        releasing_s = time.time()  # the filler may resume before the command's process has ended: bound by its start
        code, released_s, err = command(env, "release", "--holder", "test-1", "--hold-dir", str(hold_dir))
        assert code == 0, err
        assert finish(run) == 0, run.stderr[-3000:]
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.communicate(timeout=30)
    assert title == "forge-load: gpu 0 held, gpu 1 filling"
    assert ack["held_by"] == ["test-1"] and ack["drained"] is True and ack["written_unix_s"] >= placed_s
    assert (ack["format"], legacy["format"]) == (2, 1) and legacy["held_by"] == ["test-1"] and legacy["drained"]
    # GPU 0: every kernel launched before the release began had ended by the time `hold --wait` returned.
    gpu0 = run.kernels(device=0)
    assert [k for k in gpu0 if k.submit < releasing_s and k.end > held_s] == []
    assert any(k.start > released_s for k in gpu0)  # filling again after the release
    assert any(placed_s - 1.0 < k.start < placed_s for k in gpu0)  # it was filling before the hold
    # GPU 1 went on filling all along.
    assert len([k for k in run.kernels(device=1) if held_s < k.start < released_s]) > 10
    (hold,), (release,) = run.of("hold"), run.of("release")
    assert (hold["gpu"], hold["holder"], hold["reason"], hold["state"]) == (0, "test-1", "a test", "held")
    assert (release["gpu"], release["reason"], release["state"]) == (0, "released", "filling")
    print(f"hold --wait returned {held_s - placed_s:.3f} s after the hold was placed (virtual GPU, this machine)")
