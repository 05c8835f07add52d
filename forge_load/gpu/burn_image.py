"""The kernels as the filler loads them: images compiled when the package is built, and how they are launched.

numba compiles `kernels.lean_py` and `kernels.burn_py` ahead of time (scripts/build_kernels.py): for each kernel, one
cubin per architecture of CUBIN_ARCHES and the PTX, into `prebuilt/`, with `<kernel>.json` naming them. This module
reads them and knows which one a GPU runs and how cuLaunchKernel is given the arguments; it imports no compiler
(neither numba nor CUDA), so the filler carries none (docs/design.md §8 and "Which kernel image a GPU runs").
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import stat
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The kernels, by the name of their images: the shapes of control/shape.py launch them.
LEAN: str = "lean"
BURN: str = "burn"
KERNEL_NAMES: tuple[str, ...] = (LEAN, BURN)

THREADS_PER_BLOCK: int = 256  # the burn kernel's blocks
LEAN_THREADS_PER_BLOCK: int = 32  # one warp: the least an SM can hold resident

# 4096 iterations: each one is a dependent FFMA (~4 cycles latency), so a lone block runs ~10 us; a full SM (8
# resident blocks of 256) is throughput bound at ~0.1 ms. Small enough that launches of a few ms
# (docs/design.md §6) are sized in fine steps by the grid, large enough that launch overhead (~5 us) is not most
# of the kernel.
BURN_ITERS: int = 4096

LEAN_MIN_CC: tuple[int, int] = (7, 0)  # PTX's nanosleep: sm_70 and newer

# The lean kernel's sleep request: nanosleep sleeps between 0 and twice it and is unreliable above ~1 ms
# (docs/design.md §15). 10 us sizes a ~10-ms kernel in ~1000 steps, each a few instructions of one warp.
SLEEP_QUANTUM_NS: int = 10_000

# Every value a thread computes is >= 0, so a negative sentinel never matches and the kernel never writes.
UNREACHABLE_SENTINEL: float = -1.0

# The one signature of each kernel compiled, shipped and launched.
BURN_SIGNATURE: str = "void(float32[::1], int32, float32)"
LEAN_SIGNATURE: str = "void(int32, uint32)"  # (quanta, quantum_ns)

# One cubin each: a cubin runs on its own major compute capability at an equal or higher minor, so these cover
# Volta (7.0) to Blackwell (12.x); the PTX (for sm_70) is for anything newer. sm_70 is also nanosleep's first.
CUBIN_ARCHES: tuple[int, ...] = (70, 75, 80, 86, 89, 90, 100, 120)
PTX_CC: tuple[int, int] = (7, 0)

PREBUILT_DIR: Path = Path(__file__).resolve().parent / "prebuilt"


def manifest_name(kernel: str = BURN) -> str:
    return f"{kernel}.json"


def cubin_name(arch: int, kernel: str = BURN) -> str:
    return f"{kernel}.sm_{arch}.cubin"


def ptx_name(kernel: str = BURN) -> str:
    return f"{kernel}.ptx"


MANIFEST_NAME: str = manifest_name(BURN)
PTX_NAME: str = ptx_name(BURN)

# numba's ABI for BURN_SIGNATURE, as cuLaunchKernel takes it: a `float32[::1]` array is its data model's seven
# fields (meminfo, parent, nitems, itemsize, data, shape[0], strides[0]), each pointer-sized, then the int32 and
# the float32. tests/test_kernels.py checks it against what numba itself passes at a launch.
ARGUMENT_LAYOUT: tuple[tuple[str, type[ctypes._SimpleCData]], ...] = (  # type: ignore[type-arg]
    ("meminfo", ctypes.c_void_p),
    ("parent", ctypes.c_void_p),
    ("nitems", ctypes.c_ssize_t),
    ("itemsize", ctypes.c_ssize_t),
    ("data", ctypes.c_void_p),
    ("shape", ctypes.c_ssize_t),
    ("strides", ctypes.c_ssize_t),
    ("iters", ctypes.c_int32),
    ("sentinel", ctypes.c_float),
)
# LEAN_SIGNATURE's: two 32-bit scalars, as they are. The virtual GPU reads them to time the kernel (vgpu/src/cuda.c).
LEAN_ARGUMENT_LAYOUT: tuple[tuple[str, type[ctypes._SimpleCData]], ...] = (  # type: ignore[type-arg]
    ("quanta", ctypes.c_int32),
    ("quantum_ns", ctypes.c_uint32),
)
OUT_ITEMS: int = 1  # the one float32 the burn kernel may write (never, with UNREACHABLE_SENTINEL)
OUT_ITEMSIZE: int = 4


@dataclass(frozen=True)
class Arguments:
    """The kernel's arguments packed for cuLaunchKernel's kernelParams: `params` holds each value's address."""

    params: ctypes.Array[ctypes.c_void_p]
    values: tuple[ctypes._SimpleCData, ...]  # type: ignore[type-arg]  # what `params` points at, kept alive

    @property
    def address(self) -> int:
        return ctypes.addressof(self.params)

    def as_ints(self) -> list[int | float | None]:
        return [v.value for v in self.values]

    def set(self, index: int, value: int) -> None:
        """Change one value in place: cuLaunchKernel copies the values at each call, so the next launch takes it."""
        self.values[index].value = value


def pack_arguments(out_address: int, iters: int = BURN_ITERS, sentinel: float = UNREACHABLE_SENTINEL) -> Arguments:
    """The arguments of one launch on a one-float32 output at device address `out_address`."""
    fields = {"meminfo": None, "parent": None, "nitems": OUT_ITEMS, "itemsize": OUT_ITEMSIZE, "data": out_address,
              "shape": OUT_ITEMS, "strides": OUT_ITEMSIZE, "iters": iters, "sentinel": sentinel}
    values = tuple(ctype(fields[name]) for name, ctype in ARGUMENT_LAYOUT)
    params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    return Arguments(params, values)


def pack_lean_arguments(quanta: int = 1, quantum_ns: int = SLEEP_QUANTUM_NS) -> Arguments:
    """The lean kernel's arguments; `quanta` (index 0) is set again for each launch (Arguments.set)."""
    values = tuple(ctype(v) for (_, ctype), v in zip(LEAN_ARGUMENT_LAYOUT, (quanta, quantum_ns)))
    params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    return Arguments(params, values)


@dataclass(frozen=True)
class Manifest:
    """What scripts/build_kernels.py wrote for one kernel: the entry's (mangled) name, the PTX's ISA version and
    target, each file's SHA-256 and the compiler that made them."""

    entry: str
    ptx_version: str  # the PTX's .version, e.g. "8.8"
    ptx_target: str  # its .target, e.g. "sm_70"
    cubin_arches: tuple[int, ...]
    sha256: dict[str, str]
    compiler: str
    kernel: str = BURN  # whose images: the files are named after it

    @property
    def ptx_min_cuda_version(self) -> int:
        """The oldest driver (cuDriverGetVersion's form) that JIT-compiles this PTX."""
        return min_cuda_version_for_ptx(self.ptx_version)


# The first CUDA release whose driver JIT-compiles each PTX ISA version: NVIDIA's PTX ISA release history
# (docs.nvidia.com/cuda/parallel-thread-execution, "Release Notes"), as cuda-bindings' own
# utils.get_minimal_required_cuda_ver_from_ptx_ver maps it.
_PTX_FIRST_CUDA: dict[str, int] = {
    **{f"7.{m}": 11000 + 10 * m for m in range(9)},
    **{f"8.{m}": 12000 + 10 * m for m in range(6)},
    "8.6": 12070, "8.7": 12080, "8.8": 12090, "9.0": 13000, "9.1": 13010,
}


def min_cuda_version_for_ptx(ptx_version: str) -> int:
    if ptx_version not in _PTX_FIRST_CUDA:
        raise ValueError(f"PTX ISA {ptx_version} is not one this release knows")
    return _PTX_FIRST_CUDA[ptx_version]


def cuda_version_text(version: int) -> str:
    """12090 as "12.9"."""
    return f"{version // 1000}.{version % 1000 // 10}"


# No image comes near it (a cubin is a few kB): a file this large is no image of ours.
MAX_IMAGE_BYTES: int = 64 << 20


def read_image_file(path: Path) -> bytes:
    """A file of the images (the manifest, a cubin, the PTX) as bytes; ValueError naming it where it is not a
    regular file: opened without blocking, so that a FIFO or a device in its place fails at once instead of
    waiting for ever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_IMAGE_BYTES:
            raise ValueError(f"{path} is not a regular file of at most {MAX_IMAGE_BYTES >> 20} MiB")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def load_manifest(directory: Path = PREBUILT_DIR, kernel: str = BURN) -> Manifest:
    """The manifest of `kernel`'s images in `directory`; ValueError naming it where it is not of this release's shape
    (a broken install, which the launcher says as such), OSError where it cannot be read."""
    path = directory / manifest_name(kernel)
    raw = read_image_file(path)
    try:
        data = json.loads(raw)
        values: dict[str, Any] = {}
        for name, kind in typing.get_type_hints(Manifest).items():
            if name == "kernel":
                continue  # not in the file: the file's name says it
            _check_type(data[name], kind, name)
            values[name] = tuple(data[name]) if typing.get_origin(kind) is tuple else data[name]
        manifest = Manifest(**values, kernel=kernel)
        if not re.fullmatch(r"sm_[0-9]+", manifest.ptx_target):
            raise ValueError(f"ptx_target {manifest.ptx_target!r} is not sm_<arch>")
        manifest.ptx_min_cuda_version  # noqa: B018 - raises for a PTX ISA this release does not know
    except (KeyError, TypeError, ValueError) as error:  # JSON's own errors are ValueErrors
        raise ValueError(f"{path} is not a kernel manifest of this release ({type(error).__name__}: {error})") \
            from None
    return manifest


def _check_type(value: object, kind: object, where: str) -> None:
    """TypeError where `value`, as JSON gives it, is not of `kind`: str, int, tuple[int, ...] (a list), dict[str,
    str] (an object)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is tuple:
        if not isinstance(value, list):
            raise TypeError(f"{where} is {type(value).__name__}, not a list")
        for item in value:
            _check_type(item, args[0], where)
    elif origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"{where} is {type(value).__name__}, not an object")
        for key, item in value.items():
            _check_type(key, args[0], where)
            _check_type(item, args[1], where)
    elif not isinstance(value, typing.cast(type, kind)) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{where} holds {value!r}, not {getattr(kind, '__name__', kind)}")


def pick_cubin(cc: tuple[int, int], arches: tuple[int, ...] = CUBIN_ARCHES) -> int | None:
    """The cubin a GPU of compute capability `cc` runs: its own, else its major's with the highest lower minor
    (sm_80 on 8.7, never sm_80 on 9.0); None when there is none."""
    major, minor = cc
    fitting = [a for a in arches if a // 10 == major and a % 10 <= minor]
    return max(fitting) if fitting else None


@dataclass(frozen=True)
class Image:
    kind: str  # "cubin" or "ptx"
    name: str  # the file's name, e.g. lean.sm_90.cubin
    data: bytes  # as cuModuleLoadData takes it (PTX NUL-terminated)


def images_for(cc: tuple[int, int], manifest: Manifest, directory: Path = PREBUILT_DIR) -> list[Image]:
    """What to try on a GPU of `cc`, in order: the fitting cubin (if any), then the PTX. A file that does not match
    the manifest's hash is a broken install: ValueError naming it."""
    names: list[tuple[str, str]] = []
    arch = pick_cubin(cc, manifest.cubin_arches)
    if arch is not None:
        names.append(("cubin", cubin_name(arch, manifest.kernel)))
    names.append(("ptx", ptx_name(manifest.kernel)))
    images = []
    for kind, name in names:
        data = read_image_file(directory / name)
        if hashlib.sha256(data).hexdigest() != manifest.sha256.get(name):
            manifest_file = manifest_name(manifest.kernel)
            raise ValueError(f"{directory / name} does not match {manifest_file}: reinstall forge-load")
        images.append(Image(kind, name, data + b"\0" if kind == "ptx" else data))
    return images
