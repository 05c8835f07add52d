"""deploy/systemd/forge-load.service: systemd's own checks pass, and it agrees with the code on the hold directory.

`systemd-analyze verify` and `systemd-analyze security --offline=true` read the unit without a running systemd
(Debian's systemd 252); ExecStart is pointed at this checkout's forge-load, since verify wants it to exist.
What they cannot show: that the filler runs under these restrictions on a node with the NVIDIA driver.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from forge_load.service import health
from forge_load.steering import holds

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "deploy" / "systemd" / "forge-load.service"
PROLOG = ROOT / "deploy" / "slurm" / "prolog.sh"
INSTALLED_COMMAND = "/opt/forge-load/bin/forge-load"
MAX_EXPOSURE = 4.0  # systemd-analyze security's scale: 0 (locked) to 10; "OK" is below 5


def analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian's systemd package)")
    return tool


def local_copy(tmp_path: Path) -> Path:
    command = Path(sys.executable).parent / "forge-load"
    if not command.exists():
        pytest.skip("needs the forge-load console script (pip install -e .)")
    text = UNIT.read_text()
    assert f"ExecStart={INSTALLED_COMMAND} " in text
    copy = tmp_path / "forge-load.service"
    copy.write_text(text.replace(INSTALLED_COMMAND, str(command)))
    return copy


def test_systemd_analyze_verify_has_nothing_to_say(tmp_path: Path) -> None:
    proc = subprocess.run([analyze(), "verify", str(local_copy(tmp_path))], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0 and proc.stdout + proc.stderr == "", proc.stdout + proc.stderr


def test_the_unit_is_locked_down(tmp_path: Path) -> None:
    proc = subprocess.run([analyze(), "security", "--offline=true", str(local_copy(tmp_path))],
                          capture_output=True, text=True, check=False)
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", proc.stdout)
    assert found, proc.stdout + proc.stderr
    assert float(found.group(1)) <= MAX_EXPOSURE, proc.stdout
    text = UNIT.read_text()
    for line in ("NoNewPrivileges=yes", "ProtectSystem=strict", "DynamicUser=yes", "CapabilityBoundingSet="):
        assert re.search(rf"^{re.escape(line)}$", text, re.MULTILINE), line


def test_the_hold_directory_is_the_one_of_the_filler_the_commands_and_the_prolog() -> None:
    text = UNIT.read_text()
    dirs = re.search(r"^RuntimeDirectory=(.*)$", text, re.MULTILINE)
    assert dirs is not None
    assert holds.DEFAULT_HOLD_DIR in ["/run/" + d for d in dirs.group(1).split()]
    assert re.search(r"^RuntimeDirectoryPreserve=yes$", text, re.MULTILINE)  # holds outlive a restart
    assert f"\nFORGE_HOLD_DIR={holds.DEFAULT_HOLD_DIR}\n" in PROLOG.read_text()


def test_the_heartbeat_and_locks_are_in_the_runtime_directory_where_health_finds_them() -> None:
    # systemd names the first RuntimeDirectory= to the filler as $RUNTIME_DIRECTORY: its heartbeat and GPU locks
    # go there, not into the private /tmp, and an operator's `forge-load health` looks there (service/health.py).
    text = UNIT.read_text()
    dirs = re.search(r"^RuntimeDirectory=(.*)$", text, re.MULTILINE)
    assert dirs is not None and Path("/run") / dirs.group(1).split()[0] == health.UNIT_RUNTIME_DIR
    mode = re.search(r"^RuntimeDirectoryMode=(0?[0-7]{3})$", text, re.MULTILINE)
    assert mode is not None and int(mode.group(1), 8) & 0o022 == 0  # the filler refuses a directory others write
    assert "FORGE_HEARTBEAT_FILE" not in text
