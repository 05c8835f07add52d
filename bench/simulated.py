"""The simulated GPU's runs: the filler in this process (forge_load.service.loop.run_simulated) in virtual time, its
JSON log parsed, and the simulator's own record as the ground truth of each scenario's series."""

from __future__ import annotations

import argparse
import io
from typing import TYPE_CHECKING, Any

from bench.analysis import parse_events, status_series

if TYPE_CHECKING:
    from forge_load.config.settings import Config
    from forge_load.service.loop import SimRun


def sim_config(argv: list[str]) -> Config:
    from forge_load.config.load import load_config

    return load_config(argv, env={})  # the caller's FORGE_* environment must not leak into the runs


def sim_argv(args: argparse.Namespace, target: float, controller: str, duration_s: float) -> list[str]:
    return ["--simulate", "--sim-speed", "0", "--duration", f"{duration_s:g}", "--target", f"{target:g}",
            "--controller", controller, "--log-format", "json", "--log-interval", "1", "--boost-after", "0",
            "--sim-seed", str(args.seed), "--sim-window", f"{args.sim_window:g}",
            "--resume-after", f"{args.resume_after:g}"]


def run_sim(argv: list[str]) -> tuple[SimRun, list[dict[str, Any]]]:
    from forge_load.service.loop import run_simulated

    stream = io.StringIO()
    run = run_simulated(sim_config(argv), stream, keep_history=True)  # scored afterwards
    return run, parse_events(stream.getvalue().splitlines())


def sim_series(run: SimRun, events: list[dict[str, Any]], end_s: float, target: float) -> dict[str, Any]:
    """Ground truth from the simulated GPU: NVML's samples, and per window our and the foreign busy share."""
    gpu = run.gpu
    w = gpu.window_s
    samples = gpu.samples(0.0, end_s)
    return {
        "target": target,
        "util": [[round(s.t_s, 4), s.ratio] for s in samples],
        "own": [[round(s.t_s, 4), round(gpu.own_busy_s(s.t_s - w, s.t_s) / w, 4)] for s in samples],
        "foreign": [[round(s.t_s, 4), round(gpu.foreign_busy_s(s.t_s - w, s.t_s) / w, 4)] for s in samples],
        "multiplier": status_series(events, "multiplier"),
        "power_w": status_series(events, "power_w"),
    }
