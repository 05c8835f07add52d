/* libcuda.so.1 for the virtual GPU: the driver API that numba-cuda, cuda-core and cuda-bindings call,
 * on the shared state of state.h. Compiled against NVIDIA's cuda.h and cudaTypedefs.h with -Werror, so every
 * implemented entry point has NVIDIA's exact signature; every other entry point that cuGetProcAddress hands
 * out is a stub that records its name and fails (generated: cuda_procs.inc).
 *
 * The model (the README's testing section says the same):
 * - a primary context per process and device, charged `context_mib` from retain to release/reset/exit;
 *   allocations charged rounded up to `alloc_granularity_mib` (device memory is host memory here, so copies
 *   round-trip, but kernels compute nothing);
 * - a kernel takes overhead + waves x wave time, waves = ceil(grid / (SMs x resident blocks per SM)),
 *   resident blocks per SM = min(max_blocks_per_sm, threads_per_sm / block threads); the lean kernel (an entry
 *   name with "lean_py" in it, numba's mangling of forge_load.gpu.kernels.lean_py) takes overhead + its arguments'
 *   quanta x request x sleep_ratio, +- sleep_jitter drawn per kernel (docs/design.md §15); it becomes ready
 *   `latency` after the launch call, or when its stream's previous kernel ends, and starts when the device is
 *   free: kernels of all contexts on a device run one at a time, first come first served;
 * - events complete when their stream reaches them: on an idle stream at record time;
 * - a device lost (fault injection) makes every call in its context fail with CUDA_ERROR_LAUNCH_FAILED;
 * - compute modes (all devices alike): in EXCLUSIVE_PROCESS a process's first retain of a primary context fails
 *   with CUDA_ERROR_DEVICE_UNAVAILABLE while another live process holds one on the device, idle or not; in
 *   PROHIBITED every first retain fails with CUDA_ERROR_UNKNOWN (as cuda.h documents);
 * - module images are checked as a driver checks them (docs/design.md, "Which kernel image a GPU runs"): a cubin
 *   runs only on its own major compute capability at an equal or higher minor, else
 *   CUDA_ERROR_NO_BINARY_FOR_GPU; PTX is JIT-compiled only up to the PTX ISA the driver's CUDA version knows, else
 *   CUDA_ERROR_UNSUPPORTED_PTX_VERSION, and only for a .target the device reaches, else CUDA_ERROR_INVALID_PTX;
 *   every load is one line of modules.jsonl. A fatbin is recorded, not looked into.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <cudaTypedefs.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "state.h"

#define EXPORT __attribute__((visibility("default")))
#define MAGIC_CTX 0x78744356u
#define MAGIC_STREAM 0x6d727453u
#define MAGIC_EVENT 0x746e7645u
#define MAGIC_LIB 0x62694c56u
#define MAGIC_KERNEL 0x6e724b56u
#define MAGIC_ALLOC 0x636c6c41u
#define ALLOC_HEADER 256
#define LOST_ERROR CUDA_ERROR_LAUNCH_FAILED
#define MAX_LIMITS 16

typedef struct vctx vctx;

typedef struct {
    uint32_t magic;
    vctx *ctx;
    int64_t tail_ns; /* end of the last kernel queued on this stream */
} vstream;

typedef struct valloc {
    uint32_t magic;
    size_t size;
    vctx *ctx;
    struct valloc *prev, *next;
} valloc_t;

struct vctx {
    uint32_t magic;
    int dev;      /* device index (NVML order) */
    int ordinal;  /* CUDA ordinal in this process */
    int refcount;
    int active;
    unsigned flags;
    int64_t tail_ns; /* end of the last kernel of any stream of this context */
    vstream default_stream;
    valloc_t *allocs;
    size_t limits[MAX_LIMITS];
};

typedef struct {
    uint32_t magic;
    vctx *ctx;
    unsigned flags;
    int recorded;
    int64_t t_ns;
} vevent;

typedef struct {
    uint32_t magic;
    size_t size;
    unsigned char *image;
} vlib;

typedef struct {
    uint32_t magic;
    vlib *lib;
    char name[]; /* mangled names of numba kernels run to hundreds of characters */
} vkernel;

typedef struct {
    const char *name;
    int version;
    int ptds;
    int implemented;
    void *fn;
} vgpu_proc_entry;

typedef struct {
    int code;
    const char *name;
    const char *text;
} vgpu_error_entry;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static vgpu_view g_view;
static int g_attached;    /* the state is mapped */
static int g_initialized; /* cuInit succeeded */
static int g_nvisible;
static int g_visible[VGPU_MAX_DEVS]; /* CUDA ordinal -> device index (a MIG device's: mig.c) */
static vctx g_primary[VGPU_MAX_DEVS];
static __thread vctx *t_stack[32];
static __thread int t_depth;

/* --- helpers ------------------------------------------------------------------------------------------- */

static CUresult vgpu_stub_called(const char *name, int version, const char *ptds);

static vctx *current(void) { return t_depth > 0 ? t_stack[t_depth - 1] : NULL; }

static void sleep_until(int64_t t_ns) {
    struct timespec ts = {(time_t)(t_ns / 1000000000), (long)(t_ns % 1000000000)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

static int lost(int dev, int64_t now_ns) { return vgpu_lost(&g_view, dev, now_ns, 0); }

static int device_of(CUdevice ordinal) {
    if (!g_initialized || ordinal < 0 || ordinal >= g_nvisible) return -1;
    return g_visible[ordinal];
}

/* A usable context: the given one (or the current one when NULL), active, and its device not lost. */
static CUresult check_ctx(vctx **pctx) {
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    vctx *ctx = *pctx ? *pctx : current();
    if (ctx == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    if (ctx->magic != MAGIC_CTX || !ctx->active) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    if (lost(ctx->dev, vgpu_now_ns())) return LOST_ERROR;
    *pctx = ctx;
    return CUDA_SUCCESS;
}

static vstream *stream_of(CUstream hs, vctx *ctx) {
    if (hs == NULL || hs == CU_STREAM_LEGACY || hs == CU_STREAM_PER_THREAD) return &ctx->default_stream;
    vstream *s = (vstream *)hs;
    return s->magic == MAGIC_STREAM ? s : NULL;
}

static vevent *event_of(CUevent he) {
    vevent *e = (vevent *)he;
    return e != NULL && e->magic == MAGIC_EVENT ? e : NULL;
}

/* GPUs in MIG mode (docs/design.md, MIG): a CUDA process enumerates one MIG device only, the first that
 * CUDA_VISIBLE_DEVICES names by MIG-<uuid> (a unique prefix will do), or without the variable the first MIG device
 * of the first GPU; a GPU-<uuid> or an ordinal of a GPU in MIG mode names no CUDA device. */
static int parse_visible_mig(const char *env, const int *base, int nbase) {
    const vgpu_state *st = g_view.st;
    int dev = -1;
    if (env == NULL) {
        if (nbase > 0) dev = vgpu_mig_device(st, base[0], 0);
    } else {
        char buf[1024];
        snprintf(buf, sizeof buf, "%s", env);
        char *save = NULL, *tok = strtok_r(buf, ",", &save);
        while (tok != NULL && *tok == ' ') tok++;
        if (tok != NULL && strncmp(tok, "MIG-", 4) == 0) {
            char *end = tok + strlen(tok);
            while (end > tok && end[-1] == ' ') *--end = '\0';
            dev = vgpu_mig_by_uuid(st, tok, 1);
            int in_container = 0;
            for (int i = 0; dev >= 0 && i < nbase; i++) in_container |= base[i] == st->dev[dev].parent;
            if (!in_container) dev = -1;
        }
    }
    if (dev >= 0) g_visible[g_nvisible++] = dev;
    return g_nvisible;
}

static int parse_visible(void) {
    const vgpu_state *st = g_view.st;
    /* A container (NVIDIA_VISIBLE_DEVICES) has only its devices; CUDA orders and numbers those. */
    int cont[VGPU_MAX_GPUS];
    int ncont = vgpu_container_devices(st, cont);
    int base[VGPU_MAX_GPUS];
    const char *order = getenv("CUDA_DEVICE_ORDER");
    int pci = order != NULL && strcmp(order, "PCI_BUS_ID") == 0;
    int nbase = 0;
    for (int i = 0; i < st->gpus; i++) {
        int dev = pci ? i : st->fastest_first[i];
        for (int j = 0; j < ncont; j++)
            if (cont[j] == dev) base[nbase++] = dev;
    }
    const char *env = getenv("CUDA_VISIBLE_DEVICES");
    g_nvisible = 0;
    if (st->mig > 0) return parse_visible_mig(env, base, nbase);
    if (env == NULL) {
        for (int i = 0; i < nbase; i++) g_visible[g_nvisible++] = base[i];
        return g_nvisible;
    }
    /* As the driver does: entries are ordinals in CUDA_DEVICE_ORDER or GPU-UUID prefixes; the list ends
     * at the first entry that names no device (or one already listed). */
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", env);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ') tok++;
        char *end = tok + strlen(tok);
        while (end > tok && end[-1] == ' ') *--end = '\0';
        int dev = -1;
        if (strncmp(tok, "GPU-", 4) == 0) {
            int matches = 0;
            for (int i = 0; i < nbase; i++) {
                char uuid[48];
                vgpu_uuid_string(st->dev[base[i]].uuid, uuid);
                if (strncasecmp(uuid, tok, strlen(tok)) == 0) {
                    dev = base[i];
                    matches++;
                }
            }
            if (matches != 1) break;
        } else {
            char *num_end = NULL;
            long k = strtol(tok, &num_end, 10);
            if (num_end == tok || *num_end != '\0' || k < 0 || k >= nbase) break;
            dev = base[k];
        }
        int dup = 0;
        for (int i = 0; i < g_nvisible; i++) dup |= g_visible[i] == dev;
        if (dup) break;
        g_visible[g_nvisible++] = dev;
    }
    return g_nvisible;
}

static void at_fork_prepare(void) { pthread_mutex_lock(&g_mu); }
static void at_fork_parent(void) { pthread_mutex_unlock(&g_mu); }
static void at_fork_child(void) {
    /* A forked child has no CUDA: contexts stay with the parent (the real driver forbids using them). */
    vgpu_after_fork_child(&g_view);
    memset(g_primary, 0, sizeof g_primary);
    g_initialized = 0;
    t_depth = 0;
    pthread_mutex_unlock(&g_mu);
}

/* --- init, driver, errors ------------------------------------------------------------------------------ */

CUresult CUDAAPI cuInit(unsigned int Flags) {
    if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    CUresult rc = CUDA_SUCCESS;
    if (!g_attached) {
        char why[512];
        if (vgpu_attach(&g_view, why, sizeof why) != 0) {
            static int said;
            if (!said++) fprintf(stderr, "vgpu: libcuda: no virtual GPU: %s\n", why);
            rc = CUDA_ERROR_NO_DEVICE;
            goto out;
        }
        g_attached = 1;
        pthread_atfork(at_fork_prepare, at_fork_parent, at_fork_child);
    }
    if (!g_initialized) {
        if (parse_visible() == 0) {
            rc = CUDA_ERROR_NO_DEVICE;
            goto out;
        }
        g_initialized = 1;
    }
out:
    pthread_mutex_unlock(&g_mu);
    return rc;
}

CUresult CUDAAPI cuDriverGetVersion(int *driverVersion) {
    if (driverVersion == NULL) return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = g_attached ? g_view.st->cuda_version : 12090;
    return CUDA_SUCCESS;
}

/* nvJitLink asks for the driver's private tables; refusing is what it copes with (it links without). */
CUresult CUDAAPI cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId) {
    (void)pExportTableId;
    if (ppExportTable != NULL) *ppExportTable = NULL;
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* --- devices ------------------------------------------------------------------------------------------- */

CUresult CUDAAPI cuDeviceGetCount(int *count) {
    if (count == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    *count = g_nvisible;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal) {
    if (device == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (device_of(ordinal) < 0) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetName(char *name, int len, CUdevice dev) {
    int d = device_of(dev);
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0) return CUDA_ERROR_INVALID_DEVICE;
    if (name == NULL || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "%s", g_view.st->dev[d].name);
    return CUDA_SUCCESS;
}

static CUresult get_uuid(CUuuid *uuid, CUdevice dev) {
    int d = device_of(dev);
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0) return CUDA_ERROR_INVALID_DEVICE;
    if (uuid == NULL) return CUDA_ERROR_INVALID_VALUE;
    memcpy(uuid->bytes, g_view.st->dev[d].uuid, 16);
    return CUDA_SUCCESS;
}

static CUresult CUDAAPI device_get_uuid_v1(CUuuid *uuid, CUdevice dev) { return get_uuid(uuid, dev); }
CUresult CUDAAPI cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) { return get_uuid(uuid, dev); }

CUresult CUDAAPI cuDeviceTotalMem(size_t *bytes, CUdevice dev) {
    int d = device_of(dev);
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0) return CUDA_ERROR_INVALID_DEVICE;
    if (bytes == NULL) return CUDA_ERROR_INVALID_VALUE;
    *bytes = g_view.st->dev[d].total_bytes;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev) {
    int d = device_of(dev);
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0) return CUDA_ERROR_INVALID_DEVICE;
    if (pciBusId == NULL || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(pciBusId, (size_t)len, "0000:%02x:00.0", g_view.st->dev[d].pci_bus);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceComputeCapability(int *major, int *minor, CUdevice dev) {
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (device_of(dev) < 0) return CUDA_ERROR_INVALID_DEVICE;
    if (major == NULL || minor == NULL) return CUDA_ERROR_INVALID_VALUE;
    *major = g_view.st->cc_major;
    *minor = g_view.st->cc_minor;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
    int d = device_of(dev);
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0) return CUDA_ERROR_INVALID_DEVICE;
    if (pi == NULL) return CUDA_ERROR_INVALID_VALUE;
    const vgpu_state *st = g_view.st;
    int v;
    switch (attrib) {  /* an H100 SXM's values, with the configured SM count */
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: v = 64; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: v = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: v = 49152; break;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_PITCH: v = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: v = 1980000; break;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT: v = 512; break;
    case CU_DEVICE_ATTRIBUTE_GPU_OVERLAP: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: v = st->dev[d].sms; break;
    case CU_DEVICE_ATTRIBUTE_KERNEL_EXEC_TIMEOUT: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_INTEGRATED: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_MODE: v = st->dev[d].compute_mode; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_ECC_ENABLED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: v = (int)st->dev[d].pci_bus; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_TCC_DRIVER: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: v = 2619000; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: v = 5120; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: v = 52428800; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: v = st->threads_per_sm; break;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: v = 3; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: v = st->cc_major; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: v = st->cc_minor; break;
    case CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: v = 233472; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD_GROUP_ID: v = d; break;
    case CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO: v = 2; break;
    case CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: v = 232448; break;
    case CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_DIRECT_MANAGED_MEM_ACCESS_FROM_HOST: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE: v = 32768000; break;
    case CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE: v = 134213632; break;
    case CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: v = st->max_blocks_per_sm; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MPS_ENABLED: v = 0; break;
    default: {
        char what[96];
        snprintf(what, sizeof what, "cuDeviceGetAttribute(attrib=%d)", (int)attrib);
        vgpu_unimplemented(&g_view, what);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    }
    *pi = v;
    return CUDA_SUCCESS;
}

/* --- contexts ------------------------------------------------------------------------------------------ */

static void free_allocs(vctx *ctx) {
    valloc_t *a = ctx->allocs;
    while (a != NULL) {
        valloc_t *next = a->next;
        a->magic = 0;
        free(a);
        a = next;
    }
    ctx->allocs = NULL;
}

/* Under the state lock: may this process create a context on `dev` in its compute mode? cuda.h documents
 * CUDA_ERROR_UNKNOWN for a PROHIBITED device and CUDA_ERROR_DEVICE_UNAVAILABLE for a device unavailable
 * "due to use of CU_COMPUTEMODE_EXCLUSIVE_PROCESS": another live process holds a context there, idle or not. */
static CUresult compute_mode_allows(int dev) {
    vgpu_state *st = g_view.st;
    if (st->dev[dev].compute_mode == CU_COMPUTEMODE_PROHIBITED) return CUDA_ERROR_UNKNOWN;
    if (st->dev[dev].compute_mode != CU_COMPUTEMODE_EXCLUSIVE_PROCESS) return CUDA_SUCCESS;
    vgpu_reap(&g_view);  /* a dead process's context is gone: its slot lock is free */
    for (int i = 0; i < VGPU_MAX_PROCS; i++)
        if (i != g_view.slot && st->proc[i].in_use && st->proc[i].ctx_open[dev]) return CUDA_ERROR_DEVICE_UNAVAILABLE;
    return CUDA_SUCCESS;
}

/* Under g_mu: create the primary context's resources and charge them. */
static CUresult open_primary(vctx *ctx) {
    vgpu_state *st = g_view.st;
    vgpu_lock(&g_view);
    CUresult rc = compute_mode_allows(ctx->dev);
    int slot = rc == CUDA_SUCCESS ? vgpu_own_slot(&g_view) : -1;
    if (rc != CUDA_SUCCESS) {
        /* refused by the compute mode */
    } else if (slot < 0) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;  /* more processes than the virtual GPU keeps track of */
    } else if (vgpu_used_bytes(st, ctx->dev) + st->context_bytes > vgpu_usable_bytes(st, ctx->dev)) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        st->proc[slot].ctx_open[ctx->dev] = 1;
        st->proc[slot].ctx_bytes[ctx->dev] = st->context_bytes;
        st->proc[slot].alloc_bytes[ctx->dev] = 0;
        vgpu_contexts_changed(st, vgpu_now_ns());
    }
    vgpu_unlock(&g_view);
    if (rc != CUDA_SUCCESS) return rc;
    ctx->active = 1;
    ctx->tail_ns = 0;
    ctx->default_stream.magic = MAGIC_STREAM;
    ctx->default_stream.ctx = ctx;
    ctx->default_stream.tail_ns = 0;
    ctx->allocs = NULL;
    size_t limits[MAX_LIMITS] = {0};
    limits[CU_LIMIT_STACK_SIZE] = 1024;
    limits[CU_LIMIT_PRINTF_FIFO_SIZE] = 1048576;
    limits[CU_LIMIT_MALLOC_HEAP_SIZE] = 8388608;
    limits[CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH] = 2;
    limits[CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT] = 2048;
    limits[CU_LIMIT_MAX_L2_FETCH_GRANULARITY] = 32;
    memcpy(ctx->limits, limits, sizeof limits);
    return CUDA_SUCCESS;
}

/* Under g_mu: the context's memory goes back to the device; what was queued has run (or runs) anyway. As the
 * driver does, the handle stays current wherever it was; using it fails with CONTEXT_IS_DESTROYED until a
 * retain makes the primary context active again. */
static void close_primary(vctx *ctx) {
    vgpu_state *st = g_view.st;
    free_allocs(ctx);
    ctx->active = 0;
    if (g_view.slot >= 0) {
        vgpu_lock(&g_view);
        st->proc[g_view.slot].ctx_open[ctx->dev] = 0;
        st->proc[g_view.slot].ctx_bytes[ctx->dev] = 0;
        st->proc[g_view.slot].alloc_bytes[ctx->dev] = 0;
        vgpu_contexts_changed(st, vgpu_now_ns());
        vgpu_unlock(&g_view);
    }
}

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    if (pctx == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    int d = device_of(dev);
    CUresult rc = CUDA_SUCCESS;
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (d < 0) {
        rc = CUDA_ERROR_INVALID_DEVICE;
    } else if (lost(d, vgpu_now_ns())) {
        rc = LOST_ERROR;
    } else {
        vctx *ctx = &g_primary[d];
        ctx->magic = MAGIC_CTX;
        ctx->dev = d;
        ctx->ordinal = dev;
        if (!ctx->active) rc = open_primary(ctx);
        if (rc == CUDA_SUCCESS) {
            ctx->refcount++;
            *pctx = (CUcontext)ctx;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* Release drops one reference, and the last one resets the context; reset destroys its resources but, as
 * documented for the driver, does not release: the retains still count. */
static CUresult release_or_reset(CUdevice dev, int reset) {
    pthread_mutex_lock(&g_mu);
    int d = device_of(dev);
    CUresult rc = CUDA_SUCCESS;
    if (!g_initialized)
        rc = CUDA_ERROR_NOT_INITIALIZED;
    else if (d < 0)
        rc = CUDA_ERROR_INVALID_DEVICE;
    else if (!reset && g_primary[d].refcount <= 0)
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if ((reset || --g_primary[d].refcount == 0) && g_primary[d].active)
        close_primary(&g_primary[d]);
    pthread_mutex_unlock(&g_mu);
    return rc;
}

CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev) { return release_or_reset(dev, 0); }
CUresult CUDAAPI cuDevicePrimaryCtxReset(CUdevice dev) { return release_or_reset(dev, 1); }

CUresult CUDAAPI cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    int d = device_of(dev);
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0) return CUDA_ERROR_INVALID_DEVICE;
    if (flags == NULL || active == NULL) return CUDA_ERROR_INVALID_VALUE;
    *flags = g_primary[d].flags;
    *active = g_primary[d].active;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags) {
    int d = device_of(dev);
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0) return CUDA_ERROR_INVALID_DEVICE;
    g_primary[d].flags = flags;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetCurrent(CUcontext *pctx) {
    if (pctx == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    *pctx = (CUcontext)current();
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) {
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    vctx *c = (vctx *)ctx;
    if (c != NULL && c->magic != MAGIC_CTX) return CUDA_ERROR_INVALID_CONTEXT;
    if (c == NULL) {
        if (t_depth > 0) t_depth--;
    } else if (t_depth == 0) {
        t_stack[t_depth++] = c;
    } else {
        t_stack[t_depth - 1] = c;
    }
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxPushCurrent(CUcontext ctx) {
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    vctx *c = (vctx *)ctx;
    if (c == NULL || c->magic != MAGIC_CTX) return CUDA_ERROR_INVALID_CONTEXT;
    if (t_depth >= (int)(sizeof t_stack / sizeof t_stack[0])) return CUDA_ERROR_INVALID_VALUE;
    t_stack[t_depth++] = c;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxPopCurrent(CUcontext *pctx) {
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (t_depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    vctx *c = t_stack[--t_depth];
    if (pctx != NULL) *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetDevice(CUdevice *device) {
    if (device == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    vctx *c = current();
    if (c == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    *device = c->ordinal;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetApiVersion(CUcontext ctx, unsigned int *version) {
    if (version == NULL) return CUDA_ERROR_INVALID_VALUE;
    vctx *c = (vctx *)ctx;
    CUresult rc = check_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    *version = 3020;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSetLimit(CUlimit limit, size_t value) {
    vctx *c = NULL;
    CUresult rc = check_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if ((int)limit < 0 || (int)limit >= MAX_LIMITS || limit == CU_LIMIT_MAX) return CUDA_ERROR_UNSUPPORTED_LIMIT;
    c->limits[limit] = value;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetLimit(size_t *pvalue, CUlimit limit) {
    if (pvalue == NULL) return CUDA_ERROR_INVALID_VALUE;
    vctx *c = NULL;
    CUresult rc = check_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if ((int)limit < 0 || (int)limit >= MAX_LIMITS || limit == CU_LIMIT_MAX) return CUDA_ERROR_UNSUPPORTED_LIMIT;
    *pvalue = c->limits[limit];
    return CUDA_SUCCESS;
}

static CUresult wait_ctx(vctx *c) {
    pthread_mutex_lock(&g_mu);
    int64_t until = c->tail_ns;
    pthread_mutex_unlock(&g_mu);
    sleep_until(until);
    return lost(c->dev, vgpu_now_ns()) ? LOST_ERROR : CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSynchronize(void) {
    vctx *c = NULL;
    CUresult rc = check_ctx(&c);
    return rc != CUDA_SUCCESS ? rc : wait_ctx(c);
}

/* --- memory: host memory behind device pointers -------------------------------------------------------- */

static void charge(vctx *c, int64_t delta) {
    if (g_view.slot < 0) return;
    vgpu_lock(&g_view);
    g_view.st->proc[g_view.slot].alloc_bytes[c->dev] += (uint64_t)delta;
    vgpu_unlock(&g_view);
}

CUresult CUDAAPI cuMemAlloc(CUdeviceptr *dptr, size_t bytesize) {
    if (dptr == NULL) return CUDA_ERROR_INVALID_VALUE;
    vctx *c = NULL;
    CUresult rc = check_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    vgpu_state *st = g_view.st;
    vgpu_lock(&g_view);
    uint64_t used = vgpu_used_bytes(st, c->dev);
    vgpu_unlock(&g_view);
    valloc_t *a = NULL;
    if (used + bytesize > vgpu_usable_bytes(st, c->dev) ||
        posix_memalign((void **)&a, ALLOC_HEADER, ALLOC_HEADER + bytesize) != 0) {
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->magic = MAGIC_ALLOC;
    a->size = bytesize;
    a->ctx = c;
    a->prev = NULL;
    a->next = c->allocs;
    if (c->allocs) c->allocs->prev = a;
    c->allocs = a;
    charge(c, (int64_t)bytesize);
    pthread_mutex_unlock(&g_mu);
    *dptr = (CUdeviceptr)((unsigned char *)a + ALLOC_HEADER);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemFree(CUdeviceptr dptr) {
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (dptr == 0) return CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    valloc_t *a = (valloc_t *)((unsigned char *)dptr - ALLOC_HEADER);
    if (a->magic != MAGIC_ALLOC || a->ctx == NULL || !a->ctx->active) {
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    vctx *c = a->ctx;
    if (a->prev) a->prev->next = a->next; else c->allocs = a->next;
    if (a->next) a->next->prev = a->prev;
    charge(c, -(int64_t)a->size);
    a->magic = 0;
    free(a);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemGetInfo(size_t *free_bytes, size_t *total) {
    vctx *c = NULL;
    CUresult rc = check_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    vgpu_state *st = g_view.st;
    pthread_mutex_lock(&g_mu);
    vgpu_lock(&g_view);
    vgpu_reap(&g_view);
    uint64_t used = vgpu_used_bytes(st, c->dev);
    vgpu_unlock(&g_view);
    pthread_mutex_unlock(&g_mu);
    if (free_bytes) *free_bytes = vgpu_usable_bytes(st, c->dev) - used;
    if (total) *total = st->dev[c->dev].total_bytes;
    return CUDA_SUCCESS;
}

static CUresult copy_sync(void *dst, const void *src, size_t n) {
    vctx *c = NULL;
    CUresult rc = check_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    rc = wait_ctx(c);  /* a synchronous copy waits for the context's work, as on the legacy stream */
    if (rc == CUDA_SUCCESS && n) memmove(dst, src, n);
    return rc;
}

static CUresult copy_async(void *dst, const void *src, size_t n, CUstream hs) {
    vctx *c = NULL;
    CUresult rc = check_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (stream_of(hs, c) == NULL) return CUDA_ERROR_INVALID_HANDLE;
    if (n) memmove(dst, src, n);  /* kernels compute nothing, so the bytes are final already */
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr dst, const void *src, size_t n) { return copy_sync((void *)dst, src, n); }
CUresult CUDAAPI cuMemcpyDtoH(void *dst, CUdeviceptr src, size_t n) { return copy_sync(dst, (void *)src, n); }
CUresult CUDAAPI cuMemcpyDtoD(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return copy_sync((void *)dst, (void *)src, n);
}
CUresult CUDAAPI cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) { return copy_sync((void *)dst, (void *)src, n); }
CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr dst, const void *src, size_t n, CUstream hs) {
    return copy_async((void *)dst, src, n, hs);
}
CUresult CUDAAPI cuMemcpyDtoHAsync(void *dst, CUdeviceptr src, size_t n, CUstream hs) {
    return copy_async(dst, (void *)src, n, hs);
}
CUresult CUDAAPI cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream hs) {
    return copy_async((void *)dst, (void *)src, n, hs);
}
CUresult CUDAAPI cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream hs) {
    return copy_async((void *)dst, (void *)src, n, hs);
}

CUresult CUDAAPI cuMemsetD8(CUdeviceptr dst, unsigned char uc, size_t n) {
    vctx *c = NULL;
    CUresult rc = check_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    memset((void *)dst, uc, n);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr dst, unsigned char uc, size_t n, CUstream hs) {
    vctx *c = NULL;
    CUresult rc = check_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (stream_of(hs, c) == NULL) return CUDA_ERROR_INVALID_HANDLE;
    memset((void *)dst, uc, n);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemsetD32(CUdeviceptr dst, unsigned int ui, size_t n) {
    vctx *c = NULL;
    CUresult rc = check_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    unsigned int *p = (unsigned int *)dst;
    for (size_t i = 0; i < n; i++) p[i] = ui;
    return CUDA_SUCCESS;
}

/* --- streams and events -------------------------------------------------------------------------------- */

CUresult CUDAAPI cuStreamCreate(CUstream *phStream, unsigned int Flags) {
    (void)Flags;
    if (phStream == NULL) return CUDA_ERROR_INVALID_VALUE;
    vctx *c = NULL;
    CUresult rc = check_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    vstream *s = calloc(1, sizeof *s);
    if (s == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    s->magic = MAGIC_STREAM;
    s->ctx = c;
    *phStream = (CUstream)s;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority) {
    (void)priority;
    return cuStreamCreate(phStream, flags);
}

CUresult CUDAAPI cuStreamDestroy(CUstream hStream) {
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    vstream *s = (vstream *)hStream;
    if (s == NULL || s->magic != MAGIC_STREAM) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_mu);
    s->magic = 0;
    pthread_mutex_unlock(&g_mu);
    free(s);
    return CUDA_SUCCESS;
}

static CUresult stream_tail(CUstream hs, vctx **pc, int64_t *tail) {
    vctx *c = NULL;
    CUresult rc = check_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&g_mu);
    vstream *s = stream_of(hs, c);
    if (s != NULL) *tail = s->tail_ns;
    pthread_mutex_unlock(&g_mu);
    if (s == NULL) return CUDA_ERROR_INVALID_HANDLE;
    *pc = c;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamSynchronize(CUstream hStream) {
    vctx *c;
    int64_t tail;
    CUresult rc = stream_tail(hStream, &c, &tail);
    if (rc != CUDA_SUCCESS) return rc;
    sleep_until(tail);
    return lost(c->dev, vgpu_now_ns()) ? LOST_ERROR : CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamQuery(CUstream hStream) {
    vctx *c;
    int64_t tail;
    CUresult rc = stream_tail(hStream, &c, &tail);
    if (rc != CUDA_SUCCESS) return rc;
    return tail <= vgpu_now_ns() ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult CUDAAPI cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
    (void)Flags;
    vctx *c = NULL;
    CUresult rc = check_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    vevent *e = event_of(hEvent);
    if (e == NULL) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_mu);
    vstream *s = stream_of(hStream, c);
    if (s != NULL && e->recorded && e->t_ns > s->tail_ns) s->tail_ns = e->t_ns;
    pthread_mutex_unlock(&g_mu);
    return s != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult CUDAAPI cuEventCreate(CUevent *phEvent, unsigned int Flags) {
    if (phEvent == NULL) return CUDA_ERROR_INVALID_VALUE;
    vctx *c = NULL;
    CUresult rc = check_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    vevent *e = calloc(1, sizeof *e);
    if (e == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = MAGIC_EVENT;
    e->ctx = c;
    e->flags = Flags;
    *phEvent = (CUevent)e;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventDestroy(CUevent hEvent) {
    vevent *e = event_of(hEvent);
    if (e == NULL) return CUDA_ERROR_INVALID_HANDLE;
    e->magic = 0;
    free(e);
    return CUDA_SUCCESS;
}

/* The event completes when its stream reaches it: at the end of the stream's last kernel, or now. */
CUresult CUDAAPI cuEventRecord(CUevent hEvent, CUstream hStream) {
    vevent *e = event_of(hEvent);
    if (e == NULL) return CUDA_ERROR_INVALID_HANDLE;
    vctx *c = e->ctx;
    CUresult rc = check_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    int64_t now = vgpu_now_ns();
    pthread_mutex_lock(&g_mu);
    vstream *s = stream_of(hStream, c);
    if (s != NULL) {
        e->t_ns = s->tail_ns > now ? s->tail_ns : now;
        e->recorded = 1;
    }
    pthread_mutex_unlock(&g_mu);
    return s != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult CUDAAPI cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags) {
    (void)flags;
    return cuEventRecord(hEvent, hStream);
}

CUresult CUDAAPI cuEventQuery(CUevent hEvent) {
    vevent *e = event_of(hEvent);
    if (e == NULL) return CUDA_ERROR_INVALID_HANDLE;
    int64_t now = vgpu_now_ns();
    if (lost(e->ctx->dev, now)) return LOST_ERROR;
    return !e->recorded || e->t_ns <= now ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult CUDAAPI cuEventSynchronize(CUevent hEvent) {
    vevent *e = event_of(hEvent);
    if (e == NULL) return CUDA_ERROR_INVALID_HANDLE;
    if (e->recorded) sleep_until(e->t_ns);
    return lost(e->ctx->dev, vgpu_now_ns()) ? LOST_ERROR : CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    if (pMilliseconds == NULL) return CUDA_ERROR_INVALID_VALUE;
    vevent *a = event_of(hStart), *b = event_of(hEnd);
    if (a == NULL || b == NULL || !a->recorded || !b->recorded) return CUDA_ERROR_INVALID_HANDLE;
    if ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING) return CUDA_ERROR_INVALID_HANDLE;
    int64_t now = vgpu_now_ns();
    if (lost(a->ctx->dev, now)) return LOST_ERROR;
    if (a->t_ns > now || b->t_ns > now) return CUDA_ERROR_NOT_READY;
    *pMilliseconds = (float)((double)(b->t_ns - a->t_ns) / 1e6);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    return cuEventElapsedTime(pMilliseconds, hStart, hEnd);
}

/* --- code: libraries, modules, kernels ----------------------------------------------------------------- */

static size_t image_size(const void *image) {
    const unsigned char *p = image;
    if (memcmp(p, "\177ELF", 4) == 0 && p[4] == 2) {  /* a 64-bit cubin: the section headers come last */
        uint64_t shoff;
        uint16_t shentsize, shnum;
        memcpy(&shoff, p + 0x28, 8);
        memcpy(&shentsize, p + 0x3a, 2);
        memcpy(&shnum, p + 0x3c, 2);
        return (size_t)(shoff + (uint64_t)shentsize * shnum);
    }
    uint32_t magic;
    memcpy(&magic, p, 4);
    if (magic == 0xBA55ED50u) {  /* a fatbin: header size + payload size */
        uint16_t header;
        uint64_t size;
        memcpy(&header, p + 6, 2);
        memcpy(&size, p + 8, 8);
        return (size_t)header + (size_t)size;
    }
    return strlen((const char *)p) + 1;  /* PTX text */
}

/* The newest PTX ISA (major * 10 + minor) a driver of this CUDA version JIT-compiles: NVIDIA's PTX ISA release
 * history (CUDA 11.x: 7.x; 12.0-12.4: 8.0-8.4; 12.5 and 12.6: 8.5; 12.7: 8.6; 12.8: 8.7; 12.9: 8.8; 13.x: 9.x). */
static int max_ptx_isa(int cuda_version) {
    int major = cuda_version / 1000, minor = (cuda_version % 1000) / 10;
    if (major == 12) {
        static const int isa12[] = {80, 81, 82, 83, 84, 85, 85, 86, 87, 88};
        return isa12[minor < 10 ? minor : 9];
    }
    if (major == 11) return 70 + (minor < 9 ? minor : 8);
    if (major >= 13) return 90 + (major - 13) * 10 + minor;
    return 0;
}

/* The SM a CUDA ELF is for: e_flags, whose layout changed with ELF ABI version 8 (CUDA 12.8's cubins). */
static int cubin_sm(const unsigned char *p) {
    uint32_t flags;
    memcpy(&flags, p + 0x30, 4);
    return p[8] >= 8 ? (int)((flags >> 8) & 0xff) : (int)(flags & 0xff);
}

/* Append one line to modules.jsonl: what was loaded and what the load answered. */
static void record_module(const char *kind, const char *what, CUresult rc) {
    const char *name = NULL;
    if (cuGetErrorName(rc, &name) != CUDA_SUCCESS || name == NULL) name = "CUDA_ERROR_UNKNOWN";
    char line[256];
    int n = snprintf(line, sizeof line, "{\"pid\":%d,\"kind\":\"%s\",%s,\"result\":\"%s\"}\n", (int)getpid(),
                     kind, what, name);
    if (n > 0 && (size_t)n < sizeof line && g_view.modules_fd >= 0 && write(g_view.modules_fd, line, (size_t)n) < 0) {
        /* the record is best effort: the load itself answered already */
    }
}

/* Does the device run this image? As a driver decides, and recorded. */
static CUresult check_image(const unsigned char *p, size_t size) {
    const vgpu_state *st = g_view.st;
    int cc = st->cc_major * 10 + st->cc_minor;
    char what[96];
    CUresult rc = CUDA_SUCCESS;
    const char *kind;
    if (size >= 0x40 && memcmp(p, "\x7f" "ELF", 4) == 0) {
        kind = "cubin";
        int sm = cubin_sm(p);
        snprintf(what, sizeof what, "\"arch\":\"sm_%d\"", sm);
        if (sm / 10 != st->cc_major || sm % 10 > st->cc_minor) rc = CUDA_ERROR_NO_BINARY_FOR_GPU;
    } else if (size >= 4 && p[0] == 0x50 && p[1] == 0xED && p[2] == 0x55 && p[3] == 0xBA) {
        kind = "fatbin";
        snprintf(what, sizeof what, "\"arch\":null");
    } else {
        kind = "ptx";
        const char *text = (const char *)p;
        const char *v = strstr(text, ".version ");
        const char *t = strstr(text, ".target ");
        int vmaj = 0, vmin = 0, tsm = 0;
        if (v == NULL || sscanf(v, ".version %d.%d", &vmaj, &vmin) != 2 || t == NULL ||
            sscanf(t, ".target sm_%d", &tsm) != 1) {
            snprintf(what, sizeof what, "\"ptx_version\":null");
            rc = CUDA_ERROR_INVALID_IMAGE;
        } else {
            snprintf(what, sizeof what, "\"ptx_version\":\"%d.%d\",\"arch\":\"sm_%d\"", vmaj, vmin, tsm);
            if (vmaj * 10 + vmin > max_ptx_isa(st->cuda_version))
                rc = CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
            else if (tsm > cc)
                rc = CUDA_ERROR_INVALID_PTX;  /* ptxas refuses a .target above the GPU it compiles for */
        }
    }
    record_module(kind, what, rc);
    return rc;
}

static CUresult load_image(vlib **out, const void *image) {
    if (out == NULL || image == NULL) return CUDA_ERROR_INVALID_VALUE;
    size_t size = image_size(image);
    if (size == 0 || size > ((size_t)256 << 20)) return CUDA_ERROR_INVALID_IMAGE;
    CUresult checked = check_image(image, size);
    if (checked != CUDA_SUCCESS) return checked;
    vlib *lib = calloc(1, sizeof *lib);
    unsigned char *copy = malloc(size);
    if (lib == NULL || copy == NULL) {
        free(lib);
        free(copy);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    memcpy(copy, image, size);
    lib->magic = MAGIC_LIB;
    lib->size = size;
    lib->image = copy;
    *out = lib;
    return CUDA_SUCCESS;
}

static CUresult get_kernel(vkernel **out, vlib *lib, const char *name) {
    if (out == NULL || name == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (lib == NULL || lib->magic != MAGIC_LIB) return CUDA_ERROR_INVALID_HANDLE;
    size_t n = strlen(name);
    if (n == 0 || n > 65536) return CUDA_ERROR_INVALID_VALUE;
    if (memmem(lib->image, lib->size, name, n) == NULL) return CUDA_ERROR_NOT_FOUND;  /* not in the image */
    vkernel *k = calloc(1, sizeof *k + n + 1);
    if (k == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    k->magic = MAGIC_KERNEL;
    k->lib = lib;
    memcpy(k->name, name, n + 1);
    *out = k;
    return CUDA_SUCCESS;
}

static CUresult unload(vlib *lib) {
    if (lib == NULL || lib->magic != MAGIC_LIB) return CUDA_ERROR_INVALID_HANDLE;
    lib->magic = 0;
    free(lib->image);
    free(lib);  /* kernel handles of it stay allocated: a later launch through one fails its magic check */
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                   void **jitOptionsValues, unsigned int numJitOptions,
                                   CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                   unsigned int numLibraryOptions) {
    (void)jitOptions, (void)jitOptionsValues, (void)numJitOptions;
    (void)libraryOptions, (void)libraryOptionValues, (void)numLibraryOptions;
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    return load_image((vlib **)library, code);
}

CUresult CUDAAPI cuLibraryUnload(CUlibrary library) { return unload((vlib *)library); }

CUresult CUDAAPI cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name) {
    return get_kernel((vkernel **)pKernel, (vlib *)library, name);
}

CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image) {
    vctx *c = NULL;
    CUresult rc = check_ctx(&c);
    return rc != CUDA_SUCCESS ? rc : load_image((vlib **)module, image);
}

CUresult CUDAAPI cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                    CUjit_option *options, void **optionValues) {
    (void)numOptions, (void)options, (void)optionValues;
    return cuModuleLoadData(module, image);
}

CUresult CUDAAPI cuModuleUnload(CUmodule hmod) { return unload((vlib *)hmod); }

CUresult CUDAAPI cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    return get_kernel((vkernel **)hfunc, (vlib *)hmod, name);
}

CUresult CUDAAPI cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel) {
    vkernel *k = (vkernel *)kernel;
    if (pFunc == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (k == NULL || k->magic != MAGIC_KERNEL) return CUDA_ERROR_INVALID_HANDLE;
    *pFunc = (CUfunction)k;  /* one handle serves both, as a CUkernel may be passed where a CUfunction goes */
    return CUDA_SUCCESS;
}

static CUresult func_attribute(int *pi, CUfunction_attribute attrib, const vkernel *k) {
    if (pi == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (k == NULL || k->magic != MAGIC_KERNEL) return CUDA_ERROR_INVALID_HANDLE;
    switch (attrib) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
    case CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: *pi = 0; break;
    case CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES: *pi = 0; break;
    case CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES: *pi = 0; break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *pi = 32; break;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION: *pi = 90; break;
    case CU_FUNC_ATTRIBUTE_BINARY_VERSION: *pi = 90; break;
    case CU_FUNC_ATTRIBUTE_CACHE_MODE_CA: *pi = 0; break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *pi = 49152; break;
    case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: *pi = -1; break;
    default: {
        char what[96];
        snprintf(what, sizeof what, "function attribute %d", (int)attrib);
        vgpu_unimplemented(&g_view, what);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    }
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuKernelGetAttribute(int *pi, CUfunction_attribute attrib, CUkernel kernel, CUdevice dev) {
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (device_of(dev) < 0) return CUDA_ERROR_INVALID_DEVICE;
    return func_attribute(pi, attrib, (const vkernel *)kernel);
}

CUresult CUDAAPI cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc) {
    if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED;
    return func_attribute(pi, attrib, (const vkernel *)hfunc);
}

/* --- launches ------------------------------------------------------------------------------------------ */

/* A uniform draw on [-1, 1) for the lean kernel's jitter: xorshift64*, seeded by the process. */
static double jitter_draw(void) {
    static uint64_t x;
    if (x == 0) x = 0x9E3779B97F4A7C15ull ^ (uint64_t)getpid();
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    return (double)((x * 0x2545F4914F6CDD1Dull) >> 11) / 4503599627370496.0 - 1.0;  /* 53 bits over 2^52 */
}

/* The lean kernel (kernels.lean_py, burn_image.LEAN_ARGUMENT_LAYOUT): its arguments are an int32 count of quanta and
 * a uint32 request in ns, as numba's ABI passes two 32-bit scalars. -1 where the launch is not the lean kernel's. */
static int64_t lean_sleep_ns(const vkernel *k, void **params, int64_t *quanta) {
    if (strstr(k->name, "lean_py") == NULL || params == NULL || params[0] == NULL || params[1] == NULL) return -1;
    int32_t count;
    uint32_t request_ns;
    memcpy(&count, params[0], sizeof count);
    memcpy(&request_ns, params[1], sizeof request_ns);
    *quanta = count > 0 ? count : 0;
    const vgpu_state *st = g_view.st;
    double ratio = (double)st->sleep_ratio_ppm / 1e6 * (1.0 + (double)st->sleep_jitter_ppm / 1e6 * jitter_draw());
    return (int64_t)((double)*quanta * (double)request_ns * ratio + 0.5);
}

static CUresult launch(const vkernel *k, uint64_t grid, uint64_t threads, CUstream hs, void **params) {
    if (k == NULL || k->magic != MAGIC_KERNEL) return CUDA_ERROR_INVALID_HANDLE;
    if (grid == 0 || threads == 0 || threads > 1024) return CUDA_ERROR_INVALID_VALUE;
    vctx *c = NULL;
    CUresult rc = check_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    vgpu_state *st = g_view.st;
    uint64_t resident = (uint64_t)st->threads_per_sm / threads;
    if (resident > (uint64_t)st->max_blocks_per_sm) resident = (uint64_t)st->max_blocks_per_sm;
    if (resident == 0) resident = 1;
    uint64_t per_wave = resident * (uint64_t)st->dev[c->dev].sms;
    int64_t waves = (int64_t)((grid + per_wave - 1) / per_wave);
    int64_t quanta = 0;
    int64_t sleep_ns = lean_sleep_ns(k, params, &quanta);
    int lean = sleep_ns >= 0;
    /* A lean kernel's length is its sleep (its grid is at most a wave: one block per SM); any other, its waves. */
    int64_t duration = st->overhead_ns + (lean ? sleep_ns : waves * st->wave_ns);

    pthread_mutex_lock(&g_mu);
    vstream *s = stream_of(hs, c);
    if (s == NULL) {
        pthread_mutex_unlock(&g_mu);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    int64_t now = vgpu_now_ns();
    int64_t ready = now + st->latency_ns;
    if (s->tail_ns > ready) ready = s->tail_ns;
    int64_t start, end;
    char line[400];
    vgpu_lock(&g_view);
    vgpu_queue_kernel(&g_view, c->dev, now, ready, duration, &start, &end);
    vgpu_gpm_record(st, c->dev, start, end, grid, threads, lean);
    double off = (double)st->unix_offset_ns;
    /* device: the GPU's NVML index; mig: the GPU instance ID of the MIG device it ran on, or null */
    const vgpu_device *kd = &st->dev[c->dev];
    char mig[16] = "null";
    if (kd->parent >= 0) snprintf(mig, sizeof mig, "%d", kd->gi_id);
    char quanta_text[24] = "null";
    if (lean) snprintf(quanta_text, sizeof quanta_text, "%lld", (long long)quanta);
    /* kind: "lean" for the lean kernel (quanta: its count of sleep quanta), else "other" (quanta null) */
    int n = snprintf(line, sizeof line,
                     "{\"pid\":%d,\"device\":%d,\"start\":%.6f,\"end\":%.6f,\"submit\":%.6f,\"waited\":%.6f,"
                     "\"pidns\":%llu,\"grid\":%llu,\"block\":%llu,\"mig\":%s,\"kind\":\"%s\",\"quanta\":%s}\n",
                     (int)getpid(), kd->parent >= 0 ? kd->parent : c->dev, ((double)start + off) / 1e9,
                     ((double)end + off) / 1e9, ((double)now + off) / 1e9, (double)(start - ready) / 1e9,
                     (unsigned long long)g_view.pidns, (unsigned long long)grid, (unsigned long long)threads, mig,
                     lean ? "lean" : "other", quanta_text);
    if (g_view.kernels_fd >= 0 && write(g_view.kernels_fd, line, (size_t)n) < 0) {
        /* the record is for tests; the launch itself stands */
    }
    vgpu_unlock(&g_view);
    s->tail_ns = end;
    if (end > c->tail_ns) c->tail_ns = end;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra) {
    (void)extra;
    if (config == NULL) return CUDA_ERROR_INVALID_VALUE;
    uint64_t grid = (uint64_t)config->gridDimX * config->gridDimY * config->gridDimZ;
    uint64_t threads = (uint64_t)config->blockDimX * config->blockDimY * config->blockDimZ;
    return launch((const vkernel *)f, grid, threads, config->hStream, kernelParams);
}

CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra) {
    (void)sharedMemBytes, (void)extra;
    uint64_t grid = (uint64_t)gridDimX * gridDimY * gridDimZ;
    uint64_t threads = (uint64_t)blockDimX * blockDimY * blockDimZ;
    return launch((const vkernel *)f, grid, threads, hStream, kernelParams);
}

/* --- cuGetProcAddress: the table cuda-bindings resolves everything through ----------------------------- */

#define VGPU_IMPL_cuInit_v2000 cuInit
#define VGPU_IMPL_cuDriverGetVersion_v2020 cuDriverGetVersion
#define VGPU_IMPL_cuGetErrorName_v6000 cuGetErrorName
#define VGPU_IMPL_cuGetErrorString_v6000 cuGetErrorString
#define VGPU_IMPL_cuGetExportTable_v3000 cuGetExportTable
#define VGPU_IMPL_cuGetProcAddress_v11030 get_proc_address_v1
#define VGPU_IMPL_cuGetProcAddress_v12000 cuGetProcAddress
#define VGPU_IMPL_cuDeviceGetCount_v2000 cuDeviceGetCount
#define VGPU_IMPL_cuDeviceGet_v2000 cuDeviceGet
#define VGPU_IMPL_cuDeviceGetName_v2000 cuDeviceGetName
#define VGPU_IMPL_cuDeviceGetUuid_v9020 device_get_uuid_v1
#define VGPU_IMPL_cuDeviceGetUuid_v11040 cuDeviceGetUuid_v2
#define VGPU_IMPL_cuDeviceTotalMem_v3020 cuDeviceTotalMem
#define VGPU_IMPL_cuDeviceGetPCIBusId_v4010 cuDeviceGetPCIBusId
#define VGPU_IMPL_cuDeviceComputeCapability_v2000 cuDeviceComputeCapability
#define VGPU_IMPL_cuDeviceGetAttribute_v2000 cuDeviceGetAttribute
#define VGPU_IMPL_cuDevicePrimaryCtxRetain_v7000 cuDevicePrimaryCtxRetain
#define VGPU_IMPL_cuDevicePrimaryCtxRelease_v11000 cuDevicePrimaryCtxRelease
#define VGPU_IMPL_cuDevicePrimaryCtxReset_v11000 cuDevicePrimaryCtxReset
#define VGPU_IMPL_cuDevicePrimaryCtxGetState_v7000 cuDevicePrimaryCtxGetState
#define VGPU_IMPL_cuDevicePrimaryCtxSetFlags_v11000 cuDevicePrimaryCtxSetFlags
#define VGPU_IMPL_cuCtxGetCurrent_v4000 cuCtxGetCurrent
#define VGPU_IMPL_cuCtxSetCurrent_v4000 cuCtxSetCurrent
#define VGPU_IMPL_cuCtxPushCurrent_v4000 cuCtxPushCurrent
#define VGPU_IMPL_cuCtxPopCurrent_v4000 cuCtxPopCurrent
#define VGPU_IMPL_cuCtxGetDevice_v2000 cuCtxGetDevice
#define VGPU_IMPL_cuCtxGetApiVersion_v3020 cuCtxGetApiVersion
#define VGPU_IMPL_cuCtxSetLimit_v3010 cuCtxSetLimit
#define VGPU_IMPL_cuCtxGetLimit_v3010 cuCtxGetLimit
#define VGPU_IMPL_cuCtxSynchronize_v2000 cuCtxSynchronize
#define VGPU_IMPL_cuMemAlloc_v3020 cuMemAlloc
#define VGPU_IMPL_cuMemFree_v3020 cuMemFree
#define VGPU_IMPL_cuMemGetInfo_v3020 cuMemGetInfo
#define VGPU_IMPL_cuMemcpyHtoD_v3020 cuMemcpyHtoD
#define VGPU_IMPL_cuMemcpyDtoH_v3020 cuMemcpyDtoH
#define VGPU_IMPL_cuMemcpyDtoD_v3020 cuMemcpyDtoD
#define VGPU_IMPL_cuMemcpy_v4000 cuMemcpy
#define VGPU_IMPL_cuMemcpyHtoDAsync_v3020 cuMemcpyHtoDAsync
#define VGPU_IMPL_cuMemcpyDtoHAsync_v3020 cuMemcpyDtoHAsync
#define VGPU_IMPL_cuMemcpyDtoDAsync_v3020 cuMemcpyDtoDAsync
#define VGPU_IMPL_cuMemcpyAsync_v4000 cuMemcpyAsync
#define VGPU_IMPL_cuMemsetD8_v3020 cuMemsetD8
#define VGPU_IMPL_cuMemsetD8Async_v3020 cuMemsetD8Async
#define VGPU_IMPL_cuMemsetD32_v3020 cuMemsetD32
#define VGPU_IMPL_cuStreamCreate_v2000 cuStreamCreate
#define VGPU_IMPL_cuStreamCreateWithPriority_v5050 cuStreamCreateWithPriority
#define VGPU_IMPL_cuStreamDestroy_v4000 cuStreamDestroy
#define VGPU_IMPL_cuStreamSynchronize_v2000 cuStreamSynchronize
#define VGPU_IMPL_cuStreamQuery_v2000 cuStreamQuery
#define VGPU_IMPL_cuStreamWaitEvent_v3020 cuStreamWaitEvent
#define VGPU_IMPL_cuEventCreate_v2000 cuEventCreate
#define VGPU_IMPL_cuEventDestroy_v4000 cuEventDestroy
#define VGPU_IMPL_cuEventRecord_v2000 cuEventRecord
#define VGPU_IMPL_cuEventRecordWithFlags_v11010 cuEventRecordWithFlags
#define VGPU_IMPL_cuEventQuery_v2000 cuEventQuery
#define VGPU_IMPL_cuEventSynchronize_v2000 cuEventSynchronize
#define VGPU_IMPL_cuEventElapsedTime_v2000 cuEventElapsedTime
#define VGPU_IMPL_cuEventElapsedTime_v12080 cuEventElapsedTime_v2
#define VGPU_IMPL_cuLibraryLoadData_v12000 cuLibraryLoadData
#define VGPU_IMPL_cuLibraryUnload_v12000 cuLibraryUnload
#define VGPU_IMPL_cuLibraryGetKernel_v12000 cuLibraryGetKernel
#define VGPU_IMPL_cuKernelGetFunction_v12000 cuKernelGetFunction
#define VGPU_IMPL_cuKernelGetAttribute_v12000 cuKernelGetAttribute
#define VGPU_IMPL_cuModuleLoadData_v2000 cuModuleLoadData
#define VGPU_IMPL_cuModuleLoadDataEx_v2010 cuModuleLoadDataEx
#define VGPU_IMPL_cuModuleUnload_v2000 cuModuleUnload
#define VGPU_IMPL_cuModuleGetFunction_v2000 cuModuleGetFunction
#define VGPU_IMPL_cuFuncGetAttribute_v2020 cuFuncGetAttribute
#define VGPU_IMPL_cuLaunchKernel_v4000 cuLaunchKernel
#define VGPU_IMPL_cuLaunchKernelEx_v11060 cuLaunchKernelEx

static CUresult CUDAAPI get_proc_address_v1(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);

#include "cuda_procs.inc"

static const vgpu_error_entry *error_entry(CUresult error) {
    for (size_t i = 0; i < sizeof VGPU_ERRORS / sizeof VGPU_ERRORS[0]; i++)
        if (VGPU_ERRORS[i].code == (int)error) return &VGPU_ERRORS[i];
    return NULL;
}

CUresult CUDAAPI cuGetErrorName(CUresult error, const char **pStr) {
    if (pStr == NULL) return CUDA_ERROR_INVALID_VALUE;
    const vgpu_error_entry *e = error_entry(error);
    *pStr = e ? e->name : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuGetErrorString(CUresult error, const char **pStr) {
    if (pStr == NULL) return CUDA_ERROR_INVALID_VALUE;
    const vgpu_error_entry *e = error_entry(error);
    *pStr = e ? e->text : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static vgpu_proc_entry g_procs[VGPU_PROC_COUNT];
static pthread_once_t g_procs_once = PTHREAD_ONCE_INIT;

static void fill_procs(void) { vgpu_fill_procs(g_procs); }

/* Names the headers do not declare (OpenGL, EGL, VDPAU, profiler interop): each gets a generic stub. */
#define GENERIC_STUBS 64
static const char *g_generic_names[GENERIC_STUBS];
static int g_generic_count;
static CUresult generic_called(int i) { return vgpu_stub_called(g_generic_names[i], 0, ""); }
#define G(i, j) static CUresult CUDAAPI generic_##i##_##j(void) { return generic_called((i) * 8 + (j)); }
#define G8(i) G(i, 0) G(i, 1) G(i, 2) G(i, 3) G(i, 4) G(i, 5) G(i, 6) G(i, 7)
G8(0) G8(1) G8(2) G8(3) G8(4) G8(5) G8(6) G8(7)
#undef G
#define G(i, j) (void *)generic_##i##_##j,
static void *const g_generic_fns[GENERIC_STUBS] = {G8(0) G8(1) G8(2) G8(3) G8(4) G8(5) G8(6) G8(7)};
#undef G
#undef G8

static CUresult vgpu_stub_called(const char *name, int version, const char *ptds) {
    (void)version, (void)ptds;
    vgpu_unimplemented(g_attached ? &g_view : NULL, name);
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* As the driver: the newest variant not newer than the version asked for; the per-thread-stream variant
 * where the flags ask for it and one exists. */
static CUresult lookup(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                       CUdriverProcAddressQueryResult *status) {
    if (symbol == NULL || pfn == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&g_procs_once, fill_procs);
    int want_ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    const vgpu_proc_entry *plain = NULL, *ptds = NULL;
    int known = 0;
    for (int i = 0; i < VGPU_PROC_COUNT; i++) {
        const vgpu_proc_entry *e = &g_procs[i];
        if (e->name[0] != symbol[0] || strcmp(e->name, symbol) != 0) continue;
        known = 1;
        if (e->version > cudaVersion) continue;
        if (e->ptds) {
            if (ptds == NULL || e->version >= ptds->version) ptds = e;
        } else if (plain == NULL || e->version >= plain->version) {
            plain = e;
        }
    }
    const vgpu_proc_entry *pick = want_ptds && ptds != NULL ? ptds : plain;
    if (pick != NULL) {
        *pfn = pick->fn;
        if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
        return CUDA_SUCCESS;
    }
    if (known) {
        *pfn = NULL;
        if (status) *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
        return CUDA_ERROR_NOT_FOUND;
    }
    pthread_mutex_lock(&g_mu);
    int slot = -1;
    for (int i = 0; i < g_generic_count; i++)
        if (strcmp(g_generic_names[i], symbol) == 0) slot = i;
    if (slot < 0 && g_generic_count < GENERIC_STUBS) {
        slot = g_generic_count;
        g_generic_names[g_generic_count++] = strdup(symbol);
    }
    pthread_mutex_unlock(&g_mu);
    *pfn = slot >= 0 ? g_generic_fns[slot] : NULL;
    if (status) *status = slot >= 0 ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return slot >= 0 ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                  CUdriverProcAddressQueryResult *symbolStatus) {
    return lookup(symbol, pfn, cudaVersion, flags, symbolStatus);
}

static CUresult CUDAAPI get_proc_address_v1(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    return lookup(symbol, pfn, cudaVersion, flags, NULL);
}
