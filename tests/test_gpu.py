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


class Driver:
    """The driver API as the filler uses it, on the GPU the filler takes: its primary context current here."""

    def __init__(self) -> None:
        from cuda.bindings import driver as cu

        from forge_load.gpu.launcher import cuda_devices, find_device, prepare_process

        prepare_process()
        self.cu = cu
        self.call(cu.cuInit(0), "cuInit")
        self.device = self.call(cu.cuDeviceGet(find_device(cuda_devices(cu), nvml_gpu0_uuid())), "cuDeviceGet")
        self.context = self.call(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self.call(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        attribute = cu.CUdevice_attribute
        self.cc = tuple(self.call(cu.cuDeviceGetAttribute(a, self.device), "cuDeviceGetAttribute") for a in
                        (attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                         attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
        self.sm_count = self.call(cu.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                                          self.device), "cuDeviceGetAttribute")

    def call(self, result: tuple, name: str):  # type: ignore[no-untyped-def]
        assert result[0] == self.cu.CUresult.CUDA_SUCCESS, f"{name} failed: {result[0].name}"
        return result[1] if len(result) > 1 else None

    def load_shipped(self) -> tuple[object, str]:
        """(the burn kernel's function, the image's name) from the first shipped image the GPU loads."""
        from forge_load.gpu import burn_image

        manifest = burn_image.load_manifest()
        for image in burn_image.images_for(self.cc, manifest):
            err, module = self.cu.cuModuleLoadData(image.data)
            if err == self.cu.CUresult.CUDA_SUCCESS:
                return self.call(self.cu.cuModuleGetFunction(module, manifest.entry.encode()),
                                 "cuModuleGetFunction"), image.name
        raise AssertionError(f"no shipped image loads on sm_{self.cc[0]}{self.cc[1]}")

    def close(self) -> None:
        self.cu.cuCtxSetCurrent(None)
        self.cu.cuDevicePrimaryCtxRelease(self.device)


def test_burn_computes_the_reference_value_on_hardware() -> None:
    # The shipped cubin, launched by cuLaunchKernel with burn_image's argument layout: thread 0 matches the
    # sentinel and writes it, so a wrong layout or a wrong kernel fails here.
    from forge_load.gpu import burn_image, kernels

    gpu = Driver()
    cu = gpu.call
    try:
        function, image = gpu.load_shipped()
        if burn_image.pick_cubin((int(gpu.cc[0]), int(gpu.cc[1]))) is not None:
            assert image.endswith(".cubin"), image
        out = cu(gpu.cu.cuMemAlloc(4), "cuMemAlloc")
        cu(gpu.cu.cuMemsetD32(out, 0, 1), "cuMemsetD32")
        expected = np.float32(kernels.reference_value(0, burn_image.BURN_ITERS))
        args = burn_image.pack_arguments(int(out), burn_image.BURN_ITERS, float(expected))
        cu(gpu.cu.cuLaunchKernel(function, 1, 1, 1, burn_image.THREADS_PER_BLOCK, 1, 1, 0, 0, args.address, 0),
           "cuLaunchKernel")
        cu(gpu.cu.cuCtxSynchronize(), "cuCtxSynchronize")
        host = np.zeros(1, dtype=np.float32)
        cu(gpu.cu.cuMemcpyDtoH(host.ctypes.data, out, 4), "cuMemcpyDtoH")
        assert host[0] == expected
    finally:
        gpu.close()


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


def test_filler_holds_sm_activity_read_through_gpm_for_real() -> None:
    # FORGE_METRIC=sm_activity on a real Hopper or newer GPU: NVML's GPM, read here through sample pairs of this
    # test's own (not the filler's), must see SM_UTIL near the target (docs/design.md §12; the virtual GPU's model
    # of SM_UTIL is all the rest of the suite has).
    from bench.metric import METRIC_TARGET, SETTLE_BAND_RATIO
    from forge_load.gpu.nvml import NvmlProbe

    probe = NvmlProbe("0")
    try:
        if not probe.info.gpm:
            pytest.skip(f"{probe.info.name} has no NVML GPM (nvmlGpmQueryDeviceSupport: not supported; GPM needs "
                        "Hopper, cc 9.0, or newer)")
    finally:
        probe.close()
    events, late, _ = _gpm_during(f"--duration 20 --log-interval 2 --log-format json --target {METRIC_TARGET:g} "
                                  "--metric sm_activity")
    assert events[0]["event"] == "start" and not [e for e in events if e["event"] == "error"], events
    assert len(late) >= 5 and all(abs(v - METRIC_TARGET) <= SETTLE_BAND_RATIO for v in late), late


def _gpm_during(config_text: str, seconds_after_s: float = 8.0) -> tuple[list[dict[str, object]], list[float], bool]:
    """Run the filler with these flags; (its JSON lines, GPM SM_UTIL readings of this test's own 1-s sample pairs
    after `seconds_after_s`, whether the GPU has GPM)."""
    from forge_load.config.load import load_config
    from forge_load.gpu.backend import NvidiaBackend
    from forge_load.gpu.nvml import NvmlProbe
    from forge_load.service.loop import run_loop

    probe = NvmlProbe("0")
    readings: list[tuple[float, float]] = []
    try:
        has_gpm = probe.info.gpm
        done = threading.Event()

        def read_gpm() -> None:
            probe.activity()  # the first sample of the first pair
            while not done.wait(1.0):
                activity = probe.activity()
                if activity is not None:
                    readings.append((activity.t_s, activity.sm_ratio))

        reader = threading.Thread(target=read_gpm, daemon=True)
        start_s = time.monotonic()
        if has_gpm:
            reader.start()
        out = io.StringIO()
        run_loop(load_config(config_text.split(), env={}), NvidiaBackend(), out, threading.Event(), threading.Event())
        done.set()
        if has_gpm:
            reader.join(timeout=5.0)
    finally:
        probe.close()
    print(out.getvalue())
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    return events, [round(v, 4) for t, v in readings if t >= start_s + seconds_after_s], has_gpm


def test_the_lean_kernel_holds_utilization_and_sm_activity_for_real() -> None:
    # The default shape: one sleeping warp holds NVML's utilization at the target, and shows in GPM's SM_UTIL as one
    # SM of N; with FORGE_METRIC=sm_activity, a warp on every SM holds SM_UTIL at the target (docs/design.md §15:
    # what the block scheduler does with one small block per SM is this test's to show).
    from bench.metric import METRIC_TARGET, SETTLE_BAND_RATIO

    events, sm_util, has_gpm = _gpm_during("--duration 20 --log-interval 2 --log-format json --target 0.5")
    start = events[0]
    assert start["event"] == "start" and start["shape"] == "lean" and start["shape_layout"] == "one sleeping warp"
    assert str(start["kernel_image"]).startswith(("lean.", "jit")), start
    late = [e["util"] for e in events if e["event"] == "status" and e["state"] == "filling" and e["t"] >= 6.0]
    assert late and all(abs(u - 0.5) <= 0.05 for u in late), late
    if has_gpm:
        sm_count = int(start["sm_count"])
        assert len(sm_util) >= 5 and all(v <= 0.5 / sm_count + 0.02 for v in sm_util), sm_util
    else:
        pytest.skip(f"{start['gpu_name']} has no NVML GPM: utilization held; SM activity needs Hopper or newer")
    events, sm_util, _ = _gpm_during(f"--duration 20 --log-interval 2 --log-format json --target {METRIC_TARGET:g} "
                                     "--metric sm_activity")
    assert events[0]["shape_layout"] == f"one sleeping warp on each of {events[0]['sm_count']} SMs"
    assert len(sm_util) >= 5 and all(abs(v - METRIC_TARGET) <= SETTLE_BAND_RATIO for v in sm_util), sm_util


def test_the_shipped_lean_kernel_sleeps_about_its_request_on_hardware() -> None:
    # nanosleep promises 0 to twice the request: 1000 quanta of 10 us, timed with events, between 0.1 and 2.1 times
    # 10 ms (the Worker learns the real figure; this only shows the loop runs and sleeps).
    from forge_load.gpu.launcher import CudaLauncher

    launcher = CudaLauncher(nvml_gpu0_uuid(), shape="lean")
    try:
        assert launcher.kernel_image.startswith(("lean.", "jit")), launcher.kernel_image
        launcher.launch(1000, time.monotonic(), count=3)
        done = []
        deadline_s = time.monotonic() + 5.0
        while not done and time.monotonic() < deadline_s:
            time.sleep(0.001)
            done += launcher.poll(time.monotonic())
        assert len(done) == 1 and done[0].kernel_s is not None
        print(f"1000 quanta of 10 us: {done[0].kernel_s * 1e3:.3f} ms")
        assert 0.001 <= done[0].kernel_s <= 0.021
    finally:
        launcher.close()


def test_an_event_on_an_empty_stream_completes_while_another_stream_runs_a_kernel() -> None:
    # The launcher's clock anchors rest on this (docs/design.md §8).
    from forge_load.gpu import burn_image

    gpu = Driver()
    cu, d = gpu.call, gpu.cu
    try:
        function, _ = gpu.load_shipped()
        busy = cu(d.cuStreamCreate(0), "cuStreamCreate")
        empty = cu(d.cuStreamCreate(0), "cuStreamCreate")
        out = cu(d.cuMemAlloc(4), "cuMemAlloc")
        args = burn_image.pack_arguments(int(out))
        threads = burn_image.THREADS_PER_BLOCK
        cu(d.cuLaunchKernel(function, 1, 1, 1, threads, 1, 1, 0, busy, args.address, 0), "cuLaunchKernel")
        cu(d.cuStreamSynchronize(busy), "cuStreamSynchronize")
        kernel_end = cu(d.cuEventCreate(0), "cuEventCreate")
        anchor = cu(d.cuEventCreate(0), "cuEventCreate")
        grid = 2000 * int(gpu.sm_count)  # a long kernel: many waves
        cu(d.cuLaunchKernel(function, grid, 1, 1, threads, 1, 1, 0, busy, args.address, 0), "cuLaunchKernel")
        cu(d.cuEventRecord(kernel_end, busy), "cuEventRecord")
        cu(d.cuEventRecord(anchor, empty), "cuEventRecord")
        ready = d.CUresult.CUDA_SUCCESS
        deadline_s = time.monotonic() + 1.0
        while d.cuEventQuery(anchor)[0] != ready and time.monotonic() < deadline_s:
            time.sleep(0.0001)
        assert d.cuEventQuery(anchor)[0] == ready
        assert d.cuEventQuery(kernel_end)[0] != ready, "the kernel was too short to tell"
        cu(d.cuStreamSynchronize(busy), "cuStreamSynchronize")
    finally:
        gpu.close()
