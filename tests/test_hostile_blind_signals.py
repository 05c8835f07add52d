"""A GPU whose foreign-job signals are blind (NVML answers nothing, or NOT_SUPPORTED): the start line names the
signals that work, one warning names the blind ones, and a GPU where no job could be seen or announced is
left alone.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from forge_load.config.load import load_config
from forge_load.service.loop import run_simulated
from tests.hostile_support import assert_one_clean_line

ALL_BLIND = ("processes", "memory_used_mib", "utilization_samples", "utilization_ratio")
PROCESS_QUERIES = [f"nvmlDevice{kind}RunningProcesses{version}" for kind in ("GetCompute", "GetGraphics")
                   for version in ("_v3", "_v2", "")]


def test_a_blind_process_signal_is_said_on_the_virtual_gpu(vgpu: Any) -> None:
    from tests.test_real_path import finish, forge

    run = forge(vgpu(not_supported=PROCESS_QUERIES), "--duration", "1")
    assert finish(run) == 0, run.stderr[-2000:]
    start = run.of("start")[0]
    assert start["signals"] == "memory,utilization,sm_activity", start
    [warning] = run.of("warning")
    assert warning["blind"] == "process", warning
    assert "process" in warning["reason"] and "not supported" in warning["reason"], warning
    assert "memory,utilization,sm_activity" in warning["reason"], warning


@pytest.mark.parametrize(("blind", "seen"), [
    ((), "process,memory,utilization"),
    (("processes",), "memory,utilization"),
    (("memory_used_mib",), "process,utilization"),
    (("utilization_samples", "utilization_ratio"), "process,memory"),
    (("utilization_samples",), "process,memory,utilization"),  # the latest window's ratio stands in
    (ALL_BLIND, ""),  # fills only because holds announce jobs (the hold directory exists)
])
def test_the_start_line_names_the_signals_that_work_and_a_warning_the_blind_ones(
        blind: tuple[str, ...], seen: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from forge_load.gpu.sim import SimProbe

    for query in blind:
        monkeypatch.setattr(SimProbe, query, lambda self, *args: None)
    out = io.StringIO()
    run_simulated(load_config(f"--simulate --sim-speed 0 --duration 1 --log-format json --hold-dir {tmp_path}".split(),
                              {}), out)
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert events[0]["event"] == "start" and events[0]["signals"] == seen, events[0]
    warnings = [e for e in events if e["event"] == "warning"]
    if seen == "process,memory,utilization":
        assert warnings == []
        return
    [warning] = warnings
    named = {"processes": "process", "memory_used_mib": "memory", "utilization_ratio": "utilization"}
    assert warning["blind"] == ",".join(named[q] for q in blind if q in named), warning
    assert_one_clean_line(warning["reason"], *warning["blind"].split(","))
    if not seen:
        assert "no foreign job" in warning["reason"], warning


def test_a_gpu_where_no_foreign_job_can_be_seen_or_announced_is_not_filled(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    """Every signal blind and no hold directory: nothing could ever make the filler step aside for a job, so the
    GPU is left alone (exit 3 for it, one line) rather than filled beside jobs it cannot see."""
    from forge_load.control.probe import NoGpuError
    from forge_load.gpu.sim import SimProbe

    for query in ALL_BLIND:
        monkeypatch.setattr(SimProbe, query, lambda self, *args: None)
    out = io.StringIO()
    flags = f"--simulate --sim-speed 0 --duration 1 --log-format json --hold-dir {tmp_path / 'none'}"
    with pytest.raises(NoGpuError) as caught:
        run_simulated(load_config(flags.split(), {}), out)
    assert_one_clean_line(str(caught.value), "no foreign job", "FORGE_HOLD_DIR")
    assert [json.loads(line)["event"] for line in out.getvalue().splitlines()] == []  # not even a start line


def test_a_process_list_switched_off_is_not_named_but_not_warned_about() -> None:
    out = io.StringIO()
    run_simulated(load_config("--simulate --sim-speed 0 --duration 1 --log-format json --no-process-list".split(),
                              {}), out)
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert events[0]["signals"] == "memory,utilization"
    assert not [e for e in events if e["event"] == "warning"]
