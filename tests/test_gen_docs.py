"""scripts/gen_docs.py: the shell completion and the man page generated from the parsers, checked fresh as the
reference pages are; run outside the development environment, one line and exit 2 instead of a traceback."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import gen_docs  # noqa: E402

from forge_load.config.cmdline import COMMANDS  # noqa: E402

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


MAN = ROOT / "docs" / "man" / "forge-load.1"


def test_the_man_pages_name_says_what_it_is_for_whatis_and_apropos() -> None:
    # NAME held "forge-load" alone: whatis and apropos, which read `name \- description` there, found nothing.
    lines = MAN.read_text().splitlines()
    name = lines[lines.index(".SH NAME") + 1]
    assert name == "forge\\-load \\- keep a GPU at a target utilization; step aside while other jobs use it"
    lexgrog = shutil.which("lexgrog")  # man-db's reader of NAME sections, as mandb indexes them for whatis
    if lexgrog is not None:
        done = subprocess.run([lexgrog, str(MAN)], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0 and "forge-load - keep a GPU" in done.stdout, done.stdout + done.stderr


def test_the_man_page_has_exit_status_and_environment_from_the_code() -> None:
    from forge_load import exits
    from forge_load.config.settings import SETTINGS

    man = MAN.read_text()
    assert ".SH EXIT STATUS" in man and ".SH ENVIRONMENT" in man
    status = man[man.index(".SH EXIT STATUS"):]
    status = status[:status.index("\n.SH ", 1)]
    codes = {name: value for name, value in vars(exits).items() if name.startswith("EXIT_") and isinstance(value, int)}
    assert codes
    for name, code in codes.items():
        assert f"\n.B {code}\n" in status, name
    environment = man[man.index(".SH ENVIRONMENT"):]
    for setting in SETTINGS:
        assert f"\\fB{setting.env}\\fR" in environment, setting.env
    for other in ("TZ", "TMPDIR", "RUNTIME_DIRECTORY"):
        assert f"\\fB{other}\\fR" in environment, other


def test_no_usage_line_of_the_man_page_is_broken_over_indented_lines() -> None:
    # `fleet up`'s usage, wrapped by argparse at 80 columns, came out as lines of leading spaces, which roff keeps.
    lines = MAN.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("usage: "):
            assert not lines[i + 1].startswith(" "), lines[i:i + 3]
    assert not [line for line in lines if line.startswith(" ")]


def test_the_completion_offers_the_values_of_a_setting_of_a_few_values() -> None:
    bash = (ROOT / "docs/completion/forge-load.bash").read_text()
    for flag, values in (("log_format", "text json"), ("metric", "utilization sm_activity gr_activity"),
                         ("controller", "pi legacy")):
        assert f"_shtab_forge_load___{flag}_choices=({values})" in bash, flag
        assert f"_shtab_forge_load_health___{flag}_choices=({values})" in bash, flag  # the health check's too
    zsh = (ROOT / "docs/completion/_forge-load").read_text()
    assert ":(text json)" in zsh
