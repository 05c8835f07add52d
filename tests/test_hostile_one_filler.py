"""One filler per GPU: each GPU's default heartbeat is its own, a GPU named twice is filled once, and a second
filler of the same GPU (by the same name or another, or through a shared heartbeat file) is refused while
the first runs on.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from forge_load.config.load import load_config
from forge_load.gpu.backend import backend_for
from forge_load.service import health
from tests.host_paths import settings_free
from tests.hostile_support import (
    ENTRY,
    ROOT,
    assert_one_clean_line,
    finish_entry,
    forge,
    run_health,
    spawn_entry,
    started,
)

# --- one GPU named twice (tests/test_metrics.py runs it on simulated GPUs) -------------------------------------------

def test_real_gpus_named_twice_are_resolved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import forge_load.gpu.nvml
    from forge_load.control.probe import DeviceInfo
    from forge_load.service import gpu_threads

    infos = [DeviceInfo(index=i, uuid=f"GPU-{i}0000000-0000-4000-8000-000000000000", name="x",
                        memory_total_mib=1.0, driver_version="1", mig_enabled=False) for i in range(2)]
    monkeypatch.setattr(forge_load.gpu.nvml, "list_devices", lambda *a, **k: infos)
    config = load_config(["--gpus", f"1,{infos[1].uuid},0,{infos[0].uuid}"], {})
    assert gpu_threads.gpu_selectors(config, backend_for(config)) == ["1", "0"]


# --- one heartbeat, one filler ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("one", "other"), [
    (["--gpu", "0"], ["--gpu", "1"]),
    (["--gpus", "0,1"], ["--gpu", "0"]),
    (["--gpus", "all"], ["--gpus", "0,1"]),
    (["--simulate"], []),
    (["--simulate", "--sim-seed", "1"], ["--simulate"]),  # other simulated GPUs: other UUIDs
    (["--simulate", "--sim-seed", "1", "--gpus", "all"], ["--simulate", "--gpus", "all"]),
    (["--gpu", "GPU-00000000-0000-4000-8000-000000000000"], ["--gpu", "0"]),
])
def test_fillers_of_other_gpus_have_other_default_heartbeats(one: list[str], other: list[str]) -> None:
    first, second = (health.heartbeat_location(load_config(args, {})) for args in (one, other))
    assert first != second and first[1] and second[1]
    assert first[0].parent == second[0].parent == health.default_heartbeat_path().parent
    assert health.heartbeat_location(load_config(["--gpus", "1,0"], {})) == \
        health.heartbeat_location(load_config(["--gpus", "0,1"], {}))


def test_the_health_check_judges_the_filler_its_settings_name() -> None:
    """Two simulated GPUs of one user's: the health check of GPU 6 does not read GPU 7's filler's heartbeat."""
    sim = {"FORGE_SIMULATE": "1", "FORGE_SIM_GPUS": "8"}
    proc = spawn_entry("--", "--simulate", "--sim-gpus", "8", "--gpu", "7", "--duration", "60")
    try:
        first = started(proc)
        deadline_s = time.monotonic() + 20
        while (ours := run_health({**sim, "FORGE_GPU": "7"})).returncode != 0 and time.monotonic() < deadline_s:
            time.sleep(0.2)
        assert ours.returncode == 0, ours
        other = run_health({**sim, "FORGE_GPU": "6"})
        assert other.returncode == 1 and "no heartbeat" in other.stdout and "gpu6" in other.stdout, other
    finally:
        proc.send_signal(signal.SIGTERM)
    code, events, err = finish_entry(proc, first)
    assert code == 0 and events[-1]["event"] == "stop", err


def test_a_second_filler_of_the_same_gpus_is_refused() -> None:
    """As a second `forge-load --gpu 3` beside a running one (a unit, or a test run): exit 2, one line, before it
    opens the GPU; the first runs on."""
    proc = spawn_entry("--wall-clock-sim", "--", "--gpu", "3", "--duration", "60")
    try:
        first = started(proc)
        second = subprocess.Popen([sys.executable, str(ENTRY), "--wall-clock-sim", "--", "--gpu", "3", "--duration",
                                   "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                  env={**settings_free(),
                                       "PYTHONPATH": str(ROOT)})
        out, err = second.communicate(timeout=60)
        assert second.returncode == 2, (second.returncode, out[-1000:], err[-1000:])
        assert out == "" and len(err.splitlines()) == 1, err
        assert_one_clean_line(err.strip(), f"pid {proc.pid}", "heartbeat-gpu3", "FORGE_GPU")
        assert proc.poll() is None, "the first filler stopped"
    finally:
        proc.send_signal(signal.SIGTERM)
    code, events, err = finish_entry(proc, first)
    assert code == 0 and events[-1]["event"] == "stop" and err == "", err


def test_a_shared_heartbeat_file_is_refused_for_other_gpus_too(tmp_path: Path) -> None:
    beat = str(tmp_path / "heartbeat")
    proc = spawn_entry("--wall-clock-sim", "--", "--gpu", "3", "--duration", "60", "--heartbeat-file", beat)
    try:
        first = started(proc)
        # On a host with GPUs (on one without, no GPU is what it says: exit 3, tests/test_state_dir.py).
        second = subprocess.run([sys.executable, str(ENTRY), "--wall-clock-sim", "--", "--gpu", "4", "--duration", "2",
                                 "--heartbeat-file", beat], capture_output=True, text=True, cwd=ROOT, timeout=60,
                                env={**settings_free(),
                                     "PYTHONPATH": str(ROOT)})
        assert second.returncode == 2, second
        assert_one_clean_line(second.stderr.strip(), f"pid {proc.pid}", f"FORGE_HEARTBEAT_FILE={beat}")
    finally:
        proc.send_signal(signal.SIGTERM)
    code, events, err = finish_entry(proc, first)
    assert code == 0 and err == "", err


def test_a_second_simulation_of_the_same_gpus_warns_and_leaves_the_heartbeat_alone() -> None:
    proc = spawn_entry("--", "--simulate", "--sim-gpus", "8", "--gpu", "5", "--duration", "60")
    try:
        first = started(proc)
        second = forge("--simulate", "--sim-gpus", "8", "--gpu", "5", "--sim-speed", "0", "--duration", "5")
        assert second.returncode == 0, second
        assert len(second.stderr.splitlines()) == 1, second.stderr
        assert_one_clean_line(second.stderr.strip(), "warning", f"pid {proc.pid}", "heartbeat-sim-gpu5")
    finally:
        proc.send_signal(signal.SIGTERM)
    code, events, err = finish_entry(proc, first)
    assert code == 0 and err == "", err


def test_a_second_filler_of_one_gpu_by_another_name_is_refused_on_the_virtual_gpu(vgpu: Any) -> None:
    """`--gpu 0` runs; `--gpu GPU-...` (the same GPU by its UUID, another heartbeat) exits 2 before it makes a
    context, without a kernel, saying which filler has the GPU."""
    from tests.test_real_path import finish, forge, wait_for

    gpu = vgpu()
    first = forge(gpu, "--duration", "30")
    try:
        wait_for(first, "start")
        second = forge(gpu, "--gpu", gpu.uuids()[0], "--duration", "2")
        assert second.wait() == 2, (second.stdout[-2000:], second.stderr[-2000:])
        [error] = second.of("error")
        assert error["exit_code"] == 2 and f"pid {first.proc.pid}" in error["reason"], error
        assert len(second.stderr.splitlines()) == 1, second.stderr
        assert_one_clean_line(second.stderr.strip(), f"pid {first.proc.pid}", gpu.uuids()[0])
        assert second.kernels() == []
        assert first.proc.poll() is None and first.of("yield") == [], "the first filler took the second for a job"
    finally:
        first.proc.send_signal(signal.SIGTERM)
    assert finish(first) == 0, first.stderr[-2000:]
    assert first.of("yield") == []


def test_a_fleet_leaves_out_a_gpu_another_filler_fills_and_fills_the_rest() -> None:
    """`--gpu 1` runs; `--gpus 0,1` fills GPU 0, and GPU 1's filler ends at once with an error line (exit 2)."""
    proc = spawn_entry("--wall-clock-sim", "--", "--gpu", "1", "--duration", "60")
    try:
        first = started(proc)
        second = spawn_entry("--wall-clock-sim", "--", "--gpus", "0,1", "--duration", "2")
        code, events, err = finish_entry(second)
        assert code == 2, (code, err)
        [error] = [e for e in events if e["event"] == "error"]
        assert error["gpu"] == 1 and error["exit_code"] == 2 and f"pid {proc.pid}" in error["reason"], error
        assert [e["gpu"] for e in events if e["event"] == "stop"] == [0]  # GPU 0 was filled to the end
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
    code, events, err = finish_entry(proc, first)
    assert code == 0 and err == "", err
