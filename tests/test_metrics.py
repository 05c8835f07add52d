"""forge_load.service.metrics and several GPUs in one process: status, /health, the exposition, and one GPU failing
among several while the others go on filling."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from forge_load.config.load import load_config
from forge_load.config.values import ConfigError
from forge_load.control.status import GpuSlot, GpuSlots
from forge_load.service import http_server, metrics
from forge_load.service.loop import run_simulated
from forge_load.service.runtime import Runtime
from tests.host_paths import settings_free

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024


class FakeClock:
    def __init__(self) -> None:
        self.t_s = 100.0

    def __call__(self) -> float:
        return self.t_s


# --- status and /health ------------------------------------------------------------------------------------


def test_health_follows_each_slot_from_start_to_failure() -> None:
    clock = FakeClock()
    gpu_slots = GpuSlots(max_age_s=30.0, clock=clock)
    ok, body = gpu_slots.health()
    assert not ok and "no GPU" in body
    slot = gpu_slots.add("0")
    ok, body = gpu_slots.health()
    assert not ok and "gpu 0" in body and "starting" in body
    slot.beat()
    clock.t_s += 29.0
    ok, body = gpu_slots.health()
    assert ok and body.startswith("ok\n"), body
    clock.t_s += 2.0
    ok, body = gpu_slots.health()
    assert not ok and "stalled" in body and "31 s ago" in body, body
    slot.beat()
    assert gpu_slots.health()[0]
    slot.failed("GPU 0 (GPU-x) was lost: boom", 4)
    ok, body = gpu_slots.health()
    assert not ok and "gpu 0" in body and "failed: GPU 0 (GPU-x) was lost: boom" in body


def test_one_failed_gpu_makes_the_fleet_unhealthy_and_is_named() -> None:
    clock = FakeClock()
    gpu_slots = GpuSlots(clock=clock)
    good, bad = gpu_slots.add("0"), gpu_slots.add("GPU-51a00000-0000-4000-8000-000000000001")
    good.beat()
    bad.beat()
    assert gpu_slots.health()[0]
    bad.failed("lost", 4)
    ok, body = gpu_slots.health()
    lines = body.splitlines()
    assert not ok and lines[0] == "unhealthy: 1 of 2 GPUs"
    assert lines[1].startswith("gpu 0 ")
    assert lines[2] == "gpu ? GPU-51a00000-0000-4000-8000-000000000001: failed: lost"


def test_a_stopped_filler_is_not_healthy() -> None:
    gpu_slots = GpuSlots(clock=FakeClock())
    slot = gpu_slots.add("0")
    slot.beat()
    slot.stopped()
    ok, body = gpu_slots.health()
    assert not ok and "stopped" in body


# --- the exposition, from a live simulated filler ----------------------------------------------------------


def simulated_slots(flags: str) -> tuple[GpuSlots, GpuSlot, Runtime]:
    """Run the filler on the simulated GPU in virtual time; the slot is left as if the loop were still running."""
    config = load_config(f"--simulate --sim-speed 0 {flags}".split(), env={})
    gpu_slots = GpuSlots(simulated=True)
    slot = gpu_slots.add(config.gpu)
    run = run_simulated(config, io.StringIO(), heartbeat=slot.beat, on_start=lambda rt: attach(slot, rt))
    return gpu_slots, slot, run.runtime


def attach(slot: GpuSlot, rt: Runtime) -> None:
    """As gpu_threads.run_gpu does: the slot reads the filler's status snapshot."""
    slot.attach(rt.info, lambda: rt.filler.status(rt.now()))


def scrape(gpu_slots: GpuSlots) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """Metric family name -> [(sample name, labels, value)], parsed back from the text exposition."""
    text = generate_latest(metrics.make_registry(gpu_slots)).decode()
    families: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        samples = [(s.name, dict(s.labels), s.value) for s in family.samples]
        families[family.name] = samples
        assert family.type == ("counter" if family.name + "_total" in metrics.METRICS else "gauge"), family.name
    return families


Samples = list[tuple[dict[str, str], float]]


def sample_values(families: dict[str, list[tuple[str, dict[str, str], float]]]) -> dict[str, Samples]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for samples in families.values():
        for name, labels, value in samples:
            out.setdefault(name, []).append((labels, value))
    return out


def test_exposition_has_every_metric_with_dcgm_labels_and_sane_units() -> None:
    gpu_slots, slot, rt = simulated_slots("--duration 30 --resume-after 5 --sim-foreign 8-12 --max-power-w 650")
    values = sample_values(scrape(gpu_slots))
    only_mig = {"forge_load_mig_info"}  # for MIG devices only: tests/test_metrics_mig.py
    assert set(values) == set(metrics.METRICS) - only_mig, set(values) ^ (set(metrics.METRICS) - only_mig)
    # A whole GPU: no GPU instance (empty, which Prometheus reads as absent: tests/test_metrics_mig.py).
    gpu_labels = {"gpu": "0", "UUID": slot.uuid, "GPU_I_ID": "", "GPU_I_PROFILE": ""}
    assert slot.uuid.startswith("GPU-") and list(gpu_labels) == metrics.GPU_LABELS
    extra = {"forge_load_state": {"state"}, "forge_load_gpu_info": {"modelName", "hostname"},
             "forge_load_metric_ratio": {"metric"}, "forge_load_own_metric_ratio": {"metric"}}
    for name, samples in values.items():
        if name == "forge_load_build_info":
            assert samples == [({"version": samples[0][0]["version"], "python_version": samples[0][0]["python_version"],
                                 "simulated": "true"}, 1.0)]
            continue
        for labels, value in samples:
            assert {k: labels[k] for k in gpu_labels} == gpu_labels, (name, labels)
            assert set(labels) - set(gpu_labels) == extra.get(name, set()), (name, labels)
            if name.endswith("_ratio"):
                assert 0.0 <= value <= 1.0, (name, value)
    one = {name: samples[0][1] for name, samples in values.items() if len(samples) == 1}
    assert one["forge_load_yields_total"] == rt.filler.yields == 1
    assert one["forge_load_yielding_seconds_total"] == pytest.approx(rt.filler.seconds_yielding(rt.now()))
    assert 4.0 <= one["forge_load_yielding_seconds_total"] <= 12.0
    assert one["forge_load_own_busy_seconds_total"] == pytest.approx(rt.worker.busy_log.total_busy_s)
    # about half of the 30 s less the yield and the cap's first second (it waits for a reading with our context)
    assert 9.0 <= one["forge_load_own_busy_seconds_total"] <= 15.0
    assert one["forge_load_process_gpu_memory_bytes"] == 512 * MIB  # the simulated context
    assert one["forge_load_target_ratio"] == 0.5
    plan = rt.worker.plan
    assert one["forge_load_multiplier"] == (plan.multiplier if plan.duty_ratio > 0 else 0)
    assert abs(one["forge_load_device_utilization_ratio"] - 0.5) < 0.1
    # Foreign is what NVML counts beyond our own share (none where our event-timed share reads above it).
    assert one["forge_load_foreign_utilization_ratio"] == pytest.approx(
        max(one["forge_load_device_utilization_ratio"] - one["forge_load_own_utilization_ratio"], 0.0))
    # The held metric (FORGE_METRIC, utilization by default) over its latest 2 s
    assert values["forge_load_metric_ratio"][0][0]["metric"] == "utilization"
    assert abs(one["forge_load_metric_ratio"] - 0.5) < 0.05 and abs(one["forge_load_own_metric_ratio"] - 0.5) < 0.05
    assert one["forge_load_up"] == 1.0
    assert one["forge_load_gpu_info"] == 1.0
    states = {labels["state"]: value for labels, value in values["forge_load_state"]}
    assert states == {s: float(s == "filling") for s in metrics.STATES}
    assert one["forge_load_power_cap_watts"] == 650.0 and one["forge_load_power_capped"] == 0.0  # lean: ~70 W
    assert one["forge_load_power_watts"] == pytest.approx(70.0, abs=1.0)  # the simulated GPU's model, lean shape
    energy_j = rt.filler.energy.energy_j
    assert one["forge_load_energy_joules_total"] == pytest.approx(energy_j) and energy_j > 0


def test_a_capped_gpu_says_so() -> None:
    gpu_slots, _, rt = simulated_slots("--duration 20 --target 0.9 --max-power-w 300 --shape burn")  # it binds
    one = {name: samples[0][1] for name, samples in sample_values(scrape(gpu_slots)).items() if len(samples) == 1}
    assert one["forge_load_power_capped"] == 1.0 and one["forge_load_power_cap_watts"] == 300.0
    assert one["forge_load_power_watts"] <= 300.0
    assert one["forge_load_target_ratio"] == 0.9  # the target is unchanged; the cap holds the duty under it
    assert one["forge_load_own_utilization_ratio"] < 0.5


def test_without_a_cap_no_cap_series_and_never_capped() -> None:
    gpu_slots, _, _ = simulated_slots("--duration 3")
    values = sample_values(scrape(gpu_slots))
    assert "forge_load_power_cap_watts" not in values
    assert values["forge_load_power_capped"][0][1] == 0.0


def test_a_paused_gpu_is_up_healthy_and_adds_nothing(tmp_path: Path) -> None:
    pause = tmp_path / "pause"
    pause.write_text("")
    gpu_slots, slot, rt = simulated_slots(f"--duration 10 --pause-file {pause}")
    values = sample_values(scrape(gpu_slots))
    states = {labels["state"]: value for labels, value in values["forge_load_state"]}
    assert states == {s: float(s == "paused") for s in metrics.STATES}
    one = {name: samples[0][1] for name, samples in values.items() if len(samples) == 1}
    # What the Prometheus rules assume of a paused filler: up, own share 0, holding nothing, no energy.
    assert one["forge_load_up"] == 1.0
    assert one["forge_load_own_utilization_ratio"] == 0.0 and one["forge_load_target_ratio"] == 0.0
    assert one["forge_load_energy_joules_total"] == 0.0 and one["forge_load_own_busy_seconds_total"] == 0.0
    ok, line = slot.health(gpu_slots.max_age_s)
    assert ok and "paused" in line


def test_a_yielding_gpu_says_so() -> None:
    gpu_slots, _, _ = simulated_slots("--duration 10 --sim-foreign 5-20")
    values = sample_values(scrape(gpu_slots))
    states = {labels["state"]: value for labels, value in values["forge_load_state"]}
    assert states["yielding"] == 1.0 and sum(states.values()) == 1.0
    assert values["forge_load_target_ratio"][0][1] == 0.0  # holds nothing while a job runs
    assert values["forge_load_multiplier"][0][1] == 0.0
    assert values["forge_load_foreign_utilization_ratio"][0][1] > 0.5


def test_a_failed_gpu_keeps_its_counters_but_not_stale_readings() -> None:
    gpu_slots, slot, _ = simulated_slots("--duration 5")
    slot.failed("GPU 0 was lost", 4)
    values = sample_values(scrape(gpu_slots))
    assert values["forge_load_up"][0][1] == 0.0
    assert {labels["state"] for labels, value in values["forge_load_state"] if value == 1.0} == {"failed"}
    assert values["forge_load_own_busy_seconds_total"][0][1] > 2.0
    for name in ("forge_load_device_utilization_ratio", "forge_load_target_ratio", "forge_load_multiplier"):
        assert name not in values


def test_a_gpu_that_never_opened_still_shows_as_failed() -> None:
    gpu_slots = GpuSlots(clock=FakeClock())
    gpu_slots.add("3").failed("no usable GPU: GPU 3 does not exist", 3)
    values = sample_values(scrape(gpu_slots))
    assert values["forge_load_up"] == [({"gpu": "3", "UUID": "", "GPU_I_ID": "", "GPU_I_PROFILE": ""}, 0.0)]
    assert "forge_load_yields_total" not in values


def test_our_registry_is_our_own() -> None:
    gpu_slots, _, _ = simulated_slots("--duration 1")
    ours = generate_latest(metrics.make_registry(gpu_slots)).decode()
    assert "process_cpu_seconds_total" not in ours and "python_gc" not in ours
    assert "forge_load_" not in generate_latest(REGISTRY).decode()


def test_exposition_lines_look_like_dcgm_exporters() -> None:
    # dcgm-exporter: DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-604ac76c-...",...} 0
    gpu_slots, slot, _ = simulated_slots("--duration 1")
    text = generate_latest(metrics.make_registry(gpu_slots)).decode()
    # (an empty GPU_I_ID and GPU_I_PROFILE on a whole GPU, where dcgm-exporter has none: the same to Prometheus)
    assert f'forge_load_up{{GPU_I_ID="",GPU_I_PROFILE="",UUID="{slot.uuid}",gpu="0"}} 1.0' in text


# --- the HTTP server -------------------------------------------------------------------------------------


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("Content-Type", ""), error.read().decode()


def test_server_answers_metrics_health_and_404() -> None:
    clock = FakeClock()
    gpu_slots = GpuSlots(clock=clock)
    slot = gpu_slots.add("0")
    server = http_server.serve(gpu_slots, "127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{server.port}"
        status, kind, body = get(base + "/health")
        assert status == 503 and "starting" in body and kind.startswith("text/plain")
        slot.beat()
        status, _, body = get(base + "/health")
        assert status == 200 and body.startswith("ok\n")
        status, kind, body = get(base + "/metrics")
        assert status == 200 and kind.startswith("text/plain") and "forge_load_up" in body
        assert get(base + "/")[0] == 200
        assert get(base + "/nothing")[0] == 404
    finally:
        server.close()


def test_a_taken_port_is_a_config_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as info:
            http_server.serve(GpuSlots(), "127.0.0.1", port)
    message = str(info.value)
    assert f"FORGE_METRICS_PORT={port}" in message and "\n" not in message


# --- the process ---------------------------------------------------------------------------------------------


def forge_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = settings_free("TARGET")
    env.update(PYTHONPATH=str(ROOT), FORGE_HEARTBEAT_FILE=os.devnull + ".none/heartbeat", **(extra or {}))
    return env


def forge(*args: str, env: dict[str, str] | None = None,
          timeout_s: float = 60.0) -> tuple[int, list[dict[str, Any]], str]:
    result = subprocess.run([sys.executable, "-m", "forge_load", "--log-format", "json", *args], capture_output=True,
                            text=True, env=forge_env(env), timeout=timeout_s, cwd=ROOT)
    return result.returncode, [json.loads(line) for line in result.stdout.splitlines()], result.stderr


def by_gpu(events: list[dict[str, Any]], event: str) -> dict[Any, list[dict[str, Any]]]:
    out: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e["event"] == event:
            out.setdefault(e["gpu"], []).append(e)
    return out


def test_one_gpu_failing_leaves_the_others_filling() -> None:
    rc, events, err = forge("--simulate", "--sim-speed", "0", "--sim-gpus", "3", "--gpus", "all", "--duration", "30",
                            "--log-interval", "5", "--sim-fail-gpu", "1@5")
    assert rc == 4, err  # a GPU failed during the run
    errors = by_gpu(events, "error")
    assert list(errors) == [1]
    assert "was lost" in str(errors[1][0]["reason"]) and errors[1][0]["t"] == pytest.approx(5.0, abs=0.2)
    assert errors[1][0]["uuid"] == "GPU-51a00000-0000-4000-8000-000000000001"
    assert not [e for e in events if e["gpu"] == 1 and e["t"] > 5.2]
    stops = by_gpu(events, "stop")
    assert sorted(stops) == [0, 2]
    for gpu in (0, 2):
        assert stops[gpu][0]["reason"] == "duration reached"
        late = [e for e in by_gpu(events, "status")[gpu] if float(e["t"]) > 6.0]
        assert len(late) == 4, late  # 10, 15, 20, 25 s; the stop line stands for 30 s
        for status in late:
            assert abs(float(status["own"]) - 0.5) < 0.05, status
    starts = by_gpu(events, "start")
    assert {g: s[0]["uuid"] for g, s in starts.items()} == {
        i: f"GPU-51a00000-0000-4000-8000-00000000000{i}" for i in range(3)}
    assert {g: s[0]["gpu_requested"] for g, s in starts.items()} == {0: "0", 1: "1", 2: "2"}


def test_every_gpu_failing_ends_the_process_with_4() -> None:
    started_s = time.monotonic()
    rc, events, err = forge("--simulate", "--sim-speed", "0", "--sim-gpus", "2", "--gpus", "all",
                            "--sim-fail-gpu", "0@2,1@3")
    assert rc == 4, err
    assert sorted(by_gpu(events, "error")) == [0, 1]
    assert time.monotonic() - started_s < 20


def test_no_gpu_that_can_be_opened_exits_3() -> None:
    rc, events, err = forge("--simulate", "--sim-gpus", "2", "--gpus", "4,GPU-51a00000-0000-4000-8000-000000000009")
    assert (rc, err) == (3, "")  # said once: in each GPU's error line, not again on stderr
    assert [e["event"] for e in events] == ["error", "error"]
    assert "GPU 4 does not exist" in events[0]["reason"] and "000000000009 does not exist" in events[1]["reason"]


def test_a_list_of_gpus_runs_just_those() -> None:
    rc, events, err = forge("--simulate", "--sim-speed", "0", "--sim-gpus", "4", "--duration", "1",
                            "--gpus", "3,GPU-51a00000-0000-4000-8000-000000000001")
    assert rc == 0, err
    starts = by_gpu(events, "start")
    assert sorted(starts) == [1, 3]
    assert starts[1][0]["gpu_requested"] == "GPU-51a00000-0000-4000-8000-000000000001"
    assert sorted(by_gpu(events, "stop")) == [1, 3]


def test_a_gpu_named_twice_is_filled_once() -> None:
    rc, events, err = forge("--simulate", "--sim-speed", "0", "--sim-gpus", "2", "--duration", "5",
                            "--gpus", "0,1,GPU-51a00000-0000-4000-8000-000000000000")
    assert rc == 0, err  # as docs/operating.md says: filled once, not an error
    assert not [e for e in events if e["event"] == "error"]
    starts, stops = by_gpu(events, "start"), by_gpu(events, "stop")
    assert sorted(starts) == sorted(stops) == [0, 1] and len(starts[0]) == len(stops[0]) == 1
    assert starts[0][0]["gpu_requested"] == "0"  # the first name is kept
    assert not by_gpu(events, "yield")  # neither took the other for a foreign job


def test_a_foreign_job_touches_only_its_own_gpu() -> None:
    rc, events, err = forge("--simulate", "--sim-speed", "0", "--sim-gpus", "3", "--gpus", "all", "--duration", "10",
                            "--sim-foreign", "3-30", "--sim-foreign-gpus", "1")
    assert rc == 0, err
    assert list(by_gpu(events, "yield")) == [1]
    stops = by_gpu(events, "stop")
    assert [stops[g][0]["state"] for g in range(3)] == ["filling", "yielding", "filling"]


def test_gpu_and_gpus_together_exit_2() -> None:
    rc, events, err = forge("--simulate", env={"FORGE_GPU": "1", "FORGE_GPUS": "all"})
    assert rc == 2 and events == []
    assert len(err.strip().splitlines()) == 1 and "FORGE_GPU='1'" in err and "FORGE_GPUS='all'" in err


def test_missing_prometheus_client_exits_2_with_the_fix() -> None:
    code = ("import sys; sys.modules['prometheus_client'] = None; from forge_load.service.app import main; "
            "raise SystemExit(main(['--simulate', '--metrics-port', '0', '--duration', '1']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=forge_env(),
                            timeout=30, cwd=ROOT)
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "prometheus_client" in lines[0] and "forge-load[metrics]" in lines[0], result.stderr


def test_without_a_metrics_port_prometheus_client_is_not_imported() -> None:
    code = ("import sys, io; from forge_load.service.app import main; "
            "rc = main(['--simulate', '--sim-speed', '0', '--duration', '1'], io.StringIO()); "
            "print(rc, 'prometheus_client' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=forge_env(),
                            timeout=30, cwd=ROOT)
    assert result.stdout.split() == ["0", "False"], result.stderr


class Running:
    """`python -m forge_load` in the background, its JSON lines read as they come."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "forge_load", "--log-format", "json", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=forge_env(),
                                     cwd=ROOT)
        self.events: list[dict[str, Any]] = []

    def read_until(self, event: str, count: int = 1) -> list[dict[str, Any]]:
        stdout: IO[str] | None = self.proc.stdout
        assert stdout is not None
        while len([e for e in self.events if e["event"] == event]) < count:
            line = stdout.readline()
            assert line, f"exited before {count} {event!r} lines: {self.proc.stderr.read() if self.proc.stderr else ''}"
            self.events.append(json.loads(line))
        return [e for e in self.events if e["event"] == event]

    def stop(self) -> tuple[int, list[dict[str, Any]]]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=10)
        self.events += [json.loads(line) for line in out.splitlines()]
        return self.proc.returncode, self.events


def poll_health(port: int, until: str, timeout_s: float = 15.0) -> tuple[int, str]:
    deadline_s = time.monotonic() + timeout_s
    status, body = 0, ""
    while time.monotonic() < deadline_s:
        status, _, body = get(f"http://127.0.0.1:{port}/health")
        if until in body:
            return status, body
        time.sleep(0.2)
    raise AssertionError(f"/health never said {until!r}; last: {status} {body}")


def test_health_reports_the_failed_gpu_while_the_others_fill() -> None:
    run = Running("--simulate", "--sim-speed", "1", "--sim-gpus", "3", "--gpus", "all", "--sim-fail-gpu", "2@2",
                  "--metrics-port", "0", "--metrics-addr", "127.0.0.1")
    try:
        port = int(run.read_until("metrics")[0]["port"])
        status, body = poll_health(port, "ok\n")
        assert status == 200
        status, body = poll_health(port, "failed")
        assert status == 503
        lines = body.splitlines()
        assert lines[0] == "unhealthy: 1 of 3 GPUs"
        assert lines[1].startswith("gpu 0 GPU-") and ": filling, loop heartbeat" in lines[1]
        assert lines[2].startswith("gpu 1 GPU-") and ": filling, loop heartbeat" in lines[2]
        assert lines[3].startswith("gpu 2 GPU-") and "failed: GPU 2" in lines[3] and "was lost" in lines[3]
        time.sleep(1.5)  # the others go on after the failure
        _, _, exposition = get(f"http://127.0.0.1:{port}/metrics")
        busy = {s.labels["gpu"]: s.value for f in text_string_to_metric_families(exposition)
                for s in f.samples if s.name == "forge_load_own_busy_seconds_total"}
        assert busy["0"] > busy["2"] + 0.5 and busy["1"] > busy["2"] + 0.5, busy
    finally:
        rc, events = run.stop()
    assert rc == 4
    assert sorted(by_gpu(events, "stop")) == [0, 1]


def test_sigterm_stops_every_gpu_within_a_second() -> None:
    run = Running("--simulate", "--sim-speed", "1", "--sim-gpus", "3", "--gpus", "all", "--metrics-port", "0",
                  "--metrics-addr", "127.0.0.1")
    try:
        run.read_until("start", 3)
        port = int(run.read_until("metrics")[0]["port"])
        poll_health(port, "ok\n")
    finally:
        sent_s = time.monotonic()
        rc, events = run.stop()
    assert time.monotonic() - sent_s < 1.0
    assert rc == 0
    stops = by_gpu(events, "stop")
    assert sorted(stops) == [0, 1, 2]
    assert {s[0]["reason"] for s in stops.values()} == {"signal SIGTERM"}


def test_one_gpu_without_gpus_serves_metrics_too() -> None:
    run = Running("--simulate", "--sim-speed", "1", "--metrics-port", "0", "--metrics-addr", "127.0.0.1")
    try:
        port = int(run.read_until("metrics")[0]["port"])
        status, body = poll_health(port, "ok\n")
        assert status == 200 and "gpu 0 GPU-" in body and "filling" in body
    finally:
        rc, _ = run.stop()
    assert rc == 0


def test_the_metric_reference_lists_every_metric_with_its_type() -> None:
    # docs/metrics.md (scripts/gen_docs.py) has one row per exported metric, no more, each with its type.
    rows = re.findall(r"^\| `(forge_load_\w+)` \| (gauge|counter) \|", (ROOT / "docs" / "metrics.md").read_text(),
                      re.M)
    assert dict(rows) == {name: kind for name, (kind, _) in metrics.METRICS.items()}
    assert len(rows) == len(metrics.METRICS)


def test_a_held_gpu_counts_its_holds_and_never_names_a_holder(tmp_path: Path) -> None:
    from forge_load.steering import holds

    uuid = "GPU-51a00000-0000-4000-8000-000000000000"  # the simulated GPU 0
    for holder in ("slurm-41", "slurm-42"):
        holds.place(str(tmp_path), holds.Hold(uuid, holder, "a job", 0.0, None))
    gpu_slots, _, _ = simulated_slots(f"--duration 3 --hold-dir {tmp_path}")
    text = scrape(gpu_slots)
    values = sample_values(text)
    states = {labels["state"]: value for labels, value in values["forge_load_state"]}
    assert states == {s: float(s == "held") for s in metrics.STATES}
    assert values["forge_load_holds"][0][1] == 2.0 and values["forge_load_holds_begun_total"][0][1] == 2.0
    assert values["forge_load_own_busy_seconds_total"][0][1] == 0.0
    assert "slurm-4" not in text
