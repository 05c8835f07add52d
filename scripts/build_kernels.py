#!/usr/bin/env python3
"""Compiles the kernels (forge_load/gpu/kernels.py, numba's: lean and burn) into the images the filler loads:
forge_load/gpu/prebuilt/ gets each kernel's PTX (for sm_70), one cubin per architecture of burn_image.CUBIN_ARCHES
(linked from that PTX by cuda.core's Linker, nvJitLink), and <kernel>.json naming them with their SHA-256.

    python3 scripts/build_kernels.py            # write them (needs requirements-dev.txt: numba-cuda[cu12])
    python3 scripts/build_kernels.py --check    # exit 1, naming what is stale, when the files differ from a build
    python3 scripts/build_kernels.py --check --dir DIR    # the same for the files in DIR

Needs no GPU. tests/test_kernels.py runs the check, and checks every cubin for local memory. The output depends
on the kernels and the compiler's version only (no dates, no host names), as long as it is the process's first
compilation of each kernel: numba numbers each compilation of a function in the entry's mangled name (B2v1, B2v2,
...), so build() compiles once per process and the tests run this script in a process of its own."""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from forge_load.gpu import burn_image  # noqa: E402

COMMAND = "python3 scripts/build_kernels.py"


@functools.cache
def build() -> dict[str, bytes]:
    """Every file of prebuilt/, by name."""
    from importlib.metadata import version

    from forge_load.gpu import kernels

    files: dict[str, bytes] = {}
    # The burn kernel first: numba's number in an entry's name counts every compilation of the process, and the
    # burn kernel's images stay as they were before the lean one existed.
    for kernel in (burn_image.BURN, burn_image.LEAN):
        ptx, entry = kernels.compile_ptx(burn_image.PTX_CC, kernel)
        own: dict[str, bytes] = {burn_image.ptx_name(kernel): ptx.encode()}
        for arch in burn_image.CUBIN_ARCHES:
            own[burn_image.cubin_name(arch, kernel)] = kernels.link_cubin(ptx, arch)
        ptx_version = re.search(r"^\s*\.version\s+(\d+\.\d+)", ptx, re.M)
        ptx_target = re.search(r"^\s*\.target\s+(sm_\d+)", ptx, re.M)
        if ptx_version is None or ptx_target is None:
            raise RuntimeError(f"the {kernel} kernel's PTX names no .version or .target")
        manifest = {
            "entry": entry,
            "ptx_version": ptx_version.group(1),
            "ptx_target": ptx_target.group(1),
            "cubin_arches": list(burn_image.CUBIN_ARCHES),
            "sha256": {name: hashlib.sha256(data).hexdigest() for name, data in sorted(own.items())},
            "compiler": f"numba-cuda {version('numba-cuda')}, nvJitLink {_nvjitlink_version()}",
            "generated_by": COMMAND,
        }
        own[burn_image.manifest_name(kernel)] = (json.dumps(manifest, indent=2) + "\n").encode()
        files.update(own)
    return files


def _nvjitlink_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nvidia-nvjitlink-cu12")
    except PackageNotFoundError:
        return "unknown"


def stale(directory: Path = burn_image.PREBUILT_DIR) -> list[str]:
    """The files of `directory` that a build would change (or add), by name."""
    return sorted(name for name, data in build().items()
                  if not (directory / name).is_file() or (directory / name).read_bytes() != data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the files differ from a build")
    parser.add_argument("--dir", type=Path, default=burn_image.PREBUILT_DIR, help="where the files are")
    args = parser.parse_args(argv)
    directory = args.dir
    if args.check:
        names = stale(directory)
        if names:
            print(f"stale kernel images in {directory}: {', '.join(names)}; run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in build().items():
        (directory / name).write_bytes(data)
        print(f"{directory / name}: {len(data)} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
