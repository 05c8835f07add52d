"""The virtual GPU (vgpu/): the real numba-cuda, cuda-bindings and pynvml on the driver-free stand-ins.

Everything on the virtual GPU runs in subprocesses (one libnvidia-ml per process; pytest itself never loads the
stand-ins). The `vgpu` fixture (vgpu/pytest_plugin.py) makes a fresh GPU per call and fails the test if any
entry point that is not implemented was called.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from vgpu import Kernel, VgpuError, VirtualGpu
from vgpu.pytest_plugin import VgpuFactory

ROOT = Path(__file__).resolve().parent.parent
VGPU_CLI = ROOT / "scripts" / "vgpu"
MIB = 1 << 20
WAVE_S, OVERHEAD_S, LATENCY_S = 1e-4, 8e-6, 5e-6  # the defaults, as forge_load/gpu/sim.py's
PER_WAVE = 132 * 8  # 256-thread blocks resident on the whole device at once
STAMP_S = 2e-6  # the kernel record's times are printed to the microsecond

# A minimal driver-API program: a context, a stream and a kernel handle, without numba's compile (fast).
DRIVER = r'''
import json, os, sys, time
from cuda.bindings import driver as d

def ok(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise SystemExit(f"driver error {err!r}")
    return rest[0] if len(rest) == 1 else rest

ok(d.cuInit(0))
dev = ok(d.cuDeviceGet(int(os.environ.get("DEV", "0"))))
ctx = ok(d.cuDevicePrimaryCtxRetain(dev))
ok(d.cuCtxSetCurrent(ctx))
# A PTX image as the driver checks it (its .version and .target); the virtual GPU runs any entry it names.
lib = ok(d.cuLibraryLoadData(b".version 8.0\n.target sm_70\n// .entry busy\n\0", None, None, 0, None, None, 0))
fn = ok(d.cuKernelGetFunction(ok(d.cuLibraryGetKernel(lib, b"busy"))))
stream = ok(d.cuStreamCreate(0))

def launch(blocks, threads=256):
    return d.cuLaunchKernel(fn, blocks, 1, 1, threads, 1, 1, 0, stream, 0, 0)[0]

def busy(seconds):
    """One kernel of about `seconds` (waves of 0.1 ms); returns when it has ended."""
    ok(launch(PER_WAVE * round(seconds / 1e-4)))
    ok(d.cuStreamSynchronize(stream))

def say(**fields):
    print(json.dumps(fields), flush=True)
'''.replace("PER_WAVE", str(PER_WAVE))

NVML = r'''
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(int(os.environ.get("NVML_INDEX", "0")))
UTIL = n.NVML_GPU_UTILIZATION_SAMPLES
'''


def run_py(gpu: VirtualGpu, code: str, env: dict[str, str] | None = None, timeout: float = 120,
           prefix: list[str] | None = None) -> dict[str, Any]:
    """Run `code` on the GPU in a subprocess; its last stdout line is JSON."""
    proc = gpu.run([*(prefix or []), sys.executable, "-c", code], env=gpu.env({**os.environ, **(env or {})}),
                   cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def start_py(gpu: VirtualGpu, code: str, prefix: list[str] | None = None) -> subprocess.Popen[str]:
    """Start `code` on the GPU; it is expected to print one JSON line when ready and then wait on stdin."""
    return subprocess.Popen([*(prefix or []), sys.executable, "-c", code], env=gpu.env(), cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def ready(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"exited {proc.wait()} before it was ready: {proc.stderr.read() if proc.stderr else ''}"
    return dict(json.loads(line))


def finish(proc: subprocess.Popen[str]) -> None:
    out, err = proc.communicate("go\n", timeout=60)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err[-4000:]}"


HOLD = DRIVER + r'''
mib = int(os.environ.get("ALLOC_MIB", "0"))
if mib:
    ok(d.cuMemAlloc(mib << 20))
say(pid=os.getpid())
sys.stdin.readline()
'''


# --- the build ------------------------------------------------------------------------------------------------

def test_libraries_build_against_nvidia_headers_and_export_what_the_stack_loads(vgpu: VgpuFactory) -> None:
    """-Wall -Wextra -Werror against cuda.h, cudaTypedefs.h and nvml.h (the build is the check); the symbols the
    loaders look up by name are there; the old driver lacks exactly the _v3 process queries and memory v2."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")

    def symbols(path: Path) -> set[str]:
        out = subprocess.run([nm, "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True)
        return {line.split()[-1] for line in out.stdout.splitlines()}

    cuda = symbols(vgpu.lib_dir / "libcuda.so.1")
    assert {"cuGetProcAddress_v2", "cuInit", "cuGetExportTable", "cuDriverGetVersion"} <= cuda
    assert all(name.startswith("cu") for name in cuda), "the state's helpers must stay hidden"
    nvml = symbols(vgpu.lib_dir / "libnvidia-ml.so.1")
    old = symbols(vgpu.lib_dir / "old-driver" / "libnvidia-ml.so.1")
    new_only = {"nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3",
                "nvmlDeviceGetMemoryInfo_v2"}
    assert {"nvmlInitWithFlags", "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2",
            "nvmlDeviceGetSamples"} | new_only <= nvml
    assert nvml - old == new_only
    soname = subprocess.run(["readelf", "-d", str(vgpu.lib_dir / "libcuda.so.1")], capture_output=True, text=True)
    if soname.returncode == 0:
        assert "[libcuda.so.1]" in soname.stdout  # cuda-pathfinder reuses a loaded library by this SONAME


def test_two_builds_at_once_make_one_build_and_a_third_reuses_it(tmp_path: Path, vgpu_lib_dir: Path) -> None:
    out = tmp_path / "builds"
    code = "import sys; from pathlib import Path; from vgpu.build import build; print(build(Path(sys.argv[1])))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    dirs = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(dirs) == 1
    built = Path(dirs.pop())
    assert built.name == vgpu_lib_dir.name  # the same sources and headers give the same stamp
    stamp_mtime = (built / "STAMP").stat().st_mtime
    again = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, capture_output=True, text=True)
    assert again.stdout.strip() == str(built) and (built / "STAMP").stat().st_mtime == stamp_mtime
    assert [p.name for p in out.iterdir() if not p.name.startswith(".")] == [built.name]


def test_bad_options_are_one_line_errors(vgpu: VgpuFactory, tmp_path: Path) -> None:
    for kwargs, words in (({"gpus": 9}, "gpus=9"), ({"window_s": 0.05}, "window_s=0.05"),
                          ({"timestamps": "tai"}, "timestamps='tai'"), ({"fail_gpu": [(3, 1.0)]}, "device 3"),
                          ({"not_supported": ["cuInit"]}, "cuInit"),
                          ({"nvml_cost": {"nvmlNoSuch": 1.0}}, "nvmlNoSuch"),
                          ({"nvml_cost": {"nvmlDeviceGetSamples": -1.0}}, "nvmlDeviceGetSamples=-1.0"),
                          ({"compute_mode": "exclusive_thread"}, "compute_mode='exclusive_thread'")):
        with pytest.raises(VgpuError, match=words):
            VirtualGpu(tmp_path / "bad", lib_dir=vgpu.lib_dir, **kwargs)  # type: ignore[arg-type]


# --- numba-cuda on it -----------------------------------------------------------------------------------------

NUMBA_BURN = r'''
import json, os
import numpy as np
from numba import cuda
from forge_load.gpu import kernels
cuda.select_device(0)
dev = cuda.get_current_device()
stream = cuda.stream()
out = cuda.to_device(np.zeros(1, dtype=np.float32), stream=stream)
kernels.launch_burn(out, 1, stream)  # compile and load
stream.synchronize()
grids = [1, PER_WAVE, PER_WAVE + 1, 5 * PER_WAVE, 20 * PER_WAVE + 7]
elapsed = []
for blocks in grids:
    a, b = cuda.event(timing=True), cuda.event(timing=True)
    a.record(stream)
    kernels.launch_burn(out, blocks, stream)
    b.record(stream)
    b.synchronize()
    elapsed.append(cuda.event_elapsed_time(a, b) / 1e3)
# two kernels queued back to back: the second starts when the first ends
a, b = cuda.event(timing=True), cuda.event(timing=True)
a.record(stream)
kernels.launch_burn(out, 10 * PER_WAVE, stream)
kernels.launch_burn(out, 10 * PER_WAVE, stream)
b.record(stream)
busy_while_queued = not b.query()
b.synchronize()
print(json.dumps({"pid": os.getpid(), "name": dev.name.decode() if isinstance(dev.name, bytes) else dev.name,
                  "cc": list(dev.compute_capability), "sms": dev.MULTIPROCESSOR_COUNT, "grids": grids,
                  "elapsed": elapsed, "pair": cuda.event_elapsed_time(a, b) / 1e3,
                  "busy_while_queued": busy_while_queued, "uuid": dev.uuid}))
cuda.close()
'''.replace("PER_WAVE", str(PER_WAVE))


def kernel_s(blocks: int) -> float:
    return OVERHEAD_S + WAVE_S * -(-blocks // PER_WAVE)


def test_numba_compiles_launches_and_times_the_burn_kernel_by_the_wave_model(vgpu: VgpuFactory) -> None:
    gpu = vgpu()
    r = run_py(gpu, NUMBA_BURN)
    assert r["name"] == "Virtual GPU (H100-like)" and r["cc"] == [9, 0] and r["sms"] == 132
    assert r["uuid"] == gpu.uuids()[0]
    mine = [k for k in gpu.kernels() if k.pid == r["pid"]]
    assert len(mine) == 1 + len(r["grids"]) + 2
    for k, blocks in zip(mine[1:], r["grids"]):
        assert k.end - k.start == pytest.approx(kernel_s(blocks), abs=STAMP_S), blocks
        assert k.start - k.submit >= LATENCY_S - STAMP_S  # the launch latency
    for seconds, blocks, _k in zip(r["elapsed"], r["grids"], mine[1:]):
        # On an idle stream the start event completes at record time, before the kernel even starts.
        assert seconds >= kernel_s(blocks) + LATENCY_S - 1e-6
        assert seconds <= kernel_s(blocks) + 0.5  # plus Python between the record and the launch
    first, second = mine[-2:]
    assert second.start == pytest.approx(first.end, abs=STAMP_S) and second.waited == 0.0
    assert r["busy_while_queued"]
    assert r["pair"] >= 2 * kernel_s(10 * PER_WAVE)


CUDA_ORDER = DRIVER.split("dev = ")[0] + r'''
uuids = []
for i in range(ok(d.cuDeviceGetCount())):
    u = bytes(ok(d.cuDeviceGetUuid(ok(d.cuDeviceGet(i)))).bytes).hex()
    uuids.append(f"GPU-{u[:8]}-{u[8:12]}-{u[12:16]}-{u[16:20]}-{u[20:]}")
print(json.dumps({"uuids": uuids}))
'''


@pytest.mark.parametrize("order, visible, expected", [
    ("PCI_BUS_ID", None, [0, 1, 2]),
    (None, None, [2, 0, 1]),                 # FASTEST_FIRST: the driver's own order
    ("PCI_BUS_ID", "2,0", [2, 0]),
    (None, "0", [2]),                        # ordinals count in CUDA_DEVICE_ORDER
    ("PCI_BUS_ID", "UUID1,1", [1]),          # a UUID prefix, then a device already listed: the list ends
    ("PCI_BUS_ID", "1,7,0", [1]),            # an invalid entry ends the list
])
def test_cuda_visible_devices_and_device_order_as_the_driver_reads_them(
        vgpu: VgpuFactory, order: str | None, visible: str | None, expected: list[int]) -> None:
    gpu = vgpu(gpus=3, fastest_first=[2, 0, 1])
    uuids = gpu.uuids()
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES")}
    if order:
        env["CUDA_DEVICE_ORDER"] = order
    if visible:
        env["CUDA_VISIBLE_DEVICES"] = visible.replace("UUID1", uuids[1][:12])
    proc = gpu.run([sys.executable, "-c", CUDA_ORDER], env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["uuids"] == [uuids[i] for i in expected]


# --- several processes ----------------------------------------------------------------------------------------

LONG_THEN_WAIT = DRIVER + r'''
ok(launch(PER_WAVE * 5000))  # 0.5 s, queued: returns at once
say(pid=os.getpid())
sys.stdin.readline()
'''.replace("PER_WAVE", str(PER_WAVE))

SHORT = DRIVER + r'''
t = time.time()
busy(0.001)
say(pid=os.getpid(), submitted=t)
'''


def test_two_processes_share_a_device_first_come_first_served(vgpu: VgpuFactory) -> None:
    gpu = vgpu()
    first = start_py(gpu, LONG_THEN_WAIT)
    try:
        a = ready(first)["pid"]
        b = run_py(gpu, SHORT)["pid"]
    finally:
        finish(first)
    kernels = gpu.kernels()
    long = next(k for k in kernels if k.pid == a)
    short = next(k for k in kernels if k.pid == b)
    assert short.start == pytest.approx(long.end, abs=STAMP_S)  # never both at once
    assert short.waited == pytest.approx(short.start - max(short.submit + LATENCY_S, 0), abs=1e-5)
    assert short.waited > 0.1  # the record says how long it stood behind the other context


def test_a_process_that_dies_releases_its_context(vgpu: VgpuFactory) -> None:
    gpu = vgpu()
    holder = start_py(gpu, HOLD.replace('os.environ.get("ALLOC_MIB", "0")', '"64"'))
    pid = ready(holder)["pid"]
    assert [(c.pid, c.mib) for c in gpu.contexts()] == [(pid, 512 + 64)]
    assert gpu.memory_used_mib() == 576
    holder.kill()  # no clean-up at all
    holder.wait()
    assert gpu.contexts() == [] and gpu.memory_used_mib() == 0


# A first retain's error code on device DEV, without failing (the driver call a job's context creation makes).
TRY_CONTEXT = r"""
import json, os
from cuda.bindings import driver as d
assert int(d.cuInit(0)[0]) == 0
dev = d.cuDeviceGet(int(os.environ.get("DEV", "0")))[1]
mode = d.cuDeviceGetAttribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, dev)[1]
err = d.cuDevicePrimaryCtxRetain(dev)[0]
print(json.dumps({"err": int(err), "name": err.name, "mode": int(mode)}))
"""


def compute_modes(gpu: VirtualGpu) -> list[int]:
    code = NVML + "print(json.dumps({'modes': [n.nvmlDeviceGetComputeMode(n.nvmlDeviceGetHandleByIndex(i)) " \
                  "for i in range(n.nvmlDeviceGetCount())]}))"
    return list(run_py(gpu, "import json, os\n" + code)["modes"])


def test_exclusive_process_mode_takes_one_process_context_per_device(vgpu: VgpuFactory) -> None:
    gpu = vgpu(gpus=2, compute_mode="exclusive_process")
    assert compute_modes(gpu) == [3, 3]  # NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert gpu.show()["devices"][0]["compute_mode"] == 3
    holder = start_py(gpu, HOLD)  # an idle context on device 0, no kernel at all
    try:
        pid = ready(holder)["pid"]
        refused = run_py(gpu, TRY_CONTEXT)
        assert (refused["name"], refused["mode"]) == ("CUDA_ERROR_DEVICE_UNAVAILABLE", 3)
        assert run_py(gpu, TRY_CONTEXT, env={"DEV": "1"})["name"] == "CUDA_SUCCESS"  # the other device is free
        assert [(c.pid, c.device) for c in gpu.contexts()] == [(pid, 0)]  # the refused ones hold nothing
    finally:
        finish(holder)  # released at exit: the device takes a context again
    assert run_py(gpu, TRY_CONTEXT)["name"] == "CUDA_SUCCESS"


def test_exclusive_process_frees_the_device_when_the_holder_dies_or_resets(vgpu: VgpuFactory) -> None:
    gpu = vgpu(compute_mode="exclusive_process")
    holder = start_py(gpu, HOLD)
    ready(holder)
    holder.kill()  # no clean-up: the per-slot liveness says it is gone
    holder.wait()
    assert run_py(gpu, TRY_CONTEXT)["name"] == "CUDA_SUCCESS"
    # One process may retain its own context again after a reset (numba resets at close).
    again = run_py(gpu, DRIVER + "ok(d.cuDevicePrimaryCtxReset(dev))\nctx = ok(d.cuDevicePrimaryCtxRetain(dev))\n"
                   "say(ok=1)\n")
    assert again == {"ok": 1}


def test_default_mode_shares_and_prohibited_mode_refuses_every_context(vgpu: VgpuFactory) -> None:
    shared = vgpu()
    assert compute_modes(shared) == [0]
    holder = start_py(shared, HOLD)
    try:
        ready(holder)
        assert run_py(shared, TRY_CONTEXT) == {"err": 0, "name": "CUDA_SUCCESS", "mode": 0}
    finally:
        finish(holder)
    prohibited = vgpu(compute_mode="prohibited")
    assert compute_modes(prohibited) == [2]
    # cuda.h: "Retaining the primary context for the first time will fail with CUDA_ERROR_UNKNOWN if the
    # compute mode of the device is CU_COMPUTEMODE_PROHIBITED"
    assert run_py(prohibited, TRY_CONTEXT) == {"err": 999, "name": "CUDA_ERROR_UNKNOWN", "mode": 2}
    assert prohibited.contexts() == []


def test_cli_exclusive_puts_every_device_in_exclusive_process_mode(vgpu: VgpuFactory) -> None:
    code = NVML + "print([n.nvmlDeviceGetComputeMode(n.nvmlDeviceGetHandleByIndex(i)) for i in range(2)])"
    for args, want in ((["--exclusive"], "[3, 3]"), (["--compute-mode", "prohibited"], "[2, 2]"), ([], "[0, 0]")):
        proc = subprocess.run([sys.executable, str(VGPU_CLI), "run", "--gpus", "2", *args, "--", sys.executable,
                               "-c", "import os\n" + code], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert (proc.returncode, proc.stdout.strip()) == (0, want), proc.stderr


def test_an_unimplemented_entry_point_fails_loudly(vgpu: VgpuFactory) -> None:
    gpu = vgpu()
    vgpu.expect_unimplemented("cuMemAllocManaged")
    r = run_py(gpu, DRIVER + r'''
err = d.cuMemAllocManaged(1 << 20, 1)[0]
say(err=int(err))
''')
    assert r["err"] == 801  # CUDA_ERROR_NOT_SUPPORTED
    assert gpu.unimplemented() == ["cuMemAllocManaged"]


# --- scripts/vgpu ---------------------------------------------------------------------------------------------

def test_cli_runs_a_command_on_a_fresh_gpu_and_records_its_kernels(tmp_path: Path, vgpu: VgpuFactory) -> None:
    record = tmp_path / "kernels.jsonl"
    code = DRIVER + "busy(0.01)\nbusy(0.02)\nsys.exit(7)\n"
    proc = subprocess.run([sys.executable, str(VGPU_CLI), "run", "--gpus", "2", "--record", str(record), "--",
                           sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 7, proc.stderr
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(lines) == 2 and set(lines[0]) == {"pid", "device", "start", "end", "submit", "waited", "pidns",
                                                 "grid", "block", "mig"}
    kernels = [Kernel(**line) for line in lines]
    assert (kernels[1].grid, kernels[1].block, kernels[1].mig) == (PER_WAVE * 200, 256, None)
    assert kernels[0].device == 0 and abs(kernels[0].start - time.time()) < 60  # Unix seconds
    assert kernels[1].end - kernels[1].start == pytest.approx(0.02 + OVERHEAD_S, abs=STAMP_S)


@pytest.mark.parametrize("args, words", [
    (["--gpus", "0"], "gpus=0"), (["--window", "0.01"], "window_s=0.01"), (["--timestamps", "x"], "timestamps"),
    (["--fail-gpu", "1"], "--fail-gpu '1'"), (["--fail-gpu", "1@2"], "device 1"), (["--nope"], "--nope"),
    ([], "no command"), (["--nvml-cost", "nvmlDeviceGetSamples"], "--nvml-cost 'nvmlDeviceGetSamples'"),
    (["--nvml-cost", "nvmlDeviceGetSamples=-1"], "--nvml-cost"), (["--nvml-cost", "nvmlDeviceGetSamples=x"], "MS"),
    (["--nvml-cost", "nvmlNoSuchThing=1"], "nvmlNoSuchThing"),
    (["--nvml-calls", "/nonexistent/dir/calls.json"], "--nvml-calls /nonexistent/dir/calls.json"),
    (["--compute-mode", "exclusive_thread"], "--compute-mode"),
    (["--exclusive", "--compute-mode", "default"], "--compute-mode"),
    (["--cc", "9"], "cc='9': expected a compute capability MAJOR.MINOR"), (["--cc", "8.10"], "cc='8.10'"),
    (["--cuda-version", "12.2"], "--cuda-version"), (["--cuda-version", "12025"], "cuda_version=12025"),
])
def test_cli_bad_options_exit_2_with_one_line(args: list[str], words: str, vgpu: VgpuFactory) -> None:
    proc = subprocess.run([sys.executable, str(VGPU_CLI), "run", *args, "--", "true"] if args else
                          [sys.executable, str(VGPU_CLI), "run"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], proc.stderr


def test_cli_forwards_sigterm_and_reports_a_signal_death(vgpu: VgpuFactory) -> None:
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(5))\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    for child, expected in ((code, 5), (code.replace("lambda *a: sys.exit(5)", "signal.SIG_DFL"), 128 + 15)):
        proc = subprocess.Popen([sys.executable, str(VGPU_CLI), "run", "--", sys.executable, "-c", child],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == expected


# --- the repository's `gpu` tests and the benchmark, on the virtual GPU ----------------------------------------

GPU_TESTS = {
    "tests/test_gpu.py::test_burn_computes_the_reference_value_on_hardware": "no-compute",
    "tests/test_gpu.py::test_launcher_times_its_kernels_with_events": "pass",
    "tests/test_gpu.py::test_filler_holds_half_the_gpu_for_real": "pass",
    "tests/test_gpu.py::test_an_event_on_an_empty_stream_completes_while_another_stream_runs_a_kernel": "pass",
    "tests/test_gpu.py::test_filler_holds_sm_activity_read_through_gpm_for_real": "pass",
    "tests/test_gpu.py::test_the_lean_kernel_holds_utilization_and_sm_activity_for_real": "pass",
    "tests/test_gpu.py::test_the_shipped_lean_kernel_sleeps_about_its_request_on_hardware": "pass",
    "tests/test_nvml.py::test_real_gpu_answers_every_query": "pass",
    "tests/test_bench.py::test_real_gpu_short_run": "pass",
}


@pytest.fixture(scope="module")
def gpu_suite(tmp_path_factory: pytest.TempPathFactory, vgpu_lib_dir: Path) -> dict[str, str]:
    """`pytest -m gpu` run once under scripts/vgpu, in the order the files list them: outcome per test id."""
    import xml.etree.ElementTree as ET

    report = tmp_path_factory.mktemp("gpu_suite") / "junit.xml"
    files = sorted({test_id.split("::")[0] for test_id in GPU_TESTS})
    proc = subprocess.run([sys.executable, str(VGPU_CLI), "run", "--", sys.executable, "-m", "pytest", "-m", "gpu",
                           *files, "-p", "no:cacheprovider", "-q", f"--junitxml={report}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    outcomes: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        kinds = [child.tag for child in case]
        outcomes[test_id] = ("failed" if {"failure", "error"} & set(kinds) else
                             "skipped" if "skipped" in kinds else "passed")
        if outcomes[test_id] == "failed":
            outcomes[test_id] += ": " + " ".join((case[0].get("message") or "").split())[:300]
    assert "vgpu: called but not implemented" not in proc.stderr, proc.stderr[-2000:]
    return outcomes


@pytest.mark.parametrize("test_id", list(GPU_TESTS))
def test_gpu_marked_tests_on_the_virtual_gpu(gpu_suite: dict[str, str], test_id: str) -> None:
    assert set(gpu_suite) == set(GPU_TESTS), "a gpu-marked test was added or renamed: list it in GPU_TESTS"
    outcome = gpu_suite[test_id]
    if GPU_TESTS[test_id] == "no-compute":
        # The virtual GPU models time, not arithmetic: a kernel's result is never written.
        assert outcome.startswith("failed"), outcome
    else:
        assert outcome == "passed", outcome


def test_benchmark_real_mode_on_the_virtual_gpu_says_so(tmp_path: Path, vgpu_lib_dir: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_bench.py"), "--vgpu", "--out", str(out),
                           "--track-s", "10", "--targets", "0.5", "--controllers", "pi", "--scenarios", "tracking"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    results = json.loads((out / "results.json").read_text())
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: a goal missed is still a finished run
    assert results["mode"] == "real" and results["virtual_gpu"] is True and results["complete"]
    assert results["gpu"]["name"] == "Virtual GPU (H100-like)" and results["gpu"]["driver"].endswith("-virtual")
    markdown = (out / "results.md").read_text()
    assert "(virtual GPU)" in markdown.splitlines()[0] and "not a GPU measurement" in markdown
    assert "virtual GPU" in proc.stderr


IMAGE_LOADS = r'''
import json, sys
from cuda.bindings import driver as d

def ok(result):
    assert result[0] == d.CUresult.CUDA_SUCCESS, result[0]
    return result[1] if len(result) > 1 else None

ok(d.cuInit(0))
dev = ok(d.cuDeviceGet(0))
ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(dev))))
attribute = d.CUdevice_attribute
cc = [ok(d.cuDeviceGetAttribute(a, dev)) for a in (attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                                    attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)]
results = {}
for name in sys.argv[1:]:
    data = open(name, "rb").read()
    results[name.rsplit("/", 1)[-1]] = d.cuModuleLoadData(data + b"\\0" if name.endswith(".ptx") else data)[0].name
import pynvml as n
n.nvmlInit()
nvml = {"cc": list(n.nvmlDeviceGetCudaComputeCapability(n.nvmlDeviceGetHandleByIndex(0))),
        "cuda": n.nvmlSystemGetCudaDriverVersion()}
print(json.dumps({"cc": cc, "driver": ok(d.cuDriverGetVersion()), "results": results, "nvml": nvml}))
'''


def _ptx(version: str, target: str) -> bytes:
    return f".version {version}\n.target {target}\n.address_size 64\n".encode()


@pytest.mark.parametrize(("cc", "cuda_version", "expected"), [
    ("9.0", 12090, {"burn.sm_90.cubin": "CUDA_SUCCESS", "burn.sm_80.cubin": "CUDA_ERROR_NO_BINARY_FOR_GPU",
                    "burn.sm_100.cubin": "CUDA_ERROR_NO_BINARY_FOR_GPU", "burn.ptx": "CUDA_SUCCESS"}),
    ("8.6", 12020, {"burn.sm_80.cubin": "CUDA_SUCCESS", "burn.sm_86.cubin": "CUDA_SUCCESS",
                    "burn.sm_89.cubin": "CUDA_ERROR_NO_BINARY_FOR_GPU",
                    "burn.ptx": "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
                    "v82.ptx": "CUDA_SUCCESS", "v83.ptx": "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
                    "sm89.ptx": "CUDA_ERROR_INVALID_PTX"}),
    ("12.0", 12060, {"burn.sm_120.cubin": "CUDA_SUCCESS", "burn.sm_100.cubin": "CUDA_ERROR_NO_BINARY_FOR_GPU",
                     "v85.ptx": "CUDA_SUCCESS", "v86.ptx": "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"}),
], ids=["9.0-cuda12.9", "8.6-cuda12.2", "12.0-cuda12.6"])
def test_images_are_checked_as_a_driver_checks_them_and_recorded(vgpu: VgpuFactory, tmp_path: Path, cc: str,
                                                                 cuda_version: int, expected: dict[str, str]) -> None:
    from forge_load.gpu import burn_image

    made = {"v82.ptx": _ptx("8.2", "sm_70"), "v83.ptx": _ptx("8.3", "sm_70"), "sm89.ptx": _ptx("8.0", "sm_89"),
            "v85.ptx": _ptx("8.5", "sm_70"), "v86.ptx": _ptx("8.6", "sm_70")}
    paths = []
    for name in expected:
        path = burn_image.PREBUILT_DIR / name if name.startswith("burn.") else tmp_path / name
        if not name.startswith("burn."):
            path.write_bytes(made[name])
        paths.append(str(path))
    gpu = vgpu(cc=cc, cuda_version=cuda_version)
    proc = gpu.run([sys.executable, "-c", IMAGE_LOADS, *paths], cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["cc"] == [int(v) for v in cc.split(".")] and r["driver"] == cuda_version
    assert r["nvml"] == {"cc": r["cc"], "cuda": cuda_version}  # NVML says what libcuda says
    assert r["results"] == expected
    records = gpu.modules()
    assert [m["result"] for m in records] == list(expected.values())
    assert {m["pid"] for m in records} == {records[0]["pid"]}
    for name, record in zip(expected, records):
        if name.endswith(".cubin"):
            assert record == {"pid": record["pid"], "kind": "cubin", "arch": name.split(".")[1],
                              "result": expected[name]}
        else:
            assert record["kind"] == "ptx" and record["ptx_version"] == (
                "8.8" if name == "burn.ptx" else f"{name[1]}.{name[2]}" if name[0] == "v" else "8.0")
