"""forge_load.control.shape: what one kernel of ours puts on the GPU for each shape and metric, and what that is worth
in SM activity (the Monitor's own share for the sm_activity signal, the held quantity's feed-forward)."""

from __future__ import annotations

import io

import pytest

from forge_load.config.load import load_config
from forge_load.config.settings import METRIC_NAMES, SHAPE_NAMES
from forge_load.control.quantity import SM_ACTIVITY, UTILIZATION, quantity_for
from forge_load.control.shape import BURN, LEAN, Shape
from forge_load.gpu.sim import IDLE_POWER_W, LIGHT_SM_W, MAX_POWER_W
from forge_load.service.loop import open_simulated


@pytest.mark.parametrize("metric", METRIC_NAMES)
def test_the_lean_shape_is_one_warp_except_for_sm_activity_one_on_every_sm(metric: str) -> None:
    shape = Shape.for_metric(LEAN, metric, 132)
    per_sm = metric == "sm_activity"
    assert [shape.blocks(m) for m in (1, 8, 1000)] == [132 if per_sm else 1] * 3  # its length is its arguments
    assert shape.sm_ratio == (1.0 if per_sm else 1 / 132)


@pytest.mark.parametrize("metric", METRIC_NAMES)
def test_the_burn_shape_is_full_waves_the_multiplier_in_blocks_per_sm(metric: str) -> None:
    shape = Shape.for_metric(BURN, metric, 132)
    assert [shape.blocks(m) for m in (1, 8)] == [132, 1056]
    assert shape.sm_ratio == 1.0


def test_a_mig_device_is_laid_out_by_its_own_sm_count() -> None:
    assert Shape.for_metric(LEAN, "sm_activity", 16).blocks(500) == 16
    assert Shape.for_metric(LEAN, "utilization", 16).sm_ratio == 1 / 16


def test_every_shape_the_setting_accepts_is_one_and_nothing_else_is() -> None:
    assert {Shape.for_metric(name, "utilization", 8).name for name in SHAPE_NAMES} == set(SHAPE_NAMES)
    with pytest.raises(ValueError, match="no kernel shape 'fma': expected one of lean, burn"):
        Shape.for_metric("fma", "utilization", 8)


def test_sm_activity_held_with_a_share_of_the_sms_asks_for_the_duty_that_gives_it() -> None:
    # A warp on a quarter of the SMs: SM activity moves a quarter as much per unit of duty.
    quantity = quantity_for("sm_activity", 0.25)
    assert quantity.per_duty == 0.25
    assert quantity.duty_for(0.1) == pytest.approx(0.4)
    assert quantity.duty_for(0.5) == 1.0  # all the time, at most
    assert quantity_for("sm_activity", 1.0) is SM_ACTIVITY
    assert quantity_for("utilization", 1 / 132) is UTILIZATION  # the time any kernel runs: one warp counts


@pytest.mark.parametrize(("argv", "kernel_watts", "sm_ratio"), [
    ([], LIGHT_SM_W, 1 / 132),  # the default: one sleeping warp
    (["--shape", "burn"], MAX_POWER_W - IDLE_POWER_W, 1.0),
])
def test_a_filler_is_wired_for_its_shape(argv: list[str], kernel_watts: float, sm_ratio: float) -> None:
    # The launcher lays its kernels out by the shape, and the Monitor takes our own SM activity from it.
    config = load_config(["--simulate", "--sim-speed", "0", "--duration", "1", *argv], env={})
    run = open_simulated(config, io.StringIO())
    rt = run.runtime
    assert rt.launcher.shape.name == config.shape
    assert rt.monitor.own_sm_ratio == pytest.approx(sm_ratio)
    rt.launcher.launch(100, 0.0, count=1)
    assert run.gpu._watts == [pytest.approx(kernel_watts)]
