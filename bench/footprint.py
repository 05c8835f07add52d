"""The footprint scenario: what the filler costs beside a bare CUDA context (device memory), and its CPU and board
power at the tracking runs' targets. On a real GPU it measures the idle GPU and a bare context
(scripts/bare_context.py) itself and takes the rest from the tracking runs; on the simulated GPU every number is
the model's."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from bench import REPO, BenchError
from bench.analysis import first
from bench.real import RealBench
from bench.results import FOOTPRINT_TARGET, mean, q, val
from bench.runner import Child


def sim_footprint(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    """The simulated GPU's footprint, from its tracking runs and the simulator's model."""
    from forge_load.gpu import sim

    pi_05 = results["tracking"].get("pi", {}).get(f"{FOOTPRINT_TARGET:g}", {})
    filler_mib = val(pi_05.get("gpu_mem_mib"))
    note = "simulated: the simulator's model, not a measurement"
    return {
        "simulated": True,
        "filler_process_mib": q(filler_mib, "MiB", note),
        "bare_context_mib": q(sim.CONTEXT_MIB, "MiB", note),
        "over_bare_mib": q(filler_mib - sim.CONTEXT_MIB if filler_mib is not None else None, "MiB", note),
        "over_bare_ratio": q(filler_mib / sim.CONTEXT_MIB if filler_mib is not None else None, "x", note),
        "cpu_pct_one_core": q(None, "% of one core", "n/a (simulated): virtual time has no CPU cost"),
        "power_w": {f"{t:g}": results["tracking"].get("pi", {}).get(f"{t:g}", {}).get(
            "power_w", q(None, "W")) for t in args.targets},
        "idle_power_w": q(sim.IDLE_POWER_W, "W", note),
    }


def idle(bench: RealBench) -> dict[str, Any]:
    """Board power and device memory in use with nothing of ours on the GPU."""
    a = time.time()
    time.sleep(3.0)
    power = [p for _, p in bench.sampler.between("power", a, time.time())]
    memory = [m for _, m in bench.sampler.between("memory", a, time.time())]
    return {"power_w": q(mean(power), "W", None if power else "NVML gave no power reading"),
            "memory_used_mib": q(mean(memory), "MiB", None if memory else "NVML gave no memory reading")}


def bare_context(bench: RealBench) -> dict[str, Any]:
    """A bare CUDA context's memory (scripts/bare_context.py), what the filler's is compared with."""
    bench.wait_idle()
    child = Child("bare context", [sys.executable, str(REPO / "scripts" / "bare_context.py"), "--gpu", bench.gpu],
                  bench.env())
    code = child.wait_exit(bench.args.start_timeout)
    event = first(child.events, "bare_context")
    if code != 0 or event is None:
        raise BenchError(f"bare_context.py exited with code {code}{child.tail()}")
    return event


def real_footprint(args: argparse.Namespace, results: dict[str, Any], footprint: dict[str, Any],
                   bare: dict[str, Any] | None) -> None:
    """The footprint of a real run, into `footprint` (which holds the idle GPU's numbers already): the filler's
    process memory over the bare context's, from the tracking runs at FOOTPRINT_TARGET of the first controller."""
    first_controller = results["tracking"].get(args.controllers[0], {})
    at_05 = first_controller.get(f"{FOOTPRINT_TARGET:g}")
    footprint["cpu_pct_one_core"] = at_05["cpu_pct_one_core"] if at_05 else q(
        None, "% of one core", f"no tracking run at {FOOTPRINT_TARGET:g}")
    # Per-process memory from NVML where it says (bare metal, --pid=host); else the device's used
    # memory over the idle GPU's, for the filler and for the bare context alike.
    filler_mib = val(at_05["gpu_mem_mib"]) if at_05 else None
    bare_mib = bare.get("process_mib") if bare else None
    filler_delta = (val(at_05["device_mem_used_mib"]) - val(footprint["idle_memory_used_mib"])
                    if at_05 and val(at_05["device_mem_used_mib"]) is not None
                    and val(footprint["idle_memory_used_mib"]) is not None else None)
    bare_delta = bare.get("device_delta_mib") if bare else None
    footprint["filler_device_delta_mib"] = q(filler_delta, "MiB")
    footprint["bare_context_device_delta_mib"] = q(bare_delta, "MiB")
    if (filler_mib is None or bare_mib is None) and filler_delta is not None and bare_delta is not None:
        filler_mib, bare_mib = filler_delta, bare_delta
        footprint["method"] = "device memory used minus the idle GPU's (NVML gave no per-process memory)"
    else:
        footprint["method"] = "NVML per-process used memory"
    footprint["filler_process_mib"] = q(filler_mib, "MiB", None if filler_mib is not None else "not measured")
    footprint["bare_context_mib"] = q(bare_mib, "MiB", None if bare_mib is not None else "not measured")
    both = filler_mib is not None and bare_mib
    missing = None if both else "needs both the filler's and the bare context's process memory"
    over_mib = filler_mib - bare_mib if filler_mib is not None and bare_mib else None
    over_ratio = filler_mib / bare_mib if filler_mib is not None and bare_mib else None
    footprint["over_bare_mib"] = q(over_mib, "MiB", missing)
    footprint["over_bare_ratio"] = q(over_ratio, "x", missing)
    footprint["power_w"] = {f"{t:g}": first_controller.get(f"{t:g}", {}).get("power_w", q(None, "W"))
                            for t in args.targets}
