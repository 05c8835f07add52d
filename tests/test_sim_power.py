"""The simulated GPU's power model (gpu/sim.py, docs/design.md §15): bare idle, a context's DVFS step, what a kernel
of each shape draws, a foreign job's; NVML's 1-s mean and the energy counter agree. Every figure is the model's."""

from __future__ import annotations

import pytest

from forge_load.config.sim import SimConfig
from forge_load.control.worker import BusyLog, Plan, Worker
from forge_load.gpu.sim import (
    BARE_IDLE_POWER_W,
    CONTEXT_POWER_W,
    IDLE_POWER_W,
    LIGHT_SM_W,
    MAX_POWER_W,
    SimGpu,
    SimLauncher,
    SimProbe,
    VirtualClock,
)


def filled(shape: str, metric: str = "utilization", duty: float = 0.5, until_s: float = 6.0,
           config: SimConfig | None = None) -> tuple[SimGpu, SimProbe, VirtualClock]:
    clock = VirtualClock()
    gpu = SimGpu(config or SimConfig(), clock, keep_history=True)
    worker = Worker(SimLauncher(gpu, shape, metric), BusyLog())
    worker.set_plan(Plan(1000 if shape == "lean" else 800, duty))
    t = 0.0
    while t < until_s:
        t = min(worker.step(t), until_s)
        clock.advance_to(t)
    return gpu, SimProbe(gpu), clock


def test_bare_idle_then_a_context_and_nothing_running() -> None:
    clock = VirtualClock()
    gpu = SimGpu(SimConfig(), clock)
    probe = SimProbe(gpu)
    clock.advance_to(5.0)
    assert probe.power_w() == pytest.approx(BARE_IDLE_POWER_W)
    SimLauncher(gpu)  # our context, nothing launched
    clock.advance_to(5.5)
    assert probe.power_w() == pytest.approx(BARE_IDLE_POWER_W + 0.5 * CONTEXT_POWER_W)  # the 1-s mean
    clock.advance_to(7.0)
    assert probe.power_w() == pytest.approx(IDLE_POWER_W)
    assert probe.energy_j() == pytest.approx(7.0 * BARE_IDLE_POWER_W + 2.0 * CONTEXT_POWER_W)


@pytest.mark.parametrize(("shape", "metric", "above_idle_w"), [
    ("lean", "utilization", 0.5 * LIGHT_SM_W),  # one warp, half the time
    ("lean", "sm_activity", 0.5 * 132 * LIGHT_SM_W),  # a warp on every SM, half the time
    ("burn", "utilization", 0.5 * (MAX_POWER_W - IDLE_POWER_W)),  # full waves of arithmetic, half the time
])
def test_a_kernel_draws_by_its_shape(shape: str, metric: str, above_idle_w: float) -> None:
    gpu, probe, clock = filled(shape, metric)
    power_w = probe.power_w()
    assert power_w == pytest.approx(IDLE_POWER_W + above_idle_w, rel=0.01)
    # The counter integrates the same model: its mean over whole seconds is the readings'.
    at_2_j = gpu.energy_j(2.0)
    assert (gpu.energy_j(6.0) - at_2_j) / 4.0 == pytest.approx(power_w, rel=0.01)


def test_lean_at_half_is_within_the_context_idle_plus_a_tenth_of_the_span_to_the_limit() -> None:
    for metric in ("utilization", "sm_activity"):
        _, probe, _ = filled("lean", metric)
        assert probe.power_w() is not None
        assert probe.power_w() <= IDLE_POWER_W + 0.1 * (MAX_POWER_W - IDLE_POWER_W)


def test_a_foreign_job_brings_its_context_and_its_arithmetic() -> None:
    # Our context closed, a foreign job from 2 s to 8 s busy 90 % of the time: context power once, and the board's
    # limit while its kernels run.
    clock = VirtualClock()
    gpu = SimGpu(SimConfig(foreign_s=((2.0, 8.0),), foreign_load_ratio=0.9), clock)
    probe = SimProbe(gpu)
    clock.advance_to(5.0)
    assert probe.power_w() == pytest.approx(IDLE_POWER_W + 0.9 * (MAX_POWER_W - IDLE_POWER_W), rel=0.01)
    SimLauncher(gpu)  # ours too: still one context's worth
    clock.advance_to(7.0)
    assert probe.power_w() == pytest.approx(IDLE_POWER_W + 0.9 * (MAX_POWER_W - IDLE_POWER_W), rel=0.01)
    clock.advance_to(10.0)
    assert probe.power_w() == pytest.approx(IDLE_POWER_W)  # the job gone, our context still open
