"""Where a filler keeps its heartbeat and its locks, and what it leaves there: TMPDIR honoured, a systemd unit's
runtime directory (found by an operator's `forge-load health`), no lock file left behind at exit, and no GPU at all
said as such (exit 3) even while another filler holds the heartbeat."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forge_load.commands import health as health_command
from forge_load.config.load import load_config
from forge_load.config.settings import Config
from forge_load.service import health
from tests.host_paths import settings_free
from tests.test_app import no_nvml

ROOT = Path(__file__).resolve().parent.parent


def forge(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full_env = settings_free("TARGET", "TMPDIR", "RUNTIME_DIRECTORY")
    full_env.update(env, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "forge_load", *args], capture_output=True, text=True,
                          env=full_env, timeout=120, cwd=ROOT)


def test_tmpdir_is_honoured_for_the_heartbeat_and_the_locks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    mine = tmp_path / f"forge_load-{os.geteuid()}"
    assert health.default_heartbeat_path() == mine / "heartbeat-gpu0"
    assert health.gpu_lock_path("GPU-x").parent == mine
    monkeypatch.setenv("TMPDIR", "relative")  # not a path mktemp would take either: /tmp
    assert health.default_heartbeat_path() == Path("/tmp") / mine.name / "heartbeat-gpu0"


def test_a_simulated_run_leaves_no_lock_file_behind(tmp_path: Path) -> None:
    result = forge("--simulate", "--sim-speed", "0", "--duration", "2", env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    mine = tmp_path / f"forge_load-{os.geteuid()}"
    assert mine.is_dir() and list(mine.iterdir()) == []  # neither the heartbeat nor its .lock


def test_a_gpu_lock_is_removed_when_let_go_and_can_be_claimed_again(tmp_path: Path) -> None:
    uuid = "GPU-51a00000-0000-4000-8000-000000000000"
    fd, holder = health.claim_gpu(uuid, base=tmp_path)
    assert fd is not None and holder is None
    lock = health.gpu_lock_path(uuid, base=tmp_path)
    assert health.claim_lock(lock) == (None, str(os.getpid()))  # held: the second claim names the first
    health.release_lock(fd, lock)
    assert not lock.exists()
    fd, holder = health.claim_gpu(uuid, base=tmp_path)
    assert fd is not None and holder is None and lock.exists()
    health.release_lock(fd, lock)


def test_a_lock_removed_under_a_claim_is_claimed_on_the_new_file(tmp_path: Path) -> None:
    lock = tmp_path / "gpu-x.lock"
    fd, _ = health.claim_lock(lock)
    assert fd is not None
    stale = os.open(lock, os.O_RDWR)  # a claim that opened the file just before its holder let go
    health.release_lock(fd, lock)
    again, _ = health.claim_lock(lock)
    assert again is not None and lock.exists() and os.fstat(again).st_ino == lock.stat().st_ino
    os.close(stale)
    health.release_lock(again, lock)


def test_no_gpu_is_exit_3_even_while_another_filler_holds_the_heartbeat(tmp_path: Path) -> None:
    no_nvml()
    heartbeat = tmp_path / "heartbeat"
    fd, _ = health.claim_lock(heartbeat.with_name("heartbeat.lock"))  # another filler, as far as it can tell
    assert fd is not None
    try:
        result = forge("--duration", "2", env={"FORGE_HEARTBEAT_FILE": str(heartbeat)})
    finally:
        os.close(fd)
    assert (result.returncode, result.stderr) == (3, ""), result.stderr
    assert "no usable GPU" in result.stdout and str(os.getpid()) not in result.stdout


def test_a_systemd_units_filler_keeps_its_heartbeat_in_its_runtime_directory(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = tmp_path / "run" / "forge-load"
    runtime.mkdir(parents=True, mode=0o755)
    monkeypatch.setenv("RUNTIME_DIRECTORY", f"{runtime}:{runtime}/holds")  # as systemd sets it
    config = load_config(["--gpus", "all"], {})
    assert health.heartbeat_location(config) == (runtime / "heartbeat-gpus-all", True)
    assert health.gpu_lock_path("GPU-x").parent == runtime


def test_an_operators_health_check_finds_the_units_heartbeat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "operator"))  # the operator has no heartbeat of its own
    unit_dir = tmp_path / "run" / "forge-load"
    unit_dir.mkdir(parents=True, mode=0o755)
    monkeypatch.setattr(health, "UNIT_RUNTIME_DIR", unit_dir)
    beat = unit_dir / health.heartbeat_name(Config(gpus="all"))
    beat.write_text(f"{time.time():.3f}\n")
    if os.geteuid() == 0:  # the unit's dynamic user owns both; the operator (root here) reads them
        os.chown(unit_dir, 61234, 61234)
        os.chown(beat, 61234, 61234)
    assert health_command.main(["--gpus", "all"]) == 0
    assert "the systemd unit's" in capsys.readouterr().out
    assert health_command.main([]) == 1  # GPU 0 named: not the unit's, which says what it has
    assert "heartbeat-gpus-all" in capsys.readouterr().out
    old = time.time() - 600
    os.utime(beat, (old, old))
    assert health_command.main(["--gpus", "all"]) == 1
    unit_dir.chmod(0o777)  # anyone could plant it: not trusted
    os.utime(beat)
    assert health_command.main(["--gpus", "all"]) == 1
    assert "only the unit's user may write" in capsys.readouterr().out
