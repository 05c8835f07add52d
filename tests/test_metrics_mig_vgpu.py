"""`--gpus all` on a GPU in MIG mode, on the virtual GPU: `/metrics` labels each MIG device's series as
dcgm-exporter does (its GPU's gpu and UUID, its own GPU_I_ID and GPU_I_PROFILE), one series per MIG device, and
`/health` names each by its own MIG-... UUID (tests/test_metrics_mig.py has the same with stand-ins)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.test_metrics import get, poll_health
from tests.test_mig_all_vgpu import _start
from vgpu.pytest_plugin import VgpuFactory


def test_each_mig_devices_series_carry_its_gpus_uuid_and_its_gpu_instance(vgpu: VgpuFactory,
                                                                         tmp_path: Path) -> None:
    gpu = vgpu(mig=2)
    migs = gpu.mig_devices()
    (parent,) = gpu.uuids()
    proc = _start(gpu, tmp_path, "--duration", "60", "--metrics-port", "0", "--metrics-addr", "127.0.0.1")
    try:
        assert proc.stdout is not None
        port = None
        while port is None:
            line = proc.stdout.readline()
            assert line, "exited before its metrics line"
            event = json.loads(line) if line.startswith("{") else {}
            port = int(event["port"]) if event.get("event") == "metrics" else None
        status, body = poll_health(port, "ok\n", timeout_s=60.0)
        assert status == 200 and all(m.uuid in body for m in migs), body
        _, _, exposition = get(f"http://127.0.0.1:{port}/metrics")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    families = {f.name: f.samples for f in text_string_to_metric_families(exposition)}
    up = {(s.labels["gpu"], s.labels["UUID"], s.labels["GPU_I_ID"], s.labels["GPU_I_PROFILE"]): s.value
          for s in families["forge_load_up"]}
    assert up == {(str(m.gpu), parent, str(m.gi), m.profile): 1.0 for m in migs}
    assert sorted((s.labels["GPU_I_ID"], s.labels["mig_uuid"]) for s in families["forge_load_mig_info"]) == sorted(
        (str(m.gi), m.uuid) for m in migs)
