"""The lean kernel on the virtual GPU, through the real launcher (the shipped images, cuLaunchKernel) and pynvml: the
virtual GPU recognises it and times it by its sleep, records its quanta, counts its warps in GPM, and its power
model charges it the light load of the SMs it holds; a context's DVFS step and bare idle (docs/design.md §15). Every
watt here is the model's."""

from __future__ import annotations

import pytest

from tests.test_vgpu import run_py
from vgpu.pytest_plugin import VgpuFactory

LIGHT_SM_W = 1.97 / 80  # the model's, vgpu/src/state.c
SMS = 132

LEAN = r'''
import json, os, time
import pynvml as n
from forge_load.gpu.launcher import CudaLauncher
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
say = lambda **f: print(json.dumps(f), flush=True)
power = lambda: n.nvmlDeviceGetPowerUsage(h) / 1e3

def gpm(seconds, run):
    """GPM's SM_UTIL, SM_OCCUPANCY and GRAPHICS_UTIL (ratios) over `run()` and `seconds` of waiting after it."""
    s1, s2 = n.nvmlGpmSampleAlloc(), n.nvmlGpmSampleAlloc()
    n.nvmlGpmSampleGet(h, s1)
    run()
    time.sleep(seconds)
    n.nvmlGpmSampleGet(h, s2)
    get = n.c_nvmlGpmMetricsGet_t()
    get.version, get.numMetrics, get.sample1, get.sample2 = n.NVML_GPM_METRICS_GET_VERSION, 3, s1, s2
    for i, m in enumerate((n.NVML_GPM_METRIC_SM_UTIL, n.NVML_GPM_METRIC_SM_OCCUPANCY, n.NVML_GPM_METRIC_GRAPHICS_UTIL)):
        get.metrics[i].metricId = m
    n.nvmlGpmMetricsGet(get)
    return [get.metrics[i].value / 100 for i in range(3)]

bare_w = power()  # no context on the board yet
uuid = n.nvmlDeviceGetUUID(h)
launcher = CudaLauncher(uuid if isinstance(uuid, str) else uuid.decode(), shape="lean", metric=os.environ["METRIC"])
time.sleep(1.05)
idle_w = power()

def sleep_kernels():  # 0.6 s of lean kernels: 50 of 1000 quanta (12 ms each at the model's 1.2 ratio)
    launcher.launch(1000, time.monotonic(), count=50)

sm, occupancy, graphics = gpm(0.7, sleep_kernels)
busy_w = power()
done = []
while not done:
    done += launcher.poll(time.monotonic())
    time.sleep(0.01)
launcher.close()
say(pid=os.getpid(), bare_w=bare_w, idle_w=idle_w, busy_w=busy_w, sm=sm, occupancy=occupancy, graphics=graphics,
    kernel_s=done[0].kernel_s, busy_s=done[0].end_s - done[0].start_s)
'''


@pytest.mark.parametrize(("metric", "warps"), [("utilization", 1), ("sm_activity", SMS)])
def test_the_lean_kernel_sleeps_its_quanta_holds_its_warps_and_draws_their_light_load(
        vgpu: VgpuFactory, metric: str, warps: int) -> None:
    gpu = vgpu(sleep_jitter=0.0)
    r = run_py(gpu, LEAN, env={"METRIC": metric}, timeout=180)
    mine = [k for k in gpu.kernels() if k.pid == r["pid"]]
    # One warp, or one per SM: at most one warp per SM per launch, in the kernel record; its length its sleep.
    assert [(k.kind, k.grid, k.block, k.quanta) for k in mine] == [("lean", warps, 32, 1000),
                                                                   ("lean", warps, 32, 49000)]
    assert mine[0].end - mine[0].start == pytest.approx(8e-6 + 1000 * 10e-6 * 1.2, abs=2e-6)
    assert r["kernel_s"] == pytest.approx(1000 * 10e-6 * 1.2, rel=0.01)  # what the Worker learns per 1000 quanta
    busy_s = 50 * (8e-6 + 1000 * 10e-6 * 1.2)  # two launches, one overhead each: within a hair
    assert r["busy_s"] == pytest.approx(busy_s, rel=0.01)
    span_s = busy_s / r["graphics"]  # GPM's span, from the time any kernel ran in it: the kernels ran inside it
    assert span_s == pytest.approx(0.7, abs=0.05)
    assert r["sm"] == pytest.approx(r["graphics"] * warps / SMS, rel=0.01)  # SMs with a warp, averaged over all
    assert r["occupancy"] == pytest.approx(r["graphics"] * warps / (SMS * 64), rel=0.01)  # 1 of 64 warp slots
    # Power (the model's): bare idle before our context, 70 W with it, and the light load of the SMs held.
    assert r["bare_w"] == pytest.approx(32.0, abs=0.01)
    assert r["idle_w"] == pytest.approx(70.0, abs=0.01)
    assert r["busy_w"] == pytest.approx(70.0 + LIGHT_SM_W * warps * busy_s, abs=0.02)  # 0.6 s of the last second
    assert r["busy_w"] <= 70.0 + 0.1 * (700.0 - 70.0)


def test_a_context_that_ends_leaves_the_board_at_bare_idle(vgpu: VgpuFactory) -> None:
    gpu = vgpu()
    run_py(gpu, LEAN, env={"METRIC": "utilization"}, timeout=180)  # its context gone with it
    after = run_py(gpu, r'''
import json, time
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
time.sleep(1.05)
e0 = n.nvmlDeviceGetTotalEnergyConsumption(h)
time.sleep(1.0)
print(json.dumps({"w": n.nvmlDeviceGetPowerUsage(h) / 1e3, "j": (n.nvmlDeviceGetTotalEnergyConsumption(h) - e0) / 1e3}))
''')
    assert after["w"] == pytest.approx(32.0, abs=0.01)
    assert after["j"] == pytest.approx(32.0, rel=0.05)
