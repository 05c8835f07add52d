#!/usr/bin/env python3
"""What the filler weighs in memory and how soon it fills, on the virtual GPU (issue 26): a benchmark, not a test.

    python3 scripts/memory_bench.py --out docs/benchmarks/virtual_<date>_light [--repeats 5]

Each run is `python -m forge_load` in real mode on a fresh virtual GPU (vgpu.VirtualGpu), as users run it:
- one GPU: the filler's resident memory (VmRSS) and peak (VmHWM) once it fills, the CUDA compilers it has mapped
  (/proc/<pid>/maps: libnvvm, libnvrtc, libnvJitLink, llvmlite), and the time from the process's start to its
  first kernel (the virtual GPU's own record of kernels);
- eight GPUs in exclusive compute mode (`--gpus all` with holds: a supervisor and one child per GPU): the resident
  memory of the supervisor and its children together, once every GPU fills.
It prints a Markdown table and writes memory.md and memory.json into --out, labelled with the machine, the
virtual GPU (never a GPU measurement) and the date. Exit codes: 0 done; 1 a run failed (the line says which).
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


def forge(gpu: VirtualGpu, tmp: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str],
                                                                                                  float]:
    own = {"FORGE_HEARTBEAT_FILE": str(tmp / f"heartbeat-{time.monotonic_ns()}")}
    started_s = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "forge_load", "--log-format", "json", *args],
                            env=gpu.env({**os.environ, **own, **(env or {})}), cwd=REPO, text=True,
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
        f"CPUs, load average {m['load_average']:.1f} at the start), Python {m['python']}. Memory is the kernel's "
        f"VmRSS after {SETTLE_S:g} s of filling; start-up is from the process's start to its first kernel in the "
        "virtual GPU's record.",
        "",
        "| what | measured | goal (issue 26) |",
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
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="forge_memory_", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
    result: dict[str, Any] = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "virtual_gpu": True,
                              "command": "python3 scripts/memory_bench.py " + " ".join(argv or sys.argv[1:]),
                              "machine": machine()}
    try:
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
