"""CPU per driver call in the libcuda stand-in, measured from C (no Python in the loop), on a fresh virtual GPU.

    python -m vgpu.bench_calls [--calls N]

It compiles a small C program against NVIDIA's cuda.h, loads the stand-in the way cuda-bindings does
(dlopen libcuda.so.1, then cuGetProcAddress_v2), and times N calls each of cuLaunchKernelEx, cuEventRecord and
cuEventQuery with the process CPU clock. Prints one table; this is the stand-in's own cost, so that measurements
of the filler's CPU through the virtual GPU can be read as the cost of our Python and of the real libraries.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

from vgpu import VirtualGpu
from vgpu.build import build, compiler, headers

PROGRAM = r'''
#define _GNU_SOURCE
#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

#define GET(name, ver) PFN_##name##_v##ver name##_p; { CUdriverProcAddressQueryResult st; \
    if (gpa(#name, (void **)&name##_p, ver, 0, &st) != CUDA_SUCCESS || !name##_p) { \
        fprintf(stderr, "no %s\n", #name); return 1; } }
#define OK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { \
        fprintf(stderr, "%s: %d\n", #x, r_); return 1; } } while (0)

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 100000;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    typedef CUresult (*gpa_t)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
    gpa_t gpa = (gpa_t)dlsym(lib, "cuGetProcAddress_v2");
    GET(cuInit, 2000)
    GET(cuDevicePrimaryCtxRetain, 7000)
    GET(cuCtxSetCurrent, 4000)
    GET(cuLibraryLoadData, 12000)
    GET(cuLibraryGetKernel, 12000)
    GET(cuStreamCreate, 2000)
    GET(cuEventCreate, 2000)
    GET(cuEventRecord, 2000)
    GET(cuEventQuery, 2000)
    GET(cuLaunchKernelEx, 11060)
    CUcontext ctx; CUlibrary l; CUkernel k; CUstream s; CUevent e;
    OK(cuInit_p(0));
    OK(cuDevicePrimaryCtxRetain_p(&ctx, 0));
    OK(cuCtxSetCurrent_p(ctx));
    OK(cuLibraryLoadData_p(&l, "// .entry busy\n", NULL, NULL, 0, NULL, NULL, 0));
    OK(cuLibraryGetKernel_p(&k, l, "busy"));
    OK(cuStreamCreate_p(&s, 0));
    OK(cuEventCreate_p(&e, 0));
    CUlaunchConfig cfg = {1, 1, 1, 256, 1, 1, 0, s, NULL, 0};
    double t0 = cpu_s();
    for (int i = 0; i < n; i++) OK(cuLaunchKernelEx_p(&cfg, (CUfunction)k, NULL, NULL));
    double t1 = cpu_s();
    for (int i = 0; i < n; i++) OK(cuEventRecord_p(e, s));
    double t2 = cpu_s();
    for (int i = 0; i < n; i++) (void)cuEventQuery_p(e);
    double t3 = cpu_s();
    printf("%.3f %.3f %.3f\n", (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6, (t3 - t2) / n * 1e6);
    return 0;
}
'''


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100000, help="calls of each kind (default 100000)")
    args = parser.parse_args(argv)
    cc = compiler()
    if cc is None:
        print("bench_calls: no C compiler", file=sys.stderr)
        return 3
    lib_dir = build()
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "calls.c", Path(tmp) / "calls"
        src.write_text(PROGRAM)
        subprocess.run([cc, "-O2", "-Wall", "-Werror", f"-I{headers()['cuda.h'].parent}", str(src), "-o", str(exe),
                        "-ldl"], check=True)
        gpu = VirtualGpu(Path(tmp) / "gpu", lib_dir=lib_dir)
        proc = gpu.run([str(exe), str(args.calls)])
        if proc.returncode != 0:
            print(f"bench_calls: {proc.stderr.strip()}", file=sys.stderr)
            return 1
    launch, record, query = (float(x) for x in proc.stdout.split())
    print(f"CPU per call in the virtual GPU's libcuda.so.1 (virtual GPU, not a GPU measurement; "
          f"{args.calls} calls each, {platform.node()}, {date.today().isoformat()})")
    print("| call | CPU per call (us) |\n|---|---|")
    for name, value in (("cuLaunchKernelEx", launch), ("cuEventRecord", record), ("cuEventQuery", query)):
        print(f"| {name} | {value:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
