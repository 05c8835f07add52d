#!/usr/bin/env python3
"""Leave out of the image the files of the CUDA wheels that the filler never loads.

    python3 scripts/image_prune.py [--dry-run] [SITE_PACKAGES]

The Dockerfile runs this in the same layer as `pip install`, so what it deletes never reaches the image. What the
filler loads was measured on the virtual GPU with scripts/runtime_files.py (start, fill, a yield to a foreign
job, resume, stop; docs/deploying.md, "What the filler loads"): RUNTIME_FILES below. LEAVE_OUT names, per
distribution, globs over the paths in that distribution's RECORD (`*` also matches `/`), each with the reason it
is never loaded.

Every matching file is deleted and dropped from its distribution's RECORD (so pip and importlib.metadata describe
what is there), and directories left empty go too. Nothing is deleted when a check fails: a rule that matches no
file (the wheel changed: measure again), a rule that would delete a file in RUNTIME_FILES, or a file of
RUNTIME_FILES that is missing. SITE_PACKAGES defaults to the running interpreter's.
Exit codes: 0 done (or, with --dry-run, nothing to complain about); 1 a check failed (the message says which);
2 bad arguments.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import io
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn


@dataclass(frozen=True)
class Rule:
    dist: str  # distribution name, as pip spells it
    pattern: str  # fnmatch glob over RECORD paths (relative to site-packages)
    why: str


# What forge-load in real mode loads from the wheels besides their Python modules and cuda-bindings' own
# extension modules: nothing. The kernel comes compiled (forge_load/gpu/prebuilt) and cuda-bindings' driver module
# needs only the driver's libcuda, which the NVIDIA container toolkit mounts (scripts/runtime_files.py measures it).
RUNTIME_FILES: dict[str, tuple[str, ...]] = {}

LEAVE_OUT: tuple[Rule, ...] = tuple(
    Rule("cuda-bindings", f"cuda/*.{ext}", "Cython sources of the compiled modules, read only to build against them")
    for ext in ("pyx", "pyx.in", "pxd", "pxd.in", "pxi", "pxi.in"))


class PruneError(Exception):
    pass


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dist_infos(site: Path) -> dict[str, Path]:
    """Each installed distribution's canonical name -> its .dist-info directory."""
    out: dict[str, Path] = {}
    for info in site.glob("*.dist-info"):
        metadata = info / "METADATA"
        if not metadata.is_file():
            continue
        for line in metadata.read_text(errors="replace").splitlines():
            if line.startswith("Name:"):
                out[canonical(line.split(":", 1)[1].strip())] = info
                break
    return out


def record_rows(info: Path) -> list[list[str]]:
    return [row for row in csv.reader(io.StringIO((info / "RECORD").read_text())) if row]


def plan(site: Path) -> dict[Path, list[tuple[Rule, list[str]]]]:
    """For each dist-info directory, the rules that apply and the RECORD paths each one deletes; raises PruneError
    when a check fails."""
    infos = dist_infos(site)
    problems: list[str] = []
    keep = {path for paths in RUNTIME_FILES.values() for path in paths}
    for dist, paths in RUNTIME_FILES.items():
        if canonical(dist) not in infos:
            problems.append(f"{dist} is not installed, yet the filler loads {', '.join(paths)}")
        for path in paths:
            if not (site / path).is_file():
                problems.append(f"{path} ({dist}) is missing: the filler loads it")
    out: dict[Path, list[tuple[Rule, list[str]]]] = {}
    for rule in LEAVE_OUT:
        info = infos.get(canonical(rule.dist))
        if info is None:
            problems.append(f"{rule.dist} is not installed (rule {rule.pattern}): measure again")
            continue
        matched = [row[0] for row in record_rows(info)
                   if fnmatch.fnmatchcase(row[0], rule.pattern) and (site / row[0]).is_file()]
        if not matched:
            problems.append(f"{rule.dist}: {rule.pattern} matches no file (the wheel changed: measure again)")
        clash = sorted(keep.intersection(matched))
        if clash:
            problems.append(f"{rule.dist}: {rule.pattern} would delete {', '.join(clash)}, which the filler loads")
        out.setdefault(info, []).append((rule, matched))
    if problems:
        raise PruneError("; ".join(problems))
    return out


def prune(site: Path, dry_run: bool = False) -> int:
    """Delete what LEAVE_OUT names; print one line per rule; return the bytes deleted."""
    total = 0
    for info, rules in plan(site).items():
        gone: set[str] = set()
        for rule, paths in rules:
            size = sum((site / p).stat().st_size for p in paths)
            total += size
            print(f"image_prune: {rule.dist}: {rule.pattern}: {len(paths)} files, {size / 1e6:.1f} MB "
                  f"({rule.why})")
            gone.update(paths)
        if dry_run:
            continue
        for path in sorted(gone):
            (site / path).unlink()
        dirs = {(site / p).parent for p in gone}
        for directory in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
            while directory != site and directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()
                directory = directory.parent
        rows = [row for row in record_rows(info) if row[0] not in gone]
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(rows)
        (info / "RECORD").write_text(text.getvalue())
    print(f"image_prune: {'would delete' if dry_run else 'deleted'} {total / 1e6:.1f} MB")
    return total


def fail(message: str, code: int) -> NoReturn:
    print(f"image_prune: {message}", file=sys.stderr)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="image_prune.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("site", nargs="?", default=sysconfig.get_paths()["purelib"],
                        help="the site-packages directory (default: the running interpreter's)")
    parser.add_argument("--dry-run", action="store_true", help="check and say what would go; delete nothing")
    args = parser.parse_args(argv)
    site = Path(args.site)
    if not site.is_dir():
        fail(f"SITE_PACKAGES {args.site}: not a directory (expected a site-packages directory)", 2)
    try:
        prune(site, dry_run=args.dry_run)
    except PruneError as error:
        fail(f"nothing deleted: {error}", 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
