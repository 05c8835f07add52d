"""Exclusive compute mode (service/exclusive.py, docs/exclusive.md): the supervisor in virtual time with a fake
child and a fake NVML probe; the compute modes through the run loop with a backend that fails the test if a
context is ever asked for."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from forge_load.config.settings import Config
from forge_load.control.filler import Controls
from forge_load.control.probe import ComputeMode, DeviceInfo, GpuProcess, Probe
from forge_load.control.status import GpuSlot
from forge_load.control.worker import Launcher
from forge_load.exits import EXIT_NO_GPU
from forge_load.gpu.clocks import WallLoopClock
from forge_load.log import EventLog
from forge_load.service import gpu_threads
from forge_load.service.exclusive import END_WAIT_S, Supervisor, child_config
from forge_load.steering import acks, holds
from forge_load.steering.hold_watch import FillerHolds
from forge_load.steering.holds import ACK_REFRESH_S, Hold
from forge_load.steering.pause import Pauses, PauseSwitch

UUID = "GPU-0a0b0c0d-1111-4222-8333-444455556666"
RESUME_S = 5.0
UNIX0_S = 1_764_090_000.0


@dataclass
class FakeProbe:
    info: DeviceInfo = DeviceInfo(1, UUID, "Fake GPU", 81559.0, "fake", False, ComputeMode.EXCLUSIVE_PROCESS)
    procs: list[GpuProcess] = field(default_factory=list)
    memory_mib: float = 0.0
    sample_clock: str = "unix"
    util: float | None = None
    power: float | None = None

    def processes(self) -> list[GpuProcess] | None:
        return list(self.procs)

    def utilization_ratio(self) -> float | None:
        return self.util

    def power_w(self) -> float | None:
        return self.power

    def memory_used_mib(self) -> float | None:
        return self.memory_mib

    def close(self) -> None:
        pass


@dataclass
class FakeChild:
    """A child that runs until the test lets it exit (`exit()`), after it was asked to end or on its own."""

    starts: int = 0
    ends: int = 0
    kills: int = 0
    alive: bool = False
    code: int | None = None
    exits_when_asked: bool = False

    def start(self) -> int:
        assert not self.alive, "a second child while one runs"
        self.starts += 1
        self.alive, self.code = True, None
        return 1000 + self.starts

    def end(self) -> None:
        self.ends += 1
        if self.exits_when_asked:
            self.exit(0)

    def kill(self) -> None:
        self.kills += 1
        self.exit(-9)

    def exit(self, code: int = 0) -> None:
        self.alive, self.code = False, code

    def poll(self) -> int | None:
        return None if self.alive else self.code


class Rig:
    """A supervisor on a fake GPU, stepped in virtual time; `lines` are its log lines."""

    def __init__(self, tmp_path: Path, pauses: Pauses | None = None) -> None:
        self.hold_dir = str(tmp_path / "holds")
        holds.ensure_dir(self.hold_dir)
        self.probe = FakeProbe()
        self.child = FakeChild()
        self.out = io.StringIO()
        self.now_s = 0.0
        log = EventLog("json", self.out, static={"gpu": 1, "uuid": UUID})
        filler_holds = FillerHolds(self.hold_dir, UUID, 77, lambda: UNIX0_S + self.now_s)
        self.sup = Supervisor(self.probe.info, self.probe, self.child, filler_holds, log, pauses,
                              resume_after_s=RESUME_S, foreign_mem_mib=64.0, start_s=0.0)

    def step(self, dt_s: float = 0.1) -> None:
        self.now_s += dt_s
        self.sup.step(self.now_s)

    def run(self, seconds: float) -> None:
        for _ in range(round(seconds / 0.1)):
            self.step()

    def hold(self, holder: str = "slurm-42") -> float:
        """Place a hold now; the hold's placing time (what `hold --wait` compares the acknowledgement with)."""
        placed = UNIX0_S + self.now_s
        holds.place(self.hold_dir, Hold(UUID, holder, "Slurm job 42", placed, None))
        return placed

    def ack(self) -> holds.Ack:
        ack = acks.read_ack(self.hold_dir, UUID)
        assert ack is not None
        return ack

    @property
    def lines(self) -> list[dict[str, object]]:
        return [json.loads(line) for line in self.out.getvalue().splitlines()]

    def events(self) -> list[str]:
        return [str(line["event"]) for line in self.lines]


def test_the_child_runs_until_a_hold_and_the_ack_says_drained_only_once_it_has_exited(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.step()
    assert rig.child.starts == 1 and rig.sup.state == "filling"
    assert rig.ack().drained is False  # a child of ours holds a context: nothing is drained
    placed = rig.hold()
    rig.run(1.0)
    assert rig.child.ends == 1 and rig.sup.state == "held"
    ack = rig.ack()
    assert (ack.state, ack.held_by, ack.drained) == ("held", ("slurm-42",), False)
    assert not acks.acknowledged(ack, "slurm-42", placed, UNIX0_S + rig.now_s)  # `hold --wait` goes on waiting
    rig.child.exit(0)  # its kernels drained, it closed its context and exited
    rig.step()
    ack = rig.ack()
    assert ack.drained is True and acks.acknowledged(ack, "slurm-42", placed, UNIX0_S + rig.now_s)
    drained = [line for line in rig.lines if line["event"] == "drained"]
    assert drained[0]["context"] == "gone" and drained[0]["child_pid"] == 1001
    rig.run(3.0)
    assert rig.child.starts == 1  # held: no context of ours is created again
    holds.release(rig.hold_dir, UUID, "slurm-42")
    rig.run(1.1)
    assert rig.child.starts == 2 and rig.sup.state == "filling"  # at once: no foreign job was seen
    assert [e for e in rig.events() if e in ("child_start", "hold", "child_end", "drained", "release")] == [
        "child_start", "hold", "child_end", "drained", "release", "child_start"]
    hold_line = next(line for line in rig.lines if line["event"] == "hold")
    assert (hold_line["holder"], hold_line["reason"]) == ("slurm-42", "Slurm job 42")


def test_the_acknowledgement_is_refreshed_every_second(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.step()
    first = rig.ack().written_unix_s
    rig.run(ACK_REFRESH_S + 0.2)
    assert rig.ack().written_unix_s >= first + ACK_REFRESH_S


def test_a_foreign_process_keeps_the_child_from_starting_until_it_has_been_gone_a_while(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.probe.procs = [GpuProcess(4242, 900.0)]  # a job with its context: ours could not be created anyway
    rig.run(2.0)
    assert rig.child.starts == 0 and rig.sup.state == "yielding"
    rig.probe.procs = []
    rig.run(RESUME_S - 1.0)
    assert rig.child.starts == 0
    rig.run(1.5)
    assert rig.child.starts == 1


def test_memory_nobody_of_ours_holds_is_a_foreign_job_while_no_child_runs(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.probe.memory_mib = 600.0  # a hidden job (a container without --pid=host): only its memory shows
    rig.run(1.0)
    assert rig.child.starts == 0


def test_a_child_that_ends_by_itself_is_not_restarted_before_a_quiet_while(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.step()
    rig.child.exit(0)  # its filler yielded (or paused) and it ended, so that its context went too
    rig.run(RESUME_S - 0.5)
    assert rig.child.starts == 1 and rig.sup.yields == 1
    rig.run(1.0)
    assert rig.child.starts == 2


def test_a_pause_ends_the_child_and_only_its_end_brings_it_back(tmp_path: Path) -> None:
    switch = PauseSwitch()
    rig = Rig(tmp_path, pauses=Pauses(switch))
    rig.step()
    switch.set(True, "SIGUSR1")
    rig.step()
    assert rig.child.ends == 1 and rig.sup.state == "paused"
    rig.child.exit(0)
    rig.run(1.0)
    switch.set(False, "SIGUSR2")
    rig.step()
    assert rig.child.starts == 2


def test_a_child_that_does_not_end_is_killed(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.step()
    rig.hold()
    rig.run(END_WAIT_S + 1.0)
    assert rig.child.kills == 1 and rig.ack().drained is True
    assert "child_kill" in rig.events()


def test_the_child_config_fills_one_gpu_by_uuid_and_nothing_else() -> None:
    config = Config(gpus=("0", "1"), metrics_port=9400, duration_s=60.0, pause_file="/run/pause")
    info = FakeProbe().info
    child = child_config(config, info)
    assert (child.gpu, child.gpus, child.metrics_port, child.duration_s, child.pause_file, child.hold_dir) == (
        UUID, None, None, 0.0, None, "")  # "": the child reads no holds and writes no acknowledgement


# --- through the run loop: which compute mode creates a context ------------------------------------------------

class NoContextBackend:
    """A backend whose GPU is in `mode`; asking it for a launcher (our context) fails the test."""

    claims_gpus = True

    def __init__(self, mode: ComputeMode) -> None:
        self.probe = FakeProbe(info=replace(FakeProbe().info, compute_mode=mode))

    def devices(self) -> list[DeviceInfo]:
        return [self.probe.info]

    def mig_devices(self, gpu_uuid: str) -> list[str]:
        return []

    def open_probe(self, selector: str) -> Probe:
        return self.probe  # type: ignore[return-value]  # only what the supervisor reads

    def open_launcher(self, probe: Probe, shape: str = "lean", metric: str = "utilization") -> Launcher:
        raise AssertionError("a CUDA context was created")

    def open_clock(self, probe: Probe) -> WallLoopClock:
        return WallLoopClock()

    def start_fields(self, info: DeviceInfo) -> dict[str, object]:
        return {}


def run_gpu_once(backend: NoContextBackend, config: Config) -> tuple[GpuSlot, list[dict[str, object]]]:
    out = io.StringIO()
    slot = GpuSlot("0")
    gpu_threads.run_gpu(config, backend, slot, out, threading.Event(), threading.Event())
    return slot, [json.loads(line) for line in out.getvalue().splitlines()]


@pytest.mark.parametrize("mode", [ComputeMode.EXCLUSIVE_PROCESS, ComputeMode.EXCLUSIVE_THREAD])
def test_exclusive_mode_without_a_hold_dir_creates_no_context_and_says_so(
        mode: ComputeMode, tmp_path: Path) -> None:
    config = Config(log_format="json", duration_s=0.3, hold_dir=str(tmp_path / "none"))
    slot, lines = run_gpu_once(NoContextBackend(mode), config)
    assert slot.status == "stopped"
    assert [line["event"] for line in lines] == ["exclusive", "stop"]
    start = lines[0]
    assert (start["compute_mode"], start["holds"], start["filling"]) == (mode.value, False, False)
    assert str(tmp_path / "none") in str(start["reason"])


def test_prohibited_mode_is_one_line_and_exit_3(tmp_path: Path) -> None:
    slot, lines = run_gpu_once(NoContextBackend(ComputeMode.PROHIBITED), Config(log_format="json"))
    assert (slot.status, slot.exit_code) == ("failed", EXIT_NO_GPU)
    assert [line["event"] for line in lines] == ["error"]
    assert "PROHIBITED compute mode" in str(lines[0]["reason"])


def test_exclusive_mode_with_a_hold_dir_starts_a_child_and_never_a_context_here(tmp_path: Path) -> None:
    from forge_load.service import exclusive

    hold_dir = tmp_path / "holds"
    hold_dir.mkdir()
    child = FakeChild(exits_when_asked=True)
    backend = NoContextBackend(ComputeMode.EXCLUSIVE_PROCESS)
    out = io.StringIO()
    config = Config(log_format="json", duration_s=0.5, hold_dir=str(hold_dir))
    exclusive.supervise(config, backend.probe, out, threading.Event(), threading.Event(),  # type: ignore[arg-type]
                        lambda _s: None, lambda: None, None, child=child)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["event"] for line in lines][:2] == ["exclusive", "child_start"]
    assert lines[0]["holds"] is True and child.starts == 1 and child.ends == 1  # ended at the stop
    assert [line["event"] for line in lines][-2:] == ["drained", "stop"] and child.kills == 0
    assert acks.read_ack(str(hold_dir), UUID) is None  # no acknowledgement left behind by a stopped filler


def test_a_hold_dir_that_appears_later_starts_the_supervision(tmp_path: Path) -> None:
    from forge_load.service import exclusive

    hold_dir = tmp_path / "holds"
    child = FakeChild(exits_when_asked=True)
    out = io.StringIO()
    config = Config(log_format="json", duration_s=3.0, hold_dir=str(hold_dir))
    timer = threading.Timer(0.5, hold_dir.mkdir)  # a first `forge-load hold` (or the deploy files) makes it
    timer.start()
    exclusive.supervise(config, NoContextBackend(ComputeMode.EXCLUSIVE_PROCESS).probe, out,  # type: ignore[arg-type]
                        threading.Event(), threading.Event(), lambda _s: None, lambda: None, None, child=child)
    timer.join()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(line["event"], line.get("holds")) for line in lines][:3] == [
        ("exclusive", False), ("exclusive", True), ("child_start", None)]
    assert child.starts == 1


def test_the_child_ends_itself_when_its_filler_stops_filling(tmp_path: Path) -> None:
    """A yield (here: a simulated foreign job at 2 s) ends the child, so that no idle context of ours stays."""
    import os
    import signal

    from forge_load.config.sim import SimConfig
    from forge_load.gpu.backend import SimBackend
    from forge_load.service.exclusive_child import child_main

    sim = SimConfig(speed=0.0, foreign_s=((2.0, 30.0),))
    config = Config(log_format="json", simulate=True, sim=sim, duration_s=20.0)
    read_fd, write_fd = os.pipe()
    os.write(write_fd, __import__("pickle").dumps((config, 0.0)))  # the supervisor keeps its end open
    out = io.StringIO()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    stdin = os.fdopen(read_fd, "rb")
    try:
        code = child_main(stdin, out, SimBackend(sim))
    finally:
        os.close(write_fd)  # EOF first: the child's reader thread lets go of stdin, which can then be closed
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    time.sleep(0.1)
    stdin.close()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    stop = lines[-1]
    assert code == 0 and stop["event"] == "stop"
    assert stop["reason"] == "yielding in exclusive compute mode: ends, so that its context goes too"
    assert stop["t"] < 3.0  # at the yield, not at the 20-s duration


# --- the kubelet's holds (kept in this process) reach the supervisor ------------------------------------------

def test_a_hold_the_kubelet_gave_keeps_the_child_from_starting(tmp_path: Path) -> None:
    """In exclusive mode a job cannot even create its context while our child holds one: the kubelet's
    announcement (a hold on the in-process board) must reach the supervisor, with no hold directory at all."""
    from forge_load.service import exclusive
    from forge_load.steering.hold_watch import HoldBoard

    board = HoldBoard()
    board.replace([Hold(UUID, "kubelet-ns/pod", "assigned to ns/pod", time.time(), None)])
    child = FakeChild(exits_when_asked=True)
    out = io.StringIO()
    config = Config(log_format="json", duration_s=0.5, hold_dir=str(tmp_path / "none"))
    exclusive.supervise(config, NoContextBackend(ComputeMode.EXCLUSIVE_PROCESS).probe, out,  # type: ignore[arg-type]
                        threading.Event(), threading.Event(), lambda _s: None, lambda: None, None, child=child,
                        board=board)
    events = [json.loads(line)["event"] for line in out.getvalue().splitlines()]
    assert child.starts == 0, events
    assert "hold" in events


def test_run_gpu_hands_the_kubelet_board_to_the_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    from forge_load.steering.hold_watch import HoldBoard

    seen: list[object] = []

    def supervise(*_args: object, **kwargs: object) -> None:
        seen.append(kwargs.get("board"))

    monkeypatch.setattr(gpu_threads, "run_exclusive", supervise)
    board = HoldBoard()
    gpu_threads.run_gpu(Config(log_format="json"), NoContextBackend(ComputeMode.EXCLUSIVE_PROCESS), GpuSlot("0"),
                        io.StringIO(), threading.Event(), threading.Event(), Controls(board=board))
    assert seen == [board]


def _supervisor_in_a_directory_it_cannot_write(_channel: object, tmp: str) -> tuple[int, list[str], list[str]]:
    """As a plain user: a Rig whose hold directory is root's (0755)."""
    rig = Rig.__new__(Rig)
    rig.hold_dir = tmp
    rig.probe, rig.child, rig.out, rig.now_s = FakeProbe(), FakeChild(), io.StringIO(), 0.0
    log = EventLog("json", rig.out, static={"gpu": 1, "uuid": UUID})
    rig.sup = Supervisor(rig.probe.info, rig.probe, rig.child, FillerHolds(tmp, UUID, 77, lambda: UNIX0_S + rig.now_s),
                         log, None, resume_after_s=RESUME_S, foreign_mem_mib=64.0, start_s=0.0)
    rig.run(2.0)
    return rig.child.starts, [e["event"] for e in rig.lines], os.listdir(tmp)


def test_a_supervisor_that_cannot_acknowledge_creates_no_context(tmp_path: Path) -> None:
    # A plain user's filler in a hold directory only root writes: `hold --wait` could never see its context go, so
    # none is made (a job announced by a hold would fail to create its own), and it says so once.
    from tests.neighbours import FILLER, as_user, local_user, shared_dir

    user = local_user(FILLER)
    with shared_dir() as parent:
        hold_dir = parent / "holds"
        hold_dir.mkdir(mode=0o755)
        starts, events, left = as_user(user, _supervisor_in_a_directory_it_cannot_write, str(hold_dir))
    assert starts == 0 and left == []
    assert events.count("hold_warning") == 1, events
