"""Standard streams closed or broken, for every command: a closed stdout is one line on stderr and exit 5 (the work
done all the same: a hold is placed), a reader that stops reading (`| head -1`) a quiet end with 141, as the shell
reports for a tool that SIGPIPE ended, a closed stderr costs nothing but the messages, and a closed stdin is read as
closed. The one place that does it: forge_load/cli.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from forge_load.steering import holds
from tests.host_paths import settings_free
from tests.hostile_support import ROOT

GPU = "GPU-51a00000-0000-4000-8000-000000000000"  # the simulated GPU of seed 0
EXIT_OUTPUT_LOST = 5
EXIT_BROKEN_PIPE = 141


def shell(line: str, tmp_path: Path, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """`line` in bash, where `forge-load` is `python -m forge_load`, without FORGE_ variables but a hold directory."""
    env = settings_free()
    env.update(PYTHONPATH=str(ROOT), FORGE_HOLD_DIR=str(tmp_path), FORGE="-m forge_load", PY=sys.executable)
    return subprocess.run(["bash", "-c", line.replace("forge-load", '"$PY" $FORGE')], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout_s)


def assert_output_lost(result: subprocess.CompletedProcess[str], prefix: str) -> None:
    assert result.returncode == EXIT_OUTPUT_LOST, (result.returncode, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix) and "stdout" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_the_filler_with_stdout_closed_stops_with_exit_5(tmp_path: Path) -> None:
    result = shell("exec forge-load --simulate --sim-speed 0 --duration 5 >&-", tmp_path)
    assert_output_lost(result, "forge-load: ")


def test_hold_with_stdout_closed_places_the_hold_and_exits_5(tmp_path: Path) -> None:
    result = shell(f"exec forge-load hold --gpu {GPU} --holder job1 >&-", tmp_path)
    assert_output_lost(result, "forge-load hold: ")
    assert [hold.holder for hold in holds.all_holds(str(tmp_path))[0]] == ["job1"]


@pytest.mark.parametrize("command", ["status", "holds", "--help", "hold --help"])
def test_a_command_with_stdout_closed_exits_5(tmp_path: Path, command: str) -> None:
    result = shell(f"exec forge-load {command} >&-", tmp_path)
    name = command.split()[0]
    assert_output_lost(result, "forge-load: " if name.startswith("-") else f"forge-load {name}: ")


def test_a_reader_that_stops_reading_is_a_quiet_end(tmp_path: Path) -> None:
    for gpu in (GPU, GPU.replace("51a", "51b")):
        assert shell(f"forge-load hold --gpu {gpu} --holder job1", tmp_path).returncode == 0
    # The reader gone before the first line (what `| head -0` leaves behind, without its race)...
    for command in ("holds", "status", "status --watch 0.1", "--help", f"release --gpu {GPU} --holder job1"):
        read, write = os.pipe()
        os.close(read)
        env = settings_free()
        env.update(PYTHONPATH=str(ROOT), FORGE_HOLD_DIR=str(tmp_path))
        done = subprocess.run([sys.executable, "-m", "forge_load", *command.split()], stdout=write,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, timeout=60)
        os.close(write)
        assert (done.returncode, done.stderr) == (EXIT_BROKEN_PIPE, ""), command
    assert [hold.holder for hold in holds.all_holds(str(tmp_path))[0]] == ["job1"]  # the release was done
    # ...and after one line: the watch ends.
    result = shell('forge-load status --watch 0.1 | head -1 >/dev/null; echo "${PIPESTATUS[0]}"', tmp_path)
    assert result.stdout.split() == [str(EXIT_BROKEN_PIPE)] and result.stderr == "", result


def test_the_filler_with_stderr_closed_runs_and_exits_0(tmp_path: Path) -> None:
    result = shell("exec forge-load --simulate --sim-speed 0 --duration 2 2>&-", tmp_path)
    assert result.returncode == 0, result
    assert result.stdout.splitlines()[-1].split()[1] == "event=stop"


def test_a_bad_setting_with_stderr_closed_is_exit_2_and_nothing_in_the_log(tmp_path: Path) -> None:
    result = shell("exec forge-load --simulate --target 7 2>&-", tmp_path)
    assert (result.returncode, result.stdout) == (2, "")
    result = shell("exec forge-load hold --gpu nonsense 2>&-", tmp_path)
    assert (result.returncode, result.stdout) == (2, "")


def test_no_file_takes_the_number_of_a_closed_standard_stream(tmp_path: Path) -> None:
    # A file opened with fd 1 or 2 closed would take that number, and whatever writes "stdout" would write into it.
    probe = ("import os, sys; from forge_load import cli; cli.standard_streams(); "
             "fd = os.open(sys.argv[1], os.O_RDONLY); print(fd, file=sys.stderr); os.write(2, b'x')")
    for closed in ("<&-", ">&-", "2>&-", "<&- >&- 2>&-"):
        result = shell(f'exec "$PY" -c "{probe}" /dev/null {closed}', tmp_path)
        assert result.returncode == 0, (closed, result.stderr)
        if "2>&-" not in closed:
            assert int(result.stderr.rstrip("x").strip()) > 2, (closed, result.stderr)


def test_stdin_closed_is_read_as_closed(tmp_path: Path) -> None:
    probe = "from forge_load import cli; import sys; cli.standard_streams(); sys.stdin.read()"
    result = shell(f'exec "$PY" -c "{probe}" <&-', tmp_path)
    assert result.returncode == 1 and "Bad file descriptor" in result.stderr
