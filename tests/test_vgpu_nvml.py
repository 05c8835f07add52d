"""The virtual GPU's NVML (vgpu/src/nvml.c) under the real pynvml, beside the real driver API: utilization samples
and their history, memory and process lists (hidden, per PID namespace), power, energy and versions, a GPU lost
at a time or after N calls, the calls counted and made dear, bursts timed exactly, NOT_SUPPORTED injected, an old
driver's fallbacks. The helpers and the driver-side tests are tests/test_vgpu.py's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_vgpu import (
    DRIVER,
    HOLD,
    MIB,
    NVML,
    OVERHEAD_S,
    PER_WAVE,
    ROOT,
    VGPU_CLI,
    finish,
    ready,
    run_py,
    start_py,
)
from vgpu.pytest_plugin import VgpuFactory

# --- NVML -----------------------------------------------------------------------------------------------------

SAMPLES = DRIVER + NVML + r'''
_, first = n.nvmlDeviceGetSamples(h, UTIL, 0)
busy(0.5)
time.sleep(0.4)
_, new = n.nvmlDeviceGetSamples(h, UTIL, first[-1].timeStamp)
try:
    n.nvmlDeviceGetSamples(h, UTIL, new[-1].timeStamp)
    not_found = False
except n.NVMLError_NotFound:
    not_found = True
say(first=[(s.timeStamp, s.sampleValue.uiVal) for s in first], new=[(s.timeStamp, s.sampleValue.uiVal) for s in new],
    not_found=not_found, unix=time.time(), mono=time.monotonic(), rates=n.nvmlDeviceGetUtilizationRates(h).gpu)
'''

HISTORY = DRIVER.split("ok(d.cuInit(0))")[0] + NVML + r'''
_, samples = n.nvmlDeviceGetSamples(h, UTIL, 0)
print(json.dumps({"samples": [(s.timeStamp, s.sampleValue.uiVal) for s in samples]}))
'''


@pytest.mark.parametrize("timestamps", ["unix", "boot"])
def test_nvml_samples_strictly_after_last_seen_with_history(vgpu: VgpuFactory, timestamps: str) -> None:
    window_s = 1 / 6
    gpu = vgpu(timestamps=timestamps, window_s=window_s)
    r = run_py(gpu, SAMPLES)
    first, new = r["first"], r["new"]
    clock = r["unix"] if timestamps == "unix" else r["mono"]
    # ~15 s of windows before anything ran, all idle
    assert 88 <= len(first) <= 91 and all(v == 0 for _, v in first)
    assert (first[-1][0] - first[0][0]) / 1e6 == pytest.approx(15.0 - window_s, abs=window_s)
    assert first[-1][0] / 1e6 <= clock and clock - first[-1][0] / 1e6 < 2.0  # the stamp base asked for
    stamps = [t for t, _ in first + new]
    assert stamps == sorted(set(stamps))  # strictly increasing, none returned twice
    assert new and all(t > first[-1][0] for t, _ in new)
    assert r["not_found"]  # nothing newer than the newest: NOT_FOUND, as NVML answers
    busy_s = sum(v for _, v in new) / 100 * window_s  # the 0.5-s kernel, spread over whole-percent windows
    assert busy_s == pytest.approx(0.5 + OVERHEAD_S, abs=0.02)
    assert max(v for _, v in new) == 100
    # A later process finds the earlier one's kernels in its first read of the buffer.
    later = run_py(gpu, HISTORY)["samples"]
    assert sum(v for t, v in later if t > first[-1][0]) / 100 * window_s == pytest.approx(0.5, abs=0.02)


def test_nvml_memory_and_process_lists(vgpu: VgpuFactory) -> None:
    gpu = vgpu()
    holder = start_py(gpu, HOLD.replace('os.environ.get("ALLOC_MIB", "0")', '"100"'))
    try:
        pid = ready(holder)["pid"]
        r = run_py(gpu, NVML.replace("import pynvml", "import json, os\nimport pynvml") + r'''
m1 = n.nvmlDeviceGetMemoryInfo(h)
m2 = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
bad = n.c_nvmlMemory_v2_t(); bad.version = 1
ret = n._nvmlGetFunctionPointer("nvmlDeviceGetMemoryInfo_v2")(h, n.byref(bad))
print(json.dumps({"v1_used": m1.used, "v1_free": m1.free, "total": m1.total, "v2_used": m2.used,
                  "v2_reserved": m2.reserved, "v2_free": m2.free, "bad_version_ret": ret,
                  "v3": [(p.pid, p.usedGpuMemory) for p in n.nvmlDeviceGetComputeRunningProcesses_v3(h)],
                  "v2": [(p.pid, p.usedGpuMemory) for p in n.nvmlDeviceGetComputeRunningProcesses_v2(h)],
                  "graphics": n.nvmlDeviceGetGraphicsRunningProcesses(h)}))
''')
    finally:
        finish(holder)
    ours = (512 + 100) * MIB
    assert r["v2_used"] == ours and r["v2_reserved"] == 541 * MIB
    assert r["v1_used"] == ours + 541 * MIB and r["v1_free"] == r["total"] - r["v1_used"]
    assert r["v2_free"] == r["total"] - 541 * MIB - ours
    assert r["bad_version_ret"] == 25  # NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    assert r["v3"] == [[pid, ours]] and r["v2"] == [[pid, ours]] and r["graphics"] == []
    assert gpu.memory_used_mib() == 0.0  # the holder exited: its context is released


LIST = NVML.replace("import pynvml", "import json, os\nimport pynvml") + r'''
print(json.dumps({"pid": os.getpid(), "procs": [p.pid for p in n.nvmlDeviceGetComputeRunningProcesses(h)],
                  "used": n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2).used}))
'''

SELF_LIST = DRIVER + r'''
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
say(pid=os.getpid(), procs=[p.pid for p in n.nvmlDeviceGetComputeRunningProcesses(h)])
'''


def test_hide_processes_lists_only_the_caller(vgpu: VgpuFactory) -> None:
    gpu = vgpu(hide_processes=True)
    holder = start_py(gpu, HOLD)
    try:
        ready(holder)
        other = run_py(gpu, LIST)
        me = run_py(gpu, SELF_LIST)
    finally:
        finish(holder)
    assert other["procs"] == [] and other["used"] == 512 * MIB  # hidden, but its memory shows
    assert me["procs"] == [me["pid"]]


def _unshare() -> list[str] | None:
    tool = shutil.which("unshare")
    if tool is None:
        return None
    probe = subprocess.run([tool, "--pid", "--fork", "--mount-proc", "true"], capture_output=True, check=False)
    return [tool, "--pid", "--fork", "--mount-proc"] if probe.returncode == 0 else None


def test_process_lists_stop_at_the_pid_namespace(vgpu: VgpuFactory) -> None:
    """As drivers >= 535.113 do: a process in another PID namespace is not listed (its memory still counts)."""
    unshare = _unshare()
    if unshare is None:
        pytest.skip("unshare --pid is not available here (needs root or user namespaces)")
    gpu = vgpu()
    holder = start_py(gpu, HOLD, prefix=unshare)
    try:
        inside = ready(holder)
        outside = run_py(gpu, LIST)
        also_inside = run_py(gpu, LIST, prefix=unshare)
    finally:
        finish(holder)
    assert inside["pid"] == 1  # it is PID 1 of its own namespace
    assert outside["procs"] == [] and outside["used"] == 512 * MIB
    assert also_inside["procs"] == []  # a different new namespace again
    contexts = gpu.contexts()
    assert contexts == []  # all three exited


POWER = DRIVER + NVML + r'''
time.sleep(1.05)  # our context open for a whole second: NVML's 1-s mean is the idle with a context
e0, t0 = n.nvmlDeviceGetTotalEnergyConsumption(h), time.monotonic()
idle_w = n.nvmlDeviceGetPowerUsage(h) / 1e3
busy(0.6)
busy_w = n.nvmlDeviceGetPowerUsage(h) / 1e3
e1, t1 = n.nvmlDeviceGetTotalEnergyConsumption(h), time.monotonic()
say(idle_w=idle_w, busy_w=busy_w, joules=(e1 - e0) / 1e3, seconds=t1 - t0,
    limit_w=n.nvmlDeviceGetPowerManagementLimit(h) / 1e3, temp=n.nvmlDeviceGetTemperature(h, 0),
    driver=n.nvmlSystemGetDriverVersion(), cuda=n.nvmlSystemGetCudaDriverVersion())
'''


def test_power_energy_temperature_and_versions(vgpu: VgpuFactory) -> None:
    gpu = vgpu()
    r = run_py(gpu, POWER)
    assert r["idle_w"] == 70.0 and r["limit_w"] == 700.0
    # 0.6 s of full waves (arithmetic: the board's limit) in the last second
    assert r["busy_w"] == pytest.approx(70 + 630 * 0.6, abs=630 * 0.03)
    # energy: idle power (with our context) all along plus (max - idle) while the kernel ran
    assert r["joules"] == pytest.approx(70 * r["seconds"] + 630 * 0.6, rel=0.03)
    assert 30 < r["temp"] < 70
    assert r["driver"].endswith("-virtual") and r["cuda"] == 12090


LOST = DRIVER + NVML + r'''
ok(launch(PER_WAVE))
ok(d.cuStreamSynchronize(stream))
time.sleep(max(float(os.environ["LOST_AT"]) - time.time(), 0.0))
launched = int(launch(PER_WAVE))
try:
    n.nvmlDeviceGetName(h); nvml = "ok"
except n.NVMLError_GpuIsLost:
    nvml = "lost"
other = n.nvmlDeviceGetName(n.nvmlDeviceGetHandleByIndex(1))
say(launched=launched, nvml=nvml, other=other)
'''.replace("PER_WAVE", str(PER_WAVE))


def test_a_lost_gpu_fails_nvml_and_cuda_from_its_time_on(vgpu: VgpuFactory) -> None:
    gpu = vgpu(gpus=2, fail_gpu=[(0, 4.0)])
    r = run_py(gpu, LOST, env={"LOST_AT": str(gpu.show()["created"] + 4.2)})
    assert r["launched"] == 719  # CUDA_ERROR_LAUNCH_FAILED, sticky in the lost device's context
    assert r["nvml"] == "lost" and r["other"] == "Virtual GPU (H100-like)"
    assert gpu.show()["devices"][0]["lost"] and not gpu.show()["devices"][1]["lost"]


def test_a_gpu_lost_after_n_nvml_calls(vgpu: VgpuFactory) -> None:
    gpu = vgpu(fail_gpu_after_calls=[(0, 3)])
    r = run_py(gpu, NVML.replace("import pynvml", "import json, os\nimport pynvml") + r'''
answers = []
for _ in range(5):
    try:
        n.nvmlDeviceGetName(h); answers.append("ok")
    except n.NVMLError_GpuIsLost:
        answers.append("lost")
print(json.dumps({"answers": answers}))
''')
    assert r["answers"] == ["ok", "ok", "lost", "lost", "lost"]  # the handle lookup was the first call


COUNT_CALLS = NVML.replace("import pynvml", "import json, os, sys, time\nimport pynvml") + r'''
def cpu_s(f):
    t = time.thread_time(); f(); return time.thread_time() - t
mem = [cpu_s(lambda: n.nvmlDeviceGetMemoryInfo(h)) for _ in range(5)]
procs = [cpu_s(lambda: n.nvmlDeviceGetComputeRunningProcesses(h)) for _ in range(3)]
print(json.dumps({"pid": os.getpid(), "mem_cpu_s": mem, "procs_cpu_s": procs}), flush=True)
sys.stdin.readline()
'''


def test_nvml_calls_are_counted_per_process_and_function_and_cost_cpu(vgpu: VgpuFactory) -> None:
    """Each C call is counted (pynvml's process list is a count call, then a fill call when there is one) and
    a configured cost is CPU burnt in the caller, not a sleep; the counts are there while the process runs."""
    gpu = vgpu(nvml_cost={"nvmlDeviceGetComputeRunningProcesses_v3": 20.0})
    proc = start_py(gpu, COUNT_CALLS)
    r = ready(proc)
    rows = [p for p in gpu.nvml_calls()["processes"] if p["pid"] == r["pid"]]
    finish(proc)
    assert len(rows) == 1, rows
    calls = rows[0]["calls"]
    assert calls["nvmlDeviceGetMemoryInfo"] == 5 and calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 3
    assert calls["nvmlDeviceGetHandleByIndex_v2"] == 1 and calls["nvmlInitWithFlags"] == 1
    assert gpu.nvml_calls()["cost_ms"] == {"nvmlDeviceGetComputeRunningProcesses_v3": 20.0}
    assert all(t >= 0.020 for t in r["procs_cpu_s"]), r  # no process: one C call each, 20 ms of CPU
    assert all(t < 0.010 for t in r["mem_cpu_s"]), r  # what costs nothing stays cheap


def test_cli_keeps_the_nvml_calls_file_current_while_the_command_runs(tmp_path: Path, vgpu: VgpuFactory) -> None:
    calls = tmp_path / "calls.json"
    code = COUNT_CALLS.replace("sys.stdin.readline()", "time.sleep(1.5)")
    code = code.replace("print(json.dumps({", f"open({str(tmp_path / 'said')!r}, 'w').write(json.dumps({{")
    code = code.replace(", flush=True)\ntime.sleep", ")\ntime.sleep")
    proc = subprocess.Popen([sys.executable, str(VGPU_CLI), "run", "--nvml-calls", str(calls), "--nvml-cost",
                             "nvmlDeviceGetComputeRunningProcesses_v3=1,nvmlDeviceGetMemoryInfo=0", "--",
                             sys.executable, "-c", code], cwd=ROOT, text=True, stderr=subprocess.PIPE)
    during = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if (tmp_path / "said").exists() and calls.exists():
            data = json.loads(calls.read_text())
            if data["processes"] and data["processes"][0]["calls"].get("nvmlDeviceGetComputeRunningProcesses_v3"):
                during = data
                break
        time.sleep(0.1)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert during is not None, "the file was not current while the command ran"
    final = json.loads(calls.read_text())
    pid = json.loads((tmp_path / "said").read_text())["pid"]
    (row,) = [p for p in final["processes"] if p["pid"] == pid]
    assert row["calls"]["nvmlDeviceGetMemoryInfo"] == 5
    assert row["calls"]["nvmlDeviceGetComputeRunningProcesses_v3"] == 3
    assert final["cost_ms"] == {"nvmlDeviceGetComputeRunningProcesses_v3": 1.0}


BURST = r'''
import json, os, time
import pynvml
from forge_load.gpu.launcher import CudaLauncher
pynvml.nvmlInit()
uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
launcher = CudaLauncher(uuid if isinstance(uuid, str) else uuid.decode(), shape=os.environ["SHAPE"])
done = []
launcher.launch(int(os.environ["SIZE"]), time.monotonic(), count=7)
while not done:
    time.sleep(0.005)
    done += launcher.poll(time.monotonic())
launcher.close()
(k,) = done
print(json.dumps({"pid": os.getpid(), "count": k.count, "kernel_s": k.kernel_s, "busy_s": k.end_s - k.start_s}))
'''


@pytest.mark.parametrize(("shape", "size"), [("burn", 16), ("lean", 100)])  # two waves; 100 sleep quanta
def test_a_burst_is_two_driver_launches_and_still_timed_exactly(vgpu: VgpuFactory, shape: str, size: int) -> None:
    """A burst of seven kernels' work is queued as the first kernel and one kernel of the other six's work (burn:
    their blocks; lean: their quanta): two cuLaunchKernel calls, not seven; the events still time one kernel of the
    burst's size exactly."""
    gpu = vgpu(sleep_jitter=0.0)
    r = run_py(gpu, BURST, env={"SHAPE": shape, "SIZE": str(size)})
    mine = [k for k in gpu.kernels() if k.pid == r["pid"]]  # open launches nothing: only the burst's
    assert len(mine) == 2
    if shape == "lean":
        assert [(k.kind, k.quanta, k.grid, k.block) for k in mine] == [("lean", size, 1, 32), ("lean", 6 * size, 1, 32)]
    else:
        assert {k.kind for k in mine} == {"other"} and [k.grid for k in mine] == [16 * 132, 6 * 16 * 132]
    first_s, rest_s = (k.end - k.start for k in mine)
    assert rest_s == pytest.approx(6 * first_s, rel=0.05)  # one launch overhead instead of six
    assert r["count"] == 7 and r["kernel_s"] == pytest.approx(first_s, rel=0.05)


def test_not_supported_injection_and_forge_load_reads_it_as_unavailable(vgpu: VgpuFactory) -> None:
    gpu = vgpu(not_supported=["nvmlDeviceGetSamples", "nvmlDeviceGetPowerUsage"])
    r = run_py(gpu, r'''
import json
import pynvml as n
from forge_load.gpu.nvml import NvmlProbe
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
try:
    n.nvmlDeviceGetSamples(h, n.NVML_GPU_UTILIZATION_SAMPLES, 0); raised = False
except n.NVMLError_NotSupported:
    raised = True
with NvmlProbe("0") as probe:
    print(json.dumps({"raised": raised, "samples": probe.utilization_samples(0.0), "power": probe.power_w(),
                      "ratio": probe.utilization_ratio()}))
''')
    assert r == {"raised": True, "samples": None, "power": None, "ratio": 0.0}


OLD_DRIVER = DRIVER + r'''
import pynvml as n
from forge_load.gpu.nvml import NvmlProbe
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
try:
    n.nvmlDeviceGetComputeRunningProcesses_v3(h); v3 = "present"
except n.NVMLError_FunctionNotFound:
    v3 = "missing"
with NvmlProbe("0") as probe:
    say(v3=v3, pid=os.getpid(), procs=[(p.pid, p.used_mib) for p in probe.processes()],
        used_mib=probe.memory_used_mib(), driver=probe.info.driver_version)
'''


def test_old_driver_falls_back_to_v2_processes_and_v1_memory(vgpu: VgpuFactory) -> None:
    gpu = vgpu(old_driver=True)
    r = run_py(gpu, OLD_DRIVER)
    assert r["v3"] == "missing" and r["driver"].startswith("515.")
    assert r["procs"] == [[r["pid"], 512.0]]  # through nvmlDeviceGetComputeRunningProcesses_v2
    assert r["used_mib"] == 541 + 512  # v1: the reserved memory counts as used


# --- the whole API, and what a DRA driver's device names need ---------------------------------------------------

def api() -> tuple[dict[str, str], set[str]]:
    """Every function nvml.h declares (name: parameters), and those vgpu/src/nvml.c models."""
    from vgpu.build import SRC, headers
    from vgpu.gen_nvml_stubs import declarations, defined

    return declarations(headers()["nvml.h"].read_text()), defined((SRC / "nvml.c").read_text())


EVERY_FUNCTION = r'''
import ctypes, json, os, sys
lib = ctypes.CDLL("libnvidia-ml.so.1")
names = json.loads(sys.argv[1])
missing = [name for name in names if not hasattr(lib, name)]
stubs = json.loads(sys.argv[2])
before = getattr(lib, stubs[0])()  # a stub, before nvmlInit: as NVIDIA's library, UNINITIALIZED
assert lib.nvmlInit_v2() == 0
answers = {name: getattr(lib, name)() for name in stubs}  # a stub reads none of its arguments
print(json.dumps({"missing": missing, "before": before, "answers": sorted(set(answers.values()))}))
'''


def test_every_function_nvml_h_declares_is_exported_and_the_unmodelled_answer_not_supported(
        vgpu: VgpuFactory) -> None:
    import pynvml

    declared, modelled = api()
    assert len(declared) > 400 and modelled <= set(declared)
    stubs = sorted(set(declared) - modelled)
    gpu = vgpu()
    proc = gpu.run([sys.executable, "-c", EVERY_FUNCTION, json.dumps(sorted(declared)), json.dumps(stubs)],
                   timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["missing"] == []
    assert r["before"] == pynvml.NVML_ERROR_UNINITIALIZED
    assert r["answers"] == [pynvml.NVML_ERROR_NOT_SUPPORTED]
    assert gpu.nvml_unmodelled() == stubs  # each named, once
    assert proc.stderr == ""  # NOT_SUPPORTED is an answer, not a fault: nothing said


CLIENT_CALLS = NVML + r'''
import json
out = {}
for name in ("nvmlDeviceGetEncoderUtilization", "nvmlDeviceGetDecoderUtilization", "nvmlDeviceGetFanSpeed",
             "nvmlDeviceGetPerformanceState", "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetDisplayActive"):
    args = (h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC) if "Ecc" in name else (h,)
    try:
        getattr(n, name)(*args); out[name] = "answered"
    except n.NVMLError as error:
        out[name] = type(error).__name__
t = n.nvmlDeviceGetTemperatureV(h, n.NVML_TEMPERATURE_GPU)
out["temperature"] = [t, n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)]
print(json.dumps(out))
'''


def test_the_queries_gpustat_and_nvitop_make_answer_as_a_driver_does(vgpu: VgpuFactory) -> None:
    r = run_py(vgpu(), "import os\n" + CLIENT_CALLS)
    temperature = r.pop("temperature")
    assert r == dict.fromkeys(r, "NVMLError_NotSupported") and len(r) == 6  # not FunctionNotFound
    assert temperature[0] == temperature[1] == 30  # idle


GPU_INSTANCES = r'''
import json
import pynvml as n
n.nvmlInit()
out = []
for i in range(n.nvmlDeviceGetCount()):
    gpu = n.nvmlDeviceGetHandleByIndex(i)
    migs = []
    for slot in range(n.nvmlDeviceGetMaxMigDeviceCount(gpu)):
        try:
            mig = n.nvmlDeviceGetMigDeviceHandleByIndex(gpu, slot)
        except n.NVMLError_NotFound:
            continue
        try:
            n.nvmlDeviceGetMinorNumber(mig); mig_minor = "answered"
        except n.NVMLError_NotSupported:
            mig_minor = "NotSupported"
        gi = n.nvmlDeviceGetGpuInstanceId(mig)
        info = n.nvmlGpuInstanceGetInfo(n.nvmlDeviceGetGpuInstanceById(gpu, gi))
        migs.append({"uuid": n.nvmlDeviceGetUUID(mig), "gi": info.id, "profile_id": info.profileId,
                     "placement": [info.placement.start, info.placement.size], "minor": mig_minor,
                     "parent": n.nvmlDeviceGetUUID(info.device)})
    try:
        n.nvmlDeviceGetGpuInstanceById(gpu, 99); absent = "found"
    except n.NVMLError as error:
        absent = type(error).__name__
    out.append({"uuid": n.nvmlDeviceGetUUID(gpu), "minor": n.nvmlDeviceGetMinorNumber(gpu), "migs": migs,
                "absent": absent})
print(json.dumps(out))
'''


@pytest.mark.parametrize("mig", [0, 3])
def test_minor_numbers_and_gpu_instances_answer_as_configured(vgpu: VgpuFactory, mig: int) -> None:
    gpu = vgpu(gpus=2, mig=mig, minors=[5, 2])
    r = json.loads(gpu.run([sys.executable, "-c", GPU_INSTANCES], timeout=120).stdout)
    assert [(g["uuid"], g["minor"]) for g in r] == list(zip(gpu.uuids(), [5, 2], strict=True)) == \
        list(zip(gpu.uuids(), gpu.minors(), strict=True))
    if not mig:
        assert [g["migs"] for g in r] == [[], []] and {g["absent"] for g in r} == {"NVMLError_NotSupported"}
        return
    # three 2g.20gb GPU instances per GPU: H100 80GB's profile 14, placed at memory slices 0, 2 and 4
    assert [[(m["gi"], m["profile_id"], m["placement"]) for m in g["migs"]] for g in r] == \
        [[(3, 14, [0, 2]), (4, 14, [2, 2]), (5, 14, [4, 2])]] * 2
    assert all(m["parent"] == g["uuid"] and m["minor"] == "NotSupported" for g in r for m in g["migs"])
    assert [(m.uuid, m.profile_id, m.placement) for m in gpu.mig_devices()] == \
        [(m["uuid"], m["profile_id"], tuple(m["placement"])) for g in r for m in g["migs"]]
    assert {g["absent"] for g in r} == {"NVMLError_NotFound"}


def test_minors_by_default_are_the_indices_and_bad_ones_are_refused(vgpu: VgpuFactory, tmp_path: Path) -> None:
    from vgpu import VgpuError, VirtualGpu

    assert vgpu(gpus=3).minors() == [0, 1, 2]
    for minors in ([5], [5, 5], [1, 255], [-1, 0]):
        with pytest.raises(VgpuError, match="minors="):
            VirtualGpu(tmp_path / "bad", gpus=2, minors=minors, lib_dir=vgpu.lib_dir)
    proc = subprocess.run([sys.executable, str(VGPU_CLI), "run", "--gpus", "2", "--minors", "5,x", "--", "true"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("vgpu: --minors '5,x': expected 2 minor numbers")
