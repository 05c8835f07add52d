"""The benchmark's command line: arguments, which mode runs (simulated, real, virtual), where the results go,
exit codes, and --render (redraw from a saved run). `scripts/gpu_bench.py` calls main()."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
from datetime import date, datetime, timezone
from pathlib import Path

from bench import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_NO_GPU,
    EXIT_OK,
    EXIT_USAGE,
    REPO,
    BenchError,
    Interrupted,
    NoGpu,
    cpu,
    log,
)
from bench.metric import METRIC_TARGET
from bench.power import POWER_S, POWER_SETTLE_S, POWER_SHAPES, POWER_TARGETS, render_power_section
from bench.render import (
    render_announced_section,
    render_cpu_section,
    render_metric_section,
    render_section,
    write_cpu_outputs,
    write_outputs,
    write_section,
)
from bench.results import ANNOUNCED_PATHS, CONTROLLERS, JUDGE_FROM_S, SCHEMA, TARGETS, YIELD_TARGET, Json, q, slug
from bench.runner import CHILDREN
from bench.scenarios import REAL_VARIANTS, SIM_VARIANTS, real_plan, run_real_bench, run_simulated_bench
from forge_load import __version__ as forge_version

SCENARIOS = ("tracking", "yield", "footprint", "metric", "cpu", "announced", "power")
# metric: skipped, saying why, where the GPU has no GPM (the simulated GPU, before Hopper)
DEFAULT_SCENARIOS = "tracking,yield,footprint,metric"
TRACKING_SCENARIOS = {"tracking", "yield", "footprint"}  # what docs/benchmarks.md's goals section is drawn from
SCRIPT = REPO / "scripts" / "gpu_bench.py"


def on_virtual_gpu() -> bool:
    """True when the driver libraries this process loads are the virtual GPU's (scripts/vgpu sets VGPU_STATE)."""
    return bool(os.environ.get("VGPU_STATE"))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu_bench.py", description="forge_load's benchmark: tracking, yield and footprint.",
        epilog="Every number's meaning: docs/benchmarks/README.md")
    parser.add_argument("--simulate", action="store_true", help="the simulated GPU, in virtual time")
    parser.add_argument("--vgpu", action="store_true",
                        help="real mode on a fresh virtual GPU (scripts/vgpu): the real libraries on driver-free "
                             "stand-ins; results say \"virtual GPU\" and go to docs/benchmarks/virtual_<date>/")
    parser.add_argument("--out", type=Path, help="output folder; default docs/benchmarks/<gpu>_<date>/ "
                        "(simulated_<date>/ with --simulate)")
    parser.add_argument("--gpu", type=int, default=0, help="GPU index (NVML order = PCI bus order); default 0")
    parser.add_argument("--track-s", type=float, default=60.0, help="seconds per tracking run; default 60")
    parser.add_argument("--targets", default=",".join(f"{t:g}" for t in TARGETS),
                        help="tracking targets, comma separated; default 0.3,0.5,0.8")
    parser.add_argument("--controllers", default="pi,legacy", help="default pi,legacy (pi first)")
    parser.add_argument("--scenarios", default=DEFAULT_SCENARIOS,
                        help="which to run, comma separated, of tracking, yield, footprint, metric, cpu, "
                             f"announced, power; default {DEFAULT_SCENARIOS} (metric: a GPU with GPM, else skipped "
                             "saying why, see --metric-s; cpu, announced and power: real mode only, see --cpu-s, "
                             "--announced-jobs and --power-s)")
    parser.add_argument("--foreign-s", type=float, default=None,
                        help="seconds the foreign job trains; default 15 (simulated: 20)")
    parser.add_argument("--warmup-s", type=float, default=None,
                        help="seconds of filling before the foreign job starts; default 3 (simulated: 10)")
    parser.add_argument("--resume-after", type=float, default=2.0,
                        help="the filler's --resume-after in every run, seconds (its own default is 60); "
                             "default 2")
    parser.add_argument("--variants", default=None,
                        help="yield variants, comma separated; default all: visible,hidden,utilization_only "
                             "(simulated: also no_process_list)")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="real GPU: skip (and list) the scenarios that would end after this many seconds "
                             "of benchmark; the most telling run first; default 0 = no limit")
    parser.add_argument("--start-timeout", type=float, default=180.0,
                        help="seconds a process may take to start (imports, CUDA, compiling); default 180")
    parser.add_argument("--filler-args", default="",
                        help="extra flags for every filler run, one string (e.g. '--poll-interval 0.05')")
    parser.add_argument("--foreign-args", default="",
                        help="extra flags for scripts/foreign_job.py, one string (e.g. '--backend cupy')")
    parser.add_argument("--metric-s", type=float, default=20.0,
                        help="metric scenario: seconds the filler holds each GPM metric (sm_activity, then "
                             "gr_activity) at 0.5; default 20")
    parser.add_argument("--announced-jobs", type=int, default=3,
                        help="announced scenario: foreign jobs per path; default 3")
    parser.add_argument("--announced-by", default=None, metavar="PATHS",
                        help="announced scenario: how each job is announced, comma separated, of "
                             f"{','.join(ANNOUNCED_PATHS)}: hold (`forge-load hold --wait 2`, as the Slurm prolog), "
                             "kubelet (a test kubelet's pod-resources assignment), dra (a DRA claim of NVIDIA's "
                             "driver on the test kubelet), docker (`forge-load fleet watch` "
                             "on a container's create event; needs a Docker engine with the nvidia driver, "
                             "scripts/docker_engine.sh), nvml (nobody announces it: the reactive baseline); "
                             "default: those that can run here")
    parser.add_argument("--power-s", type=float, default=POWER_S,
                        help=f"power scenario: seconds of each window; default {POWER_S:g}, at least 60 on a real GPU "
                             "(NVML's power readings sample part of the time: the energy counter over a long window "
                             "is the number), from 5 on the virtual GPU, whose power is a model")
    parser.add_argument("--power-settle-s", type=float, default=POWER_SETTLE_S,
                        help=f"power scenario: seconds the filler fills before its window; default {POWER_SETTLE_S:g}")
    parser.add_argument("--power-targets", default=",".join(f"{t:g}" for t in POWER_TARGETS),
                        help="power scenario: the filler's targets, comma separated; default 0.25,0.5,1")
    parser.add_argument("--power-shapes", default=",".join(POWER_SHAPES),
                        help="power scenario: kernel shapes (FORGE_SHAPE), comma separated; default lean,burn")
    parser.add_argument("--cpu-s", type=float, default=cpu.RUN_S,
                        help=f"cpu scenario: seconds per run; default {cpu.RUN_S:g}")
    parser.add_argument("--cpu-gpus", default=",".join(map(str, cpu.GPU_COUNTS)),
                        help="cpu scenario: GPUs per filler process, comma separated; default 1,8 (on the virtual "
                             "GPU each run gets as many; on a real one, those there are)")
    parser.add_argument("--cpu-nvml-costs", default=",".join(f"{c:g}" for c in cpu.NVML_COSTS_MS),
                        help="cpu scenario on the virtual GPU: run each (GPUs, target) with each process-list query "
                             "costing these ms of CPU, comma separated; default 0,4.5")
    parser.add_argument("--cpu-repeats", type=int, default=1,
                        help="cpu scenario: runs of each (GPUs, target, cost); tables and goals take the median; "
                             "default 1")
    parser.add_argument("--sim-window", type=float, default=1 / 6, help="simulated NVML window; default 1/6 s")
    parser.add_argument("--seed", type=int, default=0, help="simulator seed; default 0")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    parser.add_argument("--section", type=Path, default=None,
                        help="also write the generated benchmark blocks (Markdown) to this file, e.g. "
                             "docs/benchmarks.md, with links relative to it")
    parser.add_argument("--render", type=Path, default=None, metavar="DIR",
                        help="measure nothing: redraw results.md, the plots (and --section) from DIR's "
                             "results.json and series.json")
    args = parser.parse_args(argv)
    try:
        args.targets = [float(t) for t in args.targets.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--targets {args.targets!r}: expected ratios such as 0.3,0.5,0.8")
    if not args.targets or not all(0 < t <= 1 for t in args.targets):
        parser.error("--targets: each must be in (0, 1]")
    args.controllers = [c.strip() for c in args.controllers.split(",") if c.strip()]
    if not args.controllers or any(c not in CONTROLLERS for c in args.controllers):
        parser.error(f"--controllers: expected some of {', '.join(CONTROLLERS)}")
    args.scenarios = {s.strip() for s in args.scenarios.split(",") if s.strip()}
    if not args.scenarios or not args.scenarios <= set(SCENARIOS):
        parser.error(f"--scenarios: expected some of {', '.join(SCENARIOS)}")
    if "cpu" in args.scenarios and args.simulate:
        parser.error("--scenarios cpu: needs real mode (a real GPU, or --vgpu): virtual time has no CPU cost")
    if "announced" in args.scenarios and args.simulate:
        parser.error("--scenarios announced: needs real mode (a real GPU, or --vgpu): the holds are files and the "
                     "commands processes, in real time")
    if "power" in args.scenarios and args.simulate:
        parser.error("--scenarios power: needs real mode (a real GPU, or --vgpu): the simulated GPU's power is its "
                     "model, which tests/test_sim_power.py pins")
    virtual = args.vgpu or on_virtual_gpu()
    if not (60 if not virtual else 5) <= args.power_s <= 3600:
        parser.error(f"--power-s {args.power_s:g}: expected 60 to 3600 seconds on a real GPU (5 to 3600 on the "
                     "virtual GPU)")
    if not 3 <= args.power_settle_s <= 600:
        parser.error(f"--power-settle-s {args.power_settle_s:g}: expected 3 to 600 seconds")
    try:
        args.power_targets = [float(t) for t in args.power_targets.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--power-targets {args.power_targets!r}: expected ratios such as 0.25,0.5,1")
    if not args.power_targets or not all(0 < t <= 1 for t in args.power_targets):
        parser.error("--power-targets: each must be in (0, 1]")
    args.power_shapes = [s.strip() for s in args.power_shapes.split(",") if s.strip()]
    if not args.power_shapes or any(s not in POWER_SHAPES for s in args.power_shapes):
        parser.error(f"--power-shapes: expected some of {', '.join(POWER_SHAPES)}")
    if not 5 <= args.metric_s <= 600:
        parser.error(f"--metric-s {args.metric_s:g}: expected 5 to 600 seconds")
    if not 1 <= args.announced_jobs <= 100:
        parser.error(f"--announced-jobs {args.announced_jobs}: expected 1 to 100")
    args.announced_by_default = args.announced_by is None
    paths = [p.strip() for p in (args.announced_by or ",".join(ANNOUNCED_PATHS)).split(",") if p.strip()]
    if not paths or any(p not in ANNOUNCED_PATHS for p in paths) or len(set(paths)) != len(paths):
        parser.error(f"--announced-by {args.announced_by!r}: expected some of {','.join(ANNOUNCED_PATHS)}, "
                     "each once")
    args.announced_by = paths
    try:
        args.cpu_gpus = sorted({int(n) for n in args.cpu_gpus.split(",") if n.strip()})
    except ValueError:
        parser.error(f"--cpu-gpus {args.cpu_gpus!r}: expected GPU counts such as 1,8")
    if not args.cpu_gpus or not all(1 <= n <= 8 for n in args.cpu_gpus):
        parser.error("--cpu-gpus: each must be 1 to 8")
    try:
        args.cpu_nvml_costs = sorted({float(c) for c in args.cpu_nvml_costs.split(",") if c.strip()})
    except ValueError:
        parser.error(f"--cpu-nvml-costs {args.cpu_nvml_costs!r}: expected milliseconds such as 0,4.5")
    if not args.cpu_nvml_costs or not all(0 <= c <= 1000 for c in args.cpu_nvml_costs):
        parser.error("--cpu-nvml-costs: each must be 0 to 1000 ms")
    if not 1 <= args.cpu_repeats <= 20:
        parser.error(f"--cpu-repeats {args.cpu_repeats}: expected 1 to 20")
    if args.cpu_s < cpu.STEADY_FROM_S + 2:
        parser.error(f"--cpu-s must be >= {cpu.STEADY_FROM_S + 2:g}: the steady state begins "
                     f"{cpu.STEADY_FROM_S:g} s after the start line")
    known = SIM_VARIANTS if args.simulate else REAL_VARIANTS
    args.variants = [v.strip() for v in (args.variants or ",".join(known)).split(",") if v.strip()]
    if not args.variants or any(v not in known for v in args.variants):
        parser.error(f"--variants: expected some of {', '.join(known)}")
    if args.foreign_s is None:
        args.foreign_s = 20.0 if args.simulate else 15.0
    if args.warmup_s is None:
        args.warmup_s = 10.0 if args.simulate else 3.0
    if args.track_s < JUDGE_FROM_S + 5 or args.foreign_s <= 0 or args.warmup_s < 1 or args.resume_after < 0:
        parser.error(f"--track-s must be >= {JUDGE_FROM_S + 5:g}, --foreign-s > 0, --warmup-s >= 1, "
                     "--resume-after >= 0")
    try:
        args.filler_args = shlex.split(args.filler_args)
        args.foreign_args = shlex.split(args.foreign_args)
    except ValueError as error:
        parser.error(f"--filler-args / --foreign-args: {error}")
    return args


def estimate_s(args: argparse.Namespace) -> float:
    """A rough length of a real run, for the first log line."""
    total = cpu.estimate_s(args) if "cpu" in args.scenarios else 0.0
    if args.scenarios - {"cpu"}:
        steps = real_plan(args, None, {"notes": [], "skipped": []})  # type: ignore[arg-type]  # estimates only
        total += sum(estimate for _, estimate, _ in steps) + 20.0
    return total


def software() -> Json:
    out: Json = {"forge_load": forge_version, "python": platform.python_version()}
    try:
        import numba

        out["numba"] = numba.__version__
    except ImportError:
        pass
    return out


def new_results(args: argparse.Namespace, argv: list[str], today: str) -> Json:
    """The results tree of the tracking, yield and footprint scenarios (results.json), before any run."""
    results: Json = {
        "schema": SCHEMA,
        "mode": "simulated" if args.simulate else "real",
        "virtual_gpu": not args.simulate and on_virtual_gpu(),  # real mode, on scripts/vgpu's stand-ins
        "date": today,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "scripts/gpu_bench.py", *argv]),
        "complete": False,
        "software": software(),
        "machine": cpu.machine(),  # where it ran (the GPU, its kind and the date are beside it)
        "settings": {
            "track_s": q(args.track_s, "s"), "targets": [q(t, "ratio") for t in args.targets],
            "controllers": args.controllers, "scenarios": sorted(args.scenarios - {"cpu"}),
            "yield_target": q(YIELD_TARGET, "ratio"), "warmup_s": q(args.warmup_s, "s"),
            "foreign_s": q(args.foreign_s, "s"), "resume_after_s": q(args.resume_after, "s"),
            "judge_from_s": q(JUDGE_FROM_S, "s"), "variants": args.variants,
            "filler_args": args.filler_args, "foreign_args": args.foreign_args,
            **({"metric_s": q(args.metric_s, "s"), "metric_target": q(METRIC_TARGET, "ratio")}
               if "metric" in args.scenarios else {}),
            "budget_s": q(args.budget_s or None, "s", None if args.budget_s else "no limit"),
            **({"announced_by": args.announced_by, "announced_jobs": q(args.announced_jobs, "count")}
               if "announced" in args.scenarios else {}),
            **({"power_s": q(args.power_s, "s"), "power_settle_s": q(args.power_settle_s, "s"),
                "power_targets": [q(t, "ratio") for t in args.power_targets], "power_shapes": args.power_shapes}
               if "power" in args.scenarios else {}),
        },
        "gpu": {"name": "unknown", "driver": "unknown"},
        "tracking": {}, "yield": {}, "metric": {}, "announced": {}, "power": {}, "footprint": {}, "notes": [],
        "failures": [],
        "skipped": [],
        "_series": {},
    }
    if args.simulate:
        results["settings"].update(sim_window_s=q(args.sim_window, "s"), seed=args.seed)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
    except SystemExit as exit_:
        return EXIT_USAGE if exit_.code else EXIT_OK
    if args.render:
        return render_saved(args)
    if args.vgpu and args.simulate:
        print("gpu_bench: --vgpu and --simulate exclude each other", file=sys.stderr)
        return EXIT_USAGE
    main_scenarios = args.scenarios - {"cpu"}
    if args.vgpu and not on_virtual_gpu() and main_scenarios:
        # The same command again, on a fresh virtual GPU (where --vgpu then only names the run). The cpu
        # scenario makes virtual GPUs of its own, so it alone needs none.
        cmd = [sys.executable, str(REPO / "scripts" / "vgpu"), "run", "--", sys.executable, str(SCRIPT), *argv]
        return subprocess.run(cmd, check=False).returncode
    today = date.today().isoformat()
    virtual = not args.simulate and (args.vgpu or on_virtual_gpu())
    results = new_results(args, argv, today) if main_scenarios else None
    cpu_results = cpu.new_results(args, argv, today, virtual, software()) if "cpu" in args.scenarios else None
    current = results if results is not None else cpu_results
    assert current is not None
    out_dir: Path | None = args.out

    def save() -> None:
        if out_dir is not None and results is not None:
            write_outputs(results, out_dir, final=False)

    def save_cpu() -> None:
        if out_dir is not None and cpu_results is not None:
            write_cpu_outputs(cpu_results, out_dir)

    def on_signal(signum: int, _frame: object) -> None:
        raise Interrupted(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    code = EXIT_OK
    try:
        if args.simulate:
            assert results is not None  # parse_args refuses cpu with --simulate
            out_dir = out_dir or REPO / "docs" / "benchmarks" / f"simulated_{today}"
            run_simulated_bench(args, results, save)
            results["complete"] = True
        else:
            kind = "virtual GPU (scripts/vgpu, not hardware)" if virtual else "real GPU"
            log(f"{kind} {args.gpu}: about {estimate_s(args) / 60:.1f} minutes; results go to the output "
                "folder as each scenario ends")
            stem = "virtual"
            if not virtual or main_scenarios:  # NVML here; never the stand-ins' outside scripts/vgpu
                try:
                    from forge_load.gpu.nvml import list_devices

                    devices = {d.index: d for d in list_devices()}
                except Exception as error:  # NoGpuError, or pynvml missing
                    raise NoGpu(str(error)) from error
                if args.gpu not in devices:
                    raise NoGpu(f"GPU index {args.gpu} does not exist: {len(devices)} GPU(s) visible")
                stem = "virtual" if virtual else slug(devices[args.gpu].name)
            out_dir = out_dir or REPO / "docs" / "benchmarks" / f"{stem}_{today}"
            log(f"output: {out_dir}")
            if results is not None:
                run_real_bench(args, results, save, results["failures"])
                results["complete"] = True
            if cpu_results is not None:
                current = cpu_results
                cpu.run_cpu_bench(args, cpu_results, save_cpu, virtual)
                cpu_results["complete"] = True
    except NoGpu as error:
        print(f"gpu_bench: no usable GPU: {error}\n"
              "gpu_bench: run with --simulate to benchmark the simulated GPU instead", file=sys.stderr)
        return EXIT_NO_GPU
    except Interrupted as error:
        log(f"interrupted by {error}: stopping the child processes, writing what was measured")
        current["failures"].append(f"interrupted by {error}")
        code = EXIT_INTERRUPTED
    except BenchError as error:
        log(f"FAILED: {error}")
        current["failures"].append(str(error))
        code = EXIT_FAILED
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        CHILDREN.kill_all()
    if any(r is not None and r["failures"] for r in (results, cpu_results)) and code == EXIT_OK:
        code = EXIT_FAILED
    if out_dir is None:  # stopped before the GPU was known: nothing was measured
        return code
    return finish_outputs(results, cpu_results, out_dir, args, code)


def finish_outputs(results: Json | None, cpu_results: Json | None, out_dir: Path, args: argparse.Namespace,
                   code: int) -> int:
    section: list[str] = []  # docs/benchmarks.md's generated blocks
    goals: list[Json] = []
    if results is not None:
        markdown = write_outputs(results, out_dir, final=True)
        print(markdown)
        log(f"wrote {out_dir}/results.json, results.md" + (", plots" if results.get("plots") else ""))
        if set(results["settings"]["scenarios"]) & TRACKING_SCENARIOS:  # else no tracking, yield or footprint
            section.append(render_section(results, out_dir, args.section))
        if results.get("metric"):  # measured: a run without GPM leaves the page's block as it was
            section.append(render_metric_section(results, out_dir, args.section))
        if results.get("announced"):
            section.append(render_announced_section(results, out_dir, args.section))
        if results.get("power"):
            section.append(render_power_section(results, out_dir, args.section))
        goals += results["goals"]
    if cpu_results is not None:
        markdown = write_cpu_outputs(cpu_results, out_dir)
        print(markdown)
        log(f"wrote {out_dir}/cpu.json, cpu.md")
        section.append(render_cpu_section(cpu_results, out_dir, args.section))
        goals += cpu_results["goals"]
    if args.section:
        args.section.parent.mkdir(parents=True, exist_ok=True)
        missing = write_section(args.section, "\n".join(section))
        log(f"wrote {args.section}")
        for name in missing:
            log(f"{args.section} has no <!-- {name} --> block, so that block was not written there: put the lines "
                f"<!-- {name} --> and <!-- /{name} --> where it belongs, and run --render {out_dir} --section again")
    if args.strict and any(g["pass"] is False for g in goals) and code == EXIT_OK:
        code = EXIT_FAILED
    return code


def render_saved(args: argparse.Namespace) -> int:
    """--render DIR: results.md, cpu.md, the plots and --section again from DIR's results.json and series.json,
    and cpu.json, e.g. after a run on a machine without matplotlib. Nothing is measured."""
    out_dir: Path = args.render
    results = cpu_results = None
    try:
        if (out_dir / "results.json").exists() or not (out_dir / "cpu.json").exists():
            results = json.loads((out_dir / "results.json").read_text())
            results["_series"] = json.loads((out_dir / "series.json").read_text())
            results.pop("plots_note", None)
        if (out_dir / "cpu.json").exists():
            cpu_results = json.loads((out_dir / "cpu.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        print(f"gpu_bench: --render {out_dir}: cannot read results.json and series.json (or cpu.json) there: "
              f"{error}", file=sys.stderr)
        return EXIT_USAGE
    return finish_outputs(results, cpu_results, out_dir, args, EXIT_OK)
