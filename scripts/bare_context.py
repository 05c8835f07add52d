#!/usr/bin/env python3
"""The floor for the benchmark's footprint: a minimal process that opens a bare CUDA context on one GPU,
the same way the filler does (the driver API through cuda-bindings, CUDA_MODULE_LOADING=LAZY, the device found
by UUID, its primary context), and no kernels, no allocations, no libraries. It prints one JSON line and exits:

  {"event": "bare_context", "pid": ..., "process_mib": ..., "device_delta_mib": ..., "wall_time": ...}

`process_mib` is NVML's used memory for this process (None where NVML does not say, e.g. without the
permission to see per-process memory); `device_delta_mib` is the device's used memory with the context
open minus before it (moves with anything else on the GPU, so run it on an idle GPU).
With --hold-s it keeps the context that many seconds more after the line (the power scenario's idle board with a
context). Exit codes: 0 done; 3 no GPU, no NVML or no CUDA (the line says which).

    python scripts/bare_context.py --gpu 0
    python scripts/bare_context.py --gpu 0 --hold-s 70
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", type=int, default=0, help="NVML index; default 0 (CUDA's device is found by UUID)")
    parser.add_argument("--settle-s", type=float, default=0.5, help="wait before reading NVML; default 0.5")
    parser.add_argument("--hold-s", type=float, default=0.0,
                        help="keep the context this many seconds after the line; default 0")
    args = parser.parse_args(argv)
    from forge_load.control.probe import NoGpuError
    from forge_load.gpu.launcher import cuda_devices, find_device, prepare_process
    from forge_load.gpu.nvml import NvmlProbe

    try:
        probe = NvmlProbe(str(args.gpu))
    except NoGpuError as error:
        print(f"bare_context: no usable GPU: {error}", file=sys.stderr)
        return 3
    try:
        before_mib = probe.memory_used_mib()
        try:
            prepare_process()  # as the filler's launcher does, before CUDA is touched
            from cuda.bindings import driver as cu

            def call(result: tuple[object, ...], name: str) -> object:
                if result[0] != cu.CUresult.CUDA_SUCCESS:
                    raise RuntimeError(f"{name} failed: {getattr(result[0], 'name', result[0])}")
                return result[1] if len(result) > 1 else None

            call(cu.cuInit(0), "cuInit")
            device = call(cu.cuDeviceGet(find_device(cuda_devices(cu), probe.info.uuid)), "cuDeviceGet")
            context = call(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")  # nothing else
            call(cu.cuCtxSetCurrent(context), "cuCtxSetCurrent")
            call(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        except Exception as error:  # noqa: BLE001 - one line for the benchmark's log
            print(f"bare_context: cannot create a CUDA context on GPU {args.gpu}: {type(error).__name__}: "
                  f"{error}", file=sys.stderr)
            return 3
        time.sleep(args.settle_s)
        after_mib = probe.memory_used_mib()
        processes = probe.processes() or []
        own = next((p.used_mib for p in processes if p.pid == os.getpid()), None)
        delta = after_mib - before_mib if after_mib is not None and before_mib is not None else None
        print(json.dumps({"event": "bare_context", "pid": os.getpid(), "gpu": args.gpu,
                          "process_mib": own, "device_delta_mib": delta, "device_before_mib": before_mib,
                          "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING"),
                          "wall_time": round(time.time(), 4)}, separators=(",", ":")), flush=True)
        time.sleep(max(args.hold_s, 0.0))
        cu.cuDevicePrimaryCtxRelease(device)
        return 0
    finally:
        probe.close()


if __name__ == "__main__":
    raise SystemExit(main())
