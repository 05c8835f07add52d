"""Many holders at once are one line (docs/holds.md, log lines): a kubelet that assigns one GPU to 1,000 pods in one
poll, and frees them in one, gives one `hold` line and one `release` line, each with the count of holders it stands
for, not a line per holder; the same for the exclusive-mode supervisor; holders that come and go one at a time
still get a line each."""

from __future__ import annotations

import io
import json
from pathlib import Path

from forge_load.log import EventLog
from forge_load.service.exclusive import Supervisor
from forge_load.steering import holds
from forge_load.steering.hold_watch import FillerHolds, HoldBoard, HoldChange
from forge_load.steering.holds import Hold
from tests.test_exclusive import RESUME_S, UNIX0_S, UUID, FakeChild, FakeProbe
from tests.test_kubelet import SIM_UUID, simulated

PODS = 1000


def pods(at_s: float) -> list[Hold]:
    return [Hold(SIM_UUID, f"k8s-ml_pod-{i:04d}_main", f"Kubernetes ml/pod-{i:04d} container main", at_s)
            for i in range(PODS)]


def test_a_thousand_kubelet_holders_at_once_are_one_hold_line_and_one_release_line(tmp_path: Path) -> None:
    board = HoldBoard()
    events, states = simulated(board, f"--duration 6 --hold-dir {tmp_path}",
                               [(1.05, lambda: board.replace(pods(1.05))), (3.05, lambda: board.replace([]))])
    lines = [e for e in events if e["event"] in ("hold", "release")]
    assert len(lines) == 2, f"{len(lines)} hold and release lines for {PODS} holders"
    assert [(e["event"], e["holder"], e["count"], e["state"]) for e in lines] == [
        ("hold", "k8s-ml_pod-0000_main", PODS, "held"), ("release", "k8s-ml_pod-0000_main", PODS, "filling")]
    assert lines[0]["reason"] == "Kubernetes ml/pod-0000 container main"
    assert {s for t, s in states if 1.3 < t < 3.05} == {"held"}
    assert {s for t, s in states if t > 3.5} == {"filling"}


def test_one_at_a_time_each_holder_has_its_line(tmp_path: Path) -> None:
    board = HoldBoard()
    first, second = pods(1.05)[:2]
    events, _ = simulated(board, f"--duration 5 --hold-dir {tmp_path}",
                          [(1.05, lambda: board.replace([first])), (2.05, lambda: board.replace([first, second])),
                           (3.05, lambda: board.replace([]))])
    lines = [(e["event"], e["holder"], e.get("count")) for e in events if e["event"] in ("hold", "release")]
    assert lines == [("hold", first.holder, None), ("hold", second.holder, None), ("release", first.holder, 2)]


def test_releases_for_different_reasons_stay_apart_and_the_fail_safe_alone() -> None:
    from forge_load.steering.hold_watch import coalesce

    changes = [HoldChange("release", "a", "released"), HoldChange("release", "b", "expired"),
               HoldChange("release", "c", "released"), HoldChange("hold", "d", "x"), HoldChange("hold", "e", "y"),
               HoldChange("hold", "-", "cannot list")]
    assert [(c.event, c.holder, c.reason, c.count) for c in coalesce(changes)] == [
        ("release", "a", "released", 2), ("release", "b", "expired", 1), ("hold", "d", "x", 2),
        ("hold", "-", "cannot list", 1)]


def test_the_exclusive_supervisor_writes_one_line_for_many_holders(tmp_path: Path) -> None:
    hold_dir = str(tmp_path)
    child = FakeChild(exits_when_asked=True)
    out = io.StringIO()
    now = [0.0]
    probe = FakeProbe()
    sup = Supervisor(probe.info, probe, child, FillerHolds(hold_dir, UUID, 77, lambda: UNIX0_S + now[0]),
                     EventLog("json", out, static={"gpu": 1, "uuid": UUID}), None, resume_after_s=RESUME_S,
                     foreign_mem_mib=64.0, start_s=0.0)
    sup.step(0.1)
    for i in range(200):
        holds.place(hold_dir, Hold(UUID, f"slurm-{i:03d}", "Slurm job", UNIX0_S))
    now[0] = 0.2
    sup.step(0.2)
    for i in range(200):
        holds.release(hold_dir, UUID, f"slurm-{i:03d}")
    now[0] = 1.5
    sup.step(1.5)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len([e for e in lines if e["event"] in ("hold", "release")]) == 2, lines[:5]
    assert [(e["event"], e["count"]) for e in lines if e["event"] in ("hold", "release")] == [
        ("hold", 200), ("release", 200)]
    assert sup.status().holds_begun == 200  # the metric still counts every holder
