#!/usr/bin/env python3
"""Where one GPU's filler spends its CPU: the filler in real mode on the virtual GPU, profiled in every thread.

    .venv/bin/python scripts/profile_filler.py --out docs/benchmarks/virtual_2026-11-25_loop/profile

Each repeat runs the filler twice on a fresh virtual GPU (`--gpu 0 --target T --duration D`, as the cpu
benchmark runs it): once plain, where each thread's CPU clock is read at the start and the end of the steady
window (`--from-s` after the process started to `--to-s`), and once with cProfile in every thread on that
thread's CPU clock (time.thread_time), whose snapshots at the same two moments are subtracted. The plain run
gives what the filler costs; the profiled one (slower: the profiler's own cost lands on every call) gives
where it goes, by part (PARTS: the inclusive time of functions, per thread) and by function (self time).

Writes OUT.md (the tables) and OUT.json (every number). The virtual GPU's stand-ins for libcuda and
libnvidia-ml cost almost nothing per call, so this is our code and the real Python libraries on this machine's
CPU: not a GPU measurement.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

Key = str  # "file:line:function", or a built-in's name
# The parts of the work timed in the instrumented run: (name, the part it runs inside, the functions whose
# inclusive CPU time it is: module and qualified name). Each is wrapped in a pair of thread CPU clock reads.
PARTS: tuple[tuple[str, str | None, tuple[tuple[str, str], ...]], ...] = (
    ("monitor: poll (Monitor.step)", None, (("forge_load.control.monitor", "Monitor.step"),)),
    ("samples (SampleReader.read)", "monitor: poll (Monitor.step)",
     (("forge_load.control.sampling", "SampleReader.read"),)),
    ("NvmlProbe.utilization_samples", "samples (SampleReader.read)",
     (("forge_load.gpu.nvml", "NvmlProbe.utilization_samples"),)),
    ("pynvml: GetSamples", "NvmlProbe.utilization_samples", (("pynvml", "nvmlDeviceGetSamples"),)),
    ("own/foreign split (Monitor._split)", "monitor: poll (Monitor.step)",
     (("forge_load.control.monitor", "Monitor._split"),)),
    ("device memory (NvmlProbe.memory_used_mib)", "monitor: poll (Monitor.step)",
     (("forge_load.gpu.nvml", "NvmlProbe.memory_used_mib"),)),
    ("pynvml: GetMemoryInfo", "device memory (NvmlProbe.memory_used_mib)", (("pynvml", "nvmlDeviceGetMemoryInfo"),)),
    ("process lists (Monitor._read_processes)", "monitor: poll (Monitor.step)",
     (("forge_load.control.monitor", "Monitor._read_processes"),)),
    ("energy counter (NvmlProbe.energy_j)", "monitor: poll (Monitor.step)",
     (("forge_load.gpu.nvml", "NvmlProbe.energy_j"),)),
    ("pynvml: GetTotalEnergyConsumption", "energy counter (NvmlProbe.energy_j)",
     (("pynvml", "nvmlDeviceGetTotalEnergyConsumption"),)),
    ("power and temperature (NvmlProbe.power_w, temperature_c)", "monitor: poll (Monitor.step)",
     (("forge_load.gpu.nvml", "NvmlProbe.power_w"), ("forge_load.gpu.nvml", "NvmlProbe.temperature_c"))),
    ("NVML calls through nvml._call (all of the NVML above)", "monitor: poll (Monitor.step)",
     (("forge_load.gpu.nvml", "_call"),)),
    ("loop: step (Filler.step)", None, (("forge_load.control.filler", "Filler.step"),)),
    ("Monitor.take", "loop: step (Filler.step)", (("forge_load.control.monitor", "Monitor.take"),)),
    ("a reading: policy, controller (Filler._react)", "loop: step (Filler.step)",
     (("forge_load.control.filler", "Filler._react"),)),
    ("controller (PiController.update)", "a reading: policy, controller (Filler._react)",
     (("forge_load.control.controller", "PiController.update"),)),
    ("holds: the hold directory (Filler._check_holds)", "loop: step (Filler.step)",
     (("forge_load.control.filler", "Filler._check_holds"),)),
    ("holds: the acknowledgement (FillerHolds.acknowledge)", "loop: step (Filler.step)",
     (("forge_load.steering.hold_watch", "FillerHolds.acknowledge"),)),
    ("pauses (Filler._check_pauses)", "loop: step (Filler.step)",
     (("forge_load.control.filler", "Filler._check_pauses"),)),
    ("status lines (Filler._status, LineGate.flush)", "loop: step (Filler.step)",
     (("forge_load.control.filler", "Filler._status"), ("forge_load.control.lines", "LineGate.flush"))),
    ("Worker.step", "loop: step (Filler.step)", (("forge_load.control.worker", "Worker.step"),)),
    ("finished kernels (Worker._collect)", "Worker.step", (("forge_load.control.worker", "Worker._collect"),)),
    ("launcher: events (CudaLauncher.poll)", "finished kernels (Worker._collect)",
     (("forge_load.gpu.launcher", "CudaLauncher.poll"),)),
    ("a burst (Worker._launch_owed)", "Worker.step", (("forge_load.control.worker", "Worker._launch_owed"),)),
    ("launcher: launch (CudaLauncher.launch)", "a burst (Worker._launch_owed)",
     (("forge_load.gpu.launcher", "CudaLauncher.launch"),)),
    ("waiting: Event.wait (the sleep and the wake-up)", None, (("threading", "Event.wait"),)),
)


# --- the child: the filler with a clock on every thread ---------------------------------------------------------

def _code_key(code: Any) -> Key:
    if isinstance(code, str):
        return code
    return f"{code.co_filename}:{code.co_firstlineno}:{code.co_name}"


class ThreadProfiles:
    """A cProfile on each thread's CPU clock, created at the thread's first event (threading.setprofile)."""

    def __init__(self) -> None:
        self.profiles: dict[int, tuple[str, cProfile.Profile]] = {}  # native thread id -> (name, profile)
        self._lock = threading.Lock()

    def start_here(self) -> None:
        profile = cProfile.Profile(time.thread_time)
        with self._lock:
            self.profiles[threading.get_native_id()] = (threading.current_thread().name, profile)
        profile.enable()

    def hook(self, _frame: Any, _event: str, _arg: Any) -> None:
        sys.setprofile(None)
        self.start_here()

    def snapshot(self) -> dict[str, dict[Key, tuple[int, float, float]]]:
        """Per thread name: {function: (calls, self s, inclusive s)}, with no Python code run meanwhile."""
        gc.disable()
        try:
            with self._lock:
                profiles = list(self.profiles.values())
            raw = [(name, profile.getstats()) for name, profile in profiles]
        finally:
            gc.enable()
        out: dict[str, dict[Key, tuple[int, float, float]]] = {}
        for name, entries in raw:
            table = out.setdefault(name, {})
            for entry in entries:
                key = _code_key(entry.code)
                calls, self_s, incl_s = table.get(key, (0, 0.0, 0.0))
                table[key] = (calls + entry.callcount, self_s + entry.inlinetime, incl_s + entry.totaltime)
        return out


def _thread_cpu_s() -> dict[str, float]:
    """Each Python thread's CPU time (user + system) now, and the whole process's."""
    out = {"(process)": time.process_time()}
    for thread in threading.enumerate():
        if thread.ident is None:
            continue
        try:
            out[thread.name] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except OSError:
            continue  # the thread ended
    return out


def _wakeups() -> dict[str, int]:
    """Voluntary context switches of each of the process's threads (by native id)."""
    out: dict[str, int] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    out[task.name] = int(line.split()[1])
        except OSError:
            continue
    return out


class PartClocks:
    """The instrumented run: each PARTS function wrapped in two reads of the calling thread's CPU clock."""

    def __init__(self) -> None:
        self.totals: dict[tuple[int, str], list[float]] = {}  # (thread ident, part) -> [calls, CPU s]

    def install(self) -> None:
        import importlib

        for name, _parent, functions in PARTS:
            for module_name, qualname in functions:
                owner: Any = importlib.import_module(module_name)
                *path, attr = qualname.split(".")
                for step in path:
                    owner = getattr(owner, step)
                setattr(owner, attr, self._wrap(name, getattr(owner, attr)))

    def _wrap(self, part: str, function: Any) -> Any:
        import functools

        clock, ident, totals = time.thread_time, threading.get_ident, self.totals

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            # threading.get_ident, never current_thread(): Event.wait runs while a thread starts
            begin_s = clock()
            try:
                return function(*args, **kwargs)
            finally:
                spent_s = clock() - begin_s
                entry = totals.get((ident(), part))
                if entry is None:
                    entry = totals[(ident(), part)] = [0, 0.0]
                entry[0] += 1
                entry[1] += spent_s

        return timed

    def snapshot(self) -> dict[str, dict[str, tuple[float, float]]]:
        names = {t.ident: t.name for t in threading.enumerate()}
        out: dict[str, dict[str, tuple[float, float]]] = {}
        for (thread, part), (calls, spent_s) in list(self.totals.items()):
            out.setdefault(names.get(thread, f"thread {thread}"), {})[part] = (calls, spent_s)
        return out


def child(args: argparse.Namespace) -> int:
    started_s = time.monotonic()
    marks: list[dict[str, Any]] = []
    profiles = ThreadProfiles() if args.mode == "profiled" else None
    clocks = PartClocks() if args.mode == "instrumented" else None

    def mark() -> None:
        names = {str(t.native_id): t.name for t in threading.enumerate() if t.native_id is not None}
        marks.append({"t_s": time.monotonic() - started_s, "cpu_s": _thread_cpu_s(), "wakeups": _wakeups(),
                      "names": names, "stats": profiles.snapshot() if profiles is not None else None,
                      "parts": clocks.snapshot() if clocks is not None else None})

    def marker() -> None:
        for at_s in (args.from_s, args.to_s):
            time.sleep(max(started_s + at_s - time.monotonic(), 0.0))
            mark()

    # The marker runs unprofiled: its thread starts before the hook is set.
    thread = threading.Thread(target=marker, name="profile-marker", daemon=True)
    thread.start()
    if profiles is not None:
        threading.setprofile(profiles.hook)
        profiles.start_here()
    if clocks is not None:
        clocks.install()
    sys.argv = ["forge-load", *args.filler_args]
    from forge_load.cli import main

    code = main()
    thread.join(timeout=5.0)
    threading.setprofile(None)
    sys.setprofile(None)
    Path(args.child_out).write_text(json.dumps({"exit_code": code, "marks": marks}))
    sys.stdout.flush()
    os._exit(code)


# --- the parent: runs, aggregates, writes -------------------------------------------------------------------------

MODES = ("plain", "instrumented", "profiled")


def _diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, dict[Key, tuple[float, ...]]]:
    out: dict[str, dict[Key, tuple[float, ...]]] = {}
    for thread, table in b.items():
        before = a.get(thread, {})
        out[thread] = {}
        for key, values in table.items():
            old = before.get(key, (0,) * len(values))
            delta = tuple(v - o for v, o in zip(values, old))
            if delta[0] > 0 or delta[1] > 0:
                out[thread][key] = delta
    return out


def run_filler(args: argparse.Namespace, tmp: Path, index: int, mode: str) -> dict[str, Any]:
    from bench.cpu import base_env
    from vgpu import VirtualGpu

    gpu = VirtualGpu(tmp / f"gpu{index}", gpus=1)
    env = gpu.env(base_env())
    env["FORGE_HEARTBEAT_FILE"] = str(tmp / f"heartbeat{index}")  # as the cpu benchmark runs it
    out = tmp / f"child{index}.json"
    filler_args = ["--gpu", "0", "--target", f"{args.target:g}", "--duration", f"{args.duration:g}",
                   "--log-format", "json"]
    argv = [sys.executable, __file__, "--child", "--child-out", str(out), "--from-s", f"{args.from_s:g}",
            "--to-s", f"{args.to_s:g}", "--mode", mode, "--", *filler_args]
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=args.duration + 120)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"profile_filler: the filler exited with {done.returncode}: {done.stderr[-2000:]}")
    missing = gpu.unimplemented()
    if missing:
        raise SystemExit(f"profile_filler: the filler called entry points the virtual GPU lacks: {missing}")
    data: dict[str, Any] = json.loads(out.read_text())
    a, b = data["marks"]
    wall_s = b["t_s"] - a["t_s"]
    cpu = {name: (b["cpu_s"][name] - a["cpu_s"].get(name, 0.0)) / wall_s
           for name in b["cpu_s"] if name != "profile-marker"}
    names = {**a["names"], **b["names"]}
    wakeups: dict[str, float] = {}
    for tid, count in b["wakeups"].items():
        name = names.get(tid, f"thread {tid}")
        if name != "profile-marker":
            wakeups[name] = wakeups.get(name, 0.0) + (count - a["wakeups"].get(tid, 0)) / wall_s
    run: dict[str, Any] = {"mode": mode, "wall_s": wall_s, "cpu_s_per_s": cpu, "wakeups_per_s": wakeups}
    if mode == "profiled":
        run["stats"] = _diff(a["stats"], b["stats"])
        run["stats"].pop("profile-marker", None)
    if mode == "instrumented":
        run["parts"] = _diff(a["parts"], b["parts"])
    return run


def _short(key: Key) -> str:
    if ":" not in key:
        return key
    path, line, name = key.rsplit(":", 2)
    for marker in (str(ROOT) + "/", "site-packages/", "lib/python3."):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{line} {name}"


def top_functions(stats: dict[str, dict[Key, tuple[float, ...]]], wall_s: float, n: int) -> list[dict[str, Any]]:
    merged = [((thread, key), value) for thread, table in stats.items() for key, value in table.items()]
    ranked = sorted(merged, key=lambda kv: -kv[1][1])[:n]
    return [{"thread": thread, "function": _short(key), "self_us_per_s": 1e6 * v[1] / wall_s,
             "incl_us_per_s": 1e6 * v[2] / wall_s, "calls_per_s": v[0] / wall_s} for (thread, key), v in ranked]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_mode = {mode: [r for r in runs if r["mode"] == mode] for mode in MODES}
    threads = sorted({t for r in runs for t in r["cpu_s_per_s"]})
    cpu_rows = [{"thread": t, "wakeups_per_s": _median([r["wakeups_per_s"].get(t, 0.0) for r in by_mode["plain"]]),
                 **{f"{mode}_us_per_s": _median([1e6 * r["cpu_s_per_s"].get(t, 0.0) for r in by_mode[mode]])
                    for mode in MODES}} for t in threads]
    parts = []
    for name, parent, _functions in PARTS:
        for thread in sorted({t for r in by_mode["instrumented"] for t in r["parts"]}):
            rows = [r["parts"][thread][name] for r in by_mode["instrumented"] if name in r["parts"].get(thread, {})]
            if not rows:
                continue
            walls = [r["wall_s"] for r in by_mode["instrumented"] if name in r["parts"].get(thread, {})]
            parts.append({"part": name, "parent": parent, "thread": thread,
                          "us_per_s": _median([1e6 * spent / w for (_, spent), w in zip(rows, walls)]),
                          "calls_per_s": _median([calls / w for (calls, _), w in zip(rows, walls)]),
                          "us_per_call": _median([1e6 * spent / max(calls, 1) for calls, spent in rows])})
    profiled = sorted(by_mode["profiled"], key=lambda r: r["cpu_s_per_s"]["(process)"])
    middle = profiled[len(profiled) // 2]  # the median run, by the process's CPU
    return {"target": args.target, "duration_s": args.duration, "window_s": [args.from_s, args.to_s],
            "repeats": args.repeats, "threads": cpu_rows, "parts": parts,
            "top_self": top_functions(middle["stats"], middle["wall_s"], args.top), "runs": runs}


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0]
    python = platform.python_version()
    return f"{cpu}, {os.cpu_count()} logical CPUs, load average {load:.2f} at the start; Python {python}"


def _depth(parts: list[dict[str, Any]], row: dict[str, Any]) -> int:
    depth, parent = 0, row["parent"]
    while parent is not None:
        depth += 1
        parent = next((r["parent"] for r in parts if r["part"] == parent), None)
    return depth


def _git_head() -> str:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "forge_load"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"commit {head}" + (" (forge_load/ changed since)" if dirty else "")


def render(summary: dict[str, Any], command: str, when: str, where: str, code: str) -> str:
    lines = [
        f"## Where one GPU's filler spends its CPU: a profile on the virtual GPU, {when}",
        "",
        "> **Virtual GPU: not a GPU measurement.** The filler ran in real mode (numba-cuda, cuda-bindings, pynvml) on "
        "the driver-free stand-ins for libcuda and libnvidia-ml (`scripts/vgpu`): the CPU time is this machine's, "
        "spent in our code, the real Python libraries and the stand-ins (whose calls cost about a microsecond "
        "when warm).",
        "",
        f"Machine: {where}",
        "",
        f"Code: {code}",
        "",
        f"`{command}`",
        "",
        f"One GPU at target {summary['target']:g}, `--duration {summary['duration_s']:g}`; the steady window is "
        f"{summary['window_s'][0]:g} s to {summary['window_s'][1]:g} s after the process started. Each of "
        f"{summary['repeats']} repeat(s) runs the filler three times, each on a fresh virtual GPU: plain (only each "
        "thread's CPU clock read at the window's ends), instrumented (the parts below each wrapped in two reads of "
        "the thread's CPU clock) and profiled (cProfile in every thread, on the thread's CPU clock). Medians of the "
        "repeats. Written by scripts/profile_filler.py.",
        "",
        "### CPU by thread (µs of CPU per second of wall time)",
        "",
        "| thread | plain | instrumented | profiled | wake-ups per s (plain) |",
        "|---|---|---|---|---|",
    ]
    for row in summary["threads"]:
        lines.append(f"| {row['thread']} | {row['plain_us_per_s']:.0f} | {row['instrumented_us_per_s']:.0f} | "
                     f"{row['profiled_us_per_s']:.0f} | {row['wakeups_per_s']:.1f} |")
    lines += [
        "",
        "The plain run is what the filler costs. `gpu-0` is the GPU's loop, `monitor` its NVML poller; the main "
        "thread and the signal thread only wait.",
        "",
        "### By part (instrumented run: inclusive µs of CPU per second, and per call)",
        "",
        "| thread | part | µs/s | calls/s | µs per call |",
        "|---|---|---|---|---|",
    ]
    parts = summary["parts"]
    for row in parts:
        indent = "… " * _depth(parts, row)
        lines.append(f"| {row['thread']} | {indent}{row['part']} | {row['us_per_s']:.0f} | {row['calls_per_s']:.1f} | "
                     f"{row['us_per_call']:.1f} |")
    lines += [
        "",
        "A part includes the parts under it (… marks each level); what a part has beyond them is its own code. "
        "Each call runs on a thread that has just woken from a sleep of tens of milliseconds, with cold caches: "
        "the same calls in a tight loop cost a few times less (`python -m vgpu.bench_calls` has the stand-in's own "
        "cost per CUDA call). The wait's time is the thread's own CPU in going to sleep and waking (the kernel's "
        "and Python's), not the time asleep.",
        "",
        f"### The top {len(summary['top_self'])} functions by self time (profiled run, the median one)",
        "",
        "| thread | function | self µs/s | inclusive µs/s | calls/s |",
        "|---|---|---|---|---|",
    ]
    for row in summary["top_self"]:
        lines.append(f"| {row['thread']} | `{row['function']}` | {row['self_us_per_s']:.0f} | "
                     f"{row['incl_us_per_s']:.0f} | {row['calls_per_s']:.1f} |")
    lines += [
        "",
        "cProfile's own cost lands on every Python call, so these are inflated, call-heavy functions most; C "
        "functions of cuda-bindings (Cython) and the ctypes calls of pynvml count as their caller's self time.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write OUT.md and OUT.json (default: print the tables)")
    parser.add_argument("--target", type=float, default=0.5)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds each filler runs (default 20)")
    parser.add_argument("--from-s", type=float, default=6.0, help="the steady window's start after the process's")
    parser.add_argument("--to-s", type=float, default=19.5, help="the steady window's end")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each kind (default 1)")
    parser.add_argument("--top", type=int, default=25, help="functions in the self-time table")
    parser.add_argument("--code", default=None, help="what code ran, for the heading (default: git's HEAD here)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, default="plain", help=argparse.SUPPRESS)
    parser.add_argument("filler_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    if not 0 < args.from_s < args.to_s < args.duration:
        parser.error(f"--from-s {args.from_s:g} and --to-s {args.to_s:g}: need 0 < from < to < --duration")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: need 1 or more")
    command = "python scripts/profile_filler.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    where = machine()
    code = args.code or _git_head()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="profile_filler_") as tmp:
        for _ in range(args.repeats):
            for mode in MODES:
                print(f"run {len(runs) + 1} of {len(MODES) * args.repeats} ({mode})", file=sys.stderr)
                runs.append(run_filler(args, Path(tmp), len(runs), mode))
    summary = summarize(args, runs)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    text = render(summary, command, when, where, code)
    if args.out is None:
        print(text)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"command": command, "when": when, "machine": where,
                                                         "code": code, **summary}, indent=1) + "\n")
    print(f"wrote {args.out.with_suffix('.md')} and .json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
