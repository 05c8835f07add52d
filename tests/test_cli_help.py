"""The command line as a new user meets it: `--help` names every command, `-V` and `--version` print the version
and exit 0; and the dispatcher (forge_load/cli.py) starts every command of forge_load/commands/, as the help names
them."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from forge_load import __version__, cli
from forge_load.config import cmdline, load

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


def test_the_dispatcher_starts_the_commands_the_help_names() -> None:
    # One table says where each command starts and what it does (a command was described in two places).
    assert cli.COMMANDS is cmdline.COMMANDS and list(cmdline.COMMANDS) == COMMANDS
    help_text = load.build_arg_parser().format_help()
    for name, (_, what) in cmdline.COMMANDS.items():
        assert f"  {name:<9} {what}" in help_text
    source = (ROOT / "forge_load" / "cli.py").read_text() + (ROOT / "forge_load" / "config" / "load.py").read_text()
    for _, what in cmdline.COMMANDS.values():
        assert what not in source, what


def test_every_command_module_is_dispatched_with_its_parser() -> None:
    shared = {"__init__", "shared", "host_gpus"}  # what the commands share: no command of their own
    modules = {path.stem for path in (ROOT / "forge_load" / "commands").glob("*.py")} - shared
    starts = [*(where for where, _ in cli.COMMANDS.values()), cli.FILLER]
    assert {where.partition(":")[0] for where in starts} == modules
    for where in starts:
        module, _, function = where.partition(":")
        assert callable(getattr(importlib.import_module(f"forge_load.commands.{module}"), function)), where
    for name, (where, _) in cli.COMMANDS.items():  # the completion and the man page read it (scripts/gen_docs.py)
        module = importlib.import_module(f"forge_load.commands.{where.partition(':')[0]}")
        assert module.build_parser(f"forge-load {name}").prog == f"forge-load {name}"


@pytest.mark.parametrize(("args", "meant"), [
    (["--targe", "0.5", "--simulate"], "--target"),
    (["--sim-sped=2", "--simulate"], "--sim-speed"),
    (["status", "--jsn"], "--json"),
    (["hold", "--gpu", "0", "--holdr", "job"], "--holder"),
])
def test_a_mistyped_flag_gets_the_closest_one_named(args: list[str], meant: str) -> None:
    # A mistyped FORGE_ variable was told the closest setting; a mistyped flag only that it was not known.
    done = forge(*args)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) == 1 and f": did you mean {meant}?)" in done.stderr, done.stderr


def test_a_flag_nothing_is_close_to_gets_no_guess() -> None:
    done = forge("--zzzzzz", "--simulate")
    assert done.returncode == 2 and "did you mean" not in done.stderr and "--zzzzzz" in done.stderr
