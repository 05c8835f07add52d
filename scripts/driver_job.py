#!/usr/bin/env python3
"""A CUDA job through the driver API alone (ctypes, libcuda.so.1; no framework, so it starts in milliseconds), for
tests/test_docker_watch.py and the benchmark's announced scenario: it opens its context on the GPU with a given
UUID a set time after its container's first instruction, launches kernels for a while, and prints one JSON line:

  {"event": "context", "process_start": T0, "wall_time_begin": ..., "wall_time": ..., "device": N}

and, once its kernels have ended and its context is released, {"event": "done", "wall_time": ...}. Its PTX is for
sm_70 and PTX ISA 8.0, which any Volta or newer GPU on a CUDA 12 driver compiles.

    JOB_T0=$(date +%s.%N) python3 driver_job.py run GPU-... --after 0.5 --seconds 1
    python3 driver_job.py index GPU-...    # prints the CUDA index of that GPU here (no context is made)

JOB_T0 is the Unix time of the container's first instruction. The device is found by UUID, so the job is right
whether the container sees every GPU or only its own (numbered from 0). Exit codes: 0 done; 3 a driver call
failed (the line names it).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

PTX = b".version 8.0\n.target sm_70\n.address_size 64\n.visible .entry driver_job_kernel()\n{\n ret;\n}\n\0"


class DriverError(Exception):
    pass


def call(cuda: ctypes.CDLL, name: str, *args: object) -> None:
    code = getattr(cuda, name)(*args)
    if code != 0:
        raise DriverError(f"{name} returned {code}")


def index_of(cuda: ctypes.CDLL, uuid: str) -> int:
    call(cuda, "cuInit", 0)
    count = ctypes.c_int()
    call(cuda, "cuDeviceGetCount", ctypes.byref(count))
    for index in range(count.value):
        device = ctypes.c_int()
        call(cuda, "cuDeviceGet", ctypes.byref(device), index)
        raw = (ctypes.c_ubyte * 16)()
        call(cuda, "cuDeviceGetUuid_v2", raw, device)
        h = bytes(raw).hex()
        if f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}".lower() == uuid.lower():
            return index
    raise DriverError(f"no device with UUID {uuid} among {count.value}")


def run(cuda: ctypes.CDLL, uuid: str, after_s: float, seconds: float) -> None:
    t0 = float(os.environ["JOB_T0"])
    time.sleep(max(0.0, t0 + after_s - time.time()))
    begin = time.time()
    index = index_of(cuda, uuid)
    device, context = ctypes.c_int(), ctypes.c_void_p()
    call(cuda, "cuDeviceGet", ctypes.byref(device), index)
    call(cuda, "cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
    call(cuda, "cuCtxSetCurrent", context)
    ready = time.time()
    print(json.dumps({"event": "context", "process_start": t0, "wall_time_begin": begin, "wall_time": ready,
                      "device": index}), flush=True)
    module, kernel = ctypes.c_void_p(), ctypes.c_void_p()
    call(cuda, "cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(PTX))
    call(cuda, "cuModuleGetFunction", ctypes.byref(kernel), module, b"driver_job_kernel")
    while time.time() < ready + seconds:
        call(cuda, "cuLaunchKernel", kernel, 1024, 1, 1, 256, 1, 1, 0, None, None, None)
        call(cuda, "cuCtxSynchronize")
    call(cuda, "cuModuleUnload", module)
    call(cuda, "cuDevicePrimaryCtxRelease_v2", device)
    print(json.dumps({"event": "done", "wall_time": time.time()}), flush=True)


def main(argv: list[str]) -> int:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        if argv[:1] == ["index"]:
            print(index_of(cuda, argv[1]))
            return 0
        after = float(argv[argv.index("--after") + 1]) if "--after" in argv else 0.0
        seconds = float(argv[argv.index("--seconds") + 1]) if "--seconds" in argv else 1.0
        run(cuda, argv[1], after, seconds)
    except (DriverError, OSError, AttributeError) as error:
        print(f"driver_job: {error}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
