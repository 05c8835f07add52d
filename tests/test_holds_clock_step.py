"""`hold --wait` judges the filler's acknowledgement by the host's boot clock (CLOCK_BOOTTIME), which no step of the
wall clock moves (docs/holds.md): with the command's wall clock 4 s ahead of the filler's (a forward NTP step), a
live filler that has not drained is waited for, not taken for a dead one; with it 4 s behind, a filler that has
drained is not taken for one that answered before the hold. The filler here is the real FillerHolds, in a thread
on its own wall clock; the command is hold_command.main with its wall clock moved."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from forge_load.commands import hold as hold_command
from forge_load.steering import acks, hold_files, holds
from forge_load.steering.hold_watch import FillerHolds

GPU0 = "GPU-51a00000-0000-4000-8000-000000000000"


def shifted_time(step_s: float) -> SimpleNamespace:
    """The time module as hold_command sees it, with the wall clock `step_s` away from everyone else's."""
    return SimpleNamespace(time=lambda: time.time() + step_s, monotonic=time.monotonic, sleep=time.sleep,
                           strftime=time.strftime, localtime=time.localtime)


def hold_beside(filler: FillerHolds, honours: bool, argv: list[str], hold_dir: Path,
                capsys: pytest.CaptureFixture[str]) -> tuple[int, float, list[str]]:
    """`hold` with `argv` while `filler` runs as a filler's loop does (every 20 ms): it honours the holds it sees and
    drains at once when `honours`, else it fills on. Exit code, seconds the command took, stderr."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.02):
            filler.check(time.monotonic())
            held = honours and filler.held
            filler.acknowledge(time.monotonic(), "held" if held else "filling", drained=held)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        time.sleep(0.1)  # it has acknowledged: a live filler
        start_s = time.monotonic()
        code = hold_command.main([*argv, "--hold-dir", str(hold_dir)], env={}, uuids_of_host=lambda: [GPU0])
        took_s = time.monotonic() - start_s
    finally:
        stop.set()
        thread.join()
    return code, took_s, capsys.readouterr().err.splitlines()


def test_a_forward_step_of_the_commands_clock_does_not_make_a_live_filler_look_dead(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hold_command, "time", shifted_time(+4.0))
    filler = FillerHolds(str(tmp_path), GPU0, os.getpid(), time.time)
    code, took_s, err = hold_beside(filler, False, ["hold", "--gpu", "0", "--holder", "h", "--wait", "0.5"],
                                    tmp_path, capsys)
    assert code == 1, err  # not 0: the filler is alive and has not drained
    assert took_s >= 0.5 and "not acknowledged" in err[0]


def test_a_backward_step_does_not_hide_a_drain_written_after_the_hold(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hold_command, "time", shifted_time(-4.0))
    filler = FillerHolds(str(tmp_path), GPU0, os.getpid(), time.time)
    code, _, err = hold_beside(filler, True, ["hold", "--gpu", "0", "--holder", "h", "--wait", "3"], tmp_path,
                               capsys)
    assert code == 0, err
    assert filler.held


def test_an_acknowledgement_from_another_boot_is_no_filler(tmp_path: Path) -> None:
    now = acks.boot_stamp()
    other_boot = holds.BootStamp("another-boot", now.boot_s)  # the same uptime, another boot: no filler of ours
    ack = holds.Ack(GPU0, 1, "filling", (), False, time.time(), other_boot)
    assert acks.acknowledged(ack, "h", time.time(), time.time(), now, acks.boot_stamp())
    live = holds.Ack(GPU0, 1, "filling", (), False, time.time(), now)
    assert not acks.acknowledged(live, "h", time.time(), time.time(), now, acks.boot_stamp())
    # Written more than ACK_STALE_S of boot time ago: no filler, whatever the wall clock says.
    old = holds.Ack(GPU0, 1, "filling", (), False, time.time() + 100.0,
                    holds.BootStamp(now.boot_id, now.boot_s - holds.ACK_STALE_S - 0.1))
    assert acks.acknowledged(old, "h", time.time(), time.time(), now, acks.boot_stamp())
    assert hold_files.ack_from_json(hold_files.ack_to_json(live), GPU0) == live
