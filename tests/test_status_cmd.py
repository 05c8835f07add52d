"""`forge-load status`: every filler of the host that shares the hold directory, from the status files they write
(steering/filler_status.py), judged alive by their process and their age; against real fillers on the simulated
GPU, run as processes of their own, as an operator would see them."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from forge_load.clock import boot_time_s
from forge_load.commands import status as status_command
from forge_load.steering import filler_dirs, filler_status
from forge_load.steering.filler_status import FillerStatus, StatusWriter
from tests.host_paths import settings_free
from tests.neighbours import FILLER, NEIGHBOUR, AsUser, hold_dir_for_all, local_user, shared_dir

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 60.0  # a loaded 2-core machine starts a filler in seconds; the conditions are polled, not timed
GPU0 = "GPU-51a00000-0000-4000-8000-000000000000"


def runtime_of(hold_dir: Path) -> Path:
    """The tests' runtime directory beside a hold directory: none of the host's fillers' rows are read."""
    return hold_dir.parent / f"{hold_dir.name}.runtime"


def status_rows(hold_dir: Path) -> list[dict[str, object]]:
    proc = subprocess.run([sys.executable, "-m", "forge_load", "status", "--json", "--hold-dir", str(hold_dir),
                           "--runtime-dir", str(runtime_of(hold_dir))],
                          capture_output=True, text=True, check=False, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def poll(hold_dir: Path, condition: Callable[[list[dict[str, object]]], bool]) -> list[dict[str, object]]:
    deadline_s = time.monotonic() + DEADLINE_S
    while True:
        rows = status_rows(hold_dir)
        if condition(rows):
            return rows
        assert time.monotonic() < deadline_s, rows
        time.sleep(0.1)


def start_filler(hold_dir: Path, *flags: str) -> subprocess.Popen[str]:
    env = settings_free()
    env["FORGE_RUNTIME_DIR"] = str(runtime_of(hold_dir))
    return subprocess.Popen([sys.executable, "-m", "forge_load", "--simulate", "--hold-dir", str(hold_dir),
                             "--target", "0.5", "--duration", "600", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


@pytest.fixture
def fillers() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def test_a_filler_its_hold_and_its_kill_as_status_shows_them(tmp_path: Path,
                                                             fillers: list[subprocess.Popen[str]]) -> None:
    fillers.append(proc := start_filler(tmp_path, "--sim-gpus", "2", "--gpus", "all"))
    rows = poll(tmp_path, lambda rows: len(rows) == 2 and all(r["state"] == "filling" for r in rows))
    assert [r["gpu"] for r in rows] == [0, 1] and {r["pid"] for r in rows} == {proc.pid}
    assert all(r["alive"] is True and r["simulated"] is True and r["target"] == 0.5 for r in rows)
    uuid = str(rows[0]["uuid"])
    hold = subprocess.run([sys.executable, "-m", "forge_load", "hold", "--gpu", uuid, "--holder", "job-7",
                           "--hold-dir", str(tmp_path)], capture_output=True, text=True, check=False, cwd=ROOT)
    assert hold.returncode == 0, hold.stderr
    rows = poll(tmp_path, lambda rows: rows[0]["state"] == "held")
    assert rows[0]["held_by"] == ["job-7"] and rows[1]["state"] == "filling"
    table = subprocess.run([sys.executable, "-m", "forge_load", "status", "--hold-dir", str(tmp_path)],
                           capture_output=True, text=True, check=False, cwd=ROOT)
    assert table.returncode == 0 and "held by job-7" in table.stdout and "UUID" in table.stdout, table.stdout
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # The files stay behind, but at once, not after they age: no killed filler is shown filling.
    rows = status_rows(tmp_path)
    assert [r["state"] for r in rows] == ["gone", "gone"] and all(r["alive"] is False for r in rows)


def test_a_clean_stop_takes_its_rows_with_it(tmp_path: Path, fillers: list[subprocess.Popen[str]]) -> None:
    fillers.append(proc := start_filler(tmp_path))
    poll(tmp_path, lambda rows: [r["state"] for r in rows] == ["filling"])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=DEADLINE_S) == 0
    assert status_rows(tmp_path) == []
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(filler_status.STATUS_SUFFIX)]


def test_a_filler_in_another_pid_namespace_is_gone_at_once_when_killed(tmp_path: Path,
                                                                       fillers: list[subprocess.Popen[str]]) -> None:
    # As a container without --pid=host: its PID means nothing here, and its file stays fresh for a while after a
    # kill. The lock it holds beside the file is let go by the kernel the moment it dies.
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                                                         capture_output=True, check=False).returncode != 0:
        pytest.skip("needs unshare with the right to make a PID namespace (root, or user namespaces)")
    env = settings_free()
    fillers.append(proc := subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-m", "forge_load",
         "--simulate", "--hold-dir", str(tmp_path), "--duration", "600"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT, start_new_session=True))
    [row] = poll(tmp_path, lambda rows: [r["state"] for r in rows] == ["filling"])
    assert row["pid"] == 1 and row["alive"] is True  # PID 1 of its namespace; seen alive through its lock
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline_s = time.monotonic() + DEADLINE_S  # the namespace's last process is reaped by the kernel, not by us
    while not [r for r in status_rows(tmp_path) if r["state"] == "gone"]:
        assert time.monotonic() < deadline_s
        time.sleep(0.05)
    rows = status_rows(tmp_path)
    assert [(r["state"], r["alive"]) for r in rows] == [("gone", False)]
    assert rows[0]["age_s"] < filler_status.STALE_S  # gone by its lock, before its file could age


def written(tmp_path: Path, **fields: object) -> None:
    """A status file as a filler of this user writes it, in its directory (filler_dirs.py)."""
    record = FillerStatus(**{"gpu_uuid": GPU0, "gpu_index": 0, "pid": os.getpid(), "state": "filling",
                             "written_unix_s": time.time(), **fields})  # type: ignore[arg-type]
    own = tmp_path / f"filler.{os.geteuid()}"
    own.mkdir(mode=0o755, exist_ok=True)
    (own / filler_status.status_name(GPU0)).write_bytes(filler_status.to_json(record))


def test_an_old_or_future_status_is_stale_and_a_reused_pid_is_gone(tmp_path: Path) -> None:
    boot_s = boot_time_s()
    assert boot_s is not None
    # Another PID namespace (a container): the process cannot be seen, only the file's age judges it.
    written(tmp_path, pid_namespace="pid:[1]", written_boot_s=boot_s - 10)
    assert [(r["state"], r["alive"]) for r in status_rows(tmp_path)] == [("stale", None)]
    written(tmp_path, pid_namespace="pid:[1]", written_boot_s=boot_s + 3600)
    assert [r["state"] for r in status_rows(tmp_path)] == ["stale"]
    written(tmp_path, pid_namespace="pid:[1]", written_boot_s=boot_s)
    assert [r["state"] for r in status_rows(tmp_path)] == ["filling"]
    # The same namespace, a fresh file, but the PID now names a process started at another tick: gone.
    ticks = filler_status.process_start_ticks(os.getpid())
    assert ticks is not None
    ns = filler_status.pid_namespace()
    written(tmp_path, pid_namespace=ns, pid_start_ticks=ticks + 1, written_boot_s=boot_s)
    assert [(r["state"], r["alive"]) for r in status_rows(tmp_path)] == [("gone", False)]
    written(tmp_path, pid_namespace=ns, pid_start_ticks=ticks, written_boot_s=boot_time_s())
    assert [(r["state"], r["alive"]) for r in status_rows(tmp_path)] == [("filling", True)]


def test_the_writer_writes_on_a_change_and_once_a_second(tmp_path: Path) -> None:
    now = [100.0]
    writer = StatusWriter(str(tmp_path), GPU0, 0, os.getpid(), monotonic=lambda: now[0])
    assert writer.due("filling", ())
    writer.write("filling", (), 0.5, 0.5, 0.5, 300.0)
    assert not writer.due("filling", ())
    assert writer.due("held", ("a",))  # a change: at once
    now[0] += filler_status.REFRESH_S
    assert writer.due("filling", ())  # nothing changed, a second has passed
    writer.close()
    assert list(tmp_path.iterdir()) == []
    # No hold directory: its row is in the runtime directory (made), and goes with it.
    writer = StatusWriter(str(tmp_path / "missing"), GPU0, 0, os.getpid(), runtime_dir=str(tmp_path / "run"))
    writer.write("filling", ())
    assert not (tmp_path / "missing").exists()
    [seen] = filler_status.read_all([str(tmp_path / "missing"), str(tmp_path / "run")])[0]
    assert (seen.state, seen.alive, seen.uid) == ("filling", True, os.geteuid())
    writer.close()
    assert list((tmp_path / "run").iterdir()) == []


@pytest.mark.parametrize(("argv", "names"), [
    (["--hold-dir", "{missing}"], "--hold-dir"),
    (["--hold-dir", "{file}"], "--hold-dir"),
    (["--hold-dir", "relative/missing"], "--hold-dir"),
    (["--runtime-dir", "a\nb"], "--runtime-dir"),
    (["--watch", "1_0"], "--watch"),
    (["--watch", "0"], "--watch"),
    (["--watch", "soon"], "--watch"),
    (["--bogus"], "--bogus"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                          names: str) -> None:
    (tmp_path / "file").write_text("")
    argv = [a.format(missing=tmp_path / "missing", file=tmp_path / "file") for a in argv]
    if "--hold-dir" not in argv:
        argv += ["--hold-dir", str(tmp_path)]
    assert status_command.main(argv, env={}) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1 and names in captured.err, captured.err


def test_watch_shows_again_and_an_empty_directory_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runtime = ["--runtime-dir", str(tmp_path / "run")]
    assert status_command.main(["--hold-dir", str(tmp_path), "--watch", "0.1", *runtime], env={}, rounds=2) == 0
    out = capsys.readouterr().out
    assert out.count("(no filler writes its status in") == 2 and "\x1b" not in out  # no terminal: no clearing
    assert status_command.main(runtime, env={"FORGE_HOLD_DIR": str(tmp_path)}) == 0


def test_an_exclusive_mode_supervisor_writes_its_row(tmp_path: Path) -> None:
    from tests.test_exclusive import UUID, Rig

    rig = Rig(tmp_path)
    rig.sup.report = StatusWriter(rig.hold_dir, UUID, 1, os.getpid(), runtime_dir=str(tmp_path / "run"),
                                  monotonic=lambda: rig.now_s)
    rig.sup.target_ratio = 0.5
    rig.probe.util, rig.probe.power = 0.04, 70.0
    rig.step()
    [seen] = filler_status.read_all([rig.hold_dir])[0]
    assert (seen.state, seen.status.gpu_index, seen.status.pid, seen.alive) == ("filling", 1, os.getpid(), True)
    rig.hold()
    rig.run(0.3)
    [seen] = filler_status.read_all([rig.hold_dir])[0]
    assert (seen.state, seen.status.held_by, seen.status.reason) == ("held", ("slurm-42",), "held by slurm-42")
    rig.child.exit(0)
    rig.run(1.1)  # the child has gone: known, none of ours; the target and NVML's numbers are shown, not `-`
    [seen] = filler_status.read_all([rig.hold_dir])[0]
    status = seen.status
    assert (status.target_ratio, status.util_ratio, status.own_ratio, status.power_w) == (0.5, 0.04, 0.0, 70.0)
    rig.sup.report.close()
    assert filler_status.read_all([rig.hold_dir])[0] == []


def test_the_hosts_index_of_a_gpu_whose_filler_numbers_it_otherwise(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # A filler in a container given the host's GPU 1 only calls it GPU 0: the driver's /proc files say which it is.
    proc_root = tmp_path / "proc"
    other = "GPU-0a0b0c0d-1111-4222-8333-444455556666"
    for bus, uuid in (("0000:3b:00.0", other), ("0000:b1:00.0", GPU0)):
        (proc_root / bus).mkdir(parents=True)
        (proc_root / bus / "information").write_text(f"GPU UUID: \t {uuid}\n")
    hold_dir = tmp_path / "holds"
    hold_dir.mkdir()
    written(hold_dir, written_boot_s=boot_time_s())
    argv = ["--json", "--hold-dir", str(hold_dir), "--runtime-dir", str(tmp_path / "run")]
    assert status_command.main(argv, env={}, proc_root=str(proc_root)) == 0
    [row] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (row["gpu"], row["filler_gpu"], row["uuid"]) == (1, 0, GPU0)
    assert status_command.main(argv, env={}, proc_root=str(tmp_path / "none")) == 0
    assert json.loads(capsys.readouterr().out)["gpu"] == 0  # no driver here: the filler's own


def test_the_alive_lock_is_held_while_the_writer_runs_and_goes_with_it(tmp_path: Path) -> None:
    writer = StatusWriter(str(tmp_path), GPU0, 0, os.getpid())
    writer.write("filling", ())
    own = tmp_path / f"filler.{os.geteuid()}"
    fd = os.open(own, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert filler_dirs.write_locked(fd, filler_status.alive_name(GPU0), None) is True
    finally:
        os.close(fd)
    assert oct((own / filler_status.alive_name(GPU0)).stat().st_mode & 0o777) == "0o644"  # anyone may ask it
    [seen] = filler_status.read_all([str(tmp_path)])[0]
    assert seen.status.locked and seen.alive is True
    writer.close()
    assert list(tmp_path.iterdir()) == []  # its files and its directory, once empty
    own.mkdir()
    os.mkfifo(own / filler_status.alive_name(GPU0))  # an earlier filler's leftover, of this user: made afresh
    writer = StatusWriter(str(tmp_path), GPU0, 0, os.getpid())
    writer.write("filling", ())
    [seen] = filler_status.read_all([str(tmp_path)])[0]
    assert seen.status.locked and seen.alive is True
    writer.close()


# --- a directory shared with neighbours ----------------------------------------------------------------------

def test_a_flood_of_dot_files_and_other_names_hides_no_filler(tmp_path: Path,
                                                              fillers: list[subprocess.Popen[str]]) -> None:
    (tmp_path / ".x").write_text("")
    for k in range(5000):  # hard links: a neighbour's flood costs it no space
        os.link(tmp_path / ".x", tmp_path / f".x{k}")
        if k < 300:
            os.link(tmp_path / ".x", tmp_path / f"filler.x{k}")
    fillers.append(start_filler(tmp_path))
    [row] = poll(tmp_path, lambda rows: [r["state"] for r in rows] == ["filling"])
    assert row["alive"] is True


def _live_row_of_its_own(channel: Any, path: str, uuid: str) -> None:
    """A neighbour's row for someone else's GPU, fresh, naming its own live process: kept until told."""
    ticks = filler_status.process_start_ticks(os.getpid())
    record = FillerStatus(uuid, 0, os.getpid(), "filling", 0.5, 0.5, 0.5, 300.0, written_unix_s=time.time(),
                          written_boot_s=(boot_time_s() or 0.0) + 2.5,
                          pid_namespace=filler_status.pid_namespace(), pid_start_ticks=ticks)
    with open(path, "wb") as file:
        file.write(filler_status.to_json(record))
    channel.put("written")
    channel.get()


def test_a_neighbours_row_never_shows_a_held_gpu_filling() -> None:
    neighbour = local_user(NEIGHBOUR)
    with shared_dir() as parent:
        hold_dir = hold_dir_for_all(parent)
        writer = StatusWriter(str(hold_dir), GPU0, 0, os.getpid())
        writer.write("held", ("job-7",))  # our filler: held
        planted = str(hold_dir / filler_status.status_name(GPU0.upper()))
        other = AsUser(neighbour, _live_row_of_its_own, planted, GPU0.upper())
        try:
            assert other.recv() == "written"
            rows = [r for r in status_rows(hold_dir) if str(r["uuid"]).upper() == GPU0.upper()]
            assert [r["state"] for r in rows if r["pid"] == os.getpid()] == ["held"]
            assert "filling" not in [r["state"] for r in rows], rows
            other.send("done")
            other.result()
        finally:
            other.kill()
            writer.close()


def _filler_row(channel: Any, hold_dir: str) -> None:
    """A plain user's filler, held: its status row written at once and kept until told."""
    writer = StatusWriter(hold_dir, GPU0, 0, os.getpid())
    writer.write("held", ("job-7",))
    channel.put("written")
    channel.get()
    writer.close()


def test_a_plain_users_row_cannot_be_taken_by_a_neighbour_before_it_starts() -> None:
    neighbour, filler_user = local_user(NEIGHBOUR), local_user(FILLER)
    with shared_dir() as parent:
        hold_dir = hold_dir_for_all(parent)
        planted = str(hold_dir / filler_status.status_name(GPU0))
        other = AsUser(neighbour, _live_row_of_its_own, planted, GPU0)
        filler = None
        try:
            assert other.recv() == "written"
            filler = AsUser(filler_user, _filler_row, str(hold_dir))
            assert filler.recv() == "written"
            rows = status_rows(hold_dir)
            assert [(r["pid"], r["state"]) for r in rows if r["state"] != "gone"] == [(filler.pid, "held")], rows
            filler.send("done")
            filler.result()
            other.send("done")
            other.result()
        finally:
            other.kill()
            if filler is not None:
                filler.kill()


def _lock_every_alive_file(channel: Any, hold_dir: str) -> None:
    """A reader of the directory: blocks to take every lock a reader can on every file named like a liveness lock
    (flock, and a POSIX read lock), holding each from the moment it gets it, until told."""
    fds: list[int] = []
    for path in Path(hold_dir).rglob("*alive*"):
        for how in (lambda fd: fcntl.flock(fd, fcntl.LOCK_EX), lambda fd: fcntl.lockf(fd, fcntl.LOCK_SH)):
            fd = os.open(path, os.O_RDONLY)
            fds.append(fd)
            threading.Thread(target=how, args=(fd,), daemon=True).start()
    channel.put(len(fds))
    channel.get()


def test_a_reader_holding_the_liveness_lock_of_a_killed_filler_does_not_keep_it_alive(
        fillers: list[subprocess.Popen[str]]) -> None:
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                                                         capture_output=True, check=False).returncode != 0:
        pytest.skip("needs unshare with the right to make a PID namespace (root, or user namespaces)")
    neighbour = local_user(NEIGHBOUR)
    with shared_dir() as parent:
        hold_dir = parent / "holds"
        hold_dir.mkdir()  # root's, 0755: the neighbour can only read
        env = settings_free()
        fillers.append(proc := subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-m", "forge_load",
             "--simulate", "--hold-dir", str(hold_dir), "--duration", "600"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT, start_new_session=True))
        poll(hold_dir, lambda rows: [r["state"] for r in rows] == ["filling"])
        reader = AsUser(neighbour, _lock_every_alive_file, str(hold_dir))
        try:
            assert reader.recv() >= 1
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            deadline_s = time.monotonic() + DEADLINE_S
            rows = status_rows(hold_dir)
            while [r["state"] for r in rows] == ["filling"]:
                assert time.monotonic() < deadline_s
                time.sleep(0.05)
                rows = status_rows(hold_dir)
            assert [(r["state"], r["alive"]) for r in rows] == [("gone", False)], rows
            reader.send("done")
            reader.result()
        finally:
            reader.kill()


# --- what an operator meets -----------------------------------------------------------------------------------

def test_a_filler_without_a_hold_directory_is_seen(tmp_path: Path, fillers: list[subprocess.Popen[str]]) -> None:
    # The quick start: `forge-load --simulate` with no hold directory anywhere, then `forge-load status`.
    runtime = tmp_path / "run"
    env = settings_free()
    env_run = {**env, "FORGE_RUNTIME_DIR": str(runtime)}
    fillers.append(proc := subprocess.Popen(
        [sys.executable, "-m", "forge_load", "--simulate", "--duration", "600", "--hold-dir", str(tmp_path / "none")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env_run, cwd=ROOT))
    deadline_s = time.monotonic() + DEADLINE_S
    while True:
        shown = subprocess.run([sys.executable, "-m", "forge_load", "status", "--json"], capture_output=True,
                               text=True, check=False, timeout=60, cwd=ROOT, env=env_run)
        assert shown.returncode == 0, shown.stderr
        rows = [json.loads(line) for line in shown.stdout.splitlines()]
        if [r["state"] for r in rows if r["pid"] == proc.pid] == ["filling"]:
            break
        assert time.monotonic() < deadline_s, (rows, shown.stderr)
        time.sleep(0.1)
    assert not (tmp_path / "none").exists()  # the filler made no hold directory
    table = subprocess.run([sys.executable, "-m", "forge_load", "status", "--runtime-dir", str(runtime)],
                           capture_output=True, text=True, check=False, timeout=60, cwd=ROOT, env=env)
    assert table.returncode == 0 and f" {proc.pid} " in table.stdout, table


def test_a_row_of_a_huge_index_widens_no_other(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    written(tmp_path, gpu_index=10 ** 4200 - 1, written_boot_s=boot_time_s())
    argv = ["--hold-dir", str(tmp_path), "--runtime-dir", str(tmp_path / "run")]
    assert status_command.main(argv, env={}) == 0
    captured = capsys.readouterr()
    assert "(no filler writes its status" in captured.out and max(map(len, captured.out.splitlines())) < 300
    assert len(captured.err.splitlines()) == 1 and "GPU index of 0 to 65535" in captured.err


def test_a_relative_hold_dir_is_taken_from_the_current_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "holds").mkdir()
    written(tmp_path / "holds", written_boot_s=boot_time_s())
    monkeypatch.chdir(tmp_path)
    for argv, env in ((["--hold-dir", "holds"], {}), ([], {"FORGE_HOLD_DIR": "holds"})):
        assert status_command.main(["--json", "--runtime-dir", "run", *argv], env=env) == 0
        [row] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert row["uuid"] == GPU0 and row["pid"] == os.getpid()
