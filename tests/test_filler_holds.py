"""The filler honours holds (docs/holds.md), in virtual time on the simulated GPU: held within one poll, drained and
acknowledged at once, filling again after the release, expiry, the idle age-out, and the lines it writes.

The simulated run's wall clock starts at Unix time 0, so a hold's times and the acknowledgement's are virtual
seconds here."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from pathlib import Path

from simrun import step_with

from forge_load.config.load import load_config
from forge_load.service.loop import run_simulated
from forge_load.service.runtime import Runtime
from forge_load.steering import acks, holds
from forge_load.steering.filler_dirs import OwnDir
from forge_load.steering.holds import Ack, Hold

UUID = "GPU-51a00000-0000-4000-8000-000000000000"  # the simulated GPU 0, seed 0
POLL_S = 0.1


class Scenario:
    """A simulated run with actions at virtual times, and every acknowledgement the filler wrote, as read back."""

    def __init__(self, hold_dir: Path, flags: str, actions: list[tuple[float, Callable[[], None]]]) -> None:
        self.hold_dir = hold_dir
        self.acks: list[Ack] = []
        self.holds_now: list[tuple[float, int]] = []
        config = load_config(f"--simulate --sim-speed 0 --log-format json --hold-dir {hold_dir} {flags}".split(),
                             env={})

        def after(rt: Runtime, now_s: float) -> None:
            ack = acks.read_ack(str(hold_dir), UUID)
            if ack is not None and (not self.acks or ack != self.acks[-1]):
                self.acks.append(ack)
            self.holds_now.append((now_s, rt.filler.status(now_s).holds))

        out = io.StringIO()
        self.run = run_simulated(config, out, on_start=step_with(actions, after), keep_history=True,
                                 wall_start_s=0.0)
        self.events = [json.loads(line) for line in out.getvalue().splitlines()]

    def of(self, event: str) -> list[dict[str, object]]:
        return [e for e in self.events if e["event"] == event]

    def starts(self) -> list[float]:
        return list(self.run.gpu._starts)


def place(hold_dir: Path, holder: str, at_s: float, until_s: float | None = None) -> Callable[[], None]:
    return lambda: holds.place(str(hold_dir), Hold(UUID, holder, f"job {holder}", at_s, until_s)) and None


def test_a_hold_stops_our_kernels_within_a_poll_and_the_release_fills_again(tmp_path: Path) -> None:
    s = Scenario(tmp_path, "--duration 8", [
        (2.0, place(tmp_path, "slurm-42", 2.0)),
        (5.0, lambda: holds.release(str(tmp_path), UUID, "slurm-42") and None)])
    (hold,) = s.of("hold")
    assert hold["holder"] == "slurm-42" and hold["reason"] == "job slurm-42" and hold["state"] == "held"
    assert 2.0 <= float(hold["t"]) < 2.0 + POLL_S + 1e-9  # seen at the first poll after it was placed
    drained = [e for e in s.of("drained") if float(e["t"]) >= float(hold["t"])][0]
    (release,) = s.of("release")
    assert release["holder"] == "slurm-42" and release["reason"] == "released" and release["state"] == "filling"
    assert 5.0 <= float(release["t"]) < 5.0 + POLL_S + 1e-9
    # Acknowledged at the drain: held by the holder, drained, written at the drain's time.
    acked = [a for a in s.acks if a.drained and "slurm-42" in a.held_by]
    assert acked and acked[0].state == "held" and acked[0].pid == os.getpid()
    assert abs(acked[0].written_unix_s - float(drained["t"])) < 1e-3
    assert acks.acknowledged(acked[0], "slurm-42", placed_unix_s=2.0, now_unix_s=acked[0].written_unix_s)
    # No kernel of ours began after the acknowledgement until the release; it fills again after it.
    starts = s.starts()
    assert [t for t in starts if acked[0].written_unix_s <= t < float(release["t"])] == []
    assert any(float(hold["t"]) - 1.0 < t < float(hold["t"]) for t in starts)
    assert any(t > float(release["t"]) for t in starts)
    assert s.acks[-1].state == "filling" and s.acks[-1].held_by == () and not s.acks[-1].drained
    assert acks.read_ack(str(tmp_path), UUID) is None  # removed at the stop, earlier releases' one too
    assert not (tmp_path / f"filler.{UUID}.json").exists() and not (tmp_path / f"filler.{os.geteuid()}").exists()
    held = [n for t, n in s.holds_now if float(hold["t"]) <= t < float(release["t"]) - 1e-3]
    assert held and set(held) == {1}


def test_the_acknowledgement_is_refreshed_every_second(tmp_path: Path) -> None:
    written: list[float] = []
    real = acks.write_ack

    def spy(own: OwnDir | str, ack: Ack) -> None:
        written.append(ack.written_unix_s)
        real(own, ack)

    acks.write_ack = spy  # type: ignore[assignment]
    try:
        Scenario(tmp_path, "--duration 10", [])
    finally:
        acks.write_ack = real  # type: ignore[assignment]
    gaps = [b - a for a, b in zip(written, written[1:])]
    assert len(written) >= 9 and max(gaps) <= 1.0 + POLL_S + 1e-9


def test_two_holders_the_gpu_fills_only_after_the_last_release(tmp_path: Path) -> None:
    s = Scenario(tmp_path, "--duration 8", [
        (1.0, place(tmp_path, "a", 1.0)), (2.0, place(tmp_path, "b", 2.0)),
        (3.0, lambda: holds.release(str(tmp_path), UUID, "a") and None),
        (5.0, lambda: holds.release(str(tmp_path), UUID, "b") and None)])
    assert [(e["event"], e["holder"], e["state"]) for e in s.events if e["event"] in ("hold", "release")] == [
        ("hold", "a", "held"), ("hold", "b", "held"), ("release", "a", "held"), ("release", "b", "filling")]
    assert [t for t in s.starts() if 1.2 < t < 5.0] == []
    assert any(a.held_by == ("a", "b") for a in s.acks)


def test_an_expired_hold_is_released_with_why(tmp_path: Path) -> None:
    s = Scenario(tmp_path, "--duration 6", [(1.0, place(tmp_path, "h", 1.0, until_s=3.0))])
    (hold,), (release,) = s.of("hold"), s.of("release")
    assert hold["until"] and release["reason"] == "expired" and 3.0 <= float(release["t"]) < 3.0 + POLL_S + 1e-9
    assert any(t > 3.1 for t in s.starts())


def test_a_hold_over_an_idle_gpu_ages_out_and_one_over_a_busy_gpu_does_not(tmp_path: Path) -> None:
    (tmp_path / "idle").mkdir()
    idle = Scenario(tmp_path / "idle", "--duration 6 --hold-idle-age-out 2",
                    [(1.0, place(tmp_path / "idle", "h", 1.0))])
    (release,) = idle.of("release")
    assert release["reason"] == "aged out" and 3.0 <= float(release["t"]) < 3.0 + POLL_S + 1e-9
    (tmp_path / "busy").mkdir()
    busy = Scenario(tmp_path / "busy", "--duration 8 --hold-idle-age-out 2 --sim-foreign 0.5-7.5",
                    [(1.0, place(tmp_path / "busy", "h", 1.0))])
    assert len(busy.of("hold")) == 1 and busy.of("release") == []


def test_a_hold_there_at_the_start_means_no_kernel_at_all(tmp_path: Path) -> None:
    holds.place(str(tmp_path), Hold(UUID, "early", "", 0.0, None))
    s = Scenario(tmp_path, "--duration 3", [])
    assert s.starts() == [] and s.of("hold")[0]["reason"] == "held by early"


def test_what_is_not_a_hold_is_said_once_and_ignored(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("")
    outside = tmp_path.parent / f"{tmp_path.name}-target"
    outside.write_bytes(holds.hold_to_json(Hold(UUID, "linked", "", 0.0, None)))
    (tmp_path / holds.hold_name(UUID, "linked")).symlink_to(outside)
    s = Scenario(tmp_path, "--duration 4", [])
    warnings = [str(e["reason"]) for e in s.of("hold_warning")]
    assert len(warnings) == 2 and any("notes.txt" in w for w in warnings)
    assert any("symbolic link" in w for w in warnings)
    assert s.of("hold") == [] and any(t > 3.0 for t in s.starts())


def test_a_hold_and_a_pause_together(tmp_path: Path) -> None:
    pause = tmp_path / "pause"
    hold_dir = tmp_path / "holds"
    hold_dir.mkdir()
    s = Scenario(hold_dir, f"--duration 8 --pause-file {pause}", [
        (1.0, place(hold_dir, "h", 1.0)), (2.0, pause.touch),
        (3.0, lambda: holds.release(str(hold_dir), UUID, "h") and None), (5.0, pause.unlink)])
    states = [(e["event"], e["state"]) for e in s.events if e["event"] in ("hold", "pause", "release", "unpause")]
    assert states == [("hold", "held"), ("pause", "held"), ("release", "paused"), ("unpause", "filling")]
    assert [t for t in s.starts() if 1.2 < t < 5.0] == []


def test_a_refreshed_hold_is_acknowledged_at_once_not_at_the_next_refresh(tmp_path: Path) -> None:
    s = Scenario(tmp_path, "--duration 6", [(1.0, place(tmp_path, "h", 1.0)), (3.55, place(tmp_path, "h", 3.55))])
    assert len(s.of("hold")) == 1  # a refresh is no new hold
    after = [a.written_unix_s for a in s.acks if a.written_unix_s >= 3.55 and "h" in a.held_by and a.drained]
    assert after and after[0] < 3.55 + POLL_S + 1e-6
