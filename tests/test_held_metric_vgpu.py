"""The held metric where an operator looks, on the virtual GPU (the real numba-cuda and pynvml path, GPM read from
the virtual GPU's model, real time): with FORGE_METRIC=sm_activity, the JSON `status` lines' `sm_activity`,
`forge-load status --json`'s `metric_value` and `/metrics`' `forge_load_metric_ratio` within 0.05 of the target,
on a whole Hopper GPU and on each MIG device of one (each filled by a child process of its own, its status reaching
the parent's /metrics through child_link.py); on a MIG device the status lines' `util`, `own` and `foreign` are
GPM's, never `-`. On the simulated GPU: tests/test_held_metric.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.test_metrics import get
from tests.test_status_cmd import status_rows
from tests.test_vgpu import ROOT
from vgpu import VirtualGpu
from vgpu.pytest_plugin import VgpuFactory

FORGE_LOAD = str(ROOT / ".venv" / "bin" / "forge-load")
TARGET = 0.5
CLOSE = 0.05
SETTLE_S = 6.0  # after the start line: the controller has learned SM activity's bias
LOOKS = 4
DEADLINE_S = 90.0  # a loaded 2-core machine starts fillers in seconds: polled, never timed


class Filler:
    """The filler as a process, its stdout read as it comes (the metrics port), its stderr kept."""

    def __init__(self, gpu: VirtualGpu, tmp_path: Path, *args: str) -> None:
        env = gpu.env({**os.environ, "TMPDIR": str(tmp_path)})
        env.pop("CUDA_VISIBLE_DEVICES", None)
        self.hold_dir = tmp_path / "holds"
        self.hold_dir.mkdir()
        self.proc = subprocess.Popen(
            [FORGE_LOAD, "--metric", "sm_activity", "--target", str(TARGET), "--log-interval", "1",
             "--log-format", "json", "--hold-dir", str(self.hold_dir), "--metrics-port", "0", "--metrics-addr",
             "127.0.0.1", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        self.lines: list[dict[str, object]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.append(json.loads(line))

    def wait_for(self, event: str, count: int = 1) -> list[dict[str, object]]:
        deadline_s = time.monotonic() + DEADLINE_S
        while len(found := [line for line in list(self.lines) if line["event"] == event]) < count:
            assert self.proc.poll() is None, self.stderr()
            assert time.monotonic() < deadline_s, f"no {count} {event!r} lines"
            time.sleep(0.1)
        return found

    def finish(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        self._reader.join(timeout=10)

    def stderr(self) -> str:
        return self.proc.stderr.read()[-3000:] if self.proc.stderr is not None and self.proc.poll() is not None else ""


def held_series(port: int) -> dict[tuple[str, str], float]:
    """forge_load_metric_ratio's samples by (GPU_I_ID, metric)."""
    _, _, text = get(f"http://127.0.0.1:{port}/metrics")
    return {(s.labels["GPU_I_ID"], s.labels["metric"]): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "forge_load_metric_ratio"}


def look(filler: Filler, devices: int) -> tuple[list[list[dict[str, object]]], list[dict[tuple[str, str], float]]]:
    """`forge-load status --json`'s rows and /metrics' held metric, LOOKS times a second apart once every device's
    filler has settled."""
    port = int(filler.wait_for("metrics")[0]["port"])  # type: ignore[arg-type]
    filler.wait_for("start", devices)
    time.sleep(SETTLE_S)
    rows, scrapes = [], []
    for _ in range(LOOKS):
        rows.append(status_rows(filler.hold_dir))
        scrapes.append(held_series(port))
        time.sleep(1.0)
    return rows, scrapes


def settled_status_lines(filler: Filler, uuid: str) -> list[dict[str, object]]:
    start = [line for line in filler.lines if line["event"] == "start" and line["uuid"] == uuid]
    assert start, uuid
    return [line for line in filler.lines if line["event"] == "status" and line["uuid"] == uuid
            and float(line["t"]) >= float(start[0]["t"]) + SETTLE_S]  # type: ignore[arg-type]


def test_sm_activity_shown_within_0_05_of_the_target_on_a_whole_gpu(vgpu: VgpuFactory, tmp_path: Path) -> None:
    gpu = vgpu()
    (uuid,) = gpu.uuids()
    filler = Filler(gpu, tmp_path, "--duration", "60")
    try:
        rows, scrapes = look(filler, 1)
    finally:
        filler.finish()
    assert filler.proc.returncode == 0, filler.stderr()
    for seen in rows:
        [row] = seen
        assert row["uuid"] == uuid and row["metric"] == "sm_activity", row
        assert abs(float(row["metric_value"]) - TARGET) <= CLOSE, rows  # type: ignore[arg-type]
    for held in scrapes:
        assert set(held) == {("", "sm_activity")} and abs(held["", "sm_activity"] - TARGET) <= CLOSE, scrapes
    lines = settled_status_lines(filler, uuid)
    assert len(lines) >= LOOKS, filler.lines
    assert all(abs(float(line["sm_activity"]) - TARGET) <= CLOSE for line in lines), lines  # type: ignore[arg-type]
    assert all(isinstance(line["sm_activity_own"], float) for line in lines), lines


def test_sm_activity_shown_within_0_05_of_the_target_on_each_mig_device(vgpu: VgpuFactory, tmp_path: Path) -> None:
    gpu = vgpu(mig=2)
    migs = gpu.mig_devices()
    filler = Filler(gpu, tmp_path, "--gpus", "all", "--duration", "60")
    try:
        rows, scrapes = look(filler, len(migs))
    finally:
        filler.finish()
    assert filler.proc.returncode == 0, filler.stderr()
    for seen in rows:
        by_uuid = {row["uuid"]: row for row in seen}
        assert set(by_uuid) == {m.uuid for m in migs}, seen
        for row in seen:
            assert row["metric"] == "sm_activity" and abs(float(row["metric_value"]) - TARGET) <= CLOSE, seen  # type: ignore[arg-type]
            assert row["util"] is not None, seen  # GPM's graphics activity where NVML has no utilization
    for held in scrapes:
        assert set(held) == {(str(m.gi), "sm_activity") for m in migs}, scrapes
        assert all(abs(value - TARGET) <= CLOSE for value in held.values()), scrapes
    for m in migs:
        lines = settled_status_lines(filler, m.uuid)
        assert len(lines) >= LOOKS, m
        for line in lines:
            assert abs(float(line["sm_activity"]) - TARGET) <= CLOSE, lines  # type: ignore[arg-type]
            assert None not in (line["util"], line["own"], line["foreign"]), line  # never `-` where GPM is read
