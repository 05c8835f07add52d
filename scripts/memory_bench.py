#!/usr/bin/env python3
"""What the filler weighs in memory and how soon it fills, on the virtual GPU: a benchmark, not a test.

    python3 scripts/memory_bench.py --out docs/benchmarks/virtual_<date>_light [--repeats 5]

Each run is `python -m forge_load` in real mode on a fresh virtual GPU (vgpu.VirtualGpu), as users run it:
- one GPU: the filler's resident memory (VmRSS) and peak (VmHWM) once it fills, the CUDA compilers it has mapped
  (/proc/<pid>/maps: libnvvm, libnvrtc, libnvJitLink, llvmlite), and the time from the process's start to its
  first kernel (the virtual GPU's own record of kernels);
- eight GPUs in exclusive compute mode (`--gpus all` with holds: a supervisor and one child per GPU): the resident
  memory of the supervisor and its children together, once every GPU fills.
It prints a Markdown table and writes memory.md and memory.json into --out, labelled with the machine, the
virtual GPU (never a GPU measurement) and the date. Exit codes: 0 done; 1 a run failed (the line says which).

--bytecode cached (the default) runs the filler as an installed one starts: from compiled bytecode (pip compiles
it at install, the image keeps it), cached under --out's temporary directory by one untimed run first, whatever
PYTHONDONTWRITEBYTECODE says. --bytecode as-is leaves the environment alone: from an editable install with
PYTHONDONTWRITEBYTECODE=1, every start compiles forge_load's own modules again (about 0.1 s here). --python runs
the filler with another interpreter (a virtual environment with `pip install -r requirements.txt .`, say: without
the development one's editable finder and numba-cuda's import hook, which add to every start); forge_load is this
checkout's either way (`python -m forge_load` from it). --startup-only times the start alone, in runs stopped once
the first kernel is in (STARTUP_WAIT_S), so that many repeats fit: startup.md and startup.json, no memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vgpu import VirtualGpu  # noqa: E402

COMPILERS = ("libnvvm", "libnvrtc", "libnvJitLink", "llvmlite")
SETTLE_S = 6.0  # filling for this long before memory is read: the steady state, not the start
GPUS_EXCLUSIVE = 8


def status(pid: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024.0
    return out


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


BYTECODE = "cached"  # --bytecode: "cached" or "as-is"
PYTHON = sys.executable  # --python: the interpreter that runs the filler


def python_env(tmp: Path) -> dict[str, str]:
    """The environment the fillers start in: with --bytecode cached, a bytecode cache of their own that they write."""
    env = dict(os.environ)
    if BYTECODE == "cached":
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
    return env


def forge(gpu: VirtualGpu, tmp: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str],
                                                                                                  float]:
    own = {"FORGE_HEARTBEAT_FILE": str(tmp / f"heartbeat-{time.monotonic_ns()}")}
    started_s = time.time()
    proc = subprocess.Popen([PYTHON, "-m", "forge_load", "--log-format", "json", *args],
                            env=gpu.env({**python_env(tmp), **own, **(env or {})}), cwd=REPO, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, started_s


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"forge-load exited {proc.returncode}: {err.strip()[-500:]}")


def one_gpu(tmp: Path, run: int) -> dict[str, Any]:
    gpu = VirtualGpu(tmp / f"one{run}")
    proc, started_s = forge(gpu, tmp, "--duration", "60")
    try:
        time.sleep(SETTLE_S)
        memory = status(proc.pid)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        mapped = [name for name in COMPILERS if name in maps]
    finally:
        stop(proc)
    kernels = [k for k in gpu.kernels() if k.pid == proc.pid]
    if not kernels:
        raise RuntimeError("the filler launched no kernel")
    return {"rss_mib": memory["VmRSS"], "peak_mib": memory["VmHWM"], "compilers_mapped": mapped,
            "start_to_first_kernel_s": min(k.start for k in kernels) - started_s}


STARTUP_WAIT_S = 2.0  # --startup-only: each run is stopped this long after its start (its first kernel: < 0.5 s)


def startup(tmp: Path, run: int) -> float:
    """One start, to its first kernel in the virtual GPU's record; stopped soon after."""
    gpu = VirtualGpu(tmp / f"start{run}")
    proc, started_s = forge(gpu, tmp, "--duration", "60")
    try:
        time.sleep(STARTUP_WAIT_S)
    finally:
        stop(proc)
    kernels = [k for k in gpu.kernels() if k.pid == proc.pid]
    if not kernels:
        raise RuntimeError(f"the filler launched no kernel within {STARTUP_WAIT_S:g} s")
    return min(k.start for k in kernels) - started_s


def render_startup(r: dict[str, Any]) -> str:
    start = r["start_to_first_kernel_s"]
    m = r["machine"]
    return "\n".join([
        f"# Start-up of the filler (virtual GPU), {r['date']}",
        "",
        f"From `{r['command']}` on the virtual GPU (scripts/vgpu: driver-free stand-ins for the driver's "
        f"libraries; not hardware, so not a GPU measurement), on {m['cpu_model']} ({m['logical_cpus']} logical "
        f"CPUs, load average {m['load_average']:.1f} at the start, {r['load_average_end']:.1f} at the end), Python "
        f"{m['python']}{' (' + r['python'] + ')' if r.get('python') else ''}: from the process's start to its first "
        f"kernel in the virtual GPU's record, bytecode {r['bytecode']}.",
        "",
        "| what | measured | goal |",
        "|---|---|---|",
        f"| start to the first kernel, median of {len(start)} (min–max) | {statistics.median(start):.3f} s "
        f"({min(start):.3f}–{max(start):.3f}) | ≤ 0.25 s |",
        f"| quartiles | {statistics.quantiles(start, n=4)[0]:.3f} s, {statistics.quantiles(start, n=4)[2]:.3f} s | |",
        "",
        "Virtual GPU: not a GPU measurement: a real driver's cuInit and context creation are not in it.",
        "",
    ])


def warm_up(tmp: Path) -> None:
    """One untimed run, which writes the bytecode cache (--bytecode cached) that the timed runs read."""
    proc, _ = forge(VirtualGpu(tmp / "warm_up"), tmp, "--duration", "1")
    _, err = proc.communicate(timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"forge-load exited {proc.returncode}: {err.strip()[-500:]}")


def exclusive(tmp: Path) -> dict[str, Any]:
    gpu = VirtualGpu(tmp / "exclusive", gpus=GPUS_EXCLUSIVE, compute_mode="exclusive_process")
    holds = tmp / "holds"
    holds.mkdir()
    proc, _ = forge(gpu, tmp, "--gpus", "all", "--duration", "120", env={"FORGE_HOLD_DIR": str(holds)})
    try:
        deadline_s = time.monotonic() + 90
        while time.monotonic() < deadline_s:
            if len({k.device for k in gpu.kernels()}) == GPUS_EXCLUSIVE:
                break
            time.sleep(0.5)
        else:
            raise RuntimeError("not every GPU filled within 90 s")
        time.sleep(SETTLE_S)
        kids = children_of(proc.pid)
        supervisor = status(proc.pid)["VmRSS"]
        each = [status(pid)["VmRSS"] for pid in kids]
    finally:
        stop(proc)
    return {"supervisor_rss_mib": supervisor, "children": len(kids), "child_rss_mib": each,
            "total_rss_mib": supervisor + sum(each)}


def machine() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu_model": model, "logical_cpus": os.cpu_count(), "python": platform.python_version(),
            "load_average": os.getloadavg()[0]}


def render(r: dict[str, Any]) -> str:
    ones = r["one_gpu"]
    rss = [o["rss_mib"] for o in ones]
    start = [o["start_to_first_kernel_s"] for o in ones]
    ex = r["exclusive_8_gpus"]
    m = r["machine"]
    mapped = ", ".join(sorted({c for o in ones for c in o["compilers_mapped"]})) or "none"
    lines = [
        f"# Memory and start-up of the filler (virtual GPU), {r['date']}",
        "",
        f"From `{r['command']}` on the virtual GPU (scripts/vgpu: driver-free stand-ins for the driver's "
        f"libraries; not hardware, so not a GPU measurement), on {m['cpu_model']} ({m['logical_cpus']} logical "
        f"CPUs, load average {m['load_average']:.1f} at the start), Python {m['python']}"
        f"{' (' + r['python'] + ')' if r.get('python') else ''}. Memory is the kernel's "
        f"VmRSS after {SETTLE_S:g} s of filling; start-up is from the process's start to its first kernel in the "
        "virtual GPU's record" + (", the filler's modules read from compiled bytecode as an installed filler's are "
                                  "(--bytecode cached)." if r.get("bytecode", "as-is") == "cached" else
                                  ", with the environment's bytecode setting as it was (--bytecode as-is: "
                                  f"PYTHONDONTWRITEBYTECODE={r.get('dont_write_bytecode') or 'unset'})."),
        "",
        "| what | measured | goal |",
        "|---|---|---|",
        f"| one filler, resident memory (median of {len(ones)}; range) | {statistics.median(rss):.1f} MiB "
        f"({min(rss):.1f}–{max(rss):.1f}) | ≤ 64 MiB |",
        f"| one filler, peak resident memory (largest) | {max(o['peak_mib'] for o in ones):.1f} MiB | |",
        f"| start to the first kernel (median of {len(ones)}; range) | {statistics.median(start):.3f} s "
        f"({min(start):.3f}–{max(start):.3f}) | ≤ 0.25 s |",
        f"| CUDA compilers mapped by the filler | {mapped} | none |",
        f"| 8 GPUs in exclusive mode: supervisor and {ex['children']} children together | "
        f"{ex['total_rss_mib']:.1f} MiB (supervisor {ex['supervisor_rss_mib']:.1f}, each child "
        f"{min(ex['child_rss_mib']):.1f}–{max(ex['child_rss_mib']):.1f}) | ≤ 600 MiB |",
        "",
        "Virtual GPU: not a GPU measurement. A real driver's libcuda maps more than the stand-in's; that part of "
        "a real filler's memory is not measured here.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where memory.md and memory.json go")
    parser.add_argument("--repeats", type=int, default=5, help="one-GPU runs (default 5)")
    parser.add_argument("--bytecode", choices=("cached", "as-is"), default="cached",
                        help="cached (default): from compiled bytecode, as installed; as-is: the environment's setting")
    parser.add_argument("--python", help="the interpreter that runs the filler (default: this one)")
    parser.add_argument("--startup-only", action="store_true", help="time the start alone (startup.md)")
    args = parser.parse_args(argv)
    global BYTECODE, PYTHON
    BYTECODE = args.bytecode
    PYTHON = args.python or sys.executable
    tmp = Path(tempfile.mkdtemp(prefix="forge_memory_", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
    result: dict[str, Any] = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "virtual_gpu": True,
                              "command": "python3 scripts/memory_bench.py " + " ".join(argv or sys.argv[1:]),
                              "machine": machine(), "bytecode": args.bytecode, "python": args.python,
                              "dont_write_bytecode": os.environ.get("PYTHONDONTWRITEBYTECODE")}
    try:
        if args.bytecode == "cached":
            warm_up(tmp)
        if args.startup_only:
            result["start_to_first_kernel_s"] = [startup(tmp, i) for i in range(args.repeats)]
            result["load_average_end"] = os.getloadavg()[0]
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "startup.json").write_text(json.dumps(result, indent=2) + "\n")
            (args.out / "startup.md").write_text(render_startup(result))
            print(render_startup(result))
            return 0
        result["one_gpu"] = [one_gpu(tmp, i) for i in range(args.repeats)]
        result["exclusive_8_gpus"] = exclusive(tmp)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
        print(f"memory_bench: a run failed: {error}", file=sys.stderr)
        return 1
    text = render(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "memory.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
