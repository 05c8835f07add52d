#!/usr/bin/env python3
"""How long `forge-load hold --wait`, `holds` and `status` take with a crowded hold directory: a benchmark, not a
test. No GPU is involved: the commands read files only, and the filler beside them is a simulated one.

    python3 scripts/hold_dir_bench.py --out docs/benchmarks/simulated_<date>_hold_dir [--section docs/benchmarks.md]

The hold directory (a fresh one under --tmp) gets --names names of mixed kinds, as a neighbour who may write it could
leave them (docs/holds.md: who can do what): dot files and names of acknowledgements of earlier releases, each a hard
link to one 1-MB file; directories, FIFOs and symbolic links named as holds (spread over many GPUs, some of them the
filler's); directories named as other users' fillers' directories; and other names. Beside them a simulated filler of
two GPUs (`forge-load --simulate --sim-gpus 2 --gpus all`) runs with that hold directory, and this process keeps a
third GPU's acknowledgement that never says drained (a filler that does not drain: `hold --wait` on it waits its
whole time). Each command runs as users run it (`python -m forge_load ...`, its start included), --repeats times:

- `hold --wait W` on the filler's GPU (it drains: exit 0) and on the never-draining one (exit 1 after W), for each
  W of --waits; goal: within W + 1 s;
- `holds`, `holds --json`, `status`, `status --json`; goal: within 2 s.

It prints a Markdown table and writes results.md and results.json into --out (the command, the machine, the date,
"no GPU involved"), and with --section the BENCH-HOLDDIR block of docs/benchmarks.md. Exit codes: 0 done (goals
met or not: see the table); 1 a command failed in a way no goal covers (the line says which); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.render import write_section  # noqa: E402
from forge_load.steering.hold_watch import FillerHolds  # noqa: E402

SIM = "GPU-51a00000-0000-4000-8000-00000000000{}"  # the simulated fillers' GPUs, seed 0
NEVER = "GPU-5eb00000-0000-4000-8000-000000000000"  # a GPU whose filler never drains
START_TIMEOUT_S = 120.0
BIG_BYTES = 1 << 20
# The mix, in shares of --names: what each kind is, and how it is made.
MIX = (("dot files (hard links to a 1-MB file)", 0.25), ("earlier releases' acknowledgement names (hard links to "
       "a 1-MB JSON file)", 0.20), ("directories named as holds", 0.15), ("FIFOs named as holds and status files",
       0.10), ("symbolic links named as holds", 0.05), ("directories named as other users' fillers' directories",
       0.05), ("other names (empty files)", 0.20))


def uuid(k: int, kind: str = "GPU") -> str:
    return f"{kind}-bad00000-0000-4000-8000-{k:012d}"


def crowd(hold_dir: Path, names: int) -> dict[str, int]:
    """`names` names of the MIX's kinds in `hold_dir`; how many of each."""
    big = hold_dir / ".big"
    big.write_text(json.dumps({"format": 1, "gpu": uuid(0, "MIG"), "pid": 1, "state": "filling",
                               "held_by": ["x" * 64] * (BIG_BYTES // 68), "drained": False, "written_unix_s": 0.0,
                               "of_gpu": SIM.format(0)}))
    counts = {kind: round(share * names) for kind, share in MIX}
    counts[MIX[-1][0]] = names - sum(counts.values()) + counts[MIX[-1][0]]
    dots, acks, dirs, fifos, links, filler_dirs, other = (counts[kind] for kind, _ in MIX)
    gpus = [SIM.format(0), SIM.format(1), NEVER] + [uuid(k) for k in range(37)]  # at most ~40 names a GPU
    for k in range(dots - 1):
        os.link(big, hold_dir / f".x{k}")
    for k in range(acks):
        os.link(big, hold_dir / f"filler.{uuid(k, 'MIG' if k % 2 else 'GPU')}.json")
    for k in range(dirs):
        (hold_dir / f"hold.{gpus[k % len(gpus)]}.slurm-{1000 + k}.json").mkdir()
    for k in range(fifos):
        name = f"hold.{gpus[k % len(gpus)]}.fifo-{k}.json" if k % 2 else f"filler.{uuid(k)}.status.json"
        os.mkfifo(hold_dir / name)
    for k in range(links):
        (hold_dir / f"hold.{gpus[k % len(gpus)]}.link-{k}.json").symlink_to("/dev/zero")
    for k in range(filler_dirs):
        (hold_dir / f"filler.{100000 + k}").mkdir()  # this user's, named as another's: not trusted
    for k in range(other):
        (hold_dir / f"notes-{k}.txt").write_text("")
    return counts


def forge(*args: str, env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    begin_s = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "forge_load", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120, check=False)
    return time.monotonic() - begin_s, proc


def never_draining(hold_dir: str, stop: threading.Event) -> None:
    """A live filler of NEVER that honours every hold and never says it has drained."""
    filler = FillerHolds(hold_dir, NEVER, os.getpid(), time.time)
    while not stop.wait(0.2):
        filler.check(time.monotonic())
        filler.acknowledge(time.monotonic(), "held" if filler.held else "filling", False)
    filler.close()


def machine() -> dict[str, Any]:
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu_model": model, "cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "platform": platform.platform(), "python": platform.python_version(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: "
                        "docs/benchmarks/simulated_<date>_hold_dir)")
    parser.add_argument("--names", type=int, default=10000, help="names in the hold directory (default 10000)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each command (default 3)")
    parser.add_argument("--waits", default="1,3", help="the --wait values timed (default 1,3)")
    parser.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()), help="where the hold directory is "
                        "made (default $TMPDIR or /tmp)")
    parser.add_argument("--section", type=Path, default=None, help="also write the BENCH-HOLDDIR block here")
    args = parser.parse_args(argv)
    try:
        waits = [float(w) for w in args.waits.split(",")]
    except ValueError:
        parser.error(f"--waits={args.waits!r}: expected comma-separated seconds, such as 1,3")
    if args.names < 100 or args.repeats < 1 or not all(0 <= w <= 30 for w in waits):
        parser.error("--names at least 100, --repeats at least 1, --waits 0 to 30 s each")
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    out = args.out or REPO / "docs" / "benchmarks" / f"simulated_{date}_hold_dir"
    work = Path(tempfile.mkdtemp(prefix="forge-hold-dir-bench-", dir=args.tmp))
    hold_dir, runtime = work / "holds", work / "run"
    hold_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env.update(FORGE_RUNTIME_DIR=str(runtime))
    stop = threading.Event()
    filler: subprocess.Popen[str] | None = None
    try:
        made_s = time.monotonic()
        counts = crowd(hold_dir, args.names)
        made_s = time.monotonic() - made_s
        print(f"hold directory {hold_dir}: {sum(counts.values())} names in {made_s:.1f} s", flush=True)
        filler = subprocess.Popen([sys.executable, "-m", "forge_load", "--simulate", "--sim-gpus", "2", "--gpus", "all",
                                   "--hold-dir", str(hold_dir), "--duration", "3600", "--log-format", "json"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO, text=True)
        thread = threading.Thread(target=never_draining, args=(str(hold_dir), stop), daemon=True)
        thread.start()
        deadline_s = time.monotonic() + START_TIMEOUT_S
        while True:
            _, shown = forge("status", "--json", "--hold-dir", str(hold_dir), env=env)
            rows = [json.loads(line) for line in shown.stdout.splitlines()]
            if len([r for r in rows if r["state"] == "filling"]) >= 2:
                break
            if time.monotonic() > deadline_s or filler.poll() is not None:
                print(f"hold_dir_bench: the simulated filler did not show both GPUs filling: {shown.stderr[-500:]}",
                      file=sys.stderr)
                return 1
            time.sleep(0.2)
        runs: list[dict[str, Any]] = []

        def timed(name: str, goal_s: float, expect: int, *command: str) -> None:
            """`expect`: the exit code it should have; a hold's 0 may be 1 on a machine too loaded for the simulated
            filler to drain within the wait (said in the table), any other is a failure."""
            seconds: list[float] = []
            exits: list[int] = []
            for _ in range(args.repeats):
                took_s, proc = forge(*command, env=env)
                if proc.returncode != expect and not (command[0] == "hold" and proc.returncode == 1):
                    raise RuntimeError(f"`forge-load {' '.join(command)}` exited {proc.returncode}, not {expect}: "
                                       f"{proc.stderr.strip()[-300:]}")
                seconds.append(took_s)
                exits.append(proc.returncode)
                if command[0] == "hold":
                    forge("release", "--holder", "bench", "--hold-dir", str(hold_dir), env=env)
            runs.append({"command": f"forge-load {' '.join('DIR' if c == str(hold_dir) else c for c in command)}",
                         "what": name, "runs": len(seconds), "median_s": round(statistics.median(seconds), 3),
                         "max_s": round(max(seconds), 3), "goal_s": goal_s, "met": max(seconds) <= goal_s,
                         "exit_codes": exits})
            print(f"{name}: max {max(seconds):.3f} s (goal {goal_s:g} s)", flush=True)

        for wait in waits:
            timed(f"hold --wait {wait:g}, its filler drains", wait + 1, 0, "hold", "--gpu", SIM.format(0),
                  "--holder", "bench", "--wait", f"{wait:g}", "--hold-dir", str(hold_dir))
            timed(f"hold --wait {wait:g}, its filler never drains", wait + 1, 1, "hold", "--gpu", NEVER,
                  "--holder", "bench", "--wait", f"{wait:g}", "--hold-dir", str(hold_dir))
        forge("hold", "--gpu", SIM.format(1), "--holder", "listed", "--hold-dir", str(hold_dir), env=env)
        for command in (("holds",), ("holds", "--json"), ("status",), ("status", "--json")):
            timed(" ".join(command), 2.0, 0, *command, "--hold-dir", str(hold_dir))
    except RuntimeError as error:
        print(f"hold_dir_bench: {error}", file=sys.stderr)
        return 1
    finally:
        stop.set()
        if filler is not None:
            filler.terminate()
            try:
                filler.wait(timeout=30)
            except subprocess.TimeoutExpired:
                filler.kill()
                filler.wait()
        shutil.rmtree(work, ignore_errors=True)
    results = {"benchmark": "hold_dir", "date": date, "gpu": "none involved: the commands read files only; the filler "
               "beside them is a simulated one (forge-load --simulate)", "command": " ".join([
                   "python3", "scripts/hold_dir_bench.py", *(argv if argv is not None else sys.argv[1:])]),
               "machine": machine(), "names": counts, "repeats": args.repeats, "runs": runs,
               "all_goals_met": all(r["met"] for r in runs)}
    text = markdown(results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(text)
    print(text)
    if args.section is not None:
        rel = os.path.relpath(out / "results.json", REPO)
        block = (f"<!-- BENCH-HOLDDIR -->\n<!-- generated by scripts/hold_dir_bench.py --section from {rel} (the run: "
                 f"{results['command']}); do not edit by hand -->\n{table(results)}<!-- /BENCH-HOLDDIR -->\n")
        missing = write_section(args.section, block)
        if missing:
            print(f"hold_dir_bench: {args.section} has no BENCH-HOLDDIR markers: not written", file=sys.stderr)
    return 0


def table(results: dict[str, Any]) -> str:
    mach = results["machine"]
    lines = [f"{sum(results['names'].values())} names in the hold directory; each command run {results['repeats']} "
             f"times, its Python start included; {results['date']}, {mach['cpu_model'] or 'unknown CPU'} "
             f"({mach['usable_cpus']} usable CPUs, load {mach['load_average'][0]} at the start); no GPU involved.", "",
             "| command | exit | median | max | goal | met |", "|---|---|---|---|---|---|"]
    for run in results["runs"]:
        lines.append(f"| `{run['command']}` ({run['what']}) | {','.join(map(str, run['exit_codes']))} | "
                     f"{run['median_s']:.3f} s | "
                     f"{run['max_s']:.3f} s | ≤ {run['goal_s']:g} s | {'yes' if run['met'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def markdown(results: dict[str, Any]) -> str:
    kinds = "\n".join(f"| {kind} | {count} |" for kind, count in results["names"].items())
    return (f"# Commands in a crowded hold directory ({results['date']})\n\n`{results['command']}`\n\n"
            f"{results['gpu']}.\n\n{table(results)}\n| names in the hold directory | count |\n|---|---|\n{kinds}\n")


if __name__ == "__main__":
    sys.exit(main())
