"""The command line as a new user meets it: `--help` names every command, `-V` and `--version` print the version
and exit 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from forge_load import __version__

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ["status", "hold", "release", "holds", "health", "fleet", "plot"]


def forge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "forge_load", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)


def test_help_names_every_command() -> None:
    done = forge("--help")
    assert done.returncode == 0, done.stderr
    listed = done.stdout[done.stdout.index("commands (forge-load COMMAND --help):"):].splitlines()[1:]
    assert [line.split()[0] for line in listed if line.startswith("  ")] == COMMANDS
    assert "--target" in done.stdout  # the filler's own flags are still there


@pytest.mark.parametrize("flag", ["-V", "--version"])
def test_version(flag: str) -> None:
    done = forge(flag)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"forge-load {__version__}\n", "")


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "status"])
def test_each_command_has_its_help(command: str) -> None:
    done = forge(command, "--help")
    assert done.returncode == 0, done.stderr
    assert "usage" in done.stdout.lower()
