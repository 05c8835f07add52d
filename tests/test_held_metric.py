"""The held metric (FORGE_METRIC) shown wherever an operator looks: each `status` line carries its reading under its
own name (`sm_activity`, `gr_activity`; utilization's is `util`) and our own share of it; `forge-load status` has a
METRIC column and `--json` its fields; `/metrics` a gauge of it with dcgm-exporter's labels. On a MIG device, where
NVML reports no utilization, GPM's GRAPHICS_UTIL stands in for it (`util`, `own`, `foreign`). On the simulated GPU
with GPM (tests/sim_gpm.py), in virtual time: each reading within 0.05 of the target once it has settled. On the
virtual GPU: tests/test_held_metric_vgpu.py."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from forge_load.clock import boot_time_s
from forge_load.commands import status as status_command
from forge_load.config.load import load_config
from forge_load.control.quantity import Held, HeldNow
from forge_load.control.status import GpuSlots
from forge_load.service import metrics
from forge_load.service.loop import run_loop
from forge_load.service.runtime import Runtime
from forge_load.steering import filler_dirs, filler_status
from forge_load.steering.filler_status import FillerStatus
from tests.sim_gpm import MIG_INSTANCE, MIG_PROFILE, GpmSimBackend, run_with_gpm

TARGET = 0.5
CLOSE = 0.05  # the goal: the held metric's reading within this of the target, wherever it is shown
SETTLE_S = 5.0
METRICS = ("utilization", "sm_activity", "gr_activity")
FIELDS = {"utilization": ("util", "own"), "sm_activity": ("sm_activity", "sm_activity_own"),
          "gr_activity": ("gr_activity", "gr_activity_own")}
GPU0 = "GPU-51a00000-0000-4000-8000-000000000000"


@dataclass
class Looks:
    """What an operator sees of one run, each virtual second after SETTLE_S: `forge-load status --json` rows and its
    table, and `/metrics` (sample name -> [(labels, value)]); and the run's JSON lines."""

    lines: list[dict[str, object]] = field(default_factory=list)
    rows: list[dict[str, object]] = field(default_factory=list)
    tables: list[list[str]] = field(default_factory=list)
    scrapes: list[dict[str, list[tuple[dict[str, str], float]]]] = field(default_factory=list)

    def status_lines(self) -> list[dict[str, object]]:
        return [line for line in self.lines if line["event"] == "status" and float(line["t"]) > SETTLE_S]  # type: ignore[arg-type]


def scrape_values(gpu_slots: GpuSlots) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = generate_latest(metrics.make_registry(gpu_slots)).decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def look(tmp_path: Path, metric: str, mig: bool, seconds: int = 20) -> Looks:
    """Fill the simulated GPU with GPM at TARGET for `seconds`, looking each virtual second after SETTLE_S."""
    looks = Looks()
    gpu_slots = GpuSlots(simulated=True)
    slot = gpu_slots.add("0")

    def on_start(rt: Runtime) -> None:
        slot.attach(rt.info, lambda: rt.filler.status(rt.now()))
        assert rt.filler.report is not None
        rt.filler.report.monotonic = rt.now  # written every virtual second, as every real one on a GPU
        real = rt.filler.step
        due = [rt.start_s + SETTLE_S]

        def step(now_s: float) -> float:
            next_s = real(now_s)
            slot.beat()
            if now_s >= due[0]:
                due[0] += 1.0
                rows, problems = status_command.read(str(tmp_path), "--hold-dir")
                assert problems == [] and len(rows) == 1
                looks.rows.append(status_command.as_json(rows[0], time.time()))
                looks.tables.append(status_command.table(rows))
                looks.scrapes.append(scrape_values(gpu_slots))
            return next_s

        rt.filler.step = step  # type: ignore[method-assign]

    _, looks.lines = run_with_gpm(f"--metric {metric} --target {TARGET} --duration {seconds} --log-interval 1 "
                                  f"--hold-dir {tmp_path}", mig=mig, on_start=on_start)
    assert len(looks.rows) >= seconds - SETTLE_S - 1
    return looks


def near(value: object) -> bool:
    return isinstance(value, float) and abs(value - TARGET) <= CLOSE


# --- the status lines --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", ["sm_activity", "gr_activity"])
@pytest.mark.parametrize("mig", [False, True], ids=["whole", "mig"])
def test_each_status_line_carries_the_held_gpm_metric_under_its_own_name(tmp_path: Path, metric: str,
                                                                         mig: bool) -> None:
    looks = look(tmp_path, metric, mig)
    lines = looks.status_lines()
    assert len(lines) >= 10
    name, own = FIELDS[metric]
    for line in lines:
        assert near(line[name]) and isinstance(line[own], float), line
        assert abs(float(line[own]) - float(line[name])) <= CLOSE, line  # type: ignore[arg-type]
    other = "gr_activity" if metric == "sm_activity" else "sm_activity"
    assert not [line for line in looks.lines if other in line or f"{other}_own" in line]  # the held one only
    assert looks.lines[0]["metric"] == metric


def test_a_utilization_status_line_is_as_it_was(tmp_path: Path) -> None:
    looks = look(tmp_path, "utilization", mig=False, seconds=10)
    for line in looks.status_lines():
        assert near(line["util"]) and not {"sm_activity", "gr_activity", "utilization"} & set(line), line


def test_the_held_metric_in_key_value_lines_has_three_decimals() -> None:
    config = load_config("--simulate --sim-speed 0 --metric sm_activity --duration 3 --log-interval 1".split(), env={})
    out = io.StringIO()
    run_loop(config, GpmSimBackend(config), out, threading.Event(), threading.Event())
    status = [line for line in out.getvalue().splitlines() if " event=status " in line]
    assert status and all(" sm_activity=0." in line and " sm_activity_own=0." in line for line in status), status
    value = status[-1].split(" sm_activity=")[1].split(" ")[0]
    assert len(value.split(".")[1]) == 3, status[-1]


# --- MIG: GPM where NVML has no utilization ------------------------------------------------------------------------


@pytest.mark.parametrize("metric", METRICS)
def test_on_a_mig_device_gpms_graphics_activity_stands_for_utilization(tmp_path: Path, metric: str) -> None:
    looks = look(tmp_path, metric, mig=True, seconds=12)
    lines = looks.status_lines()
    assert lines and all(line["util"] is not None and line["own"] is not None and line["foreign"] is not None
                         for line in lines), lines
    assert all(near(line["util"]) and float(line["foreign"]) <= CLOSE and int(line["samples"]) >= 4  # type: ignore[arg-type]
               for line in lines), lines
    # the event lines' latest shares too, and the status file's
    assert all(row["util"] is not None and near(row["util"]) for row in looks.rows), looks.rows


# --- forge-load status ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("mig", [False, True], ids=["whole", "mig"])
def test_forge_load_status_shows_the_held_metric(tmp_path: Path, metric: str, mig: bool) -> None:
    looks = look(tmp_path, metric, mig)
    for row in looks.rows:
        assert row["metric"] == metric and near(row["metric_value"]), row
        assert isinstance(row["metric_own"], float) and abs(row["metric_own"] - TARGET) <= 2 * CLOSE, row
    for table in looks.tables:
        head, body = table[0].split(), table[1].split()
        assert head[:8] == ["GPU", "UUID", "PID", "USER", "STATE", "TARGET", "METRIC", "UTIL"], table
        name, value = body[head.index("METRIC")].split("=")
        assert name == metric and abs(float(value) - TARGET) <= CLOSE, table


# --- /metrics ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("mig", [False, True], ids=["whole", "mig"])
def test_metrics_export_the_held_metric_with_dcgm_exporters_labels(tmp_path: Path, metric: str, mig: bool) -> None:
    looks = look(tmp_path, metric, mig)
    labels = ({"gpu": "0", "UUID": GPU0, "GPU_I_ID": str(MIG_INSTANCE), "GPU_I_PROFILE": MIG_PROFILE} if mig
              else {"gpu": "0", "UUID": GPU0, "GPU_I_ID": "", "GPU_I_PROFILE": ""})
    for values in looks.scrapes:
        [(held_labels, held)] = values["forge_load_metric_ratio"]
        [(own_labels, own)] = values["forge_load_own_metric_ratio"]
        assert held_labels == own_labels == {**labels, "metric": metric}
        assert abs(held - TARGET) <= CLOSE and abs(own - TARGET) <= 2 * CLOSE, (held, own)
        if mig:  # GPM's graphics activity where NVML has no utilization
            [(_, util)] = values["forge_load_device_utilization_ratio"]
            assert abs(util - TARGET) <= CLOSE


# --- the snapshot -----------------------------------------------------------------------------------------------------


def test_a_supervisors_row_and_its_series_have_no_held_metric_to_show() -> None:
    from forge_load.service.exclusive import supervisor_status

    status = supervisor_status("filling")
    assert status.metric_ratio is None and status.metric_own_ratio is None


# --- the status file: optional fields, an older filler's file still shows -------------------------------------------


def write_status(hold_dir: Path, record: dict[str, object]) -> None:
    """The record where a filler of this user writes its status: its own directory in the hold directory."""
    own = filler_dirs.OwnDir(str(hold_dir))
    try:
        own.write(filler_status.status_name(GPU0), json.dumps(record).encode())
    finally:
        own.forget()


def older_record() -> dict[str, object]:
    """A status file without the held metric's fields (the exclusive mode's supervisor writes none)."""
    return {"format": 2, "gpu_uuid": GPU0, "gpu_index": 0, "pid": os.getpid(), "state": "filling",
            "target_ratio": 0.5, "util_ratio": 0.49, "own_ratio": 0.48, "power_w": 300.0, "reason": None,
            "held_by": [], "simulated": False, "pid_namespace": None, "pid_start_ticks": None,
            "written_unix_s": time.time(), "written_boot_s": boot_time_s(), "locked": False}


def test_a_status_file_without_the_held_metric_still_shows_with_no_metric(tmp_path: Path) -> None:
    write_status(tmp_path, older_record())
    rows, problems = status_command.read(str(tmp_path), "--hold-dir")
    assert problems == [] and len(rows) == 1
    shown = status_command.as_json(rows[0], time.time())
    assert (shown["metric"], shown["metric_value"], shown["metric_own"], shown["util"]) == (None, None, None, 0.49)
    head, body = (line.split() for line in status_command.table(rows)[:2])
    assert body[head.index("METRIC")] == "-" and body[head.index("UTIL")] == "0.49"


def test_the_metric_fields_are_written_and_read_back_and_bad_ones_are_unknown(tmp_path: Path) -> None:
    writer = filler_status.StatusWriter(str(tmp_path), GPU0, 0, os.getpid())
    writer.write("filling", (), 0.5, 0.5, 0.5, 300.0, metric="sm_activity", metric_ratio=0.51, metric_own_ratio=0.52)
    [seen] = filler_status.read_all([str(tmp_path)])[0]
    assert (seen.status.metric, seen.status.metric_ratio, seen.status.metric_own_ratio) == ("sm_activity", 0.51, 0.52)
    writer.close()
    for bad in ({"metric": 7, "metric_ratio": "0.5"}, {"metric": "x" * 100, "metric_ratio": True},
                {"metric": "sm activity\n", "metric_own_ratio": float("nan")}):
        raw = json.dumps({**older_record(), **bad}).encode()
        status = filler_status.from_json(raw, GPU0)
        assert (status.metric, status.metric_ratio, status.metric_own_ratio) == (None, None, None), bad
    assert isinstance(filler_status.from_json(filler_status.to_json(FillerStatus(GPU0, 0, 1, "filling")), GPU0),
                      FillerStatus)


def test_held_now_is_the_fewest_latest_readings_that_cover_two_seconds_weighted_by_span() -> None:
    now = HeldNow()
    assert now.mean() is None
    now.add([Held(0.2 * k, 0.2, 1.0 if k <= 5 else 0.5, 0.5) for k in range(1, 16)])  # 0.2 ... 3.0
    assert now.mean() == pytest.approx((0.5, 0.5))  # the first second's readings are gone: 1.0-3.0 is kept
    now.add([Held(3.3, 0.3, 0.0, 0.0)])  # 1.2-3.0 (1.8 s at 0.5) and 3.0-3.3 (0.3 s at 0): 2.1 s, the fewest
    assert now.mean() == pytest.approx((0.5 * 1.8 / 2.1, 0.5 * 1.8 / 2.1))
    now.add([Held(6.0, 2.5, 0.25, 0.2)])  # longer than two seconds: kept alone
    assert now.mean() == pytest.approx((0.25, 0.2))
