"""MIG and GPM on the virtual GPU (vgpu/src/mig.c, gpm.c): the real pynvml and cuda-bindings on the stand-ins.

A GPU split by `mig=N` into MIG devices: their UUIDs, SMs, memory and processes; NVML's MIG queries and its
NOT_SUPPORTED answers; CUDA_VISIBLE_DEVICES=MIG-<uuid>; the kernel record's grid, block and MIG instance; GPM's
SM_UTIL, SM_OCCUPANCY and GRAPHICS_UTIL computed from the kernels' shapes, per GPU and per GPU instance, on
compute capability 9.0 and not on 8.0. What a real GPU does that this cannot show: docs/design.md §12.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_vgpu import DRIVER, ROOT, run_py
from vgpu import VgpuError, VirtualGpu
from vgpu.pytest_plugin import VgpuFactory

VGPU_CLI = ROOT / "scripts" / "vgpu"

NVML_MIG = r'''
import json, os
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
out = {"count": n.nvmlDeviceGetCount(), "mode": list(n.nvmlDeviceGetMigMode(h)),
       "max": n.nvmlDeviceGetMaxMigDeviceCount(h), "devices": []}
for i in range(out["max"]):
    try:
        m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
    except n.NVMLError_NotFound:
        continue
    a = n.nvmlDeviceGetAttributes_v2(m)
    mem = n.nvmlDeviceGetMemoryInfo(m, version=n.nvmlMemory_v2)
    def refused(fn, *args):
        try:
            fn(m, *args)
        except n.NVMLError_NotSupported:
            return True
        return False
    out["devices"].append({
        "index": i, "uuid": n.nvmlDeviceGetUUID(m), "name": n.nvmlDeviceGetName(m),
        "is_mig": n.nvmlDeviceIsMigDeviceHandle(m).value, "gi": n.nvmlDeviceGetGpuInstanceId(m),
        "ci": n.nvmlDeviceGetComputeInstanceId(m), "sms": a.multiprocessorCount, "mem_mib": a.memorySizeMB,
        "total_mib": mem.total >> 20,
        "parent": n.nvmlDeviceGetUUID(n.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)),
        "by_uuid": n.nvmlDeviceGetUUID(n.nvmlDeviceGetHandleByUUID(n.nvmlDeviceGetUUID(m))),
        "util_refused": refused(n.nvmlDeviceGetUtilizationRates),
        "samples_refused": refused(n.nvmlDeviceGetSamples, n.NVML_GPU_UTILIZATION_SAMPLES, 0),
        "power_refused": refused(n.nvmlDeviceGetPowerUsage),
    })
try:
    n.nvmlDeviceGetUtilizationRates(h)
    out["parent_util_refused"] = False
except n.NVMLError_NotSupported:
    out["parent_util_refused"] = True
out["parent_is_mig"] = n.nvmlDeviceIsMigDeviceHandle(h).value
out["parent_power_w"] = n.nvmlDeviceGetPowerUsage(h) / 1000
print(json.dumps(out))
'''


def test_a_gpu_split_three_ways_has_three_mig_devices_with_their_share(vgpu: VgpuFactory) -> None:
    gpu = vgpu(mig=3)
    out = run_py(gpu, NVML_MIG)
    assert out["count"] == 1  # NVML enumerates GPUs; MIG devices only through their GPU
    assert out["mode"] == [1, 1] and out["max"] == 7 and out["parent_is_mig"] == 0
    assert out["parent_util_refused"]  # nvidia-smi's N/A for a GPU in MIG mode
    devices = out["devices"]
    assert [d["index"] for d in devices] == [0, 1, 2]
    assert [d["gi"] for d in devices] == [3, 4, 5] and {d["ci"] for d in devices} == {0}  # H100's 2g placements
    uuid = gpu.uuids()[0]
    for d in devices:
        assert d["uuid"].startswith("MIG-") and d["uuid"] != "MIG-" + uuid[4:]
        assert d["by_uuid"] == d["uuid"] and d["parent"] == uuid and d["is_mig"] == 1
        assert d["sms"] == 132 * 2 // 7 and d["mem_mib"] == d["total_mib"] == 81559 * 2 // 8
        assert d["name"].endswith("MIG 2g.20gb")
        assert d["util_refused"] and d["samples_refused"] and d["power_refused"]
    assert len({d["uuid"] for d in devices}) == 3
    assert [m.uuid for m in gpu.mig_devices()] == [d["uuid"] for d in devices]


def test_without_mig_the_gpu_reports_mig_off_and_no_mig_devices(vgpu: VgpuFactory) -> None:
    out = run_py(vgpu(), r'''
import json, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
try:
    n.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    refused = False
except n.NVMLError_NotSupported:
    refused = True
print(json.dumps({"mode": list(n.nvmlDeviceGetMigMode(h)), "max": n.nvmlDeviceGetMaxMigDeviceCount(h),
                  "refused": refused, "util": n.nvmlDeviceGetUtilizationRates(h).gpu}))
''')
    assert out == {"mode": [0, 0], "max": 0, "refused": True, "util": out["util"]}


MIG_LAUNCH = DRIVER + r'''
import pynvml as n
sms = ok(d.cuDeviceGetAttribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
count = ok(d.cuDeviceGetCount())
total = ok(d.cuDeviceTotalMem(dev))
uuid = bytes(ok(d.cuDeviceGetUuid(dev)).bytes).hex()
ok(launch(int(os.environ.get("BLOCKS", "100")), int(os.environ.get("THREADS", "256"))))
ok(d.cuStreamSynchronize(stream))
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
lists = {}
for i in range(3):
    m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
    lists[n.nvmlDeviceGetUUID(m)] = [(p.pid, p.gpuInstanceId) for p in n.nvmlDeviceGetComputeRunningProcesses(m)]
parent = [(p.pid, p.gpuInstanceId) for p in n.nvmlDeviceGetComputeRunningProcesses(h)]
say(sms=sms, count=count, total_mib=total >> 20, uuid=uuid, pid=os.getpid(), lists=lists, parent=parent,
    used_mib=n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2).used >> 20)
'''


def test_cuda_visible_devices_names_one_mig_device_which_cuda_sees_as_device_0(vgpu: VgpuFactory) -> None:
    gpu = vgpu(mig=3)
    migs = gpu.mig_devices()
    target = migs[1]
    out = run_py(gpu, MIG_LAUNCH, env={"CUDA_VISIBLE_DEVICES": f"{target.uuid},{migs[2].uuid}", "BLOCKS": "100",
                                       "THREADS": "128"})
    # One MIG device per CUDA process (NVIDIA's MIG user guide): the first one listed.
    assert out["count"] == 1 and out["sms"] == target.sms == 37 and out["total_mib"] == int(target.total_mib)
    assert "MIG-" + "-".join([out["uuid"][:8], out["uuid"][8:12], out["uuid"][12:16], out["uuid"][16:20],
                              out["uuid"][20:]]) == target.uuid
    # Its process is on that MIG device only; the GPU's list is the MIG devices' together, with their GI.
    assert out["lists"] == {m.uuid: ([[out["pid"], m.gi]] if m is target else []) for m in migs}
    assert out["parent"] == [[out["pid"], target.gi]]
    assert out["used_mib"] >= 512
    kernels = gpu.kernels()
    assert [(k.device, k.mig, k.grid, k.block) for k in kernels] == [(0, target.gi, 100, 128)]
    assert [c.mig for c in gpu.contexts()] == []  # the process has ended: its context is gone


def test_without_cuda_visible_devices_cuda_sees_the_first_mig_device_and_a_gpu_uuid_names_none(
        vgpu: VgpuFactory) -> None:
    gpu = vgpu(mig=3)
    out = run_py(gpu, MIG_LAUNCH)
    assert out["count"] == 1 and out["sms"] == gpu.mig_devices()[0].sms
    assert gpu.kernels()[0].mig == gpu.mig_devices()[0].gi
    proc = gpu.run([sys.executable, "-c", "from cuda.bindings import driver as d; print(int(d.cuInit(0)[0]))"],
                   env=gpu.env({**os.environ, "CUDA_VISIBLE_DEVICES": gpu.uuids()[0]}))
    assert proc.stdout.strip() == "100"  # CUDA_ERROR_NO_DEVICE: a GPU in MIG mode is no CUDA device


def test_mig_devices_run_side_by_side_each_on_its_own_timeline(vgpu: VgpuFactory) -> None:
    gpu = vgpu(mig=3)
    migs = gpu.mig_devices()
    code = DRIVER + r'''
ok(launch(37 * 8 * 2000))  # 2000 full waves: 0.2 s
ok(d.cuStreamSynchronize(stream))
say(done=True)
'''
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env=gpu.env({**os.environ, "CUDA_VISIBLE_DEVICES": m.uuid})) for m in migs]
    for p in procs:
        p.communicate(timeout=120)
        assert p.returncode == 0
    kernels = sorted(gpu.kernels(), key=lambda k: k.mig or 0)
    assert [k.mig for k in kernels] == [m.gi for m in migs]
    assert all(k.waited == 0 for k in kernels)  # nothing queued behind another instance's kernel
    assert all(abs((k.end - k.start) - (8e-6 + 2000 * 1e-4)) < 1e-5 for k in kernels)


GPM = DRIVER + r'''
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
support = n.nvmlGpmQueryDeviceSupport(h).isSupportedDevice
IDS = [n.NVML_GPM_METRIC_SM_UTIL, n.NVML_GPM_METRIC_SM_OCCUPANCY, n.NVML_GPM_METRIC_GRAPHICS_UTIL,
       n.NVML_GPM_METRIC_DRAM_BW_UTIL]
GI = os.environ.get("GI")

def sample(s):
    if GI is None:
        n.nvmlGpmSampleGet(h, s)
    else:
        n.nvmlGpmMigSampleGet(h, int(GI), s)

def metrics(a, b):
    g = n.c_nvmlGpmMetricsGet_t()
    g.version = n.NVML_GPM_METRICS_GET_VERSION
    g.numMetrics = len(IDS)
    g.sample1, g.sample2 = a, b
    for i, m in enumerate(IDS):
        g.metrics[i].metricId = m
    n.nvmlGpmMetricsGet(g)
    return [(g.metrics[i].nvmlReturn, g.metrics[i].value) for i in range(len(IDS))]

s1, s2 = n.nvmlGpmSampleAlloc(), n.nvmlGpmSampleAlloc()
sample(s1)
# a kernel of BLOCKS blocks of THREADS threads, back to back for about 0.5 s, then idle for about 0.5 s
blocks, threads = int(os.environ["BLOCKS"]), int(os.environ["THREADS"])
t0 = time.monotonic()
while time.monotonic() - t0 < 0.5:
    ok(launch(blocks, threads))
    ok(d.cuStreamSynchronize(stream))
time.sleep(0.5)
sample(s2)
out = metrics(s1, s2)
n.nvmlGpmSampleFree(s1)
n.nvmlGpmSampleFree(s2)
say(support=support, metrics=out)
'''


def _gpm_from_record(gpu: VirtualGpu, sms: int) -> tuple[float, float]:
    """SM-seconds over SMs and busy seconds, from the kernel record, as the virtual GPU's GPM counts them."""
    sm_s = busy_s = 0.0
    for k in gpu.kernels():
        resident = min(32, 2048 // k.block)
        per_wave = resident * sms
        waves = -(-k.grid // per_wave)
        last = k.grid - (waves - 1) * per_wave
        length = k.end - k.start
        full = 0.0 if waves == 1 else (length if last == per_wave else length - 1e-4)
        sm_s += full + (length - full) * min(last, sms) / sms
        busy_s += length
    return sm_s, busy_s


@pytest.mark.parametrize("blocks,threads", [(132 * 8 * 50, 256), (13, 256), (132 * 8 + 5, 256)])
def test_gpm_sm_util_follows_the_kernels_shape_wave_by_wave(vgpu: VgpuFactory, blocks: int, threads: int) -> None:
    gpu = vgpu()
    out = run_py(gpu, GPM, env={"BLOCKS": str(blocks), "THREADS": str(threads)})
    assert out["support"] == 1
    (sm_rc, sm), (occ_rc, occ), (gr_rc, gr), (other_rc, _) = out["metrics"]
    assert (sm_rc, occ_rc, gr_rc) == (0, 0, 0) and other_rc == 3  # NVML_ERROR_NOT_SUPPORTED for the rest
    sm_s, busy_s = _gpm_from_record(gpu, 132)
    # The window is the two samples' (about 1 s, which the test cannot know to the microsecond): the ratio
    # SM_UTIL / GRAPHICS_UTIL is the kernels' own, whatever the window.
    assert gr > 5 and sm / gr == pytest.approx(sm_s / busy_s, rel=1e-3)
    if blocks == 13:
        assert sm / gr == pytest.approx(13 / 132, rel=1e-3)  # 13 blocks: 13 SMs of 132 busy
        assert occ / gr == pytest.approx(13 * 8 / (132 * 64), rel=1e-3)  # 8 warps a block of 64 a SM
    if blocks == 132 * 8 * 50:
        assert sm / gr == pytest.approx(1.0, rel=1e-6) and occ / gr == pytest.approx(1.0, rel=1e-3)


def test_gpm_per_gpu_instance_counts_that_instance_and_the_gpu_weighs_them_by_sms(vgpu: VgpuFactory) -> None:
    gpu = vgpu(mig=3)
    target = gpu.mig_devices()[2]
    env = {"CUDA_VISIBLE_DEVICES": target.uuid, "BLOCKS": str(37 * 8 * 50), "THREADS": "256"}
    own = run_py(gpu, GPM, env={**env, "GI": str(target.gi)})
    (_, sm), _, (_, gr), _ = own["metrics"]
    assert sm == pytest.approx(gr, rel=1e-6) and 20 < gr < 80  # full waves: every SM of the instance active
    other = run_py(gpu, GPM, env={**env, "GI": str(gpu.mig_devices()[0].gi), "BLOCKS": "1"})
    assert other["metrics"][0][1] == 0.0  # the other instance saw none of it (its own run's kernel went to GI 5)
    whole = run_py(gpu, GPM, env=env)
    (_, sm_gpu), _, _, _ = whole["metrics"]
    (_, sm_inst), _, _, _ = run_py(gpu, GPM, env={**env, "GI": str(target.gi)})["metrics"]
    assert sm_gpu == pytest.approx(sm_inst * 37 / 132, rel=0.15)  # one instance of 37 SMs busy of 132


def test_no_gpm_before_hopper(vgpu: VgpuFactory) -> None:
    gpu = vgpu(cc="8.0", mig=3)
    out = run_py(gpu, r'''
import json, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
s = n.nvmlGpmSampleAlloc()
try:
    n.nvmlGpmSampleGet(h, s)
    refused = False
except n.NVMLError_NotSupported:
    refused = True
print(json.dumps({"support": n.nvmlGpmQueryDeviceSupport(h).isSupportedDevice, "refused": refused,
                  "cc": list(n.nvmlDeviceGetCudaComputeCapability(h))}))
''')
    assert out == {"support": 0, "refused": True, "cc": [8, 0]}


def test_bad_mig_options_are_one_line_errors(vgpu: VgpuFactory, tmp_path: Path) -> None:
    with pytest.raises(VgpuError, match=r"mig=8: expected 0 \(MIG off\) to 7"):
        vgpu(mig=8)
    with pytest.raises(VgpuError, match="at most 16 in all"):
        vgpu(gpus=3, mig=7)
    with pytest.raises(VgpuError, match="MIG needs compute capability 8.0"):
        vgpu(mig=2, cc="7.0")
    proc = subprocess.run([sys.executable, str(VGPU_CLI), "run", "--mig", "9", "--", "true"], capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "mig=9" in proc.stderr


# --- the filler on one MIG device ----------------------------------------------------------------------------

def test_show_cuda_the_mig_device_names_it_only_where_the_operator_named_nothing() -> None:
    from forge_load.gpu.backend import show_cuda_the_mig_device

    env: dict[str, str] = {}
    show_cuda_the_mig_device("MIG-abc", env)
    assert env == {"CUDA_VISIBLE_DEVICES": "MIG-abc"}
    env = {"CUDA_VISIBLE_DEVICES": "MIG-other"}
    show_cuda_the_mig_device("MIG-abc", env)
    assert env == {"CUDA_VISIBLE_DEVICES": "MIG-other"}
    env = {}
    show_cuda_the_mig_device("GPU-abc", env)
    assert env == {}


def _fill_one(gpu: VirtualGpu, tmp_path: Path, mig_uuid: str, duration_s: int) -> subprocess.CompletedProcess[str]:
    """`forge-load --gpu MIG-…` (JSON lines) for `duration_s`, CUDA_VISIBLE_DEVICES left to the filler to set."""
    env = gpu.env({**os.environ, "TMPDIR": str(tmp_path)})
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run([str(ROOT / ".venv" / "bin" / "forge-load"), "--gpu", mig_uuid, "--duration",
                           str(duration_s), "--log-format", "json", "--hold-dir", str(tmp_path / "holds")],
                          env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_the_filler_holds_a_mig_device_at_its_target_by_the_kernel_record(vgpu: VgpuFactory, tmp_path: Path) -> None:
    gpu = vgpu(mig=3)
    target = gpu.mig_devices()[1]
    proc = _fill_one(gpu, tmp_path, target.uuid, 10)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    import json
    start = json.loads(proc.stdout.splitlines()[0])
    assert start["event"] == "start" and start["uuid"] == target.uuid and start["gpu"] == 0  # its GPU's index
    assert start["sm_count"] == target.sms
    kernels = gpu.kernels()
    assert {k.mig for k in kernels} == {target.gi}  # nothing ran on the other MIG devices
    begin, end = kernels[0].start + 1.0, kernels[-1].end  # after the first second
    busy = sum(max(0.0, min(k.end, end) - max(k.start, begin)) for k in kernels)
    assert abs(busy / (end - begin) - 0.5) <= 0.03


def test_a_mig_devices_filler_names_its_gpu_instance_profile_and_gpu_as_dcgm_exporter_does(
        vgpu: VgpuFactory, tmp_path: Path) -> None:
    import json

    gpu = vgpu(mig=3)
    target = gpu.mig_devices()[2]
    proc = _fill_one(gpu, tmp_path, target.uuid, 1)
    assert proc.returncode == 0, proc.stderr[-2000:]
    start = json.loads(proc.stdout.splitlines()[0])
    assert (start["gpu_instance"], start["mig_profile"], start["gpu_uuid"]) == (target.gi, "2g.20gb",
                                                                                  gpu.uuids()[0])


def test_three_mig_devices_fillers_hold_their_gpus_board_under_one_power_cap(vgpu: VgpuFactory,
                                                                            tmp_path: Path) -> None:
    # The board's power, read from the GPU's handle by each MIG device's filler: each one keeps the board under
    # the cap from the same readings, the others' draw in its line's intercept (docs/operating.md, Cap it).
    gpu = vgpu(mig=3)
    migs = gpu.mig_devices()
    cap_w, seconds = 200.0, 14
    procs = []
    for m in migs:
        env = gpu.env({**os.environ, "TMPDIR": str(tmp_path / m.uuid), "CUDA_VISIBLE_DEVICES": m.uuid})
        (tmp_path / m.uuid).mkdir()
        procs.append(subprocess.Popen([str(ROOT / ".venv" / "bin" / "forge-load"), "--gpu", m.uuid, "--duration",
                                       str(seconds), "--max-power-w", str(cap_w), "--shape", "burn", "--hold-dir",
                                       str(tmp_path / "holds")], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=ROOT))
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    kernels = gpu.kernels()
    begin = min(k.start for k in kernels) + 6.0  # after the caps' lines have learnt the slope
    end = max(k.end for k in kernels)
    weighted = sum(max(0.0, min(k.end, end) - max(k.start, begin)) for k in kernels) * 37 / 132 / (end - begin)
    board_w = 70.0 + 630.0 * weighted  # the virtual GPU's power model (burn kernels), from the kernel record
    assert board_w <= cap_w * 1.02  # under the cap, less the cap's 5 % margin, within noise
    assert board_w >= 70.0 + 630.0 * 0.05  # and still filling: not every filler gave up
