"""TZ naming what the C library would wait on or read whole (a FIFO, a device, a directory, a huge file):
refused in one line by the `forge-load` command before Python starts, or by the settings; a good TZ runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from forge_load.config.load import load_config
from forge_load.config.values import ConfigError
from forge_load.service import health
from tests.host_paths import settings_free
from tests.hostile_support import ROOT, assert_config_exit, assert_one_clean_line


@pytest.fixture
def launcher(tmp_path: Path) -> Path:
    """bin/forge-load as installed: beside a forge-load-python that runs this checkout's forge_load."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    command = bin_dir / "forge-load"
    command.write_bytes((ROOT / "bin" / "forge-load").read_bytes())
    python = bin_dir / "forge-load-python"
    python.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                      "from forge_load.cli import entry\nentry()\n")
    for path in (command, python):
        path.chmod(0o755)
    return command


def _through_launcher(command: Path, tz: str, extra_env: dict[str, str] | None = None,
                      stdin: int | None = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
    env = settings_free("TZ", "TZDIR")
    env.update(extra_env or {}, TZ=tz)
    with subprocess.Popen([str(command), "--simulate", "--sim-speed", "0", "--duration", "1", "--active-hours",
                           "Mon-Sun"], stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env) as proc:
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"TZ={tz!r}: start-up hangs") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("kind", ["fifo", "colon fifo", "relative fifo", "TZDIR fifo", "/dev/zero", "/dev/stdin"])
def test_tz_naming_a_fifo_or_a_device_exits_2_at_once(launcher: Path, tmp_path: Path, kind: str) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    extra: dict[str, str] = {}
    tz = {"fifo": str(fifo), "colon fifo": f":{fifo}", "relative fifo": "../../../../../../../.." + str(fifo),
          "/dev/zero": "/dev/zero", "/dev/stdin": "/dev/stdin", "TZDIR fifo": "fifo"}[kind]
    if kind == "TZDIR fifo":
        extra["TZDIR"] = str(tmp_path)
    result = _through_launcher(launcher, tz, extra, stdin=subprocess.PIPE if kind == "/dev/stdin" else None)
    assert_config_exit(result, "TZ=")


def test_forge_load_health_through_the_launcher_is_unhealthy_never_2(launcher: Path, tmp_path: Path) -> None:
    """`forge-load health` keeps the health check's exit codes: a TZ the launcher refuses is 1, as Docker reserves 2;
    a good TZ and a fresh heartbeat are 0."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    beat = tmp_path / "hb"
    health.Heartbeat(beat)()
    env = settings_free("TZ", "TZDIR")
    env["FORGE_HEARTBEAT_FILE"] = str(beat)
    refused = subprocess.run([str(launcher), "health"], env={**env, "TZ": str(fifo)}, capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 1 and "TZ=" in refused.stderr, refused.stderr
    fine = subprocess.run([str(launcher), "health"], env={**env, "TZ": "UTC"}, capture_output=True, text=True,
                          timeout=60)
    assert fine.returncode == 0, fine.stdout + fine.stderr


@pytest.mark.parametrize("tz", ["Europe/Berlin", "", "CET-1CEST,M3.5.0,M10.5.0/3", "UTC"])
def test_the_launcher_runs_the_filler_for_a_good_tz(launcher: Path, tz: str) -> None:
    result = _through_launcher(launcher, tz)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert "event=stop" in result.stdout.splitlines()[-1]


@pytest.mark.parametrize("kind", ["directory", "large file", "fifo"])
def test_tz_naming_what_is_no_zone_file_is_refused_without_reading_it_all(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "zone"
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        with path.open("wb") as big:
            big.truncate(1 << 34)  # 16 GiB, sparse
    with pytest.raises(ConfigError) as info:
        load_config(["--active-hours", "Mon-Sun"], {"TZ": str(path)})
    assert_one_clean_line(str(info.value), "TZ=")
