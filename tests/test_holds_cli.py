"""`forge-load hold|release|holds`: the commands of docs/holds.md, their exit codes, and that they import nothing of
CUDA or numba (a Slurm prolog runs them before every job)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from forge_load.commands import hold as hold_command
from forge_load.commands import host_gpus
from forge_load.steering import acks, hold_files, holds
from forge_load.steering.hold_watch import FillerHolds
from forge_load.steering.holds import Ack
from tests.neighbours import FILLER, NEIGHBOUR, AsUser, as_user, hold_dir_for_all, local_user, shared_dir

GPU0 = "GPU-51a00000-0000-4000-8000-000000000000"
GPU1 = "GPU-51a00000-0000-4000-8000-000000000001"
HOST = [GPU0, GPU1]


def run(argv: list[str], hold_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], list[str]]:
    code = hold_command.main([*argv, "--hold-dir", str(hold_dir)], env={}, uuids_of_host=lambda: list(HOST))
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err.splitlines()


def run_beside(filler: Callable[[threading.Event], None], argv: list[str], hold_dir: Path,
               capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], list[str]]:
    """`run(argv)` while `filler(stop)` plays a filler in a thread of its own, until the command has returned."""
    stop = threading.Event()
    thread = threading.Thread(target=filler, args=(stop,))
    thread.start()
    try:
        return run(argv, hold_dir, capsys)
    finally:
        stop.set()
        thread.join()


def test_hold_by_index_and_uuid_then_release_every_gpu_of_the_holder(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    hold_dir = tmp_path / "new" / "holds"  # created, with its parents
    code, out, err = run(["hold", "--gpu", f"1,{GPU0},1", "--holder", "slurm-42", "--reason", "job 42"], hold_dir,
                         capsys)
    assert code == 0 and not err and out == [f"{GPU1} held by slurm-42", f"{GPU0} held by slurm-42"]
    assert oct(hold_dir.stat().st_mode & 0o777) == "0o755"
    found, _ = holds.all_holds(str(hold_dir))
    assert [(h.gpu_uuid, h.holder, h.reason, h.until_unix_s) for h in found] == [
        (GPU0, "slurm-42", "job 42", None), (GPU1, "slurm-42", "job 42", None)]
    run(["hold", "--gpu", "0", "--holder", "other"], hold_dir, capsys)
    code, out, _ = run(["release", "--holder", "slurm-42"], hold_dir, capsys)
    assert code == 0 and sorted(out) == [f"{GPU0} released by slurm-42", f"{GPU1} released by slurm-42"]
    assert [h.holder for h in holds.all_holds(str(hold_dir))[0]] == ["other"]
    assert run(["release", "--holder", "slurm-42", "--gpu", "all"], hold_dir, capsys)[0] == 0  # nothing held: 0
    code, out, _ = run(["release", "--holder", "other", "--gpu", "0"], hold_dir, capsys)
    assert code == 0 and out == [f"{GPU0} released by other"]


def test_hold_all_and_until(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = time.time()
    code, out, _ = run(["hold", "--gpu", "all", "--holder", "h", "--until", "2h"], tmp_path, capsys)
    assert code == 0 and len(out) == 2
    found, _ = holds.all_holds(str(tmp_path))
    assert all(h.until_unix_s is not None and before + 7200 <= h.until_unix_s <= time.time() + 7200 for h in found)
    code, _, _ = run(["hold", "--gpu", "0", "--holder", "h", "--until", "4102444800"], tmp_path, capsys)
    assert code == 0 and holds.read_holds(str(tmp_path), GPU0, 0.0).holds[0].until_unix_s == 4102444800.0


@pytest.mark.parametrize(("argv", "names"), [
    (["hold", "--gpu", "0", "--holder", "-bad"], "--holder"),
    (["hold", "--gpu", "0", "--holder", "a/b"], "--holder"),
    (["hold", "--gpu", "0", "--holder", "a" * 65], "--holder"),
    (["hold", "--gpu", "2", "--holder", "h"], "--gpu"),
    (["hold", "--gpu", "GPU-1234", "--holder", "h"], "--gpu"),
    (["hold", "--gpu", "0,,1", "--holder", "h"], "--gpu"),
    (["hold", "--gpu", "", "--holder", "h"], "--gpu"),
    (["hold", "--gpu", "0", "--holder", "h", "--until", "yesterday"], "--until"),
    (["hold", "--gpu", "0", "--holder", "h", "--until", "2000-01-01T00:00:00Z"], "--until"),
    (["hold", "--gpu", "0", "--holder", "h", "--wait", "-1"], "--wait"),
    (["hold", "--gpu", "0", "--holder", "h", "--wait", "nan"], "--wait"),
    (["hold", "--gpu", "0", "--holder", "h", "--wait", "1_0"], "--wait"),  # not 10 s
    (["hold", "--gpu", "0", "--holder", "h", "--wait", "1e1"], "--wait"),
    (["hold", "--gpu", "0", "--holder", "h", "--reason", "a\nb"], "--reason"),
    (["hold", "--holder", "h"], "--gpu"),
    (["release", "--gpu", "0"], "--holder"),
    (["holds", "--bogus"], "--bogus"),
])
def test_bad_input_exits_2_with_one_line_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         argv: list[str], names: str) -> None:
    code, out, err = run(argv, tmp_path / "holds", capsys)
    assert code == 2 and not out and len(err) == 1 and names in err[0], err
    assert not (tmp_path / "holds").exists() or not list((tmp_path / "holds").iterdir())  # nothing written


def test_a_relative_hold_dir_is_taken_from_the_current_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for env, flag in (({"FORGE_HOLD_DIR": "rel/holds"}, []), ({}, ["--hold-dir", "rel/holds"])):
        code = hold_command.main(["hold", "--gpu", GPU0, "--holder", "h", *flag], env=env, uuids_of_host=lambda: HOST)
        assert code == 0, capsys.readouterr().err
        assert [h.holder for h in holds.all_holds(str(tmp_path / "rel" / "holds"))[0]] == ["h"]
        assert hold_command.main(["holds", "--json", *flag], env=env, uuids_of_host=lambda: HOST) == 0
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["holder"] == "h"
        assert hold_command.main(["release", "--holder", "h", *flag], env=env, uuids_of_host=lambda: HOST) == 0
        assert holds.all_holds(str(tmp_path / "rel" / "holds"))[0] == []


def test_a_hold_dir_that_cannot_be_made_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    code, _, err = run(["hold", "--gpu", "0", "--holder", "h"], tmp_path / "file" / "holds", capsys)
    assert code == 2 and len(err) == 1 and "--hold-dir" in err[0]


def test_indices_without_any_gpu_are_bad_input_and_uuids_need_none(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code = hold_command.main(["hold", "--gpu", "0", "--holder", "h", "--hold-dir", str(tmp_path)], env={},
                        uuids_of_host=lambda: [])
    err = capsys.readouterr().err
    assert code == 2 and "name the GPUs by UUID" in err and "start line" in err  # where a simulated GPU's is
    code = hold_command.main(["hold", "--gpu", GPU1, "--holder", "h", "--hold-dir", str(tmp_path)], env={},
                        uuids_of_host=lambda: [])
    assert code == 0


def test_proc_files_give_the_uuids_in_pci_bus_order(tmp_path: Path) -> None:
    for bus, uuid in (("0000:b1:00.0", GPU1), ("0000:3b:00.0", GPU0), ("0000:c0:00.0", "not a uuid")):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "information").write_text(
            f"Model: \t\t NVIDIA H100\nGPU UUID: \t {uuid}\nBus Location: \t {bus}\nDevice Minor: \t 7\n")
    assert host_gpus.proc_uuids(str(tmp_path)) == [GPU0, GPU1]
    assert host_gpus.proc_uuids(str(tmp_path / "none")) == []


# --- hold --wait --------------------------------------------------------------------------------------

def test_wait_without_a_filler_or_with_a_stale_one_returns_at_once(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    acks.write_ack(str(tmp_path), Ack(GPU1, 1, "filling", (), False, time.time() - 3.5))  # a dead filler's
    start = time.monotonic()
    code, _, _ = run(["hold", "--gpu", "0,1", "--holder", "h", "--wait", "5"], tmp_path, capsys)
    assert code == 0 and time.monotonic() - start < 4  # not the 5 s wait


def test_wait_exits_1_when_the_filler_has_not_acknowledged_and_the_hold_stays(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def live_filler_that_ignores_holds(stop: threading.Event) -> None:
        while not stop.is_set():
            acks.write_ack(str(tmp_path), Ack(GPU0, 1, "filling", (), False, time.time()))
            stop.wait(0.05)

    acks.write_ack(str(tmp_path), Ack(GPU0, 1, "filling", (), False, time.time()))  # there before the hold
    code, out, err = run_beside(live_filler_that_ignores_holds, ["hold", "--gpu", "0", "--holder", "h", "--wait",
                                                                 "0.3"], tmp_path, capsys)
    assert code == 1 and len(err) == 1 and GPU0 in err[0] and "the hold stays" in err[0]
    assert holds.read_holds(str(tmp_path), GPU0, time.time()).held


def test_wait_returns_once_the_filler_has_drained_after_the_hold(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    acks.write_ack(str(tmp_path), Ack(GPU0, 1, "held", ("h",), True, time.time()))  # before the hold: not enough
    def filler(stop: threading.Event) -> None:
        while not stop.is_set():
            view = holds.read_holds(str(tmp_path), GPU0, time.time())
            held_by = tuple(h.holder for h in view.holds)
            # A stale "drained" from before would do; only one written after the hold counts.
            acks.write_ack(str(tmp_path), Ack(GPU0, 1, "held" if held_by else "filling", held_by,
                                               bool(held_by), time.time()))
            stop.wait(0.05)

    code, out, _ = run_beside(filler, ["hold", "--gpu", "0", "--holder", "h", "--wait", "10"], tmp_path, capsys)
    assert code == 0 and out == [f"{GPU0} held by h"]


def test_a_first_hold_that_makes_the_directory_waits_for_a_filler_to_find_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A filler acknowledges only into a directory that exists: the hold that makes it cannot take "no
    acknowledgement" for "no filler" before a filler has had its second to find the directory."""
    hold_dir = tmp_path / "holds"

    def filler_that_finds_the_directory_late(stop: threading.Event) -> None:  # polls as a filler does; no drain
        while not stop.is_set():
            if hold_dir.is_dir():
                stop.wait(0.3)
                acks.write_ack(str(hold_dir), Ack(GPU0, 1, "filling", (), False, time.time()))
            stop.wait(0.05)

    code, _, err = run_beside(filler_that_finds_the_directory_late, ["hold", "--gpu", "0", "--holder", "h", "--wait",
                                                                     "2"], hold_dir, capsys)
    assert code == 1 and "not acknowledged" in err[0]


def test_holds_lists_with_the_fillers_word(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(["hold", "--gpu", "0", "--holder", "a", "--reason", "job a"], tmp_path, capsys)
    run(["hold", "--gpu", "1", "--holder", "b"], tmp_path, capsys)
    acks.write_ack(str(tmp_path), Ack(GPU0, 1, "held", ("a",), True, time.time()))
    (tmp_path / "stray").write_text("")
    code, out, err = run(["holds", "--json"], tmp_path, capsys)
    rows = [json.loads(line) for line in out]
    assert code == 0 and [(r["gpu"], r["holder"], r["reason"], r["filler"]) for r in rows] == [
        (GPU0, "a", "job a", "drained"), (GPU1, "b", "", "no filler")]
    assert len(err) == 1 and "stray" in err[0]
    code, out, _ = run(["holds"], tmp_path, capsys)
    assert code == 0 and out[0].split()[:2] == ["GPU", "HOLDER"] and len(out) == 3


# --- as a command, in its own process --------------------------------------------------------------------

# The interpreter's start (the cuda-bindings wheel's .pth file) may already have put an empty `cuda` namespace in
# sys.modules: what counts is what the command adds.
_PROBE = """
import sys
before = set(sys.modules)
sys.argv = ["forge-load", *sys.argv[1:]]
from forge_load import cli
code = cli.main()
heavy = sorted(m for m in set(sys.modules) - before
               if m.split(".")[0] in ("numba", "numba_cuda", "cuda", "numpy", "llvmlite"))
print("HEAVY", ",".join(heavy))
sys.exit(code)
"""


def test_the_commands_import_nothing_of_cuda_or_numba(tmp_path: Path) -> None:
    for argv in (["hold", "--gpu", GPU0, "--holder", "h", "--wait", "0.1"], ["holds"], ["release", "--holder", "h"]):
        proc = subprocess.run([sys.executable, "-c", _PROBE, *argv, "--hold-dir", str(tmp_path)],
                              capture_output=True, text=True, check=False, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[-1] == "HEAVY ", proc.stdout


def test_an_index_is_resolved_through_nvml_on_the_virtual_gpu(vgpu, tmp_path: Path) -> None:  # noqa: ANN001
    gpu = vgpu(gpus=2)
    uuids = gpu.uuids()
    hold_dir = tmp_path / "holds"
    proc = gpu.run([sys.executable, "-c", _PROBE, "hold", "--gpu", "1", "--holder", "slurm-7",
                    "--hold-dir", str(hold_dir)], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"{uuids[1]} held by slurm-7", "HEAVY "]
    assert [p.name for p in hold_dir.iterdir()] == [f"hold.{uuids[1]}.slurm-7.json"]
    assert gpu.contexts() == []  # no CUDA context was made


@pytest.mark.parametrize("what", ["missing", "file"])
def test_holds_in_a_missing_or_non_directory_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                    what: str) -> None:
    # A typo in --hold-dir once printed an empty table and exited 0: it read as "no holds".
    (tmp_path / "file").write_text("")
    for argv in (["holds"], ["holds", "--json"]):
        code, out, err = run(argv, tmp_path / what, capsys)
        assert code == 2 and not out and len(err) == 1 and "--hold-dir" in err[0], err
        assert ("not a directory" if what == "file" else "no such directory") in err[0]


def test_a_simulated_gpu_is_not_held_in_the_host_wide_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Every simulated filler of seed 0 has GPU0's UUID: a hold in the host-wide directory held other users' too.
    host_wide = tmp_path / "host-wide"
    monkeypatch.setattr(holds, "DEFAULT_HOLD_DIR", str(host_wide))
    code = hold_command.main(["hold", "--gpu", GPU0, "--holder", "h"], env={}, uuids_of_host=lambda: list(HOST))
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and "--gpu" in err[0] and "--hold-dir" in err[0], err
    assert not host_wide.exists()
    # Its own directory, by flag or variable: held.
    assert hold_command.main(["hold", "--gpu", GPU0, "--holder", "h"], env={"FORGE_HOLD_DIR": str(tmp_path)},
                        uuids_of_host=lambda: list(HOST)) == 0
    code, _, _ = run(["hold", "--gpu", GPU0, "--holder", "h"], tmp_path, capsys)
    assert code == 0 and [h.holder for h in holds.all_holds(str(tmp_path))[0]] == ["h"]


# --- a directory shared with neighbours ----------------------------------------------------------------------

def _filler_as_user(channel: Any, hold_dir: str, uuid: str) -> str:
    """A filler's side of the holds (FillerHolds), in a process of its own user: it honours the holds and says it
    has drained once the parent says "drain"; it stops at "stop"."""
    filler = FillerHolds(hold_dir, uuid, os.getpid(), time.time)
    drain = False
    filler.check(time.monotonic())
    filler.acknowledge(time.monotonic(), "filling", False)  # a line: earlier releases' acknowledgement is taken
    assert filler.ack_ok
    channel.put("started")  # it has said so once, as a running filler has
    while True:
        ready, _, _ = select.select([channel.read_fd], [], [], 0.05)
        if ready:
            word = channel.get()
            if word == "stop":
                break
            drain = word == "drain"
        now_s = time.monotonic()
        filler.check(now_s)
        problem = filler.acknowledge(now_s, "held" if filler.held else "filling", drain and filler.held)
        assert problem is None, problem
    filler.close()
    return "stopped"


def test_hold_wait_is_not_fooled_by_a_neighbours_acknowledgement(capsys: pytest.CaptureFixture[str]) -> None:
    # A neighbour plants a stale acknowledgement and a context lock where a plain user's filler would write its own,
    # before it starts. `hold --wait` must still wait for that filler's own word.
    neighbour, filler_user = local_user(NEIGHBOUR), local_user(FILLER)
    with shared_dir() as parent:
        hold_dir = hold_dir_for_all(parent)
        stale = Ack(GPU0, 4242, "held", ("h", "h2"), True, time.time() - 10)

        def plant(_channel: Any) -> None:  # where format 1 had them, before the filler starts
            (hold_dir / f"filler.{GPU0}.json").write_bytes(hold_files.ack_to_json(stale, 1))
            (hold_dir / f"filler.{GPU0}.lock").write_text("")

        as_user(neighbour, plant)
        filler = AsUser(filler_user, _filler_as_user, str(hold_dir), GPU0)
        try:
            assert filler.recv() == "started"
            code, _, err = run(["hold", "--gpu", GPU0, "--holder", "h", "--wait", "1"], hold_dir, capsys)
            assert code == 1, err  # its filler has not drained: not acknowledged
            filler.send("drain")
            code, _, err = run(["hold", "--gpu", GPU0, "--holder", "h2", "--wait", "10"], hold_dir, capsys)
            assert code == 0, err
            filler.send("stop")
            assert filler.result() == "stopped"
        finally:
            filler.kill()


def test_hold_wait_parses_no_file_twice_a_poll_whatever_is_named_like_an_acknowledgement(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # Hard links to one 1-MB JSON file, named as MIG devices' acknowledgements: read once, not once a name and poll.
    big = tmp_path / "big"
    big.write_text(json.dumps({"format": 1, "gpu": "MIG-00000000-0000-4000-8000-000000000000", "pid": 1,
                               "state": "filling", "held_by": ["x" * 64] * 15000, "drained": False,
                               "written_unix_s": time.time(), "of_gpu": GPU0}))
    for k in range(300):
        os.link(big, tmp_path / f"filler.MIG-00000000-0000-4000-8000-{k:012d}.json")
    parsed: list[int] = []
    real_loads = json.loads
    monkeypatch.setattr(json, "loads", lambda data, *a, **k: parsed.append(len(data)) or real_loads(data, *a, **k))

    filler = FillerHolds(str(tmp_path), GPU0, os.getpid(), time.time)
    filler.acknowledge(time.monotonic(), "filling", False)  # it runs before the hold

    def live_filler(stop: threading.Event) -> None:
        while not stop.wait(0.05):
            filler.check(time.monotonic())
            filler.acknowledge(time.monotonic(), "held", False)  # never drains
        filler.close()

    polls = 0.5 / hold_command.WAIT_POLL_S
    code, _, _ = run_beside(live_filler, ["hold", "--gpu", GPU0, "--holder", "h", "--wait", "0.5"], tmp_path, capsys)
    assert code == 1
    assert len([n for n in parsed if n > 1_000_000]) <= 1, len(parsed)  # the big file: once at most
    assert len(parsed) <= 4 * polls, len(parsed)


def test_holds_lists_from_one_look_at_the_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # 300 held GPUs, each with a MIG device's acknowledgement: the directory is listed a bounded number of times,
    # not once a GPU.
    uuids = [f"GPU-51a00000-0000-4000-8000-{k:012d}" for k in range(300)]
    now_s = time.time()
    for k, uuid in enumerate(uuids):
        holds.place(str(tmp_path), holds.Hold(uuid, "h", "", now_s))
        acks.write_ack(str(tmp_path), Ack(f"MIG-61a00000-0000-4000-8000-{k:012d}", 1, "held", ("h",), True, now_s,
                                           of_gpu=uuid))
    listed: list[str] = []
    real_scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path=".": listed.append(str(path)) or real_scandir(path))
    code, out, _ = run(["holds", "--json"], tmp_path, capsys)
    assert code == 0 and len(out) == 300
    assert len(listed) <= 5, len(listed)


def test_a_uuid_no_filler_knows_is_held_and_said_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A well-formed UUID that is no GPU of this host and that no filler of the directory acknowledges: held (a
    # container may name the host's other GPUs, whose fillers may start later), in one line on stderr.
    nowhere = "GPU-00000000-1111-4222-8333-444444444444"
    tmp_path.joinpath("holds").mkdir()
    acks.write_ack(str(tmp_path / "holds"), Ack(GPU0, 1, "filling", (), False, time.time()))
    code, out, err = run(["hold", "--gpu", f"{GPU0},{nowhere}", "--holder", "h"], tmp_path / "holds", capsys)
    assert code == 0 and out == [f"{GPU0} held by h", f"{nowhere} held by h"]
    assert len(err) == 1 and nowhere in err[0] and GPU0 not in err[0] and "held all the same" in err[0], err
    code, _, err = run(["hold", "--gpu", GPU1, "--holder", "h"], tmp_path / "holds", capsys)
    assert code == 0 and err == []  # a GPU of this host: its filler may just not run


def test_release_says_what_it_released_or_that_nothing_was_held(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["release", "--holder", "nobody"], tmp_path, capsys)
    assert code == 0 and out == [f"no hold of nobody in {tmp_path}: nothing released"] and not err
    code, out, _ = run(["release", "--holder", "nobody", "--gpu", "0"], tmp_path, capsys)
    assert code == 0 and out == [f"no hold of nobody in {tmp_path} on {GPU0}: nothing released"]
    run(["hold", "--gpu", "0", "--holder", "h"], tmp_path, capsys)
    code, out, _ = run(["release", "--holder", "h"], tmp_path, capsys)
    assert code == 0 and out == [f"{GPU0} released by h"]
