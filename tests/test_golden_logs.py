"""The log lines of whole scenarios on the simulated GPU in virtual time, pinned byte for byte (tests/golden/): foreign
jobs, the boost, the power cap, every reason to pause, holds on disk and the kubelet's, and exclusive mode's supervisor.
A change to how the filler decides that is meant to change no behaviour must leave these files as they are.

After a change that is meant to change the lines: `UPDATE_GOLDEN=1 .venv/bin/python -m pytest
tests/test_golden_logs.py`, and read the diff. Only what differs from run to run is masked: the start line's wall
time, the version and the temporary directory's path."""

from __future__ import annotations

import io
import itertools
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from simrun import step_with
from test_exclusive import UNIX0_S, FakeChild, FakeProbe
from test_exclusive import UUID as EXCLUSIVE_UUID

from forge_load.config.load import load_config
from forge_load.control.filler import NO_CONTROLS, Controls
from forge_load.control.probe import GpuProcess
from forge_load.log import EventLog
from forge_load.service.exclusive import Supervisor
from forge_load.service.loop import run_simulated
from forge_load.steering import holds
from forge_load.steering.hold_watch import FillerHolds, HoldBoard
from forge_load.steering.holds import Hold
from forge_load.steering.pause import Pauses, PauseSwitch

GOLDEN = Path(__file__).resolve().parent / "golden"
UUID = "GPU-51a00000-0000-4000-8000-000000000000"  # the simulated GPU 0, seed 0
Action = tuple[float, Callable[[], object]]
MTIMES_NS = itertools.count(1)  # the hold directory's mtimes the scenarios set: each one new


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A hold's `until` is shown in the process's local time: UTC here, wherever the tests run."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def masked(text: str, tmp: Path) -> str:
    text = text.replace(str(tmp), "<tmp>")
    text = re.sub(r"wall_time=[0-9.]+", "wall_time=<wall>", text)
    return re.sub(r"version=[^ ]+", "version=<version>", text)


def pinned(name: str, text: str) -> None:
    path = GOLDEN / f"{name}.log"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} is missing: UPDATE_GOLDEN=1 writes it"
    assert text == path.read_text()


def simulated(tmp: Path, flags: str, actions: list[Action], controls: Controls = NO_CONTROLS) -> str:
    """A run's text log; the wall clock starts at Unix time 0 (UTC), so the hours and the holds' times are virtual."""
    config = load_config(f"--simulate --sim-speed 0 {flags}".split(), env={"TZ": "UTC"})
    out = io.StringIO()
    run_simulated(config, out, on_start=step_with(actions, lambda _rt, _now_s: None), controls=controls,
                  wall_start_s=0.0)
    return masked(out.getvalue(), tmp)


def touched(hold_dir: Path, act: Callable[[], object]) -> Callable[[], None]:
    """`act` on the hold directory, then its mtime moved to a value of its own: the filler lists the directory again
    at once, as it does in real time, even where the coarse file clock would not have moved between two steps."""
    def run() -> None:
        act()
        move = next(MTIMES_NS)
        os.utime(hold_dir, ns=(move, move))

    return run


def test_foreign_jobs_the_boost_and_the_stale_readings(tmp_path: Path) -> None:
    pinned("foreign", simulated(tmp_path, "--duration 120 --sim-foreign 20-40,60-61 --sim-foreign-hidden 80-90 "
                                          "--resume-after 5 --boost-after 12 --boost-target 0.6 --log-interval 10",
                                []))


def test_the_power_cap(tmp_path: Path) -> None:
    # The burn shape: the lean one draws too little for a cap of 300 W to bind (docs/design.md §15).
    pinned("powercap", simulated(tmp_path, "--duration 40 --max-power-w 300 --sim-foreign 15-20 --resume-after 3 "
                                           "--log-interval 5 --shape burn", []))


def test_every_reason_to_pause(tmp_path: Path) -> None:
    switch = PauseSwitch()
    pause_file = tmp_path / "pause"
    actions: list[Action] = [
        (70.0, lambda: switch.set(True, "SIGUSR1")),
        (72.0, lambda: pause_file.write_text("")),
        (75.0, lambda: switch.set(False, "SIGUSR2")),
        (78.0, lambda: pause_file.unlink()),
        (90.0, lambda: pause_file.write_text("100")),  # a time already passed
        (95.0, lambda: pause_file.write_text("130")),  # until 130 s
    ]
    for i in range(12):  # a storm: SIGUSR1 and SIGUSR2 by turns
        actions.append((140.0 + i * 0.05, lambda i=i: switch.set(i % 2 == 0, "SIGUSR1" if i % 2 == 0 else "SIGUSR2")))
    pinned("pauses", simulated(tmp_path, f"--duration 160 --active-hours 00:01-23:00 --pause-file {pause_file} "
                                         "--sim-foreign 100-104 --resume-after 8 --log-interval 20", actions,
                               Controls(switch)))


def test_holds_on_disk_and_the_kubelets(tmp_path: Path) -> None:
    hold_dir = tmp_path / "holds"
    hold_dir.mkdir()
    d = str(hold_dir)
    board = HoldBoard()
    switch = PauseSwitch()

    def place(holder: str, at_s: float, until_s: float | None = None) -> Callable[[], None]:
        return touched(hold_dir, lambda: holds.place(d, Hold(UUID, holder, f"job {holder}", at_s, until_s)))

    def release(holder: str) -> Callable[[], None]:
        return touched(hold_dir, lambda: holds.release(d, UUID, holder))

    actions: list[Action] = [
        (2.0, place("slurm-1", 2.0)),
        (3.0, place("slurm-2", 3.0)),
        (4.0, release("slurm-1")),
        (6.0, release("slurm-2")),
        (9.0, place("short", 9.0, until_s=11.0)),  # expires
        (14.0, lambda: switch.set(True, "SIGUSR1")),
        (15.0, place("during-pause", 15.0)),  # a hold outranks the pause
        (16.0, lambda: switch.set(True, "SIGUSR1")),
        (18.0, release("during-pause")),  # paused again
        (19.0, lambda: switch.set(False, "SIGUSR2")),
        (22.0, place("job-behind", 22.0)),  # the job comes at 23 s, behind its hold
        (27.0, release("job-behind")),  # yielding: the job is still there
        (40.0, lambda: board.replace([Hold(UUID, f"pod-{i:04}", "kubelet", 40.0, None) for i in range(50)])),
        (42.0, lambda: board.replace([Hold(UUID, "pod-0007", "kubelet", 40.0, None)])),
        (43.0, place("pod-0007", 43.0)),  # a file's hold of the same holder: the file's
        (45.0, lambda: board.replace([])),
        (46.0, release("pod-0007")),
        (50.0, touched(hold_dir, lambda: (hold_dir / "hold.bad.json").write_text("x"))),  # a problem, once
    ]
    pinned("holds", simulated(tmp_path, f"--duration 60 --hold-dir {d} --sim-foreign 23-30 --resume-after 4 "
                                        "--hold-idle-age-out 0 --log-interval 30", actions,
                              Controls(switch, board=board)))


def test_a_hold_ages_out(tmp_path: Path) -> None:
    hold_dir = tmp_path / "holds"
    hold_dir.mkdir()
    actions: list[Action] = [
        (1.0, touched(hold_dir, lambda: holds.place(str(hold_dir), Hold(UUID, "idle", "gone", 1.0, None)))),
        (30.0, touched(hold_dir, lambda: holds.place(str(hold_dir), Hold(UUID, "idle", "again", 30.0, None)))),
    ]
    pinned("age_out", simulated(tmp_path, f"--duration 45 --hold-dir {hold_dir} --hold-idle-age-out 10 "
                                          "--sim-foreign 34-36 --resume-after 2 --log-interval 45", actions))


@pytest.mark.parametrize("paused", [False, True])
def test_the_exclusive_mode_supervisor(tmp_path: Path, paused: bool) -> None:
    hold_dir = tmp_path / "holds"
    holds.ensure_dir(str(hold_dir))
    now = [0.0]
    probe, child, out = FakeProbe(), FakeChild(), io.StringIO()
    switch = PauseSwitch()
    pauses = Pauses(switch, wall_clock=lambda: UNIX0_S + now[0]) if paused else None
    log = EventLog("text", out, static={"gpu": 1, "uuid": EXCLUSIVE_UUID}, wall_clock=lambda: UNIX0_S + now[0])
    filler_holds = FillerHolds(str(hold_dir), EXCLUSIVE_UUID, 77, lambda: UNIX0_S + now[0], idle_age_out_s=20.0)
    sup = Supervisor(probe.info, probe, child, filler_holds, log, pauses, resume_after_s=3.0, foreign_mem_mib=64.0,
                     start_s=0.0)

    def place(holder: str, until_s: float | None = None) -> Callable[[], None]:
        return touched(hold_dir, lambda: holds.place(str(hold_dir), Hold(EXCLUSIVE_UUID, holder, "Slurm job",
                                                                         UNIX0_S + now[0], until_s)))

    def release(holder: str) -> Callable[[], None]:
        return touched(hold_dir, lambda: holds.release(str(hold_dir), EXCLUSIVE_UUID, holder))

    actions: dict[int, Callable[[], object]] = {
        10: place("slurm-1"), 15: place("slurm-2"), 20: lambda: child.exit(0), 25: release("slurm-1"),
        30: release("slurm-2"),
        50: lambda: probe.procs.append(GpuProcess(4242, 2048.0)), 60: lambda: child.exit(0),
        70: lambda: probe.procs.clear(),
        120: lambda: child.exit(3),  # ended by itself: a while before the next one
        180: lambda: setattr(probe, "memory_mib", 4096.0), 200: lambda: setattr(probe, "memory_mib", 0.0),
        260: place("short", until_s=UNIX0_S + 28.0),
        300: lambda: switch.set(True, "SIGUSR1") if paused else None,
        310: place("over-pause"), 330: release("over-pause"),
        340: lambda: switch.set(False, "SIGUSR2") if paused else None,
        360: place("idle"),  # ages out after 20 s without foreign work
        400: lambda: child.exit(0),
    }
    for i in range(1, 700):
        now[0] = i * 0.1
        if i in actions:
            actions[i]()
        if child.alive and sup.ending_since_s is not None and i % 3 == 0:
            child.exit(0)  # asked to end: gone a little later
        sup.step(now[0])
    pinned(f"exclusive{'_paused' if paused else ''}", masked(out.getvalue(), tmp_path))
