"""The commands the docs give a new user, as they would type them, and the traps in them: the image they build is the
one the DaemonSet names; `kubectl logs -l ... -f` follows more than 5 pods; no `sudo forge-load` that sudo's
secure_path cannot find; the Slurm node's install pinned and with the metrics extra (FORGE_METRICS_PORT needs it); the
test command saying what it installs as root; and no file of the repository that names a tracker's number instead of
its subject."""

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


def repository_text() -> list[Path]:
    """Every text file of the repository as git tracks it (no venv, cache or build output), less the benchmarks'
    result folders (docs/benchmarks/<run>/): records of past runs, each as its benchmark wrote it then."""
    ignored = {".git", ".venv", "venv", "build", "dist", "out", "node_modules", "__pycache__", ".mypy_cache",
               ".ruff_cache", ".pytest_cache"}
    results = ROOT / "docs" / "benchmarks"
    found = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if any(part in ignored or part.endswith(".egg-info") for part in rel.parts) or not path.is_file():
            continue
        if path.is_relative_to(results) and len(path.relative_to(results).parts) > 1:
            continue
        data = path.read_bytes()
        if b"\0" not in data:  # not a cubin or a picture
            found.append(path)
    return found


# Other projects, whose public trackers a reader can follow: "numba issue 8961" is a source, and stays.
OTHER_PROJECTS = ("numba", "numba-cuda", "llvmlite", "cuda-python", "cuda-bindings", "nvidia-ml-py", "pynvml",
                  "kubernetes", "moby", "docker", "slurm", "prometheus", "grpc", "dcgm-exporter")
PROJECT = r"\b[\w-][\w.-]*/[\w.-]*\w|\b[\w-]+"  # owner/repo (not "n/a."), or one word
TRACKER_NUMBER = re.compile(rf"(?:(?P<project>{PROJECT})\s+)?\b(?P<number>" + "iss" + r"ues?\s+#?\d+)", re.I)


def tracker_numbers(text: str) -> list[tuple[int, str]]:
    """(line, words) of each "issue <number>" in `text` that is not another project's (owner/repo, or a name of
    OTHER_PROJECTS just before it)."""
    return [(text.count("\n", 0, match.start("number")) + 1, match.group("number"))
            for match in TRACKER_NUMBER.finditer(text)
            if match.group("project") is None
            or ("/" not in match.group("project") and match.group("project").lower() not in OTHER_PROJECTS)]


def test_a_tracker_number_is_found_and_another_projects_is_not() -> None:
    word = "iss" + "ue"
    text = f"the goals ({word}s 12, 20 and 26);\n{word.title()} #5's; before {word}\n20; n/a. {word.title()} 26's"
    assert tracker_numbers(text) == [(1, f"{word}s 12"), (2, f"{word.title()} #5"), (2, f"{word}\n20"),
                                     (3, f"{word.title()} 26")]
    assert tracker_numbers(f"numba {word} 8961, numba-cuda {word}s 163, kubernetes/kubernetes {word}s #119423") == []


def test_nothing_is_named_by_a_tracker_number() -> None:
    # A file that names a tracker's number tells a reader of the repository nothing: they cannot read our tracker.
    # Say the subject instead (what was asked for, what changed). The benchmarks' generated tables take their
    # goals' names from bench/, so those are checked here too.
    files = repository_text()
    assert ROOT / "docs" / "benchmarks.md" in files and ROOT / "bench" / "cpu.py" in files
    found = [f"{path.relative_to(ROOT)}:{line}: {words!r}" for path in files
             for line, words in tracker_numbers(path.read_text(errors="replace"))]
    assert found == []
