"""What `forge-load plot` draws in each panel, and which panels: every interval of a run (the first and the last
too), power as steps on one scale for every GPU, an exclusive-mode run on its own timeline with its holds shaded,
one panel per MIG device, the held metric beside NVML's utilization, more GPUs than one picture holds, and a
long log thinned for drawing without losing its shape."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from forge_load.commands import plot as command
from forge_load.plot.logs import read_log
from tests.test_plot import TEXT, as_json, points, write_log


def svg_ids(path: Path) -> set[str]:
    return {element.get("id") or "" for element in ET.parse(path).iter()} - {""}


def render(lines: list[str], selection: str | None = None) -> Any:
    pytest.importorskip("matplotlib")
    from forge_load.plot.draw import render
    from forge_load.plot.logs import panels

    run = read_log(lines)
    figure, _drawn = render(panels(run, selection)[0])
    return figure


def lines_of(figure: Any, gid: str) -> list[Any]:
    return [line for axes in figure.axes for line in axes.get_lines() if line.get_gid() == gid]


# --- every interval, power as steps on one scale --------------------------------------------------------------

def test_the_first_interval_begins_at_the_start_and_the_last_ends_at_the_stop() -> None:
    stop = TEXT[-1].replace("reason=", "util=0.500 own=0.495 foreign=0.005 reason=")
    gpu = read_log([*TEXT[:-1], stop]).gpus["0"]
    # each status line is the mean of the interval that ends at it: the first from the start line on; the stop
    # line's latest reading stands for the last, partial interval
    assert points(gpu.util) == [(0.0, None), (5.0, 0.51), (10.0, 0.9), (15.0, 0.0), (20.0, 0.5)]
    assert points(gpu.own)[0] == (0.0, None) and points(gpu.own)[-1] == (20.0, 0.495)
    figure = render([*TEXT[:-1], stop])
    (util,) = lines_of(figure, "util")
    assert (util.get_xdata()[0], util.get_xdata()[-1]) == (0.0, 20.0)


def test_power_is_drawn_as_steps_on_one_scale_for_every_gpu() -> None:
    other = [line.replace("gpu=0", "gpu=1").replace("power_w=600.0", "power_w=150.0") for line in TEXT]
    figure = render([line for pair in zip(TEXT, other) for line in pair])
    power = lines_of(figure, "power_w")
    assert len(power) == 2 and {line.get_drawstyle() for line in power} == {"steps-pre"}
    assert {line.get_drawstyle() for line in lines_of(figure, "util")} == {"steps-pre"}
    limits = {line.axes.get_ylim() for line in power}
    assert len(limits) == 1 and limits.pop()[1] >= 600.0


# --- exclusive compute mode: the supervisor and its children ---------------------------------------------------

# From a run on the virtual GPU in exclusive_process mode (`scripts/vgpu run --exclusive`, 25 s, a hold from 8 to
# 14 s; fields the plot does not read left out): the supervisor's lines and two children's, on one timeline.
EXCLUSIVE = [
    't=0.00 event=exclusive reason="exclusive_process compute mode: the GPU work runs in a child process" gpu=0',
    't=0.00 event=child_start reason="nothing holds the GPU: the child creates our context and fills" gpu=0',
    't=0.46 event=start state=filling target=0.500 gpu=0 metric=utilization',
    't=1.46 event=status state=filling target=0.500 util=0.505 own=0.503 foreign=0.002 gpu=0 power_w=70.0',
    't=2.46 event=status state=filling target=0.500 util=0.503 own=0.503 foreign=0.001 gpu=0 power_w=382.4',
    't=7.46 event=status state=filling target=0.500 util=0.498 own=0.497 foreign=0.002 gpu=0 power_w=383.5',
    't=7.83 event=hold reason="held by job-1" gpu=0 holder=job-1',
    't=7.83 event=child_end reason="held by job-1" gpu=0',
    't=7.89 event=stop state=filling target=0.500 util=0.510 own=0.512 foreign=0.000 reason="asked to end by the '
    'supervisor (SIGTERM)" gpu=0 yields=0',
    't=7.90 event=drained reason="asked to end" gpu=0 exit_code=0 context=gone',
    't=14.24 event=release reason=released gpu=0 holder=job-1',
    't=14.24 event=child_start reason="nothing holds the GPU: the child creates our context and fills" gpu=0',
    't=14.74 event=start state=filling target=0.500 gpu=0 metric=utilization',
    't=15.74 event=status state=filling target=0.500 util=0.505 own=0.505 foreign=0.002 gpu=0 power_w=70.0',
    't=24.74 event=status state=filling target=0.500 util=0.500 own=0.498 foreign=0.002 gpu=0 power_w=384.1',
    't=25.00 event=child_end reason="the filler stops" gpu=0',
    't=25.00 event=stop state=filling target=0.500 util=0.500 own=0.498 foreign=0.002 reason="asked to end by the '
    'supervisor (SIGTERM)" gpu=0 yields=0',
    't=25.01 event=drained reason="asked to end" gpu=0 exit_code=0 context=gone',
    't=25.01 event=stop state=stopped reason="duration reached" gpu=0 yields=0',
]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_an_exclusive_mode_run_is_one_timeline_with_its_hold_shaded(fmt: str) -> None:
    lines = EXCLUSIVE if fmt == "text" else [as_json(line) for line in EXCLUSIVE]
    gpu = read_log(lines).gpus["0"]
    assert gpu.end_t == 25.01 and gpu.restarts_t == []  # a child's start line is not a restart
    assert gpu.spans == [("held", 7.83, 14.24)]
    # no share drawn across the hold, while no child ran
    assert points(gpu.util)[4:7] == [(7.89, 0.51), (14.74, None), (15.74, 0.505)]


def test_an_exclusive_mode_child_that_yields_by_itself_is_shaded_until_the_next_child() -> None:
    lines = [*EXCLUSIVE[:6],
             't=7.50 event=yield state=yielding target=0.500 util=0.900 own=0.000 foreign=0.900 gpu=0 '
             'reason="process 40000 on the GPU"',
             't=7.60 event=stop state=yielding target=0.500 reason="yielding in exclusive compute mode: ends, so '
             'that its context goes too" gpu=0',
             't=7.62 event=drained reason="the child ended by itself" gpu=0 exit_code=0 context=gone',
             't=12.00 event=child_start reason="nothing holds the GPU: the child creates our context and fills" gpu=0',
             't=12.50 event=start state=filling target=0.500 gpu=0 metric=utilization',
             't=13.00 event=stop state=stopped reason="duration reached" gpu=0 yields=1']
    gpu = read_log(lines).gpus["0"]
    assert gpu.spans == [("yielding", 7.5, 12.5)] and gpu.end_t == 13.0


def test_a_restarted_exclusive_mode_filler_still_follows_on() -> None:
    gpu = read_log(EXCLUSIVE + EXCLUSIVE).gpus["0"]
    assert gpu.restarts_t == [25.01] and gpu.end_t == pytest.approx(50.02)
    assert [state for state, _, _ in gpu.spans] == ["held", "held"]
    assert [span[1:] for span in gpu.spans] == [(7.83, 14.24), pytest.approx((32.84, 39.25))]


def test_the_held_span_of_an_exclusive_mode_run_is_drawn_and_named(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "x.svg"
    assert command.main([str(write_log(tmp_path, EXCLUSIVE)), "-o", str(out)]) == 0
    assert {"span-held", "util", "power_w"} <= svg_ids(out)
    figure = render(EXCLUSIVE)
    assert "held" in figure.axes[0].get_legend_handles_labels()[1]
    assert figure.axes[0].get_xlim()[1] < 27.0  # the 25-s run, not the children's times added up


# --- MIG devices and the held metric ----------------------------------------------------------------------------

MIG_A, MIG_B = "MIG-1eb61278-0f6c-48ab-999b-c2a1fb63255b", "MIG-1eb61278-0f6c-48ab-999b-112ba2c1255a"


def mig_lines(uuid: str, instance: int) -> list[str]:
    """A MIG device's filler holding gr_activity: NVML has no utilization there, the held metric stands alone."""
    start = {"t": 1.66, "event": "start", "state": "filling", "target": 0.5, "gpu": 0, "uuid": uuid,
             "metric": "gr_activity", "gpu_instance": instance, "mig_profile": "3g.40gb",
             "gpu_uuid": "GPU-1eb61278-0f6c-48ab-999b-73d8ccfd2501"}
    lines = [json.dumps(start)]
    for t in range(3, 9):
        lines.append(json.dumps({"t": t + 0.66, "event": "status", "state": "filling", "target": 0.5, "util": None,
                                 "own": None, "foreign": None, "gpu": 0, "uuid": uuid, "power_w": 336.0,
                                 "gr_activity": 0.5 + instance / 100, "gr_activity_own": 0.49}))
    lines.append(json.dumps({"t": 9.66, "event": "stop", "state": "filling", "target": 0.5, "gpu": 0, "uuid": uuid}))
    return lines


MIG = [line for pair in zip(mig_lines(MIG_A, 1), mig_lines(MIG_B, 2)) for line in pair]


def test_each_mig_device_is_a_panel_of_its_own_with_its_held_metric(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    run = read_log(MIG)
    assert list(run.gpus) == [MIG_A, MIG_B]
    assert points(run.gpus[MIG_B].metric_curves["gr_activity"])[:2] == [(1.66, None), (3.66, 0.52)]
    pytest.importorskip("matplotlib")
    out = tmp_path / "mig.svg"
    assert command.main([str(write_log(tmp_path, MIG)), "-o", str(out)]) == 0
    ids = svg_ids(out)
    assert {"gr_activity", "gr_activity_own", "target", "power_w"} <= ids and "util" not in ids
    figure = render(MIG)
    titles = [axes.get_title(loc="left") for axes in figure.axes if axes.get_title(loc="left")]
    assert titles == [f"GPU 0, MIG 3g.40gb (instance 1) {MIG_A}", f"GPU 0, MIG 3g.40gb (instance 2) {MIG_B}"]
    labels = figure.axes[0].get_legend_handles_labels()[1]
    assert "gr_activity (held)" in labels and "gr_activity, own share" in labels
    assert f"(GPU {MIG_A}, {MIG_B}: {len(MIG)} lines)" in capsys.readouterr().out


def filled_mig_lines(metric: str) -> list[str]:
    """A MIG device's filler as it writes its lines: where NVML has no utilization, util, own and foreign are GPM's
    graphics activity (docs/operating.md, Reading the log), beside the held metric's own fields."""
    lines = []
    for line in mig_lines(MIG_A, 1):
        record = json.loads(line)
        record["metric"] = metric if record["event"] == "start" else record.get("metric")
        if record["event"] == "status":
            held = record.pop("gr_activity"), record.pop("gr_activity_own")
            record.update(util=held[0], own=held[1], foreign=0.01)
            if metric != "utilization":
                record.update({metric: held[0], f"{metric}_own": held[1]})
        lines.append(json.dumps({k: v for k, v in record.items() if v is not None or k != "metric"}))
    return lines


@pytest.mark.parametrize("metric", ["utilization", "sm_activity", "gr_activity"])
def test_a_mig_devices_utilization_is_named_as_gpms_not_nvmls(metric: str) -> None:
    pytest.importorskip("matplotlib")
    labels = render(filled_mig_lines(metric)).axes[0].get_legend_handles_labels()[1]
    assert "NVML utilization" not in labels
    if metric == "gr_activity":  # the same reading twice: drawn once, as the held metric
        assert "gr_activity (held)" in labels and "graphics activity (GPM)" not in labels
    else:
        assert "graphics activity (GPM)" in labels


@pytest.mark.parametrize(("selection", "expected"), [(MIG_B, [MIG_B]), ("0", [MIG_A, MIG_B]),
                                                     (f"{MIG_B},{MIG_A}", [MIG_A, MIG_B]),
                                                     ("GPU-1eb61278-0f6c-48ab-999b-73d8ccfd2501", [MIG_A, MIG_B])])
def test_gpu_picks_a_mig_device_by_its_uuid_or_every_one_of_its_gpu(selection: str, expected: list[str]) -> None:
    from forge_load.plot.logs import panels

    chosen, left_out = panels(read_log(MIG), selection)
    assert [series.key for series in chosen] == expected and left_out == []


def test_the_held_metric_is_drawn_beside_nvmls_utilization(tmp_path: Path) -> None:
    lines = [TEXT[0].replace("gpu=0", "gpu=0 metric=sm_activity")]
    for line in TEXT[1:]:
        if "event=status" in line:
            line = line.replace(" gpu=0", " sm_activity=0.497 sm_activity_own=0.488 gpu=0")
        lines.append(line)
    gpu = read_log(lines).gpus["0"]
    assert gpu.metric == "sm_activity" and points(gpu.metric_curves["sm_activity_own"])[1] == (5.0, 0.488)
    pytest.importorskip("matplotlib")
    out = tmp_path / "x.svg"
    assert command.main([str(write_log(tmp_path, lines)), "-o", str(out)]) == 0
    assert {"util", "own", "foreign", "sm_activity", "sm_activity_own", "target"} <= svg_ids(out)
    labels = render(lines).axes[0].get_legend_handles_labels()[1]
    assert {"sm_activity (held)", "sm_activity, own share", "NVML utilization", "target"} <= set(labels)


def test_without_a_held_metric_nothing_more_is_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "x.svg"
    assert command.main([str(write_log(tmp_path, TEXT)), "-o", str(out)]) == 0
    assert not {"sm_activity", "gr_activity"} & svg_ids(out)


# --- more GPUs than a picture holds -----------------------------------------------------------------------------

TWENTY = [line.replace("gpu=0", f"gpu={gpu}") for line in TEXT for gpu in range(20)]


def test_more_than_16_gpus_the_first_16_drawn_and_the_rest_named(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    assert len(read_log(TWENTY).gpus) == 20
    out = tmp_path / "x.png"
    assert command.main([str(write_log(tmp_path, TWENTY)), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert "(GPU 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15:" in captured.out
    assert captured.err == ("forge-load plot: GPU 16, 17, 18, 19 not drawn: at most 16 panels in one picture; "
                            "--gpu 16,17,18,19 draws them\n")


def test_gpu_takes_a_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "x.png"
    assert command.main([str(write_log(tmp_path, TWENTY)), "-o", str(out), "--gpu", "19,16,17"]) == 0
    captured = capsys.readouterr()
    assert "(GPU 16, 17, 19:" in captured.out and captured.err == ""


def test_gpu_not_in_the_log_names_what_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert command.main([str(write_log(tmp_path, MIG)), "--gpu", "MIG-00000000-0000-0000-0000-000000000000"]) == 2
    assert capsys.readouterr().err == ("forge-load plot: --gpu='MIG-00000000-0000-0000-0000-000000000000': expected "
                                       f"one of the log's GPUs, or a list of them: 0, {MIG_A}, {MIG_B}\n")


# --- the log's other shapes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("when", ["time=10:14:25", 'time="2026-11-28 10:14:25"', "ts=2026-11-28T10:14:25.123Z"])
def test_a_time_field_between_t_and_the_event_is_read_past(when: str) -> None:
    lines = [line.replace(" event=", f" {when} event=", 1) for line in TEXT]
    gpu = read_log(lines).gpus["0"]
    assert points(gpu.util)[1:] == [(5.0, 0.51), (10.0, 0.9), (15.0, 0.0)] and gpu.end_t == 20.0


def test_a_long_log_is_thinned_for_drawing_without_losing_its_shape() -> None:
    from forge_load.plot.draw import thin
    from forge_load.plot.series import Curve

    curve = Curve()
    for t in range(1_000_000):
        if t == 400_000:
            curve.gap(float(t))  # a gap: the filler was not running
        else:
            curve.add(float(t), 0.95 if t == 123_457 else 0.01 if t == 700_000 else 0.5)  # a spike and a dip
    ts, vs = thin(curve, buckets=2000)
    assert len(ts) <= 4 * 2000 + 1 and ts[0] == 0.0 and ts[-1] == 999_999.0
    finite = [v for v in vs if not math.isnan(v)]
    assert max(finite) == 0.95 and min(finite) == 0.01
    assert [t for t, v in zip(ts, vs) if math.isnan(v)] == [400_000.0]
    assert list(ts) == sorted(ts)
    assert [(t, v) for t, v in zip(ts, vs) if t in (123_456.0, 123_457.0, 123_458.0)] == [(123_457.0, 0.95)]
    short = Curve()
    for t in range(100):
        short.add(float(t), 0.5)
    assert len(thin(short, buckets=2000)[0]) == 100  # short enough: drawn as it is


def test_the_thinned_picture_is_the_picture_of_every_point() -> None:
    np = pytest.importorskip("numpy")
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from forge_load.plot import draw
    from forge_load.plot.logs import panels

    lines = ["t=0.00 event=start state=filling target=0.500 gpu=0"]
    for t in range(1, 20_001):  # a status line a second, five foreign jobs, one spike: 20,000 points a curve
        foreign = 0.9 if (t // 1000) % 4 == 1 else 0.0
        util = 0.95 if t == 12_345 else 0.5 + 0.01 * ((t * 7919) % 5) if foreign == 0 else foreign
        own = util - foreign
        lines.append(f"t={t}.00 event=status state=filling target=0.500 util={util:.3f} own={own:.3f} "
                     f"foreign={foreign:.3f} gpu=0 power_w={380 + 250 * foreign + (t % 3):.1f}")
    chosen = panels(read_log(lines))[0]

    def pixels(buckets: int) -> Any:
        saved = draw.thin.__defaults__
        draw.thin.__defaults__ = (buckets,)
        try:
            figure, _ = draw.render(chosen)
        finally:
            draw.thin.__defaults__ = saved
        canvas = FigureCanvasAgg(figure)
        canvas.draw()
        return np.asarray(canvas.buffer_rgba(), dtype=float)[..., :3] / 255

    thinned, every = pixels(draw.THIN_BUCKETS), pixels(10**9)
    assert len(draw.thin(chosen[0].util)[0]) < 20_000 / 2  # it was thinned
    differ = (np.abs(thinned - every).max(axis=2) > 0.1).sum()
    # the same picture, short of antialiasing (at the edge of a band of lines a pixel apart: 690 of 420,000 here)
    assert differ < 0.005 * thinned.shape[0] * thinned.shape[1], differ
