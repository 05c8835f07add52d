#!/usr/bin/env python3
"""Which files of its Python environment the filler really loads: forge-load in real mode through start, fill,
a yield to a foreign CUDA job, resume and stop, with every shared object it maps and every module it imports
recorded. The image leaves out what this never sees (scripts/image_prune.py; docs/deploying.md, "What the
filler loads").

    scripts/vgpu run -- .venv/bin/python scripts/runtime_files.py [--json FILE] [--fill-s S]
    # in the image: the command in docs/deploying.md ("What the filler loads"), which mounts scripts/ at /opt/scripts

It needs a GPU, virtual or real. The filler runs as a child (`python -c BOOTSTRAP`, which installs an audit hook
for `open` and `ctypes.dlopen`, then calls forge_load.cli.main, what the `forge-load` command runs); the parent
reads /proc/<child>/maps every --sample-s seconds and the child writes its sys.modules and its final maps when
main() has returned. The foreign job is scripts/foreign_job.py --backend numba, started once the filler fills;
the run ends --after-s seconds after the filler has resumed. Shared objects mapped at any sample or at the end
count as loaded; other files (bitcode, headers) count when Python opened them (what a C library opens by itself
without mapping it is not seen: check that with strace where it matters). Each file is attributed to its
distribution by the distribution's RECORD.

Prints a table per distribution (installed size, size of what was loaded, the loaded shared objects, the large
files never loaded) and, with --json, writes everything. Exit codes: 0 done; 1 the filler did not start, fill,
yield, resume or stop as expected (the message says which); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

HERE = Path(__file__).resolve().parent
FOREIGN_JOB = HERE / "foreign_job.py"
LARGE_BYTES = 1_000_000  # files never loaded and at least this big are listed by name

# Runs in the child: record what Python opens and dlopens, run forge_load.cli.main (what the `forge-load`
# command runs), then write sys.modules and the maps before leaving.
BOOTSTRAP = r"""
import json, os, sys
_opened = set()
def _hook(event, args):
    if event in ("open", "ctypes.dlopen") and args and isinstance(args[0], str):
        _opened.add(os.path.abspath(args[0]))
sys.addaudithook(_hook)
sys.argv = ["forge-load", *sys.argv[1:]]
from forge_load.cli import main
code = main()
with open("/proc/self/maps") as maps:
    text = maps.read()
with open(os.environ["RUNTIME_FILES_DUMP"], "w") as out:
    json.dump({"modules": sorted(sys.modules), "opened": sorted(_opened), "maps": text}, out)
sys.exit(code)
"""


def fail(message: str, code: int = 1) -> NoReturn:
    print(f"runtime_files: {message}", file=sys.stderr)
    raise SystemExit(code)


def mapped_files(maps_text: str) -> set[str]:
    """The files behind file-backed mappings in a /proc/<pid>/maps text (not [heap], not deleted files)."""
    out: set[str] = set()
    for line in maps_text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[4] != "0" and parts[5].startswith("/") and not parts[5].endswith(" (deleted)"):
            out.add(parts[5])
    return out


def is_shared_object(path: str) -> bool:
    """libx.so, libx.so.12, libx.so.12.9 (not ld.so.cache)."""
    return re.search(r"\.so(\.\d+)*$", os.path.basename(path)) is not None


@dataclass
class Run:
    mapped: set[str] = field(default_factory=set)
    opened: set[str] = field(default_factory=set)
    modules: list[str] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    foreign: list[dict[str, Any]] = field(default_factory=list)
    exit_code: int | None = None


def run_filler(fill_s: float, after_s: float, sample_s: float, timeout_s: float) -> Run:
    run = Run()
    dump = Path(tempfile.mkdtemp(prefix="runtime-files-")) / "dump.json"
    env = dict(os.environ, RUNTIME_FILES_DUMP=str(dump), FORGE_LOG_FORMAT="json", FORGE_LOG_INTERVAL="1",
               FORGE_RESUME_AFTER="3", FORGE_SIMULATE="0")
    child = subprocess.Popen([sys.executable, "-c", BOOTSTRAP], env=env, stdout=subprocess.PIPE, text=True)
    stop_sampling = threading.Event()

    def sample() -> None:
        maps = Path(f"/proc/{child.pid}/maps")
        while not stop_sampling.is_set():
            try:
                run.mapped |= mapped_files(maps.read_text())
            except OSError:  # not started yet, or gone
                pass
            stop_sampling.wait(sample_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    assert child.stdout is not None
    deadline = time.monotonic() + timeout_s
    first_fill: float | None = None
    foreign: subprocess.Popen[str] | None = None
    resumed_at: float | None = None
    try:
        while True:
            now = time.monotonic()
            if now > deadline:
                fail(f"timed out after {timeout_s:.0f} s; events so far: {[e['event'] for e in run.events]}")
            if child.poll() is not None:
                fail(f"the filler exited with {child.returncode} before the run was over; "
                     f"events: {[e['event'] for e in run.events]}")
            ready, _, _ = select.select([child.stdout], [], [], 0.2)
            if ready:
                line = child.stdout.readline()
                if line.startswith("{"):
                    event = json.loads(line)
                    run.events.append(event)
                    if event["event"] == "status" and event.get("state") == "filling" and first_fill is None:
                        first_fill = time.monotonic()
                    if event["event"] == "resume":
                        resumed_at = time.monotonic()
            if first_fill is not None and foreign is None and time.monotonic() - first_fill >= fill_s:
                foreign = subprocess.Popen([sys.executable, str(FOREIGN_JOB), "--backend", "numba", "--seconds", "3"],
                                           stdout=subprocess.PIPE, text=True)
            if resumed_at is not None and time.monotonic() - resumed_at >= after_s:
                break
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=30)
        run.events += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        run.exit_code = child.returncode
        if foreign is not None:
            job_out, _ = foreign.communicate(timeout=120)
            run.foreign = [json.loads(line) for line in job_out.splitlines() if line.startswith("{")]
            if foreign.returncode != 0:
                fail(f"the foreign job exited with {foreign.returncode}")
    finally:
        stop_sampling.set()
        sampler.join()
        if child.poll() is None:
            child.kill()
    names = [e["event"] for e in run.events]
    for needed in ("start", "yield", "resume", "stop"):
        if needed not in names:
            fail(f"the filler never logged {needed!r}: {names}")
    if run.exit_code != 0:
        fail(f"the filler exited with {run.exit_code} after SIGTERM")
    data = json.loads(dump.read_text())
    dump.unlink()
    dump.parent.rmdir()
    run.mapped |= mapped_files(data["maps"])
    run.opened = set(data["opened"])
    run.modules = data["modules"]
    return run


def file_owners() -> tuple[dict[str, str], dict[str, dict[str, int]]]:
    """Every installed file's distribution, and each distribution's files with their sizes (from RECORD)."""
    owner: dict[str, str] = {}
    files: dict[str, dict[str, int]] = defaultdict(dict)
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        for entry in dist.files or []:
            path = os.path.realpath(str(entry.locate()))
            if os.path.isfile(path):
                owner[path] = name
                files[name][path] = os.path.getsize(path)
    return owner, files


def report(run: Run) -> dict[str, Any]:
    owner, files = file_owners()
    loaded: dict[str, set[str]] = defaultdict(set)  # distribution -> files loaded (mapped, or opened non-Python)
    outside: set[str] = set()
    for path in run.mapped | {p for p in run.opened if not p.endswith((".py", ".pyc"))}:
        real = os.path.realpath(path)
        if not os.path.isfile(real):
            continue
        dist = owner.get(real)
        if dist is None:
            outside.add(path)
        else:
            loaded[dist].add(real)
    for path in run.opened:  # Python sources count for the distribution, not as files listed by name
        real = os.path.realpath(path)
        if real in owner:
            loaded[owner[real]].add(real)
    top = sorted({m.split(".")[0] for m in run.modules})
    dists: dict[str, Any] = {}
    for name in sorted(files, key=str.lower):
        installed = files[name]
        used = loaded.get(name, set())
        site = _site_root(max(installed, key=lambda p: "site-packages" in p))
        dists[name] = {
            "installed_bytes": sum(installed.values()),
            "loaded_bytes": sum(installed.get(p, 0) for p in used),
            "shared_objects_loaded": sorted(os.path.relpath(p, site) for p in used if is_shared_object(p)),
            "data_files_loaded": sorted(os.path.relpath(p, site) for p in used
                                        if not is_shared_object(p) and not p.endswith((".py", ".pyc"))),
            "large_files_never_loaded": {os.path.relpath(p, site): size for p, size in
                                         sorted(installed.items(), key=lambda kv: -kv[1])
                                         if p not in used and size >= LARGE_BYTES},
            "imported": bool(used),
        }
    return {"argv": sys.argv, "python": sys.version.split()[0], "prefix": sys.prefix,
            "events": [e["event"] for e in run.events], "exit_code": run.exit_code,
            "top_level_modules": top, "distributions": dists,
            "shared_objects_outside_distributions": sorted(p for p in outside if is_shared_object(p))}


def _site_root(path: str) -> str:
    """The site-packages directory the path is in (paths are printed relative to it), else its directory."""
    marker = os.sep + "site-packages" + os.sep
    return path[:path.index(marker) + len(marker)] if marker in path else os.path.dirname(path)


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f}"


def print_table(result: dict[str, Any]) -> None:
    print(f"events: {' '.join(result['events'])}; exit code {result['exit_code']}\n")
    print("| distribution | installed MB | loaded MB | shared objects loaded | large files never loaded |")
    print("|---|---:|---:|---|---|")
    for name, d in result["distributions"].items():
        never = ", ".join(f"{p} ({_mb(s)} MB)" for p, s in d["large_files_never_loaded"].items())
        loaded = ", ".join(p for p in d["shared_objects_loaded"] + d["data_files_loaded"]
                           if "site-packages" not in p and "/cpython-" not in p and ".cpython-" not in p)
        n_ext = sum(".cpython-" in p for p in d["shared_objects_loaded"])
        if n_ext:
            loaded = f"{loaded}{', ' if loaded else ''}{n_ext} Python extension modules"
        print(f"| {name}{'' if d['imported'] else ' (never loaded)'} | {_mb(d['installed_bytes'])} | "
              f"{_mb(d['loaded_bytes'])} | {loaded or '-'} | {never or '-'} |")
    outside = ", ".join(result["shared_objects_outside_distributions"])
    print(f"\nshared objects from outside the distributions: {outside}")
    print("\ntop-level modules imported: " + " ".join(m for m in result["top_level_modules"] if not m.startswith("_")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runtime_files.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--json", metavar="FILE", help="write the whole result as JSON")
    parser.add_argument("--fill-s", type=float, default=4.0, help="seconds of filling before the foreign job")
    parser.add_argument("--after-s", type=float, default=3.0, help="seconds of filling after the resume")
    parser.add_argument("--sample-s", type=float, default=0.1, help="seconds between reads of the maps")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="give up after this long")
    args = parser.parse_args(argv)
    for name in ("fill_s", "after_s", "sample_s", "timeout_s"):
        if not getattr(args, name) > 0:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)}: expected a number of seconds > 0", 2)
    result = report(run_filler(args.fill_s, args.after_s, args.sample_s, args.timeout_s))
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
