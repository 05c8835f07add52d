"""The kernels do what they claim (CUDA simulator: the burn kernel computes its reference value, the lean one sleeps
its count of quanta and nothing else) and, for every supported architecture, compile to code with no local memory
(real NVVM and ptxas from the cu12 wheels). Neither needs a GPU."""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from forge_load.gpu import burn_image, kernels
from vgpu.pytest_plugin import VgpuFactory

REPO_ROOT = Path(__file__).resolve().parents[1]

# --- simulator ---------------------------------------------------------------

SIM_ITERS = 16
SIM_BLOCKS = 2
SIM_THREADS = 32
UNTOUCHED = 12345.0  # out[0] before the launch; no thread can produce it

# Runs in its own interpreter: NUMBA_ENABLE_CUDASIM must be set before numba
# is first imported, and this pytest process imports numba without it.
_SIM_SCRIPT = """
import json, sys
import numpy as np
from numba import config, cuda
assert config.ENABLE_CUDASIM, "simulator not enabled"
from forge_load.gpu import kernels
iters, blocks, threads = (int(a) for a in sys.argv[1:4])
untouched = float(sys.argv[4])
results = {}
for name, sentinel in json.loads(sys.argv[5]).items():
    out = cuda.to_device(np.full(1, untouched, dtype=np.float32))
    if name.startswith("launch_burn"):  # the worker's entry point: 1 block of THREADS_PER_BLOCK
        kernels.launch_burn(out, 1, iters=iters, sentinel=sentinel)
    else:
        kernels.burn[blocks, threads](out, np.int32(iters), np.float32(sentinel))
    results[name] = float(out.copy_to_host()[0])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def sim_sentinels() -> dict[str, float]:
    last_thread = SIM_BLOCKS * SIM_THREADS - 1
    return {
        "thread0": kernels.reference_value(0, SIM_ITERS),
        "last_thread": kernels.reference_value(last_thread, SIM_ITERS),
        "one_more_iter": kernels.reference_value(0, SIM_ITERS + 1),
        "unreachable": kernels.UNREACHABLE_SENTINEL,
        "launch_burn_last_thread": kernels.reference_value(kernels.THREADS_PER_BLOCK - 1, SIM_ITERS),
        "launch_burn_unreachable": kernels.UNREACHABLE_SENTINEL,
    }


@pytest.fixture(scope="module")
def sim_results(sim_sentinels: dict[str, float]) -> dict[str, float]:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    args = [str(SIM_ITERS), str(SIM_BLOCKS), str(SIM_THREADS), str(UNTOUCHED), json.dumps(sim_sentinels)]
    proc = subprocess.run(
        [sys.executable, "-c", _SIM_SCRIPT, *args],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"simulator run failed:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sim_writes_when_thread0_hits_sentinel(sim_results, sim_sentinels) -> None:
    assert sim_results["thread0"] == sim_sentinels["thread0"]


def test_sim_seeds_from_global_thread_index(sim_results, sim_sentinels) -> None:
    # The last thread of the second block: proves blockIdx enters the seed.
    assert sim_results["last_thread"] == sim_sentinels["last_thread"]


def test_sim_runs_exactly_iters_iterations(sim_results, sim_sentinels) -> None:
    grid_values = {kernels.reference_value(t, SIM_ITERS) for t in range(SIM_BLOCKS * SIM_THREADS)}
    assert sim_sentinels["one_more_iter"] not in grid_values  # else the check proves nothing
    assert sim_results["one_more_iter"] == UNTOUCHED


def test_sim_never_writes_with_unreachable_sentinel(sim_results) -> None:
    assert sim_results["unreachable"] == UNTOUCHED


def test_sim_launch_burn_runs_threads_per_block(sim_results, sim_sentinels) -> None:
    assert sim_results["launch_burn_last_thread"] == sim_sentinels["launch_burn_last_thread"]
    assert sim_results["launch_burn_unreachable"] == UNTOUCHED


# The lean kernel under the simulator: every thread of every block sleeps `quanta` times the quantum, and does
# nothing else (kernels.py stands a host sleep in for nanosleep there; here it is counted instead).
_LEAN_SIM_SCRIPT = """
import json, sys
from numba import config, cuda
assert config.ENABLE_CUDASIM, "simulator not enabled"
from forge_load.gpu import kernels
from numba.cuda.simulator import kernelapi
calls = []
host_sleep = kernelapi.FakeCUDAModule.__dict__["nanosleep"]  # the staticmethod itself
kernelapi.FakeCUDAModule.nanosleep = staticmethod(lambda ns: calls.append(int(ns)))
blocks, quanta, quantum_ns = (int(a) for a in sys.argv[1:4])
kernels.launch_lean(blocks, quanta, quantum_ns=quantum_ns)
cuda.synchronize()
counted = list(calls)
kernelapi.FakeCUDAModule.nanosleep = host_sleep  # the stand-in kernels.py installed: really sleeps
import time
t0 = time.monotonic()
kernels.lean[1, 1](3, 20_000_000)
print(json.dumps({"calls": counted, "slept_s": time.monotonic() - t0}))
"""


def test_sim_lean_kernel_sleeps_its_quanta_in_every_thread_and_nothing_else() -> None:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _LEAN_SIM_SCRIPT, "2", "5", "7000"], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"simulator run failed:\n{proc.stderr}"
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["calls"] == [7000] * (2 * burn_image.LEAN_THREADS_PER_BLOCK * 5)
    assert got["slept_s"] >= 0.06  # three sleeps of 20 ms on the host stand-in


def test_reference_values_are_non_negative() -> None:
    # Why UNREACHABLE_SENTINEL (negative) can never match, production size included.
    values = [kernels.reference_value(t, n) for t in (0, 1, 255, 10**6) for n in (0, 1, kernels.BURN_ITERS)]
    assert kernels.UNREACHABLE_SENTINEL < 0
    assert min(values) >= 0


def test_reference_value_depends_on_iters_and_thread() -> None:
    assert kernels.reference_value(0, 8) != kernels.reference_value(0, 9)
    assert kernels.reference_value(0, 8) != kernels.reference_value(1, 8)


# --- real compile: PTX for every supported cc, checked by ptxas ---------------

MAX_REGISTERS = 64  # 65536 registers per SM / 1024 threads: full occupancy still possible

_PROPS_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS_RE = re.compile(r"Used (\d+) registers")


def _find_ptxas() -> Path | None:
    try:
        import nvidia  # namespace package of the NVIDIA cu12 wheels
    except ImportError:
        return None
    for base in getattr(nvidia, "__path__", []):
        candidate = Path(base) / "cuda_nvcc" / "bin" / "ptxas"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def _ptxas_report(arch: int, kernel: str = burn_image.BURN) -> str:
    """ptxas -v on the kernel's shipped PTX for sm_`arch`: what the cubin of that architecture was linked from."""
    ptxas = _find_ptxas()
    if ptxas is None:
        pytest.skip("ptxas not found under nvidia/cuda_nvcc/bin: install numba-cuda[cu12]")
    proc = subprocess.run(
        [str(ptxas), f"-arch=sm_{arch}", "-v", "-o", os.devnull,
         str(burn_image.PREBUILT_DIR / burn_image.ptx_name(kernel))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"ptxas failed for sm_{arch}:\n{report}"
    assert f"for 'sm_{arch}'" in report, report
    return report


@pytest.mark.parametrize("kernel", burn_image.KERNEL_NAMES)
@pytest.mark.parametrize("arch", burn_image.CUBIN_ARCHES, ids=lambda a: f"sm_{a}")
def test_every_kernel_uses_no_local_memory_by_ptxas(arch: int, kernel: str) -> None:
    report = _ptxas_report(arch, kernel)
    props = _PROPS_RE.findall(report)
    regs = _REGS_RE.findall(report)
    assert len(props) == 1 and len(regs) == 1, f"expected one entry function:\n{report}"
    stack, spill_stores, spill_loads = (int(v) for v in props[0])
    assert (stack, spill_stores, spill_loads) == (0, 0, 0), report
    assert int(regs[0]) <= MAX_REGISTERS, report


def test_the_shipped_ptx_is_float32_only() -> None:
    # float64 runs at 1/64 rate on most GPUs: a different burn.
    assert ".f64" not in (burn_image.PREBUILT_DIR / burn_image.PTX_NAME).read_text()


def test_the_lean_kernel_sleeps_in_a_loop_and_touches_no_memory_and_no_float() -> None:
    ptx = (burn_image.PREBUILT_DIR / burn_image.ptx_name(burn_image.LEAN)).read_text()
    body = ptx[ptx.index(".entry"):]
    assert "nanosleep.u32" in body
    assert re.search(r"@%p\d+ bra\s+\$L__BB0_\d+;", body)  # a loop, not one sleep
    for instruction in ("ld.global", "st.global", "ld.local", "st.local", "ld.shared", "st.shared", "atom.", ".f32",
                        ".f64", "fma."):
        assert instruction not in body, instruction


# --- the shipped images: current, for their architectures, with no local memory ------------------------------

BUILD_KERNELS = REPO_ROOT / "scripts" / "build_kernels.py"


def _check_kernels(directory: Path) -> subprocess.CompletedProcess[str]:
    # A process of its own: the check must be that process's first compilation of the kernel (build_kernels.py).
    return subprocess.run([sys.executable, str(BUILD_KERNELS), "--check", "--dir", str(directory)],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)


def test_the_shipped_kernel_images_are_what_the_kernel_compiles_to() -> None:
    proc = _check_kernels(burn_image.PREBUILT_DIR)
    assert proc.returncode == 0, proc.stderr


def test_a_stale_image_fails_the_check_naming_it(tmp_path: Path) -> None:
    for name in os.listdir(burn_image.PREBUILT_DIR):
        (tmp_path / name).write_bytes((burn_image.PREBUILT_DIR / name).read_bytes())
    (tmp_path / "burn.sm_86.cubin").write_bytes(b"\x7fELF old")
    (tmp_path / "burn.sm_120.cubin").unlink()
    proc = _check_kernels(tmp_path)
    assert proc.returncode == 1
    assert "burn.sm_120.cubin, burn.sm_86.cubin; run `python3 scripts/build_kernels.py`" in proc.stderr


def _elf_sections(data: bytes) -> dict[str, bytes]:
    """The sections of an ELF64 (little-endian), by name."""
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx]

    def name(offset: int) -> str:
        start = names[4] + offset
        return data[start:data.index(b"\0", start)].decode()

    return {name(h[0]): data[h[4]:h[4] + h[5]] for h in headers}


# The per-kernel attributes of a cubin's .nv.info section (names as `cuobjdump -elf` prints them): format 0x04 is
# a 2-byte size and that many bytes (here a symbol index and a 4-byte value). Read from the cubins themselves, and
# the register count checked against ptxas -v below, which is what proves the reading.
EIATTR_FRAME_SIZE, EIATTR_MIN_STACK_SIZE, EIATTR_REGCOUNT = 0x11, 0x12, 0x2F


def _nv_info(section: bytes) -> dict[int, int]:
    out: dict[int, int] = {}
    i = 0
    while i + 4 <= len(section):
        fmt, attribute, size = section[i], section[i + 1], struct.unpack_from("<H", section, i + 2)[0]
        if fmt == 0x04:  # a value: symbol index, then the value
            if size == 8:
                out[attribute] = struct.unpack_from("<I", section, i + 8)[0]
            i += 4 + size
        else:  # a 2-byte value in place of the size
            i += 4
    return out


@pytest.mark.parametrize("kernel", burn_image.KERNEL_NAMES)
@pytest.mark.parametrize("arch", burn_image.CUBIN_ARCHES, ids=lambda a: f"sm_{a}")
def test_every_shipped_cubin_is_for_its_architecture_and_uses_no_local_memory(arch: int, kernel: str) -> None:
    manifest = burn_image.load_manifest(kernel=kernel)
    data = (burn_image.PREBUILT_DIR / burn_image.cubin_name(arch, kernel)).read_bytes()
    assert data[:4] == b"\x7fELF"
    flags = struct.unpack_from("<I", data, 0x30)[0]
    # e_flags names the SM: its low byte up to ELF ABI version 7, its second byte from version 8 (CUDA 12.8+).
    assert (flags >> 8 & 0xFF if data[8] >= 8 else flags & 0xFF) == arch
    sections = _elf_sections(data)
    assert f".text.{manifest.entry}" in sections
    assert not [name for name in sections if name.startswith(".nv.local")], "the kernel has local memory"
    info = _nv_info(sections[".nv.info"])
    assert info[EIATTR_FRAME_SIZE] == 0 and info[EIATTR_MIN_STACK_SIZE] == 0, info
    assert info[EIATTR_REGCOUNT] == int(_REGS_RE.findall(_ptxas_report(arch, kernel))[0]) <= MAX_REGISTERS


@pytest.mark.parametrize("kernel", burn_image.KERNEL_NAMES)
def test_the_manifest_names_the_ptx_it_ships(kernel: str) -> None:
    manifest = burn_image.load_manifest(kernel=kernel)
    assert manifest.kernel == kernel and f"7{kernel}_py" in manifest.entry
    ptx = (burn_image.PREBUILT_DIR / burn_image.ptx_name(kernel)).read_text()
    assert f".version {manifest.ptx_version}\n" in ptx and f".target {manifest.ptx_target}\n" in ptx
    assert f".entry {manifest.entry}(" in ptx
    assert manifest.ptx_target == f"sm_{burn_image.PTX_CC[0]}{burn_image.PTX_CC[1]}"


# --- the argument layout, against numba's own launch ----------------------------------------------------------

_NUMBA_ARGS_SCRIPT = """
import json
import numpy as np
from numba import cuda
from forge_load.gpu import burn_image, kernels
from vgpu.pytest_plugin import VgpuFactory
out = cuda.to_device(np.zeros(1, dtype=np.float32))
expanded = kernels.numba_launch_arguments(out, 4096, -1.0)
ours = burn_image.pack_arguments(out.device_ctypes_pointer.value, 4096, -1.0)
print(json.dumps({
    "numba": [[type(v).__name__, v if isinstance(v, int) else v.value] for v in expanded],
    "ours": [[type(v).__name__, v.value] for v in ours.values],
    "numba_sizes": [8 if isinstance(v, int) else ctypes_size(v) for v in expanded],
}))
"""


def test_the_argument_layout_is_what_numbas_own_launch_passes(vgpu: VgpuFactory) -> None:
    # numba packs on a (virtual) device: an array's fields need its device pointer. A plain int is passed by
    # numba as an intptr_t (8 bytes), as cuda.core packs it.
    gpu = vgpu()
    script = "import ctypes\ndef ctypes_size(v): return ctypes.sizeof(v)\n" + _NUMBA_ARGS_SCRIPT
    proc = gpu.run([sys.executable, "-c", script], cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = [value for _, value in got["ours"]]
    numba = [None if value == 0 and i < 2 else value for i, (_, value) in enumerate(got["numba"])]
    assert ours[:7] == numba[:7]  # meminfo, parent, nitems, itemsize, data, shape, strides
    assert ours[7] == numba[7] == 4096
    assert ours[8] == pytest.approx(numba[8]) and ours[8] == -1.0
    sizes = [ctypes.sizeof(ctype) for _, ctype in burn_image.ARGUMENT_LAYOUT]
    assert sizes == got["numba_sizes"]


_NUMBA_LEAN_ARGS_SCRIPT = """
import ctypes, json
from forge_load.gpu import burn_image, kernels
expanded = kernels.numba_lean_launch_arguments(1234, 10000)
ours = burn_image.pack_lean_arguments(7, 10000)
ours.set(0, 1234)
print(json.dumps({"numba": [[type(v).__name__, v.value, ctypes.sizeof(v)] for v in expanded],
                  "ours": [[type(v).__name__, v.value, ctypes.sizeof(v)] for v in ours.values]}))
"""


def test_the_lean_argument_layout_is_what_numbas_own_launch_passes(vgpu: VgpuFactory) -> None:
    gpu = vgpu()
    proc = gpu.run([sys.executable, "-c", _NUMBA_LEAN_ARGS_SCRIPT], cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["ours"] == got["numba"] == [["c_int", 1234, 4], ["c_uint", 10000, 4]]


# --- which image a GPU runs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("cc", "arch"), [
    ((7, 0), 70), ((7, 2), 70), ((7, 5), 75), ((8, 0), 80), ((8, 6), 86), ((8, 7), 86), ((8, 9), 89), ((9, 0), 90),
    ((10, 0), 100), ((10, 3), 100), ((12, 0), 120), ((12, 1), 120), ((6, 1), None), ((11, 0), None),
    ((13, 0), None),
])
def test_a_gpu_gets_its_own_cubin_else_its_majors_highest_lower_minor(cc: tuple[int, int], arch: int | None) -> None:
    assert burn_image.pick_cubin(cc) == arch


def test_the_images_tried_are_the_fitting_cubin_then_the_ptx() -> None:
    manifest = burn_image.load_manifest()
    assert [i.name for i in burn_image.images_for((8, 7), manifest)] == ["burn.sm_86.cubin", "burn.ptx"]
    lean = burn_image.load_manifest(kernel=burn_image.LEAN)
    assert [i.name for i in burn_image.images_for((9, 0), lean)] == ["lean.sm_90.cubin", "lean.ptx"]
    assert [i.name for i in burn_image.images_for((11, 0), manifest)] == ["burn.ptx"]
    assert burn_image.images_for((11, 0), manifest)[0].data.endswith(b"\0")  # PTX is a C string to the driver


def test_an_image_that_does_not_match_its_hash_is_a_broken_install(tmp_path: Path) -> None:
    for name in os.listdir(burn_image.PREBUILT_DIR):
        (tmp_path / name).write_bytes((burn_image.PREBUILT_DIR / name).read_bytes())
    (tmp_path / "burn.sm_90.cubin").write_bytes(b"\x7fELF truncated")
    with pytest.raises(ValueError, match="burn.sm_90.cubin does not match burn.json: reinstall forge-load"):
        burn_image.images_for((9, 0), burn_image.load_manifest(tmp_path), tmp_path)


def _installed_copy(tmp_path: Path) -> Path:
    for name in os.listdir(burn_image.PREBUILT_DIR):
        (tmp_path / name).write_bytes((burn_image.PREBUILT_DIR / name).read_bytes())
    return tmp_path


@pytest.mark.parametrize("change", [
    "[]", "null", '"burn"', {"entry": 5}, {"cubin_arches": "70,75"}, {"cubin_arches": [70, "75"]},
    {"cubin_arches": [70, True]}, {"sha256": ["burn.ptx"]}, {"sha256": {"burn.ptx": 1}}, {"ptx_target": "70"},
    {"ptx_version": "99.9"}, {"compiler": None}, {"entry": None}, "drop entry",
])
def test_a_manifest_of_the_wrong_shape_is_a_broken_install(tmp_path: Path, change: object) -> None:
    # It parsed, and its wrong shape surfaced later as a TypeError or AttributeError: "internal error" (exit 1),
    # where a broken install is exit 3, "reinstall forge-load" (gpu/launcher.py catches the ValueError).
    manifest = _installed_copy(tmp_path) / burn_image.MANIFEST_NAME
    data = json.loads(manifest.read_text())
    if isinstance(change, dict):
        data.update(change)
        manifest.write_text(json.dumps(data))
    elif change == "drop entry":
        del data["entry"]
        manifest.write_text(json.dumps(data))
    else:
        manifest.write_text(str(change))
    with pytest.raises(ValueError, match="burn.json"):
        burn_image.load_manifest(tmp_path)


@pytest.mark.parametrize("name", [burn_image.MANIFEST_NAME, burn_image.PTX_NAME, "burn.sm_90.cubin"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_an_image_that_is_not_a_regular_file_is_a_broken_install_at_once(tmp_path: Path, name: str,
                                                                         kind: str) -> None:
    # A FIFO in place of burn.ptx hung the filler's start for ever, without a line.
    directory = _installed_copy(tmp_path)
    (directory / name).unlink()
    os.mkfifo(directory / name) if kind == "fifo" else (directory / name).mkdir()

    def hung(signum: int, frame: object) -> None:
        raise TimeoutError(f"reading {name} still waits after 10 s")

    signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        with pytest.raises(ValueError, match=f"{name} is not a regular file"):
            burn_image.images_for((9, 0), burn_image.load_manifest(directory), directory)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


@pytest.mark.parametrize("ptx_version", ["7.0", "7.8", "8.0", "8.4", "8.5", "8.6", "8.7", "8.8"])
def test_the_first_driver_for_each_ptx_version_is_nvidias(ptx_version: str) -> None:
    from cuda.bindings import utils

    assert burn_image.min_cuda_version_for_ptx(ptx_version) == \
        utils.get_minimal_required_cuda_ver_from_ptx_ver(ptx_version)
