"""scripts/gen_docs.py: the shell completion and the man page generated from the parsers, checked fresh as the
reference pages are; run outside the development environment, one line and exit 2 instead of a traceback."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import gen_docs  # noqa: E402

from forge_load.config.load import COMMANDS  # noqa: E402

GENERATED = ["docs/completion/forge-load.bash", "docs/completion/_forge-load", "docs/man/forge-load.1"]


@pytest.mark.parametrize("path", GENERATED)
def test_completion_and_man_page_are_generated_and_fresh(path: str) -> None:
    assert path in gen_docs.PAGES
    assert (ROOT / path).read_text() == gen_docs.PAGES[path](), f"regenerate with `{gen_docs.COMMAND}`"


def test_the_completion_offers_every_command_and_flag() -> None:
    bash = (ROOT / "docs/completion/forge-load.bash").read_text()
    (commands,) = re.findall(r"^_shtab_forge_load_subparsers=\((.*)\)$", bash, re.M)
    assert commands.split() == list(COMMANDS)
    for flag in ("--target", "--simulate", "-V"):
        assert re.search(rf"^_shtab_forge_load_option_strings=\(.* {flag}( |\))", bash, re.M), flag
    assert "_shtab_forge_load_plot_pos_0_COMPGEN=_shtab_compgen_files" in bash  # plot's LOG: a file
    zsh = (ROOT / "docs/completion/_forge-load").read_text()
    assert zsh.startswith("#compdef forge-load")
    top = zsh[zsh.index("_shtab_forge_load_commands() {"):]
    top = top[:top.index("\n}")]
    assert sorted(re.findall(r"^    ([a-z]+):'", top, re.M)) == sorted(COMMANDS)
    assert "    health:'the health check of a filler started with the same settings'" in zsh


def test_the_man_page_has_every_command_and_no_date() -> None:
    man = (ROOT / "docs/man/forge-load.1").read_text()
    assert man.startswith('.TH FORGE\\-LOAD "1" "" "forge\\-load 0.1.0" "forge\\-load manual"\n')
    for name in COMMANDS:
        assert f".SH COMMAND \\fI\\,'forge\\-load {name}'\\/\\fR" in man, name


def test_a_missing_module_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as outside the venv: import fails
    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)
    assert gen_docs.main(["--check"]) == 2
    assert capsys.readouterr().err == (
        "gen_docs: the Python module prometheus_client.core is missing: run it as `.venv/bin/python "
        "scripts/gen_docs.py`, in the project's development environment (set up by `python3 -m venv .venv && "
        ".venv/bin/pip install -q -r requirements-dev.txt -e .`, docs/testing.md)\n")


def test_the_documented_command_is_the_one_the_script_names() -> None:
    testing = (ROOT / "docs" / "testing.md").read_text()
    assert f"`{gen_docs.COMMAND}` writes them all" in testing
    assert gen_docs.SETUP in testing


def test_the_documented_command_runs() -> None:
    done = subprocess.run([str(ROOT / ".venv/bin/python") if (ROOT / ".venv/bin/python").exists() else sys.executable,
                           "scripts/gen_docs.py", "--check"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")
