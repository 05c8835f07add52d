"""On a real GPU only (marked `gpu`, skipped elsewhere): the kernels, the launcher and the filler for real."""

from __future__ import annotations

import io
import json
import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def nvml_gpu0_uuid() -> str:
    """The GPU the filler takes by default (NVML index 0); CUDA's numbering may differ."""
    from forge_load.gpu.nvml import NvmlProbe

    with NvmlProbe("0") as probe:
        return probe.info.uuid


def test_burn_computes_the_reference_value_on_hardware() -> None:
    from forge_load.gpu.launcher import find_device, prepare_process

    prepare_process()
    from numba import cuda

    from forge_load.gpu import kernels

    cuda.select_device(find_device(cuda, nvml_gpu0_uuid()).id)
    out = cuda.to_device(np.zeros(1, dtype=np.float32))
    kernels.launch_burn(out, 1, sentinel=kernels.reference_value(0, kernels.BURN_ITERS))
    cuda.synchronize()
    assert out.copy_to_host()[0] == np.float32(kernels.reference_value(0, kernels.BURN_ITERS))


def test_launcher_times_its_kernels_with_events() -> None:
    from forge_load.gpu.launcher import CudaLauncher

    launcher = CudaLauncher(nvml_gpu0_uuid())
    try:
        for _ in range(3):
            launcher.launch(16, time.monotonic())
        done = []
        deadline_s = time.monotonic() + 5.0
        while len(done) < 3 and time.monotonic() < deadline_s:
            time.sleep(0.001)
            done += launcher.poll(time.monotonic())
        assert len(done) == 3
        for kernel in done:
            assert 0.0 < kernel.end_s - kernel.start_s < 0.1
        assert done[0].end_s <= done[1].start_s + 1e-4 and done[1].end_s <= done[2].start_s + 1e-4
    finally:
        launcher.close()


def test_filler_holds_half_the_gpu_for_real() -> None:
    from forge_load.config.load import load_config
    from forge_load.gpu.backend import NvidiaBackend
    from forge_load.service.loop import run_loop

    config = load_config("--duration 20 --log-interval 2 --log-format json --target 0.5".split(), env={})
    out = io.StringIO()
    run_loop(config, NvidiaBackend(), out, threading.Event(), threading.Event())
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    print("\n".join(out.getvalue().splitlines()))
    statuses = [e for e in events if e["event"] == "status" and e["state"] == "filling"]
    assert statuses, events
    late = [e["util"] for e in statuses if e["t"] >= 6.0]
    assert late and all(abs(u - 0.5) <= 0.05 for u in late), late
    assert events[0]["gpu_mem_mib"] is not None


def test_an_event_on_an_empty_stream_completes_while_another_stream_runs_a_kernel() -> None:
    # The launcher's clock anchors rest on this (docs/design.md §8).
    from forge_load.gpu.launcher import find_device, prepare_process

    prepare_process()
    from numba import cuda

    from forge_load.gpu import kernels

    device = find_device(cuda, nvml_gpu0_uuid())
    cuda.select_device(device.id)
    busy, empty = cuda.stream(), cuda.stream()
    out = cuda.to_device(np.zeros(1, dtype=np.float32), stream=busy)
    kernels.launch_burn(out, 1, busy)  # compile and load first
    busy.synchronize()
    kernel_end = cuda.event(timing=True)
    kernels.launch_burn(out, 2000 * int(device.MULTIPROCESSOR_COUNT), busy)  # a long kernel: many waves
    kernel_end.record(busy)
    anchor = cuda.event(timing=True)
    anchor.record(empty)
    deadline_s = time.monotonic() + 1.0
    while not anchor.query() and time.monotonic() < deadline_s:
        time.sleep(0.0001)
    assert anchor.query()
    assert not kernel_end.query(), "the kernel was too short to tell"
    busy.synchronize()
