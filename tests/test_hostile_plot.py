"""`forge-load plot` thrown careless and hostile input: a picture never written over its log or through a symlink,
closed and strict standard streams, lines too deep, too long or with impossible numbers. Each is one line and the
documented exit code, never a traceback, and never a lost log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forge_load.commands import plot as command
from forge_load.plot.logs import read_log
from tests.test_plot import TEXT, as_json, write_log

ROOT = Path(__file__).resolve().parent.parent
PNG = b"\x89PNG\r\n\x1a\n"


def plot_cli(*args: str, shell: str | None = None, stdin: bytes | None = None,
             env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[bytes]:
    """`forge-load plot ARGS` as a user runs it; `shell`: a bash line around it instead (`{plot}` stands for it)."""
    plot = [sys.executable, "-m", "forge_load", "plot", *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    if shell is not None:
        line = shell.format(plot=" ".join(f"'{part}'" for part in plot))
        return subprocess.run(["bash", "-c", line], capture_output=True, env=full_env, cwd=cwd, timeout=120)
    return subprocess.run(plot, input=stdin, capture_output=True, env=full_env, cwd=cwd, timeout=120)


# --- the log is never written over ------------------------------------------------------------------------------

def test_a_log_named_like_a_picture_is_not_drawn_over_by_default(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "run.png"
    log.write_text("\n".join(TEXT) + "\n")
    before = log.read_bytes()
    assert command.main([str(log)]) == 2
    assert log.read_bytes() == before
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is the log itself" in err and "-o" in err, err


@pytest.mark.parametrize("how", ["same name", "relative and absolute", "hard link", "symlink to the log"])
def test_the_output_is_never_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "x.svg"
    log.write_text("\n".join(TEXT) + "\n")
    before = log.read_bytes()
    out = {"same name": "x.svg", "relative and absolute": str(log)}.get(how, "other.svg")
    if how == "hard link":
        os.link(log, tmp_path / "other.svg")
    elif how == "symlink to the log":
        (tmp_path / "other.svg").symlink_to(log)
    assert command.main(["x.svg", "-o", out]) == 2
    assert log.read_bytes() == before
    err = capsys.readouterr().err
    assert err == f"forge-load plot: -o={out!r} is the log itself (LOG='x.svg'): expected another file for the " \
                  "picture\n"


def test_the_log_on_stdin_is_not_drawn_over_either(tmp_path: Path) -> None:
    log = tmp_path / "run.png"
    log.write_text("\n".join(TEXT) + "\n")
    before = log.read_bytes()
    done = plot_cli("-", "-o", str(log), shell="{plot} < " + str(log))
    assert done.returncode == 2, done.stderr
    assert log.read_bytes() == before
    assert b"is the log itself" in done.stderr and b"Traceback" not in done.stderr


def test_a_symlink_at_the_output_is_replaced_never_followed(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's file\n")
    link = tmp_path / "run.png"
    link.symlink_to(victim)
    assert command.main([str(write_log(tmp_path, TEXT)), "-o", str(link)]) == 0
    assert victim.read_text() == "someone else's file\n"
    assert not link.is_symlink() and link.read_bytes()[:8] == PNG
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.log", "run.png", "victim.txt"]  # no temporary left


def test_a_picture_that_cannot_be_written_leaves_no_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "missing" / "run.png"
    assert command.main([str(write_log(tmp_path, TEXT)), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be written" in err and "No such file or directory" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.log"]


# --- standard streams ------------------------------------------------------------------------------------------

def test_stdin_closed_is_one_line_and_exit_2() -> None:
    done = plot_cli("-", "-o", "/dev/null.png", shell="{plot} <&-")
    assert done.returncode == 2, done.stderr
    assert done.stderr.decode() == ("forge-load plot: LOG='-': stdin is closed: expected a log on stdin "
                                    "(docker logs NAME 2>&1 | forge-load plot -) or a file\n")


def test_a_byte_that_is_not_utf8_on_a_strict_stdin_is_read_as_a_file_is(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "x.png"
    data = "\n".join(TEXT).encode() + b"\nt=21.00 event=status state=filling caf\xe9=\xff gpu=0\n"
    done = plot_cli("-", "-o", str(out), stdin=data, env={"PYTHONIOENCODING": "utf-8:strict", "LC_ALL": "C.UTF-8"})
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == PNG
    log = tmp_path / "run.log"
    log.write_bytes(data)
    from_file = plot_cli(str(log), "-o", str(out))
    assert from_file.returncode == 0, from_file.stderr
    assert from_file.stdout.split(b" (", 1)[1] == done.stdout.split(b" (", 1)[1]  # the same lines read, and drawn


def test_stdout_closed_draws_and_exits_5(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    log = write_log(tmp_path, TEXT)
    out = tmp_path / "x.png"
    done = plot_cli(str(log), "-o", str(out), shell="{plot} >&-")
    assert done.returncode == 5, done.stderr
    assert out.read_bytes()[:8] == PNG
    assert done.stderr.decode().count("\n") == 1 and b"stdout could not be written" in done.stderr, done.stderr


def test_stdout_full_exits_5(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    done = plot_cli(str(write_log(tmp_path, TEXT)), "-o", str(tmp_path / "x.png"), shell="{plot} > /dev/full")
    assert done.returncode == 5, done.stderr
    assert b"stdout could not be written" in done.stderr and b"Traceback" not in done.stderr


def test_stderr_closed_bad_input_still_exits_2_and_says_nothing_on_stdout(tmp_path: Path) -> None:
    done = plot_cli(str(tmp_path / "missing.log"), shell="{plot} 2>&-")
    assert (done.returncode, done.stdout) == (2, b"")


def test_stderr_closed_drawn_exits_0(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    done = plot_cli(str(write_log(tmp_path, TEXT)), "-o", str(tmp_path / "x.png"), shell="{plot} 2>&-")
    assert done.returncode == 0 and done.stdout.startswith(b"forge-load plot: wrote ")


# --- lines no filler writes -------------------------------------------------------------------------------------

def test_a_deeply_nested_json_line_is_a_line_not_the_fillers(tmp_path: Path) -> None:
    deep = '{"t":1,"event":"status","gpu":0,"x":' + "[" * 100_000 + "]" * 100_000 + "}"
    run = read_log([deep, *TEXT])
    assert run.skipped == 1 and run.gpus["0"].end_t == 20.0
    pytest.importorskip("matplotlib")
    log = write_log(tmp_path, [deep, *TEXT])
    done = plot_cli(str(log), "-o", str(tmp_path / "x.png"))
    assert done.returncode == 0, done.stderr
    assert b"1 lines not the filler's left out" in done.stdout


def test_a_line_too_long_to_be_the_fillers_is_left_out_unread(tmp_path: Path) -> None:
    long = "t=3.00 event=status state=filling util=0.5 gpu=0 reason=" + "x" * 5_000_000
    log = write_log(tmp_path, [*TEXT[:2], long, *TEXT[2:]])
    from forge_load.plot.logs import read_file

    with log.open("rb") as stream:
        run = read_file(stream)
    assert run.skipped == 1 and run.lines == len(TEXT) + 1
    assert [t for t, _ in run.gpus["0"].util.points()] == [0.0, 5.0, 10.0, 15.0]


@pytest.mark.parametrize("bad", [
    "t=12.00 event=status state=filling target=0.500 util=0.5 gpu=0 power_w=1.7e308",
    "t=1e308 event=status state=filling target=0.500 util=0.5 gpu=0",
    "t=-1e308 event=status state=filling target=0.500 util=0.5 gpu=0",
    "t=nan event=status state=filling target=0.500 util=0.5 gpu=0",
    "t=12.00 event=status state=filling target=0.500 util=1e300 gpu=0",
    "t=12.00 event=status state=filling target=inf util=0.5 gpu=0",
    '{"t":12.0,"event":"status","state":"filling","target":0.5,"util":0.5,"gpu":0,"power_w":1.7e308}',
    '{"t":-1e308,"event":"status","state":"filling","target":0.5,"util":0.5,"gpu":0}',
    '{"t":12.0,"event":"status","state":"filling","target":0.5,"util":NaN,"gpu":0}',
])
def test_an_impossible_number_skips_its_line_and_says_so(tmp_path: Path, bad: str) -> None:
    run = read_log([*TEXT[:-1], bad, TEXT[-1]])
    assert run.impossible == 1
    gpu = run.gpus["0"]
    assert gpu.end_t == 20.0 and max(v for _, v in gpu.power_w.points() if v == v) == 600.0  # v == v: not a gap
    pytest.importorskip("matplotlib")
    log = write_log(tmp_path, [*TEXT[:-1], bad, TEXT[-1]])
    done = plot_cli(str(log), "-o", str(tmp_path / "x.png"))
    assert done.returncode == 0, done.stderr
    assert b"1 lines with an impossible number (not finite, or out of range) skipped" in done.stdout, done.stdout


def test_a_gpu_that_is_not_a_name_is_a_line_not_the_fillers() -> None:
    line = json.dumps({"t": 3.0, "event": "status", "gpu": {"a": [1]}, "util": 0.5})
    run = read_log([*TEXT, line, as_json(TEXT[2])])
    assert list(run.gpus) == ["0"] and run.skipped == 1


def test_a_title_or_gpu_with_dollars_is_text_not_mathtext(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    log = write_log(tmp_path, [line.replace("gpu=0", "gpu=$\\frac{$") for line in TEXT])
    assert command.main([str(log), "-o", str(tmp_path / "x.png"), "--title", "$\\frac{$ $x^$"]) == 0
