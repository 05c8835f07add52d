"""The virtual GPU: driver-free stand-ins for libcuda.so.1 and libnvidia-ml.so.1 (C, in vgpu/src) that the real,
unmodified numba-cuda and pynvml load, sharing one modelled GPU across processes.

    gpu = VirtualGpu(tmp_path / "gpu", gpus=2)
    subprocess.run([sys.executable, "-c", "..."], env=gpu.env())
    gpu.kernels()        # every kernel that ran: pid, device, start, end (Unix seconds)
    gpu.unimplemented()  # driver entry points called but not implemented (should stay empty)
    gpu.nvml_calls()     # every process's NVML calls so far, per function
    gpu.nvml_unmodelled()  # NVML functions called that it does not model (they answered NOT_SUPPORTED)

`nvml_cost={"nvmlDeviceGetComputeRunningProcesses_v3": 4.5}` makes each call of that function burn 4.5 ms of the
caller's CPU, as a slow driver would.

Never load the stand-ins into the calling process: everything on the virtual GPU runs in subprocesses with
`env()` (one libnvidia-ml per process). What the model does, and what it cannot prove: docs/testing.md, "The
virtual GPU".
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vgpu.build import OLD_DRIVER_DIR, BuildError, build

__all__ = ["STATE_ENV", "BuildError", "Context", "Kernel", "MigDevice", "VirtualGpu", "VgpuError", "build",
           "parse_cc"]

STATE_ENV = "VGPU_STATE"
WINDOW_MIN_S, WINDOW_MAX_S = 1 / 6, 1.0
MAX_GPUS = 8  # VGPU_MAX_GPUS in src/state.h
NVML_COST_MAX_MS = 10000.0  # the most a call may cost (src/state.c, nvml_cost)
# NVML's and CUDA's compute modes the virtual GPU models (EXCLUSIVE_THREAD is gone from both: "Support Removed")
COMPUTE_MODES = ("default", "prohibited", "exclusive_process")
MIG_MAX, MIG_TOTAL_MAX = 7, 16  # VGPU_MIG_SLOTS and VGPU_MAX_MIG in src/state.h
MINOR_MAX = 254  # /dev/nvidia255 is nvidiactl's


class VgpuError(Exception):
    """A bad option or a state that cannot be created; the message is one line."""


@dataclass(frozen=True)
class Kernel:
    """One kernel as the virtual GPU ran it (Unix seconds). `waited` is how long it was ready but queued
    behind other contexts' kernels on the device; `pid` is in the launching process's own PID namespace,
    `pidns` (the namespace's inode) tells processes of different containers apart."""

    pid: int
    device: int
    start: float
    end: float
    submit: float
    waited: float
    pidns: int = 0
    grid: int = 0  # blocks
    block: int = 0  # threads per block
    mig: int | None = None  # the GPU instance ID of the MIG device it ran on; None on a whole GPU
    kind: str = "other"  # "lean": the lean kernel, timed by its sleep (docs/design.md §15); "other": by its waves
    quanta: int | None = None  # the lean kernel's count of sleep quanta (its first argument); None for any other


@dataclass(frozen=True)
class Context:
    """A live process's context (or leftover allocations) on one device, as NVML would charge it."""

    pid: int
    pidns: int
    comm: str
    device: int
    open: bool
    mib: float
    mig: int | None = None  # the GPU instance ID where the context is on a MIG device


@dataclass(frozen=True)
class MigDevice:
    """A MIG device of the virtual GPU: its UUID (MIG-...), GPU and compute instance IDs, profile, SMs, memory; its
    GPU instance's profile ID and placement (start and size in memory slices), as nvmlGpuInstanceGetInfo gives them."""

    gpu: int
    uuid: str
    gi: int
    ci: int
    profile: str
    sms: int
    total_mib: float
    profile_id: int = 0
    placement: tuple[int, int] = (0, 0)


def parse_cc(cc: str) -> tuple[int, int]:
    """A compute capability "MAJOR.MINOR" (e.g. "8.6") as (8, 6); VgpuError naming the value otherwise."""
    major, sep, minor = str(cc).partition(".")
    if not (sep and major.isdigit() and minor.isdigit() and 1 <= int(major) <= 99 and len(minor) == 1):
        raise VgpuError(f"cc={cc!r}: expected a compute capability MAJOR.MINOR, e.g. 8.6")
    return int(major), int(minor)


def _pairs(name: str, pairs: Sequence[tuple[int, float]], gpus: int, integer: bool) -> str:
    items = []
    for pair in pairs:
        if len(pair) != 2:
            raise VgpuError(f"{name}: expected (device, value) pairs, got {pair!r}")
        device, value = pair
        if not (isinstance(device, int) and 0 <= device < gpus):
            raise VgpuError(f"{name}: device {device!r} is not one of 0..{gpus - 1}")
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0) or \
                (integer and int(value) != value):
            kind = "a whole number >= 0" if integer else "a number of seconds >= 0"
            raise VgpuError(f"{name}: value {value!r} for device {device} is not {kind}")
        items.append(f"{device}@{int(value) if integer else float(value)!r}")
    return ",".join(items)


class VirtualGpu:
    """A fresh virtual GPU whose state lives in `state_dir` (created; must not hold one already)."""

    def __init__(self, state_dir: str | os.PathLike[str], *, gpus: int = 1, window_s: float = 1 / 6,
                 timestamps: str = "unix", hide_processes: bool = False,
                 fail_gpu: Sequence[tuple[int, float]] = (), fail_gpu_after_calls: Sequence[tuple[int, int]] = (),
                 not_supported: Sequence[str] = (), old_driver: bool = False, sms: int = 132,
                 context_mib: float = 512.0, reserved_mib: float = 541.0, total_mib: float = 81559.0,
                 wave_s: float = 1e-4, overhead_s: float = 8e-6, latency_s: float = 5e-6,
                 history_s: float = 15.0, fastest_first: Sequence[int] | None = None,
                 nvml_cost: Mapping[str, float] | None = None,
                 compute_mode: str = "default", cc: str = "9.0", cuda_version: int = 12090, mig: int = 0,
                 minors: Sequence[int] | None = None, sleep_ratio: float = 1.2, sleep_jitter: float = 0.1,
                 lib_dir: str | os.PathLike[str] | None = None) -> None:
        if not (isinstance(gpus, int) and 1 <= gpus <= MAX_GPUS):
            raise VgpuError(f"gpus={gpus!r}: expected 1 to {MAX_GPUS}")
        if not (isinstance(window_s, (int, float)) and WINDOW_MIN_S - 1e-9 <= window_s <= WINDOW_MAX_S):
            raise VgpuError(f"window_s={window_s!r}: expected 1/6 to 1 second (NVML's sample windows)")
        if timestamps not in ("unix", "boot"):
            raise VgpuError(f"timestamps={timestamps!r}: expected unix or boot")
        if not (isinstance(sms, int) and 1 <= sms <= 1024):
            raise VgpuError(f"sms={sms!r}: expected 1 to 1024")
        if compute_mode not in COMPUTE_MODES:
            raise VgpuError(f"compute_mode={compute_mode!r}: expected one of {', '.join(COMPUTE_MODES)}")
        cc_major, cc_minor = parse_cc(cc)
        if not (isinstance(cuda_version, int) and 11000 <= cuda_version <= 99990 and cuda_version % 10 == 0):
            raise VgpuError(f"cuda_version={cuda_version!r}: expected the driver's CUDA version as "
                            "cuDriverGetVersion gives it, 1000 x major + 10 x minor, e.g. 12020 for 12.2")
        if not (isinstance(mig, int) and 0 <= mig <= MIG_MAX and gpus * mig <= MIG_TOTAL_MAX):
            raise VgpuError(f"mig={mig!r}: expected 0 (MIG off) to {MIG_MAX} MIG devices per GPU, "
                            f"at most {MIG_TOTAL_MAX} in all ({gpus} GPUs)")
        if mig and (cc_major, cc_minor) < (8, 0):
            raise VgpuError(f"mig={mig}: MIG needs compute capability 8.0 or newer, not {cc}")
        if minors is not None and not (len(minors) == gpus and len(set(minors)) == gpus
                                       and all(isinstance(m, int) and 0 <= m <= MINOR_MAX for m in minors)):
            raise VgpuError(f"minors={minors!r}: expected {gpus} distinct minor numbers from 0 to {MINOR_MAX}, "
                            "one per GPU (the N of /dev/nvidiaN)")
        if not (isinstance(sleep_ratio, (int, float)) and 0 < sleep_ratio <= 2):
            raise VgpuError(f"sleep_ratio={sleep_ratio!r}: expected what a sleep lasts over its request, (0, 2] "
                            "(nanosleep promises 0 to 2 times)")
        if not (isinstance(sleep_jitter, (int, float)) and 0 <= sleep_jitter < 1):
            raise VgpuError(f"sleep_jitter={sleep_jitter!r}: expected a share of the lean kernel's length, [0, 1)")
        for name in not_supported:
            if not (isinstance(name, str) and name.startswith("nvml") and name.replace("_", "").isalnum()):
                raise VgpuError(f"not_supported: {name!r} is not an NVML function name (nvml...)")
        self.state_dir = Path(state_dir).resolve()
        self.gpus = gpus
        self.old_driver = old_driver
        self.lib_dir = Path(lib_dir) if lib_dir is not None else build()
        self._ctl = self.lib_dir / "vgpuctl"
        config = {
            "gpus": gpus, "sms": sms, "window_s": repr(float(window_s)), "timestamps": timestamps,
            "hide_processes": int(bool(hide_processes)), "context_mib": context_mib, "reserved_mib": reserved_mib,
            "total_mib": total_mib, "wave_s": repr(float(wave_s)), "overhead_s": repr(float(overhead_s)),
            "latency_s": repr(float(latency_s)), "history_s": history_s, "compute_mode": compute_mode,
            "cc_major": cc_major, "cc_minor": cc_minor, "cuda_version": cuda_version, "mig": mig,
            "sleep_ratio": repr(float(sleep_ratio)), "sleep_jitter": repr(float(sleep_jitter)),
        }
        if fail_gpu:
            config["fail_gpu"] = _pairs("fail_gpu", fail_gpu, gpus, integer=False)
        if fail_gpu_after_calls:
            config["fail_gpu_calls"] = _pairs("fail_gpu_after_calls", fail_gpu_after_calls, gpus, integer=True)
        if not_supported:
            config["not_supported"] = ",".join(not_supported)
        if nvml_cost:
            items = []
            for name, ms in nvml_cost.items():
                if not (isinstance(ms, (int, float)) and math.isfinite(ms) and 0 <= ms <= NVML_COST_MAX_MS):
                    raise VgpuError(f"nvml_cost: {name}={ms!r} is not a number of milliseconds from 0 to "
                                    f"{NVML_COST_MAX_MS:g}")
                if not (isinstance(name, str) and name.startswith("nvml") and name.replace("_", "").isalnum()):
                    raise VgpuError(f"nvml_cost: {name!r} is not an NVML function name (nvml...)")
                items.append(f"{name}:{float(ms)!r}")
            config["nvml_cost"] = ",".join(items)
        if minors is not None:
            config["minors"] = ",".join(str(m) for m in minors)
        if fastest_first is not None:
            config["fastest_first"] = ",".join(str(int(i)) for i in fastest_first)
        if (self.state_dir / "state").exists():
            raise VgpuError(f"{self.state_dir} already holds a virtual GPU; use a fresh directory")
        text = "".join(f"{k}={v}\n" for k, v in config.items())
        proc = subprocess.run([str(self._ctl), "create", str(self.state_dir)], input=text, capture_output=True,
                              text=True, check=False)
        if proc.returncode != 0:
            raise VgpuError(proc.stderr.strip().removeprefix("vgpuctl: ") or f"vgpuctl exited {proc.returncode}")

    @property
    def library_dir(self) -> Path:
        """Where libcuda.so.1 and libnvidia-ml.so.1 of this GPU's driver variant are."""
        return self.lib_dir / OLD_DRIVER_DIR if self.old_driver else self.lib_dir

    def env(self, base: Mapping[str, str] | None = None, visible: str | None = None) -> dict[str, str]:
        """The environment for a subprocess on this GPU: `base` (default os.environ) plus the library path
        and the state path; the CUDA simulator switched off. `visible`: NVIDIA_VISIBLE_DEVICES, the devices of a
        container as the NVIDIA container toolkit sets it (NVML and CUDA then show only those, numbered from 0);
        without it the variable is dropped: the test machine's own value says nothing about the virtual GPU."""
        env = dict(os.environ if base is None else base)
        env.pop("NVIDIA_VISIBLE_DEVICES", None)
        if visible is not None:
            env["NVIDIA_VISIBLE_DEVICES"] = visible
        lib = str(self.library_dir)
        env["LD_LIBRARY_PATH"] = lib + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        env[STATE_ENV] = str(self.state_dir)
        env.pop("NUMBA_ENABLE_CUDASIM", None)
        return env

    def run(self, args: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """subprocess.run on this GPU (text mode, output captured unless given)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("check", False)
        env = self.env(kwargs.pop("env", None))
        return subprocess.run(list(args), env=env, **kwargs)

    def kernels(self) -> list[Kernel]:
        """Every kernel queued so far, in launch order per device (the ground truth, written at launch)."""
        path = self.state_dir / "kernels.jsonl"
        out = []
        for line in path.read_text().splitlines():
            if line.strip():
                out.append(Kernel(**json.loads(line)))
        return out

    def modules(self) -> list[dict[str, Any]]:
        """Every module load so far, in order: {"pid", "kind" (cubin, ptx or fatbin), "arch" and, for PTX,
        "ptx_version", "result" (the CUresult's name)}."""
        path = self.state_dir / "modules.jsonl"
        return [dict(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]

    def unimplemented(self) -> list[str]:
        """Entry points called but not implemented (each fails with an error code), sorted, once each."""
        text = (self.state_dir / "unimplemented").read_text()
        return sorted({line.strip() for line in text.splitlines() if line.strip()})

    def show(self) -> dict[str, Any]:
        """The state as vgpuctl shows it (after releasing dead processes' contexts): devices, processes."""
        proc = subprocess.run([str(self._ctl), "show", str(self.state_dir)], capture_output=True, text=True,
                              check=False)
        if proc.returncode != 0:
            raise VgpuError(proc.stderr.strip())
        return dict(json.loads(proc.stdout))

    def nvml_calls(self) -> dict[str, Any]:
        """Every process's NVML calls so far: {"now": Unix s, "cost_ms": {fn: ms}, "processes": [{"pid",
        "pidns", "comm", "calls": {fn: count}}]}; a process's row stays after it ends."""
        proc = subprocess.run([str(self._ctl), "calls", str(self.state_dir)], capture_output=True, text=True,
                              check=False)
        if proc.returncode != 0:
            raise VgpuError(proc.stderr.strip())
        return dict(json.loads(proc.stdout))

    def contexts(self) -> list[Context]:
        """Live contexts of every process, in every PID namespace."""
        out = []
        for p in self.show()["processes"]:
            for c in p["contexts"]:
                out.append(Context(pid=p["pid"], pidns=p["pidns"], comm=p["comm"], device=c["device"],
                                   open=c["open"], mib=c["mib"], mig=c.get("mig")))
        return out

    def memory_used_mib(self, device: int = 0) -> float:
        """Device memory in use by contexts and allocations (NVML's v2 `used`)."""
        return float(self.show()["devices"][device]["used_mib"])

    def uuids(self) -> list[str]:
        return [d["uuid"] for d in self.show()["devices"]]

    def mig_devices(self) -> list[MigDevice]:
        """Every MIG device, GPU by GPU, in the order nvmlDeviceGetMigDeviceHandleByIndex gives them."""
        return [MigDevice(gpu=d["index"], uuid=m["uuid"], gi=m["gi"], ci=m["ci"], profile=m["profile"], sms=m["sms"],
                          total_mib=m["total_mib"], profile_id=m["profile_id"], placement=tuple(m["placement"]))
                for d in self.show()["devices"] for m in d["mig"]]

    def minors(self) -> list[int]:
        """Each GPU's minor number (nvmlDeviceGetMinorNumber, /dev/nvidia<minor>), in index order."""
        return [int(d["minor"]) for d in self.show()["devices"]]

    def nvml_unmodelled(self) -> list[str]:
        """The NVML functions called that the virtual GPU does not model (each answered NOT_SUPPORTED), sorted."""
        text = (self.state_dir / "nvml_unmodelled").read_text()
        return sorted({line.strip() for line in text.splitlines() if line.strip()})
