"""Builds the virtual GPU's libraries with the C compiler, against NVIDIA's own headers.

    scripts/vgpu build              # prints the directory with libcuda.so.1, libnvidia-ml.so.1 and vgpuctl

Headers: cuda.h and cudaTypedefs.h from the nvidia-cuda-runtime-cu12 wheel (numba-cuda[cu12] installs it),
nvml.h from the nvidia-nvml-dev wheel (requirements-dev.txt). Generated from them first: the driver's entry-point
table (gen_cuda_procs.py) and a stub for every NVML function nvml.c does not model (gen_nvml_stubs.py). Output:
build/vgpu/<hash>/, where the hash covers the sources, the headers, the compiler and the flags, so a change
rebuilds and nothing else does.
Two processes building at once take turns on a lock file; the loser finds the finished build.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
ROOT = PACKAGE.parent
SRC = PACKAGE / "src"
DEFAULT_OUT = ROOT / "build" / "vgpu"
CFLAGS = ("-std=gnu11", "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror")
OLD_DRIVER_DIR = "old-driver"
KEEP_BUILDS = 3


class BuildError(Exception):
    """The libraries could not be built (no compiler, missing headers, a compile error); the message says which."""


def _header(dist: str, name: str) -> Path:
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError as error:
        raise BuildError(f"{name} comes from the Python package {dist}, which is not installed "
                         f"(pip install -r requirements-dev.txt)") from error
    for f in files:
        if f.name == name:
            return Path(str(f.locate())).resolve()
    raise BuildError(f"the package {dist} has no {name}")


def headers() -> dict[str, Path]:
    """NVIDIA's headers the build compiles against."""
    return {
        "cuda.h": _header("nvidia-cuda-runtime-cu12", "cuda.h"),
        "cudaTypedefs.h": _header("nvidia-cuda-runtime-cu12", "cudaTypedefs.h"),
        "nvml.h": _header("nvidia-nvml-dev", "nvml.h"),
    }


def compiler() -> str | None:
    """The C compiler: $CC, else cc, else gcc; None where there is none."""
    for candidate in (os.environ.get("CC"), "cc", "gcc"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def _digest(cc: str, hdrs: dict[str, Path]) -> str:
    h = hashlib.sha256()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    h.update(version.encode())
    h.update(" ".join(CFLAGS).encode())
    for path in sorted(SRC.iterdir()) + [PACKAGE / "gen_cuda_procs.py", PACKAGE / "gen_nvml_stubs.py",
                                         Path(__file__).resolve()]:
        if path.is_file():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    for name, path in sorted(hdrs.items()):
        h.update(name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")


def _compile(cc: str, hdrs: dict[str, Path], out: Path) -> None:
    gen = out / "gen"
    gen.mkdir(parents=True)
    _run([sys.executable, str(PACKAGE / "gen_cuda_procs.py"), str(hdrs["cudaTypedefs.h"]), str(hdrs["cuda.h"]),
          str(SRC / "cuda.c"), str(gen / "cuda_procs.inc")])
    _run([sys.executable, str(PACKAGE / "gen_nvml_stubs.py"), str(hdrs["nvml.h"]), str(SRC / "nvml.c"),
          str(gen / "nvml_stubs.inc")])
    cuda_inc = str(hdrs["cuda.h"].parent)
    nvml_inc = str(hdrs["nvml.h"].parent)
    state = [str(SRC / name) for name in ("state.c", "mig.c", "gpm.c")]  # the shared state, MIG devices, GPM
    link = ["-Wl,-z,defs", "-lpthread"]
    _run([cc, *CFLAGS, f"-I{SRC}", f"-I{gen}", f"-I{cuda_inc}", "-Wl,-soname,libcuda.so.1",
          str(SRC / "cuda.c"), *state, "-o", str(out / "libcuda.so.1"), *link])
    for variant, extra in (("", []), (OLD_DRIVER_DIR, ["-DVGPU_OLD_DRIVER"])):
        target = out / variant
        target.mkdir(exist_ok=True)
        _run([cc, *CFLAGS, *extra, f"-I{SRC}", f"-I{gen}", f"-I{nvml_inc}", "-Wl,-soname,libnvidia-ml.so.1",
              str(SRC / "nvml.c"), *state, "-o", str(target / "libnvidia-ml.so.1"), *link])
    _run([cc, "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{SRC}", str(SRC / "vgpuctl.c"), *state,
          "-o", str(out / "vgpuctl"), *link])
    # The unversioned names too: some loaders try libcuda.so first, and must find ours before a system one.
    for name in ("libcuda.so", "libnvidia-ml.so"):
        (out / name).symlink_to(f"{name}.1")
    old = out / OLD_DRIVER_DIR
    (old / "libcuda.so.1").symlink_to("../libcuda.so.1")
    (old / "libcuda.so").symlink_to("../libcuda.so.1")
    (old / "libnvidia-ml.so").symlink_to("libnvidia-ml.so.1")


def build(out_dir: Path | None = None) -> Path:
    """The directory holding the built libraries (built now if the sources or headers changed)."""
    cc = compiler()
    if cc is None:
        raise BuildError("no C compiler (cc or gcc, or $CC) is installed")
    hdrs = headers()
    base = Path(out_dir) if out_dir is not None else DEFAULT_OUT
    base.mkdir(parents=True, exist_ok=True)
    digest = _digest(cc, hdrs)
    target = base / digest
    if (target / "STAMP").exists():
        return target
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "STAMP").exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{digest}-", dir=base))
        try:
            _compile(cc, hdrs, tmp)
            (tmp / "STAMP").write_text(digest + "\n")
            tmp.chmod(0o755)  # mkdtemp makes it private; containers' users read the libraries too
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        builds = sorted((p for p in base.iterdir() if p.is_dir() and (p / "STAMP").exists()),
                        key=lambda p: p.stat().st_mtime, reverse=True)
        for old in builds[KEEP_BUILDS:]:
            shutil.rmtree(old, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    try:
        print(build())
    except BuildError as error:
        print(f"vgpu build: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
