"""The commands the docs give a new user, as they would type them, and the traps in them: the image they build is the
one the DaemonSet names; `kubectl logs -l ... -f` follows more than 5 pods; no `sudo forge-load` that sudo's
secure_path cannot find; the Slurm node's install pinned and with the metrics extra (FORGE_METRICS_PORT needs it); the
test command saying what it installs as root; and no page, module or test that names a tracker's number instead of its
subject."""

from __future__ import annotations

import re
from pathlib import Path

from forge_load import __version__

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def command_lines(pattern: str) -> list[tuple[str, str]]:
    return [(path.relative_to(ROOT).as_posix(), line) for path in DOCS for line in path.read_text().splitlines()
            if re.search(pattern, line)]


def test_the_image_built_is_the_one_the_daemonset_and_fleet_name() -> None:
    daemonset = (ROOT / "deploy" / "kubernetes" / "20-daemonset.yaml").read_text()
    (image,) = re.findall(r"^\s+image: (\S+)", daemonset, re.M)
    assert image == f"forge-load:{__version__}"
    builds = command_lines(r"^docker build .*-t forge-load[ :]")
    assert builds, "no docker build of the filler's image found"
    for where, line in builds:
        tags = re.findall(r"-t (\S+)", line)
        assert f"forge-load:{__version__}" in tags and "forge-load:latest" in tags, (where, line)


def test_kubectl_logs_following_a_label_raises_the_stream_limit() -> None:
    follows = command_lines(r"^\s*kubectl .*logs .*-l .*(-f|--follow)\b")
    assert follows
    for where, line in follows:
        assert re.search(r"--max-log-requests[ =]\d+", line), (where, line)


def test_no_bare_sudo_forge_load() -> None:
    # sudo's secure_path holds /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin, not the venv's bin.
    assert command_lines(r"^\s*(\S+ )?sudo forge-load\b") == []


def test_the_slurm_nodes_install_is_pinned_and_has_the_metrics_extra() -> None:
    installs = [line for where, line in command_lines(r"/opt/forge-load/bin/pip install") if where == "docs/slurm.md"]
    assert installs
    for line in installs:
        assert "-r requirements.txt" in line and "'.[metrics]'" in line, line


def test_the_test_command_says_what_it_installs_as_root_and_how_not_to() -> None:
    # `scripts/test.sh` as root with apt-get installs Docker, Slurm, munge and Prometheus and starts a dockerd: a
    # reader of the quick start must learn that before typing it, and how to skip it.
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert '"${FORGE_SKIP_SYSTEM_TOOLS:-0}" != 1' in script
    readme = (ROOT / "README.md").read_text()
    quick = readme[readme.index("### Try it without a GPU"):readme.index("### A GPU host with Docker")]
    testing = (ROOT / "docs" / "testing.md").read_text()
    setup = testing[testing.index("## Set up and run"):testing.index("## The layers")]
    for text in (quick, setup):
        flat = " ".join(text.split())
        assert "FORGE_SKIP_SYSTEM_TOOLS=1 scripts/test.sh" in flat
        for what in ("root", "apt", "Docker", "Slurm", "munge", "Prometheus", "dockerd"):
            assert what in flat, what


def test_nothing_is_named_by_a_tracker_number() -> None:
    # A test module was titled by the number of what asked for it: a number tells a reader of the repository nothing.
    # Another project's (kubernetes/kubernetes issues #119423) is a source a reader can follow, and stays.
    number = re.compile(r"([\w.-]+/[\w.-]+ )?\b" + "iss" + r"ues? #?\d+", re.I)
    files = [*DOCS, *sorted((ROOT / "forge_load").rglob("*.py")), *sorted((ROOT / "tests").glob("*.py"))]
    # docs/benchmarks.md's tables are written from the benchmark's own goal names (bench/), not by hand.
    found = [f"{path.relative_to(ROOT)}: {match.group(0)}" for path in files if path.name != "benchmarks.md"
             for match in number.finditer(path.read_text()) if match.group(1) is None]
    assert found == []
