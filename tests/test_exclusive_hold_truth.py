"""Exclusive compute mode: an acknowledged hold means our context is gone, whatever becomes of the supervisor
(docs/exclusive.md). The child takes the GPU's context lock before its context exists, which the kernel lets go
only at its exit, and `hold --wait` never returns 0 while that lock is taken; the child watches the holds itself
and ends on one the supervisor has not ended it for (the supervisor stopped or hung). On the virtual GPU with the
supervisor SIGSTOPped: `hold --wait` returns 0 only once our child and its context are gone, and a real CUDA job
then creates its context."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import pickle
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from forge_load.commands import hold as hold_command
from forge_load.config.settings import Config
from forge_load.config.sim import SimConfig
from forge_load.gpu.backend import SimBackend
from forge_load.service.exclusive_child import child_main, take_context_lock
from forge_load.steering import acks, holds
from forge_load.steering.hold_watch import FillerHolds
from forge_load.steering.holds import Hold
from tests.neighbours import FILLER, NEIGHBOUR, AsUser, as_user, hold_dir_for_all, local_user, shared_dir
from tests.test_exclusive_vgpu import command, foreign, ours, wait_until
from tests.test_real_path import finish, forge
from vgpu.pytest_plugin import VgpuFactory

GPU0 = "GPU-51a00000-0000-4000-8000-000000000000"  # the simulated GPU 0, seed 0


def hold(hold_dir: Path, wait_s: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = hold_command.main(["hold", "--gpu", GPU0, "--holder", "job", "--wait", wait_s, "--hold-dir", str(hold_dir)],
                        env={})
    return code, capsys.readouterr().err.splitlines()


def test_hold_wait_never_returns_0_while_our_childs_context_lock_is_taken(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """No acknowledgement at all (a supervisor that never wrote one, or whose one went stale) beside a live child of
    ours: not "no filler"."""
    lock, why_not = take_context_lock(str(tmp_path), GPU0.upper(), threading.Event())  # as the child does
    assert lock is not None and why_not is None and acks.context_held(str(tmp_path), GPU0)  # in any spelling
    assert take_context_lock(str(tmp_path), GPU0, threading.Event())[0] is None  # one holder at a time
    try:
        code, err = hold(tmp_path, "0.3", capsys)
        assert code == 1 and "not acknowledged" in err[0], err
    finally:
        lock.close()  # the child's exit
    assert not acks.context_held(str(tmp_path), GPU0)
    code, err = hold(tmp_path, "0.3", capsys)
    assert code == 0, err


def test_the_lock_file_is_the_fillers_own_and_never_a_problem_in_the_directory(tmp_path: Path) -> None:
    lock, _ = take_context_lock(str(tmp_path), GPU0, threading.Event())
    assert lock is not None and lock.fd >= 100  # above the driver's descriptors, so that it is closed after them
    assert lock.legacy_fd is not None and lock.legacy_fd >= 100  # earlier releases' flock too
    lock.close()
    assert holds.list_dir(str(tmp_path)).ignored == ()


def run_child(hold_dir: Path, aged_out: dict[str, int], place_after_s: float | None,
              duration_s: float) -> list[dict[str, object]]:
    """The exclusive-mode child in this process on the simulated GPU in real time (its supervisor's end of stdin
    kept open and silent, as a stopped supervisor's is); a hold placed after `place_after_s`."""
    config = Config(log_format="json", simulate=True, sim=SimConfig(speed=1.0), duration_s=duration_s, gpu=GPU0)
    read_fd, write_fd = os.pipe()
    os.write(write_fd, pickle.dumps((config, 0.0, str(hold_dir), aged_out)))
    out = io.StringIO()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    timer = threading.Timer(place_after_s or 0.0, lambda: holds.place(str(hold_dir), Hold(GPU0, "late", "", 1.0)))
    if place_after_s is not None:
        timer.start()
    stdin = os.fdopen(read_fd, "rb")
    try:
        assert child_main(stdin, out, SimBackend(config.sim)) == 0
    finally:
        timer.cancel()
        os.close(write_fd)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    time.sleep(0.1)
    stdin.close()
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_the_child_ends_itself_on_a_hold_its_supervisor_does_not_end_it_for(tmp_path: Path) -> None:
    lines = run_child(tmp_path, {}, place_after_s=0.5, duration_s=60.0)
    stop = lines[-1]
    assert stop["event"] == "stop", lines
    assert str(stop["reason"]).startswith("held by late, and the supervisor has not ended the child")


def test_a_hold_the_supervisor_let_age_out_does_not_end_the_child(tmp_path: Path) -> None:
    holds.place(str(tmp_path), Hold(GPU0, "old", "", 1.0))
    mtime_ns = (tmp_path / holds.hold_name(GPU0, "old")).stat().st_mtime_ns
    lines = run_child(tmp_path, {"old": mtime_ns}, place_after_s=None, duration_s=1.5)
    assert lines[-1]["event"] == "stop" and lines[-1]["reason"] == "duration reached", lines


def test_hold_wait_with_the_supervisor_stopped_returns_only_once_our_context_is_gone(vgpu: VgpuFactory,
                                                                                      tmp_path: Path) -> None:
    gpu = vgpu(gpus=1, compute_mode="exclusive_process")
    hold_dir = tmp_path / "holds"
    hold_dir.mkdir()
    run = forge(gpu, "--duration", "120", "--resume-after", "2", "--log-interval", "1",
                env={"FORGE_HOLD_DIR": str(hold_dir)})
    stopped = False
    try:
        child = int(wait_until(run, "child_start", 0)["child_pid"])
        wait_until(run, "status", 0)  # the child fills
        os.kill(run.proc.pid, signal.SIGSTOP)  # the supervisor: stopped (a hang on NVML or stdout does the same)
        stopped = True
        asked_s = time.time()
        held = command(gpu, "hold", "--gpu", "0", "--holder", "job", "--wait", "30", "--hold-dir", str(hold_dir))
        held_s = time.time()
        contexts_then = [c.pid for c in gpu.contexts()]
        assert held.returncode == 0, held.stderr  # the child saw the hold and ended itself within the 30 s
        assert child not in contexts_then  # our context was gone when it returned
        code, lines, stderr = foreign(gpu, 0, seconds=1.0)
        assert code == 0, stderr[-2000:]  # the job's context: created, in EXCLUSIVE_PROCESS mode
        assert [k for k in ours(gpu, {child}, 0) if k.end > held_s] == []
    finally:
        if stopped:
            os.kill(run.proc.pid, signal.SIGCONT)
        run.proc.send_signal(signal.SIGTERM)
        code = finish(run)
    assert code == 0, run.stderr[-3000:]
    assert gpu.contexts() == []
    child_stop = [e for e in run.events if e["event"] == "stop" and "supervisor has not ended" in str(e["reason"])]
    assert len(child_stop) == 1, run.events
    print(f"hold --wait with the supervisor stopped returned 0 after {held_s - asked_s:.2f} s, the command's start "
          "included (virtual GPU, this machine)")


def test_holds_does_not_say_no_filler_beside_a_live_context_of_ours(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    holds.place(str(tmp_path), Hold(GPU0, "job", "", time.time()))
    lock, _ = take_context_lock(str(tmp_path), GPU0, threading.Event())  # a child whose supervisor is silent
    assert lock is not None
    try:
        assert hold_command.main(["holds", "--json", "--hold-dir", str(tmp_path)], env={}) == 0
        (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    finally:
        lock.close()
    assert row["filler"] == "draining (our exclusive-mode child still holds the GPU)"


# --- a directory shared with neighbours ----------------------------------------------------------------------

def _take_and_keep_the_context_lock(channel: Any, hold_dir: str) -> bool:
    """As the exclusive-mode child does, as its own user: take the lock, say whether, keep it until told."""
    lock, why_not = take_context_lock(hold_dir, GPU0, threading.Event())
    channel.put(why_not)
    channel.get()
    if lock is not None:
        lock.close()  # the child's exit
    return lock is not None


def test_a_child_takes_its_context_lock_where_a_neighbour_planted_its_name(capsys: pytest.CaptureFixture[str]) -> None:
    neighbour, filler_user = local_user(NEIGHBOUR), local_user(FILLER)
    with shared_dir() as parent:
        hold_dir = hold_dir_for_all(parent)
        as_user(neighbour, lambda _c: (hold_dir / f"filler.{GPU0}.lock").write_text(""))
        child = AsUser(filler_user, _take_and_keep_the_context_lock, str(hold_dir))
        try:
            assert child.recv() is None  # taken
            code, err = hold(hold_dir, "0.3", capsys)
            assert code == 1 and "not acknowledged" in err[0], err  # our context may be there: never 0
            child.send("exit")
            assert child.result() is True
        finally:
            child.kill()
        code, err = hold(hold_dir, "0.3", capsys)
        assert code == 0, err


def _lock_every_lock_file(channel: Any, hold_dir: str) -> int:
    """A reader of the directory: every file named like a lock, opened read-only and locked every way a reader can
    (flock and a POSIX read lock), kept until told."""
    fds = []
    for path in Path(hold_dir).rglob("*lock*"):
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            fds.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fd2 = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            fds.append(fd2)
            fcntl.lockf(fd2, fcntl.LOCK_SH | fcntl.LOCK_NB)
    channel.put(len(fds))
    channel.get()
    for fd in fds:
        os.close(fd)
    return len(fds)


def test_a_reader_holding_the_context_lock_file_does_not_fail_the_hold(capsys: pytest.CaptureFixture[str]) -> None:
    # A reader of the directory may open the context lock's file; taking a lock on it must not make every
    # `hold --wait` wait out its time once our child (and its context) is gone.
    neighbour = local_user(NEIGHBOUR)
    with shared_dir() as parent:
        hold_dir = parent / "holds"
        hold_dir.mkdir()  # root's, 0755: the neighbour only reads
        lock, _ = take_context_lock(str(hold_dir), GPU0, threading.Event())
        assert lock is not None
        lock.close()  # our child has exited
        reader = AsUser(neighbour, _lock_every_lock_file, str(hold_dir))
        try:
            assert reader.recv() >= 1  # it found and locked the lock file

            def supervisor(stop: threading.Event) -> None:  # alive, no child: drained
                filler = FillerHolds(str(hold_dir), GPU0, os.getpid(), time.time)
                while not stop.wait(0.05):
                    filler.check(time.monotonic())
                    filler.acknowledge(time.monotonic(), "held" if filler.held else "filling", True)
                filler.close()

            stop = threading.Event()
            thread = threading.Thread(target=supervisor, args=(stop,))
            thread.start()
            try:
                code, err = hold(hold_dir, "3", capsys)
            finally:
                stop.set()
                thread.join()
            assert code == 0, err
            reader.send("done")
            reader.result()
        finally:
            reader.kill()
