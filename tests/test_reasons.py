"""control/reasons.py: the reasons not to fill one GPU, their order (held > paused > yielding), the quiet time after a
foreign job, when the sources are asked, and the hold lines of one look; in virtual time, with the real Pauses and
FillerHolds on a temporary directory."""

from __future__ import annotations

from pathlib import Path

from forge_load.control.powercap import PowerCap
from forge_load.control.reasons import HoldLine, Reasons, State, Verdict, hold_lines
from forge_load.steering import holds
from forge_load.steering.hold_watch import FAIL_SAFE_HOLDER, FillerHolds, HoldBoard, HoldChange
from forge_load.steering.holds import Hold
from forge_load.steering.pause import Pauses, PauseSwitch

UUID = "GPU-51a00000-0000-4000-8000-000000000000"


def test_nothing_in_the_way_fills() -> None:
    assert Reasons(5.0).verdict(0.0) == Verdict(State.FILLING, None)
    assert Reasons(5.0).verdict(0.0).may_fill


def test_the_order_held_then_paused_then_yielding() -> None:
    r = Reasons(5.0)
    r.foreign_seen(10.0)
    assert r.verdict(10.0, "process 7 on the GPU") == Verdict(State.YIELDING, "foreign job: process 7 on the GPU")
    r.pause = "SIGUSR1 (SIGUSR2 resumes)"
    assert r.verdict(10.0, "process 7 on the GPU") == Verdict(State.PAUSED, "paused: SIGUSR1 (SIGUSR2 resumes)")
    r.holders = ("slurm-2", "slurm-9")
    assert r.verdict(10.0, "process 7 on the GPU") == Verdict(State.HELD, "held by slurm-2,slurm-9")
    r.holders = ()  # the fail-safe: the holds cannot be counted
    assert r.verdict(10.0).reason == "held by the fail-safe"
    r.holders, r.pause = None, None
    assert r.verdict(14.9).state is State.YIELDING and not r.verdict(14.9).may_fill


def test_the_quiet_time_after_a_foreign_job_or_a_wait() -> None:
    r = Reasons(5.0)
    assert r.quiet_s(3.0) == float("inf")
    r.foreign_seen(10.0)
    assert r.verdict(14.99) == Verdict(State.YIELDING, "no foreign job for 5 s first")
    assert r.verdict(15.0).may_fill and r.quiet_s(15.0) == 5.0
    r.wait_quiet(20.0)  # exclusive mode: the child yielded by itself
    assert r.verdict(24.0).state is State.YIELDING and r.verdict(25.0).may_fill


def test_a_foreign_job_now_yields_even_with_no_quiet_time() -> None:
    r = Reasons(0.0)
    r.foreign_seen(1.0)
    assert r.verdict(1.0, "1024 MiB of GPU memory in use by another process").state is State.YIELDING
    assert r.verdict(1.0).may_fill  # nothing seen now, nothing to wait for


def test_the_power_cap_limits_the_duty() -> None:
    assert Reasons(5.0).duty_limit == 1.0
    cap = PowerCap(300.0, 700.0)
    assert Reasons(5.0, power_cap=cap).duty_limit == cap.duty_limit < 1.0


def test_the_pauses_are_asked_first_then_at_readings_and_when_the_switch_moves() -> None:
    switch = PauseSwitch()
    r = Reasons(5.0, pauses=Pauses(switch, wall_clock=lambda: 0.0))
    assert r.pauses_due(fresh=False)  # the first look, before anything is launched
    assert r.look_pauses() is None and not r.pauses_due(fresh=False) and r.pauses_due(fresh=True)
    switch.set(True, "SIGUSR1")
    assert r.pauses_due(fresh=False)
    change = r.look_pauses()
    assert change is not None and (change.event, change.reason) == ("pause", "SIGUSR1 (SIGUSR2 resumes)")
    assert r.paused and r.verdict(0.0).state is State.PAUSED
    switch.set(True, "SIGUSR1")
    assert r.look_pauses() is None  # the same reason: no line
    switch.set(False, "SIGUSR2")
    change = r.look_pauses()
    assert change is not None and (change.event, change.reason) == ("unpause", "SIGUSR2") and not r.paused
    assert Reasons(5.0).pauses_due(fresh=True) is False  # no pauses configured


def test_the_holds_on_disk_and_the_kubelets(tmp_path: Path) -> None:
    board = HoldBoard()
    now = [0.0]
    r = Reasons(5.0, holds=FillerHolds(str(tmp_path), UUID, 1, lambda: now[0], board=board))
    assert r.holds_due(fresh=False)
    look = r.look_holds(0.0)
    assert look.lines == [] and look.problems == [] and not r.held and not r.holds_due(fresh=False)
    holds.place(str(tmp_path), Hold(UUID, "slurm-1", "job 1", 0.0, 30.0))
    board.replace([Hold(UUID, f"pod-{i}", "", 0.0, None) for i in range(3)])
    assert r.holds_due(fresh=False)  # the kubelet's holds: at once, not at the next reading
    now[0] = 0.1
    look = r.look_holds(0.1)
    # the file's and the kubelet's, begun in one look: one line, with their count
    assert look.lines == [HoldLine("hold", "pod-0", "held by pod-0", {"count": 4}, turns=True)]
    assert r.holders == ("pod-0", "pod-1", "pod-2", "slurm-1") and r.holds_begun == 4
    assert r.verdict(0.1) == Verdict(State.HELD, "held by pod-0,pod-1,pod-2,slurm-1")
    board.replace([])
    holds.release(str(tmp_path), UUID, "slurm-1")
    now[0] = 1.5
    look = r.look_holds(1.5)
    assert [(x.event, x.holder, x.reason, x.more, x.turns) for x in look.lines] == [
        ("release", "pod-0", "released", {"count": 4}, True)]
    assert not r.held and r.verdict(1.5).may_fill


def test_hold_lines_turn_only_where_the_state_turns() -> None:
    a, b = HoldChange("hold", "a", ""), HoldChange("hold", "b", "job b")
    gone = HoldChange("release", "c", "expired")
    assert [x.turns for x in hold_lines([a, b], held_before=False, held_after=True)] == [True]  # one line, count 2
    assert [x.turns for x in hold_lines([gone, b], held_before=True, held_after=True)] == [False, False]
    assert [x.turns for x in hold_lines([gone], held_before=True, held_after=False)] == [True]
    fail_safe = HoldChange("hold", FAIL_SAFE_HOLDER, "the hold directory cannot be listed")
    lines = hold_lines([fail_safe, a], held_before=False, held_after=True)
    assert [(x.holder, x.turns) for x in lines] == [(FAIL_SAFE_HOLDER, True), ("a", False)]
    assert hold_lines([a], held_before=False, held_after=True)[0].reason == "held by a"
    until = hold_lines([HoldChange("hold", "u", "job u", until_unix_s=0.0)], held_before=False, held_after=True)
    assert until[0].more == {"until": until[0].more["until"]} and str(until[0].more["until"]).startswith("19")
