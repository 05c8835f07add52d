"""A hold on a GPU in MIG mode holds every MIG device of it (docs/holds.md, MIG): a job given the whole GPU (`docker
run --gpus device=0`, a Slurm job's index, a hold by index) runs on all of its MIG devices, so each MIG device's
filler honours it, acknowledges it as the GPU's, and `hold --wait` on the GPU waits for every one of them."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from forge_load.commands import hold as hold_command
from forge_load.service.exclusive_child import take_context_lock, watch_holds
from forge_load.service.runtime import StopEvent
from forge_load.steering import acks, holds
from forge_load.steering.hold_watch import FillerHolds, HoldBoard, HoldWatch

GPU = "GPU-51a00000-0000-4000-8000-000000000000"
MIG_A = "MIG-51a00000-0000-4000-8000-0000000000aa"
MIG_B = "MIG-51a00000-0000-4000-8000-0000000000bb"
OTHER = "GPU-0be00000-0000-4000-8000-000000000000"


def test_a_mig_devices_watch_honours_a_hold_on_its_gpu(tmp_path: Path) -> None:
    holds.place(str(tmp_path), holds.Hold(GPU, "job1", "whole GPU", time.time()))
    watch = HoldWatch(str(tmp_path), MIG_A, whole_gpu_uuid=GPU)
    changes, _ = watch.check(0.0, time.time())
    assert watch.holders == ("job1",)
    assert [(c.event, c.holder) for c in changes] == [("hold", "job1")]


def test_a_hold_on_another_gpu_or_on_a_sibling_mig_device_does_not(tmp_path: Path) -> None:
    holds.place(str(tmp_path), holds.Hold(OTHER, "job1", "", time.time()))
    holds.place(str(tmp_path), holds.Hold(MIG_B, "job2", "", time.time()))
    watch = HoldWatch(str(tmp_path), MIG_A, whole_gpu_uuid=GPU)
    watch.check(0.0, time.time())
    assert watch.holders == ()


def test_one_holder_on_the_gpu_and_on_the_device_is_one_hold(tmp_path: Path) -> None:
    holds.place(str(tmp_path), holds.Hold(GPU, "job1", "", time.time()))
    holds.place(str(tmp_path), holds.Hold(MIG_A, "job1", "", time.time()))
    watch = HoldWatch(str(tmp_path), MIG_A, whole_gpu_uuid=GPU)
    changes, _ = watch.check(0.0, time.time())
    assert watch.holders == ("job1",) and len(changes) == 1
    holds.release(str(tmp_path), GPU, "job1")
    watch.check(2.0, time.time())
    assert watch.holders == ("job1",)  # its own hold on the device still stands


def test_the_kubelets_assignment_of_the_whole_gpu_holds_its_mig_devices(tmp_path: Path) -> None:
    board = HoldBoard()
    board.replace([holds.Hold(GPU, "pod/a", "", time.time())])
    watch = HoldWatch(str(tmp_path / "none"), MIG_A, board=board, whole_gpu_uuid=GPU)
    watch.check(0.0, time.time())
    assert watch.holders == ("pod/a",)


def test_a_mig_devices_acknowledgement_names_its_gpu(tmp_path: Path) -> None:
    filler = FillerHolds(str(tmp_path), MIG_A, os.getpid(), time.time, whole_gpu_uuid=GPU)
    filler.acknowledge(0.0, "filling", drained=False)
    ack = acks.read_ack(str(tmp_path), MIG_A)
    assert ack is not None and ack.of_gpu == GPU
    assert [a.gpu_uuid for a in acks.mig_acks(str(tmp_path), GPU)] == [MIG_A]
    assert acks.mig_acks(str(tmp_path), OTHER) == []
    whole = FillerHolds(str(tmp_path), OTHER, os.getpid(), time.time)
    whole.acknowledge(0.0, "filling", drained=False)
    assert acks.read_ack(str(tmp_path), OTHER).of_gpu == ""  # type: ignore[union-attr]
    written = sorted(p.name for p in (tmp_path / f"filler.{os.geteuid()}").iterdir())
    assert written == [f"{OTHER}.ack.json", f"{MIG_A}.of.{GPU}.ack.json"]  # a whole GPU's names no other


def _fillers(fillers: list[tuple[FillerHolds, bool]], stop: threading.Event) -> threading.Thread:
    """Each filler as its loop would run it (every 20 ms): honouring what it sees and draining at once when its flag
    says so, else filling on regardless."""

    def loop() -> None:
        while not stop.wait(0.02):
            for filler, honours in fillers:
                filler.check(time.monotonic())
                held = honours and filler.held
                filler.acknowledge(time.monotonic(), "held" if held else "filling", drained=held)

    thread = threading.Thread(target=loop)
    thread.start()
    return thread


@pytest.mark.parametrize("b_honours", [True, False])
def test_hold_wait_on_the_gpu_waits_for_every_mig_devices_filler(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], b_honours: bool) -> None:
    a = FillerHolds(str(tmp_path), MIG_A, os.getpid(), time.time, whole_gpu_uuid=GPU)
    b = FillerHolds(str(tmp_path), MIG_B, os.getpid(), time.time, whole_gpu_uuid=GPU)
    stop = threading.Event()
    thread = _fillers([(a, True), (b, b_honours)], stop)
    try:
        time.sleep(0.1)  # both have acknowledged: live fillers
        code = hold_command.main(["hold", "--gpu", "0", "--holder", "job1", "--wait", "1", "--hold-dir",
                                  str(tmp_path)], env={}, uuids_of_host=lambda: [GPU])
    finally:
        stop.set()
        thread.join()
    err = capsys.readouterr().err
    if b_honours:
        assert code == 0, err
        assert a.held and b.held
    else:  # one MIG device's filler fills on: the GPU is not drained, and the command says so
        assert code == 1, err
        assert "not acknowledged" in err and GPU in err


def test_holds_lists_the_mig_devices_fillers_of_a_gpu_hold(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    holds.place(str(tmp_path), holds.Hold(GPU, "job1", "", time.time()))
    a = FillerHolds(str(tmp_path), MIG_A, os.getpid(), time.time, whole_gpu_uuid=GPU)
    b = FillerHolds(str(tmp_path), MIG_B, os.getpid(), time.time, whole_gpu_uuid=GPU)
    for filler, drained in ((a, True), (b, False)):
        filler.check(0.0)
        filler.acknowledge(0.0, "held", drained=drained)
    assert hold_command.main(["holds", "--json", "--hold-dir", str(tmp_path)], env={}) == 0
    assert '"filler": "draining (1 of 2 MIG devices\' fillers)"' in capsys.readouterr().out
    b.acknowledge(1.0, "held", drained=True)
    assert hold_command.main(["holds", "--json", "--hold-dir", str(tmp_path)], env={}) == 0
    assert '"filler": "drained (2 of 2 MIG devices\' fillers)"' in capsys.readouterr().out


def test_a_hold_that_makes_the_directory_waits_for_every_mig_device_to_find_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The first hold makes the directory; each MIG device's filler finds it at its own next refresh. One MIG device's
    acknowledgement is not all of them: `hold --wait` returns only once the late one has drained too."""
    hold_dir = tmp_path / "holds"
    a = FillerHolds(str(hold_dir), MIG_A, os.getpid(), time.time, whole_gpu_uuid=GPU)
    b = FillerHolds(str(hold_dir), MIG_B, os.getpid(), time.time, whole_gpu_uuid=GPU)
    stop = threading.Event()

    def loop() -> None:  # a finds the directory at once, b a second later (its refresh came just before the hold)
        found_s: float | None = None
        while not stop.wait(0.02):
            found_s = found_s or (time.monotonic() if hold_dir.is_dir() else None)
            for filler, late_s in ((a, 0.0), (b, 1.0)):
                if found_s is not None and time.monotonic() - found_s >= late_s:
                    filler.check(time.monotonic())
                    filler.acknowledge(time.monotonic(), "held" if filler.held else "filling", drained=filler.held)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        code = hold_command.main(["hold", "--gpu", "0", "--holder", "job1", "--wait", "5", "--hold-dir",
                                  str(hold_dir)], env={}, uuids_of_host=lambda: [GPU])
        b_ack = acks.read_ack(str(hold_dir), MIG_B)
    finally:
        stop.set()
        thread.join()
    assert code == 0, capsys.readouterr().err
    assert b_ack is not None and b_ack.drained  # b had drained before the command returned


def test_a_hold_on_the_gpu_is_not_no_filler_while_a_mig_devices_child_holds_its_context(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A MIG device in exclusive compute mode whose supervisor went silent (its acknowledgement stale) beside its live
    child: `hold --wait` on the GPU does not return 0, and `holds` does not say "no filler"."""
    acks.write_ack(str(tmp_path), holds.Ack(MIG_A, 1, "filling", (), False, time.time() - 60, of_gpu=GPU))
    lock, _ = take_context_lock(str(tmp_path), MIG_A, threading.Event())  # as that child does
    assert lock is not None
    argv = ["hold", "--gpu", "0", "--holder", "job1", "--wait", "0.3", "--hold-dir", str(tmp_path)]
    try:
        assert hold_command.main(argv, env={}, uuids_of_host=lambda: [GPU]) == 1
        assert hold_command.main(["holds", "--json", "--hold-dir", str(tmp_path)], env={}) == 0
        assert '"filler": "draining (our exclusive-mode child still holds the GPU)"' in capsys.readouterr().out
    finally:
        lock.close()  # the child's exit
    assert hold_command.main(argv, env={}, uuids_of_host=lambda: [GPU]) == 0


def test_a_mig_devices_exclusive_mode_child_ends_itself_on_a_hold_on_its_gpu(tmp_path: Path) -> None:
    """Its own look at the holds (a supervisor gone silent): its GPU's holds are its own, a sibling's are not."""
    holds.place(str(tmp_path), holds.Hold(MIG_B, "sibling", "", time.time()))
    stop, wake = StopEvent(), threading.Event()
    thread = threading.Thread(target=watch_holds, args=(str(tmp_path), MIG_A, {}, stop, wake, GPU))
    thread.start()
    try:
        assert not stop.wait(1.0)  # past SUPERVISOR_GRACE_S: the sibling's hold is no reason
        holds.place(str(tmp_path), holds.Hold(GPU, "job1", "whole GPU", time.time()))
        assert stop.wait(5.0)
    finally:
        stop.set()
        thread.join()
    assert stop.reason.startswith("held by job1, and the supervisor has not ended the child")
