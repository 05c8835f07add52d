"""The documentation holds together: every relative link and anchor of every Markdown file resolves, every
`docs/design.md §N` a file cites names a section there, and the generated reference pages match the code."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".git", ".venv", "node_modules", "build", "dist", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
# Pages other branches are adding now; linked already. Tolerated only while they do not exist: once one is
# there, its links and anchors are checked like any other.
PENDING_PAGES = {"docs/holds.md", "docs/slurm.md", "docs/exclusive.md"}
OLD_DESIGN = "docs/" + "DESIGN" + r"\.md"  # the facts' old page, merged into docs/design.md (spelled so to not match)

sys.path.insert(0, str(ROOT / "scripts"))
import gen_docs  # noqa: E402


def repo_files(suffixes: tuple[str, ...] = (".md",), names: tuple[str, ...] = ()) -> list[Path]:
    found = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts[:-1]):
            continue
        if path.is_file() and (path.suffix in suffixes or path.name in names):
            found.append(path)
    return sorted(found)


def without_code(text: str) -> str:
    """The text with fenced code blocks blanked (line numbers kept) and inline code spans removed."""
    out, fenced = [], False
    for line in text.split("\n"):
        if re.match(r"^\s*(```|~~~)", line):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text as rendered (code, links and emphasis reduced to their words),
    lowercased, everything but letters, digits, `_`, `-` and spaces dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text()
    found: set[str] = set()
    counts: dict[str, int] = {}
    fenced = False
    for line in text.split("\n"):
        if re.match(r"^\s*(```|~~~)", line):
            fenced = not fenced
        if fenced:
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    return found


def links(path: Path) -> list[tuple[int, str]]:
    out = []
    for number, line in enumerate(without_code(path.read_text()).split("\n"), 1):
        for target in re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not ours to check
                out.append((number, target))
    return out


def broken_links(files: list[Path]) -> list[str]:
    broken = []
    for page in files:
        rel_page = page.relative_to(ROOT).as_posix()
        for number, target in links(page):
            where = f"{rel_page}:{number}: {target}"
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            try:
                rel_dest = dest.relative_to(ROOT).as_posix()
            except ValueError:
                broken.append(f"{where} (outside the repository)")
                continue
            if not dest.exists():
                if rel_dest not in PENDING_PAGES:
                    broken.append(f"{where} (no such file)")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no such anchor in {rel_dest})")
    return broken


def test_github_anchors() -> None:
    assert slug("Metrics and `/health`") == "metrics-and-health"
    assert slug("Every GPU of a host: `scripts/forge_fleet.py`") == "every-gpu-of-a-host-scriptsforge_fleetpy"
    assert slug("§2 Buffered samples, their clock") == "2-buffered-samples-their-clock"
    assert slug("The operators' controls") == "the-operators-controls"


def test_anchors_number_repeated_headings(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A\n## Setup\n```\n# not a heading\n```\n### Setup\n## Setup\n")
    assert anchors(page) == {"a", "setup", "setup-1", "setup-2"}


def test_a_broken_link_or_anchor_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# Other\n\n## Part two\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#part-two) [gone](missing.md) [bad](other.md#part-three) [self](#nowhere)\n"
                    "`[in code](missing.md)` [web](https://example.com/x)\n```\n[fenced](missing.md)\n```\n")
    assert broken_links([page]) == ["page.md:1: missing.md (no such file)",
                                    "page.md:1: other.md#part-three (no such anchor in other.md)",
                                    "page.md:1: #nowhere (no such anchor in page.md)"]


def test_every_relative_link_and_anchor_resolves() -> None:
    files = repo_files()
    assert ROOT / "README.md" in files and ROOT / "docs" / "operating.md" in files
    assert len(links(ROOT / "README.md")) > 10
    assert broken_links(files) == []


def test_every_cited_design_section_exists() -> None:
    sections = set(re.findall(r"^#{2,3} (§\d+) ", (ROOT / "docs" / "design.md").read_text(), re.M))
    assert sections == {f"§{n}" for n in range(1, len(sections) + 1)}
    cited, stale = [], []
    for path in repo_files((".py", ".md", ".yaml", ".yml", ".sh", ".toml"), ("Dockerfile", "vgpu")):
        text = path.read_text(errors="replace")
        rel = path.relative_to(ROOT).as_posix()
        if re.search(OLD_DESIGN, text):
            stale.append(rel)
        for group in re.findall(r"docs/design\.md\)?,? ((?:§\d+(?:,? (?:and )?)?)+)", text):
            cited += [(rel, section) for section in re.findall(r"§\d+", group)]
    assert stale == [], "the design facts moved to docs/design.md (same § numbers): cite that"
    assert cited, "no citation found: the pattern is wrong"
    assert [(rel, s) for rel, s in cited if s not in sections] == []


def test_the_generated_pages_match_the_code() -> None:
    assert gen_docs.stale() == [], f"regenerate with `{gen_docs.COMMAND}`"


def test_a_stale_page_fails_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    for name, page in gen_docs.PAGES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(page())
    monkeypatch.setattr(gen_docs, "REPO", tmp_path)
    assert gen_docs.stale() == [] and gen_docs.main(["--check"]) == 0
    settings = tmp_path / "docs" / "settings.md"
    settings.write_text(settings.read_text().replace("| 0.5 |", "| 0.6 |", 1))
    assert gen_docs.stale() == ["docs/settings.md"] and gen_docs.main(["--check"]) == 1
    message = "gen_docs: stale: docs/settings.md; regenerate with `.venv/bin/python scripts/gen_docs.py`\n"
    assert capsys.readouterr().err == message
    assert gen_docs.main([]) == 0 and gen_docs.stale() == []
