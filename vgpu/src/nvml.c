/* libnvidia-ml.so.1 for the virtual GPU: what pynvml (nvidia-ml-py) calls, read from the shared state of
 * state.h. Compiled against NVIDIA's nvml.h with -Werror. Every other function nvml.h declares is exported too, as a
 * stub generated from the header (vgpu/gen_nvml_stubs.py, included at the end) that answers NOT_SUPPORTED, as a
 * driver does for what a GPU lacks, and notes its name in <state>/nvml_unmodelled: NVML clients written elsewhere
 * (gpustat, nvitop) run on it.
 *
 * With -DVGPU_OLD_DRIVER: an older driver without the _v3 process queries and without nvmlMemory_v2 (absent from
 * the library, no stub: pynvml raises NVMLError_FunctionNotFound for them as it does on such a driver).
 *
 * The model (the README's testing section says the same):
 * - utilization samples: a window ends every window_s (per-device phase); its value is the share of the
 *   window during which any context's kernel ran, in whole percent; the buffer holds the windows of the last
 *   history_s (15 s), including those from before any process ran; stamps are microseconds of the Unix
 *   clock or of CLOCK_MONOTONIC (boot-relative), as configured;
 * - memory: v2 `used` is the contexts plus allocations; v1 `used` adds the reserved amount;
 * - processes: only those in the caller's PID namespace (drivers >= 535.113 translate and drop the others);
 *   with hide_processes, only the caller itself;
 * - power (a model, docs/design.md §15): bare idle (idle - context power), plus the context power while any
 *   process's context is open on the GPU (or a MIG device of it), plus what each kernel draws while it runs
 *   (gpm.c: a lean kernel its SMs' light load, any other arithmetic up to max); NVML's reading is the mean over the
 *   last second, energy its integral since the state was created;
 * - faults: a lost device answers GPU_IS_LOST from its time on; named functions answer NOT_SUPPORTED;
 * - the compute mode is the configured one (cuda.c enforces it); the minor number the configured one (by default
 *   the index; a MIG device answers NOT_SUPPORTED: its device file is its GPU's);
 * - MIG (mig.c): a GPU in MIG mode answers its GPU instances by ID (profile ID and placement, for the DRA driver's
 *   device names) and NOT_SUPPORTED for utilization, and so does each of its MIG devices,
 *   which also answer NOT_SUPPORTED for power, energy and temperature (those are the GPU's); a MIG device's memory
 *   and processes are its own, the GPU's are the sum of its MIG devices' (as a privileged caller sees them);
 * - GPM (gpm.c) on compute capability 9.0 and newer: SM_UTIL, SM_OCCUPANCY and GRAPHICS_UTIL between two samples,
 *   computed from the kernels that ran; any other metric answers NOT_SUPPORTED in its own nvmlReturn.
 */
#define _GNU_SOURCE
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <nvml.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "state.h"

#ifdef VGPU_OLD_DRIVER
#define DRIVER_VERSION "515.105.01-virtual"
#define NVML_VERSION "11.515.105.01-virtual"
#define CUDA_DRIVER_VERSION 11070
#else
#define DRIVER_VERSION "575.57.08-virtual"
#define NVML_VERSION "12.575.57.08-virtual"
#define CUDA_DRIVER_VERSION 12090
#endif
#define DEVICE_MAGIC 0x4c4d564eu
#define SAMPLE_MAGIC 0x4d504756u

typedef struct {
    uint32_t magic;
    int index;
} vdev;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static vgpu_view g_view;
static int g_attached;
static int g_init_count;
static vdev g_devs[VGPU_MAX_DEVS];       /* by host index; MIG devices after the GPUs (mig.c) */
static int g_cont[VGPU_MAX_GPUS];       /* NVML index -> host index: the devices NVIDIA_VISIBLE_DEVICES gives */
static int g_ncont;
static int g_calls_row = -1; /* this process's row of NVML call counters (-1: none yet or none left) */
static int g_calls_claimed;

/* Count a call of NVML function `fi` for this process and burn what it is configured to cost. */
static void counted(int fi) {
    if (fi < 0 || !__atomic_load_n(&g_attached, __ATOMIC_ACQUIRE)) return;
    vgpu_state *st = g_view.st;
    if (!__atomic_load_n(&g_calls_claimed, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&g_mu);
        if (!g_calls_claimed) {
            vgpu_lock(&g_view);
            g_calls_row = vgpu_nvml_claim(&g_view);
            vgpu_unlock(&g_view);
            __atomic_store_n(&g_calls_claimed, 1, __ATOMIC_RELEASE);
        }
        pthread_mutex_unlock(&g_mu);
    }
    if (g_calls_row >= 0) __atomic_add_fetch(&st->nvml_proc[g_calls_row].calls[fi], 1, __ATOMIC_RELAXED);
    int64_t cost = st->nvml_cost_ns[fi];
    if (cost > 0) vgpu_burn_cpu_ns(cost);
}

/* At the top of every exported function: count the call (and burn its cost) once the state is mapped. */
#define COUNTED()                                                              \
    do {                                                                       \
        static int fi_ = -2;                                                   \
        if (fi_ == -2) fi_ = vgpu_nvml_index(__func__);                        \
        counted(fi_);                                                          \
    } while (0)

static void at_fork_prepare(void) { pthread_mutex_lock(&g_mu); }
static void at_fork_parent(void) { pthread_mutex_unlock(&g_mu); }
static void at_fork_child(void) {
    vgpu_after_fork_child(&g_view);
    g_calls_row = -1;  /* the child counts in a row of its own */
    g_calls_claimed = 0;
    pthread_mutex_unlock(&g_mu);
}

static nvmlReturn_t init(void) {
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&g_mu);
    if (!g_attached) {
        char why[512];
        if (vgpu_attach(&g_view, why, sizeof why) != 0) {
            static int said;
            if (!said++) fprintf(stderr, "vgpu: libnvidia-ml: no virtual GPU: %s\n", why);
            rc = NVML_ERROR_DRIVER_NOT_LOADED;
            goto out;
        }
        g_attached = 1;
        for (int i = 0; i < VGPU_MAX_DEVS; i++) {
            g_devs[i].magic = DEVICE_MAGIC;
            g_devs[i].index = i;
        }
        g_ncont = vgpu_container_devices(g_view.st, g_cont);
        pthread_atfork(at_fork_prepare, at_fork_parent, at_fork_child);
    }
    g_init_count++;
out:
    pthread_mutex_unlock(&g_mu);
    return rc;
}

nvmlReturn_t DECLDIR nvmlInit(void) {
    nvmlReturn_t rc = init();
    COUNTED();
    return rc;
}
nvmlReturn_t DECLDIR nvmlInit_v2(void) {
    nvmlReturn_t rc = init();
    COUNTED();
    return rc;
}
nvmlReturn_t DECLDIR nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    nvmlReturn_t rc = init();
    COUNTED();
    return rc;
}

nvmlReturn_t DECLDIR nvmlShutdown(void) {
    COUNTED();
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t rc = g_init_count > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (g_init_count > 0) g_init_count--;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

const DECLDIR char *nvmlErrorString(nvmlReturn_t result) {
    COUNTED();
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    default: return "Unknown Error";
    }
}

static int initialized(void) { return __atomic_load_n(&g_init_count, __ATOMIC_RELAXED) > 0; }

/* The NVML index of a host device in this process's view; -1 where it is not in it. */
static int nvml_index(int host) {
    for (int i = 0; i < g_ncont; i++)
        if (g_cont[i] == host) return i;
    return -1;
}

static int refused(const char *fn) {
    const char *list = g_view.st->not_supported;
    if (list[0] == '\0') return 0;
    char key[128];
    snprintf(key, sizeof key, ",%s,", fn);
    return strstr(list, key) != NULL;
}

/* Every device query starts here: initialised, a valid handle, not lost, not refused. */
static nvmlReturn_t enter(const char *fn, nvmlDevice_t device, int *index) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    const vdev *d = (const vdev *)device;
    if (d == NULL || d < g_devs || d >= g_devs + VGPU_MAX_DEVS || d->magic != DEVICE_MAGIC)
        return NVML_ERROR_INVALID_ARGUMENT;
    const vgpu_device *vd = &g_view.st->dev[d->index];
    int gpu = vd->parent >= 0 ? vd->parent : d->index;  /* a MIG device is in the view with its GPU */
    if (gpu >= g_view.st->gpus || (d->index >= VGPU_MAX_GPUS && vd->parent < 0) || nvml_index(gpu) < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (vgpu_lost(&g_view, d->index, vgpu_now_ns(), 1)) return NVML_ERROR_GPU_IS_LOST;
    if (refused(fn)) return NVML_ERROR_NOT_SUPPORTED;
    *index = d->index;
    return NVML_SUCCESS;
}

#define ENTER(device)                                           \
    int dev_;                                                   \
    COUNTED();                                                  \
    {                                                           \
        nvmlReturn_t rc_ = enter(__func__, (device), &dev_);    \
        if (rc_ != NVML_SUCCESS) return rc_;                    \
    }

#define SYSTEM_ENTER()                                                  \
    do {                                                                \
        COUNTED();                                                      \
        if (!initialized()) return NVML_ERROR_UNINITIALIZED;            \
        if (refused(__func__)) return NVML_ERROR_NOT_SUPPORTED;         \
    } while (0)

static nvmlReturn_t copy_text(char *out, unsigned int len, const char *text) {
    if (out == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(text) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, text, strlen(text) + 1);
    return NVML_SUCCESS;
}

/* --- system -------------------------------------------------------------------------------------------- */

nvmlReturn_t DECLDIR nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    SYSTEM_ENTER();
    return copy_text(version, length, DRIVER_VERSION);
}

nvmlReturn_t DECLDIR nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    SYSTEM_ENTER();
    return copy_text(version, length, NVML_VERSION);
}

static nvmlReturn_t cuda_version(int *v) {
    if (v == NULL) return NVML_ERROR_INVALID_ARGUMENT;
#ifdef VGPU_OLD_DRIVER
    *v = CUDA_DRIVER_VERSION;  /* the old driver's own */
#else
    *v = g_view.st != NULL ? g_view.st->cuda_version : CUDA_DRIVER_VERSION;  /* as libcuda's: --cuda-version */
#endif
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion) {
    SYSTEM_ENTER();
    return cuda_version(cudaDriverVersion);
}

nvmlReturn_t DECLDIR nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion) {
    SYSTEM_ENTER();
    return cuda_version(cudaDriverVersion);
}

/* --- devices ------------------------------------------------------------------------------------------- */

static nvmlReturn_t device_count(unsigned int *count) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned int)g_ncont;
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceGetCount(unsigned int *deviceCount) {
    COUNTED();
    return device_count(deviceCount);
}
nvmlReturn_t DECLDIR nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    COUNTED();
    return device_count(deviceCount);
}

static nvmlReturn_t handle_of_host(int host, nvmlDevice_t *device) {
    if (vgpu_lost(&g_view, host, vgpu_now_ns(), 1)) return NVML_ERROR_GPU_IS_LOST;
    *device = (nvmlDevice_t)&g_devs[host];
    return NVML_SUCCESS;
}

static nvmlReturn_t handle_by_index(unsigned int index, nvmlDevice_t *device) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (device == NULL || index >= (unsigned int)g_ncont) return NVML_ERROR_INVALID_ARGUMENT;
    return handle_of_host(g_cont[index], device);
}

nvmlReturn_t DECLDIR nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    COUNTED();
    return handle_by_index(index, device);
}
nvmlReturn_t DECLDIR nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    COUNTED();
    return handle_by_index(index, device);
}

nvmlReturn_t DECLDIR nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    COUNTED();
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (uuid == NULL || device == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < g_ncont; i++) {
        char s[48];
        vgpu_uuid_string(g_view.st->dev[g_cont[i]].uuid, s);
        if (strcasecmp(s, uuid) == 0) return handle_of_host(g_cont[i], device);
    }
    int mig = vgpu_mig_by_uuid(g_view.st, uuid, 0);  /* a MIG device's UUID names its handle */
    if (mig >= 0 && nvml_index(g_view.st->dev[mig].parent) >= 0) return handle_of_host(mig, device);
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t DECLDIR nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device) {
    COUNTED();
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (pciBusId == NULL || device == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < g_ncont; i++) {
        const char *id = g_view.st->dev[g_cont[i]].pci_bus_id;  /* "00000000:18:00.0"; "0000:18:00.0" matches too */
        if (strcasecmp(id, pciBusId) == 0 || strcasecmp(id + 4, pciBusId) == 0)
            return handle_of_host(g_cont[i], device);
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t DECLDIR nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    ENTER(device);
    if (index == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (vgpu_is_mig(g_view.st, dev_)) return NVML_ERROR_NOT_SUPPORTED;  /* a MIG device has no NVML index */
    *index = (unsigned int)nvml_index(dev_);
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber) {
    ENTER(device);
    if (minorNumber == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (vgpu_is_mig(g_view.st, dev_)) return NVML_ERROR_NOT_SUPPORTED;  /* its device file is its GPU's */
    *minorNumber = (unsigned int)g_view.st->dev[dev_].minor;
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    ENTER(device);
    return copy_text(name, length, g_view.st->dev[dev_].name);
}

nvmlReturn_t DECLDIR nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    ENTER(device);
    char s[48];
    if (vgpu_is_mig(g_view.st, dev_))
        vgpu_mig_uuid_string(g_view.st->dev[dev_].uuid, s);
    else
        vgpu_uuid_string(g_view.st->dev[dev_].uuid, s);
    return copy_text(uuid, length, s);
}

nvmlReturn_t DECLDIR nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    ENTER(device);
    if (pci == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    const vgpu_device *d = &g_view.st->dev[dev_];
    snprintf(pci->busId, sizeof pci->busId, "%s", d->pci_bus_id);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%s", d->pci_bus_id + 4);
    pci->domain = 0;
    pci->bus = d->pci_bus;
    pci->device = 0;
    pci->pciDeviceId = 0x233010deu;    /* H100 SXM5 80GB */
    pci->pciSubSystemId = 0x16c110deu;
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    ENTER(device);
    if (major == NULL || minor == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *major = g_view.st->cc_major;  /* as libcuda's device attributes, --cc */
    *minor = g_view.st->cc_minor;
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode) {
    ENTER(device);
    if (currentMode == NULL || pendingMode == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (vgpu_is_mig(g_view.st, dev_)) return NVML_ERROR_NOT_SUPPORTED;
    unsigned int mode = vgpu_mig_mode(g_view.st, dev_) ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
    *currentMode = mode;
    *pendingMode = mode;
    return NVML_SUCCESS;
}

/* --- MIG ----------------------------------------------------------------------------------------------- */

nvmlReturn_t DECLDIR nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    ENTER(device);
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *count = vgpu_mig_mode(g_view.st, dev_) ? VGPU_MIG_SLOTS : 0;  /* zero where MIG is not enabled */
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                         nvmlDevice_t *migDevice) {
    ENTER(device);
    if (migDevice == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (!vgpu_mig_mode(g_view.st, dev_)) return NVML_ERROR_NOT_SUPPORTED;
    if (index >= VGPU_MIG_SLOTS) return NVML_ERROR_INVALID_ARGUMENT;
    int mig = vgpu_mig_device(g_view.st, dev_, (int)index);
    if (mig < 0) return NVML_ERROR_NOT_FOUND;  /* a slot with no MIG device in it */
    *migDevice = (nvmlDevice_t)&g_devs[mig];
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device) {
    ENTER(migDevice);
    if (device == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (!vgpu_is_mig(g_view.st, dev_)) return NVML_ERROR_NOT_SUPPORTED;
    *device = (nvmlDevice_t)&g_devs[g_view.st->dev[dev_].parent];
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    ENTER(device);
    if (isMigDevice == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *isMigDevice = (unsigned int)vgpu_is_mig(g_view.st, dev_);
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    ENTER(device);
    if (id == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (!vgpu_is_mig(g_view.st, dev_)) return NVML_ERROR_NOT_SUPPORTED;
    *id = (unsigned int)g_view.st->dev[dev_].gi_id;
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    ENTER(device);
    if (id == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (!vgpu_is_mig(g_view.st, dev_)) return NVML_ERROR_NOT_SUPPORTED;
    *id = (unsigned int)g_view.st->dev[dev_].ci_id;
    return NVML_SUCCESS;
}

/* A GPU instance handle: the MIG device whose GPU instance it is. */
#define GI_MAGIC 0x49475056u
struct nvmlGpuInstance_st {
    uint32_t magic;
    int dev;
};
static struct nvmlGpuInstance_st g_gis[VGPU_MAX_DEVS];

nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id,
                                                  nvmlGpuInstance_t *gpuInstance) {
    ENTER(device);
    if (gpuInstance == NULL || vgpu_is_mig(g_view.st, dev_)) return NVML_ERROR_INVALID_ARGUMENT;
    if (!vgpu_mig_mode(g_view.st, dev_)) return NVML_ERROR_NOT_SUPPORTED;  /* "doesn't have MIG mode enabled" */
    int mig = vgpu_mig_by_gi(g_view.st, dev_, (int)id);
    if (mig < 0) return NVML_ERROR_NOT_FOUND;
    g_gis[mig].magic = GI_MAGIC;
    g_gis[mig].dev = mig;
    *gpuInstance = &g_gis[mig];
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info) {
    COUNTED();
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (gpuInstance == NULL || info == NULL || gpuInstance < g_gis || gpuInstance >= g_gis + VGPU_MAX_DEVS ||
        gpuInstance->magic != GI_MAGIC)
        return NVML_ERROR_INVALID_ARGUMENT;
    const vgpu_device *d = &g_view.st->dev[gpuInstance->dev];
    if (vgpu_lost(&g_view, gpuInstance->dev, vgpu_now_ns(), 1)) return NVML_ERROR_GPU_IS_LOST;
    info->device = (nvmlDevice_t)&g_devs[d->parent];
    info->id = (unsigned int)d->gi_id;
    info->profileId = (unsigned int)d->gi_profile_id;
    info->placement.start = (unsigned int)d->placement_start;
    info->placement.size = (unsigned int)d->placement_size;
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes) {
    ENTER(device);
    if (attributes == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (!vgpu_is_mig(g_view.st, dev_)) return NVML_ERROR_NOT_SUPPORTED;  /* "only supports MIG device handles" */
    const vgpu_device *d = &g_view.st->dev[dev_];
    memset(attributes, 0, sizeof *attributes);
    attributes->multiprocessorCount = (unsigned int)d->sms;
    attributes->gpuInstanceSliceCount = (unsigned int)(7 / g_view.st->mig);
    attributes->computeInstanceSliceCount = attributes->gpuInstanceSliceCount;
    attributes->memorySizeMB = d->total_bytes >> 20;
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceGetComputeMode(nvmlDevice_t device, nvmlComputeMode_t *mode) {
    ENTER(device);
    if (mode == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *mode = (nvmlComputeMode_t)g_view.st->dev[dev_].compute_mode;
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceGetPersistenceMode(nvmlDevice_t device, nvmlEnableState_t *mode) {
    ENTER(device);
    if (mode == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *mode = NVML_FEATURE_ENABLED;
    return NVML_SUCCESS;
}

/* --- memory -------------------------------------------------------------------------------------------- */

static uint64_t used_bytes(int dev) {
    pthread_mutex_lock(&g_mu);
    vgpu_lock(&g_view);
    vgpu_reap(&g_view);
    uint64_t used = vgpu_used_bytes(g_view.st, dev);
    vgpu_unlock(&g_view);
    pthread_mutex_unlock(&g_mu);
    return used;
}

nvmlReturn_t DECLDIR nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    ENTER(device);
    if (memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    const vgpu_state *st = g_view.st;
    uint64_t total = st->dev[dev_].total_bytes;
    uint64_t used = used_bytes(dev_) + vgpu_reserved_bytes(st, dev_);  /* v1 counts the reserved memory as used */
    memory->total = total;
    memory->used = used;
    memory->free = total - used;
    return NVML_SUCCESS;
}

#ifndef VGPU_OLD_DRIVER
nvmlReturn_t DECLDIR nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    ENTER(device);
    if (memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    const vgpu_state *st = g_view.st;
    uint64_t used = used_bytes(dev_);
    memory->total = st->dev[dev_].total_bytes;
    memory->reserved = vgpu_reserved_bytes(st, dev_);
    memory->used = used;
    memory->free = vgpu_usable_bytes(st, dev_) - used;
    return NVML_SUCCESS;
}
#endif

/* --- utilization --------------------------------------------------------------------------------------- */

/* NVML has no utilization for a MIG device, nor for a GPU in MIG mode (nvidia-smi shows N/A there). */
static int no_utilization(int dev) { return vgpu_is_mig(g_view.st, dev) || vgpu_mig_mode(g_view.st, dev); }

static int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

static unsigned int sample_percent(const vgpu_state *st, int dev, int64_t end_ns) {
    int64_t w = st->window_ns;
    int64_t busy = vgpu_busy_ns(st, dev, end_ns - w, end_ns);
    return (unsigned int)((busy * 100 + w / 2) / w);
}

nvmlReturn_t DECLDIR nvmlDeviceGetSamples(nvmlDevice_t device, nvmlSamplingType_t type,
                                          unsigned long long lastSeenTimeStamp, nvmlValueType_t *sampleValType,
                                          unsigned int *sampleCount, nvmlSample_t *samples) {
    ENTER(device);
    if (no_utilization(dev_)) return NVML_ERROR_NOT_SUPPORTED;
    if (sampleValType == NULL || sampleCount == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (type != NVML_GPU_UTILIZATION_SAMPLES) return NVML_ERROR_NOT_SUPPORTED;
    if (samples != NULL && *sampleCount == 0) return NVML_ERROR_INVALID_ARGUMENT;
    const vgpu_state *st = g_view.st;
    const vgpu_device *d = &st->dev[dev_];
    int64_t w = st->window_ns, phase = d->phase_ns;
    int64_t base = st->timestamps_boot ? 0 : st->unix_offset_ns;
    int64_t now = vgpu_now_ns();
    int64_t k_last = floor_div(now - phase, w);
    int64_t k_lo = floor_div(now - st->history_ns - phase, w) + 1;
    if (lastSeenTimeStamp >= (1ull << 62) / 1000) return NVML_ERROR_NOT_FOUND;
    /* stamps are whole microseconds: floor((phase + k w + base) / 1000) > lastSeen */
    int64_t threshold = ((int64_t)lastSeenTimeStamp + 1) * 1000 - base - phase;
    int64_t k_after = -floor_div(-threshold, w);  /* ceil */
    if (k_after > k_lo) k_lo = k_after;
    if (k_lo > k_last) return NVML_ERROR_NOT_FOUND;
    unsigned int n = (unsigned int)(k_last - k_lo + 1);
    *sampleValType = NVML_VALUE_TYPE_UNSIGNED_INT;
    if (samples == NULL) {
        *sampleCount = n;
        return NVML_SUCCESS;
    }
    if (n > *sampleCount) n = *sampleCount;  /* the oldest first: asking again with the last stamp gets the rest */
    pthread_mutex_lock(&g_mu);
    vgpu_lock(&g_view);
    for (unsigned int i = 0; i < n; i++) {
        int64_t end = phase + (k_lo + (int64_t)i) * w;
        samples[i].timeStamp = (unsigned long long)((end + base) / 1000);
        samples[i].sampleValue.uiVal = sample_percent(st, dev_, end);
    }
    vgpu_unlock(&g_view);
    pthread_mutex_unlock(&g_mu);
    *sampleCount = n;
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    ENTER(device);
    if (no_utilization(dev_)) return NVML_ERROR_NOT_SUPPORTED;
    if (utilization == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    const vgpu_state *st = g_view.st;
    int64_t w = st->window_ns, phase = st->dev[dev_].phase_ns;
    int64_t end = phase + floor_div(vgpu_now_ns() - phase, w) * w;  /* the newest complete window */
    pthread_mutex_lock(&g_mu);
    vgpu_lock(&g_view);
    utilization->gpu = sample_percent(st, dev_, end);
    vgpu_unlock(&g_view);
    pthread_mutex_unlock(&g_mu);
    utilization->memory = 0;
    return NVML_SUCCESS;
}

/* --- processes ----------------------------------------------------------------------------------------- */

#define MAX_LISTED (VGPU_MAX_PROCS * (VGPU_MIG_SLOTS + 1))

/* Under the lock: the processes with a context or memory on `dev` that this caller may see (a GPU in MIG mode:
 * those of its MIG devices, one entry per MIG device, with its GPU and compute instance; else 0xFFFFFFFF). */
static unsigned int visible_processes(int dev, unsigned int pids[], uint64_t bytes[], unsigned int gi[],
                                      unsigned int ci[]) {
    const vgpu_state *st = g_view.st;
    int32_t me = (int32_t)getpid();
    unsigned int n = 0;
    int devs[VGPU_MIG_SLOTS + 1], ndevs = 0;
    if (vgpu_mig_mode(st, dev))
        for (int k = 0; k < st->dev[dev].mig; k++) devs[ndevs++] = vgpu_mig_device(st, dev, k);
    else
        devs[ndevs++] = dev;
    for (int j = 0; j < ndevs; j++) {
        int d = devs[j];
        for (int s = 0; s < VGPU_MAX_PROCS; s++) {
            const vgpu_proc *p = &st->proc[s];
            if (!p->in_use || (!p->ctx_open[d] && p->alloc_bytes[d] == 0)) continue;
            if (p->pidns != g_view.pidns) continue;           /* another PID namespace: not listed */
            if (st->hide_processes && p->pid != me) continue;  /* a container without --pid=host */
            pids[n] = (unsigned int)p->pid;
            bytes[n] = vgpu_proc_bytes(st, s, d);
            gi[n] = vgpu_is_mig(st, d) ? (unsigned int)st->dev[d].gi_id : 0xFFFFFFFFu;
            ci[n] = vgpu_is_mig(st, d) ? (unsigned int)st->dev[d].ci_id : 0xFFFFFFFFu;
            n++;
        }
    }
    return n;
}

static nvmlReturn_t processes(int dev, unsigned int *infoCount, nvmlProcessInfo_v2_t *v2, nvmlProcessInfo_v1_t *v1,
                              int graphics) {
    if (infoCount == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int pids[MAX_LISTED], gi[MAX_LISTED], ci[MAX_LISTED];
    uint64_t bytes[MAX_LISTED];
    unsigned int n = 0;
    if (!graphics) {  /* compute contexts only: nothing here draws */
        pthread_mutex_lock(&g_mu);
        vgpu_lock(&g_view);
        vgpu_reap(&g_view);
        n = visible_processes(dev, pids, bytes, gi, ci);
        vgpu_unlock(&g_view);
        pthread_mutex_unlock(&g_mu);
    }
    int have_buffer = v2 != NULL || v1 != NULL;
    if (!have_buffer || *infoCount < n) {
        *infoCount = n;
        return n == 0 ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < n; i++) {
        if (v2 != NULL) {
            v2[i].pid = pids[i];
            v2[i].usedGpuMemory = bytes[i];
            v2[i].gpuInstanceId = gi[i];
            v2[i].computeInstanceId = ci[i];
        } else {
            v1[i].pid = pids[i];
            v1[i].usedGpuMemory = bytes[i];
        }
    }
    *infoCount = n;
    return NVML_SUCCESS;
}

#ifndef VGPU_OLD_DRIVER
nvmlReturn_t DECLDIR nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                             nvmlProcessInfo_t *infos) {
    ENTER(device);
    return processes(dev_, infoCount, infos, NULL, 0);
}

nvmlReturn_t DECLDIR nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                              nvmlProcessInfo_t *infos) {
    ENTER(device);
    return processes(dev_, infoCount, infos, NULL, 1);
}
#endif

nvmlReturn_t DECLDIR nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                             nvmlProcessInfo_v2_t *infos) {
    ENTER(device);
    return processes(dev_, infoCount, infos, NULL, 0);
}

nvmlReturn_t DECLDIR nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                              nvmlProcessInfo_v2_t *infos) {
    ENTER(device);
    return processes(dev_, infoCount, infos, NULL, 1);
}

nvmlReturn_t DECLDIR nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                          nvmlProcessInfo_v1_t *infos) {
    ENTER(device);
    return processes(dev_, infoCount, NULL, infos, 0);
}

nvmlReturn_t DECLDIR nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                           nvmlProcessInfo_v1_t *infos) {
    ENTER(device);
    return processes(dev_, infoCount, NULL, infos, 1);
}

/* --- power and temperature ----------------------------------------------------------------------------- */

/* The board's power model's mean over the last second, in mW (a GPU's handle: MIG devices have none of their own). */
static unsigned int power_mw(int dev) {
    const vgpu_state *st = g_view.st;
    pthread_mutex_lock(&g_mu);
    vgpu_lock(&g_view);
    vgpu_reap(&g_view);  /* a dead process's context ends when it is seen gone */
    int64_t now = vgpu_now_ns();
    double context_s = (double)vgpu_context_ns(st, dev, now - 1000000000, now) / 1e9;
    double kernel_j = vgpu_kernel_j(st, dev, now - 1000000000, now);
    vgpu_unlock(&g_view);
    pthread_mutex_unlock(&g_mu);
    double bare_mw = (double)(st->idle_power_mw - st->context_power_mw);
    return (unsigned int)(bare_mw + st->context_power_mw * context_s + kernel_j * 1e3 + 0.5);
}

/* Power, energy, temperature and the power limits are the board's: a MIG device has none of its own. */
#define BOARD_ONLY()                                                                \
    do {                                                                            \
        if (vgpu_is_mig(g_view.st, dev_)) return NVML_ERROR_NOT_SUPPORTED;          \
    } while (0)

nvmlReturn_t DECLDIR nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    ENTER(device);
    BOARD_ONLY();
    if (power == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *power = power_mw(dev_);
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device, unsigned long long *energy) {
    ENTER(device);
    BOARD_ONLY();
    if (energy == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    const vgpu_state *st = g_view.st;
    pthread_mutex_lock(&g_mu);
    vgpu_lock(&g_view);
    vgpu_reap(&g_view);
    int64_t now = vgpu_now_ns();
    double context_s = (double)vgpu_context_total_ns(st, dev_, now) / 1e9;
    double kernel_j = vgpu_kernel_total_j(st, dev_, now);
    vgpu_unlock(&g_view);
    pthread_mutex_unlock(&g_mu);
    double seconds = (double)(now - st->created_ns) / 1e9;
    double mj = (double)(st->idle_power_mw - st->context_power_mw) * seconds + st->context_power_mw * context_s +
                kernel_j * 1e3;
    *energy = (unsigned long long)(mj + 0.5);
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device, unsigned int *limit) {
    ENTER(device);
    BOARD_ONLY();
    if (limit == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *limit = (unsigned int)g_view.st->max_power_mw;
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit) {
    ENTER(device);
    BOARD_ONLY();
    if (limit == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *limit = (unsigned int)g_view.st->max_power_mw;
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t device, unsigned int *minLimit,
                                                                  unsigned int *maxLimit) {
    ENTER(device);
    BOARD_ONLY();
    if (minLimit == NULL || maxLimit == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *minLimit = (unsigned int)g_view.st->idle_power_mw * 3;
    *maxLimit = (unsigned int)g_view.st->max_power_mw;
    return NVML_SUCCESS;
}

static unsigned int temperature_c(int dev) {
    const vgpu_state *st = g_view.st;
    double span = (double)(st->max_power_mw - st->idle_power_mw);
    double share = span > 0 ? ((double)power_mw(dev) - st->idle_power_mw) / span : 0.0;
    if (share < 0) share = 0;  /* bare idle, below the idle with a context */
    return (unsigned int)(30.0 + 40.0 * share + 0.5);
}

nvmlReturn_t DECLDIR nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensorType,
                                              unsigned int *temp) {
    ENTER(device);
    BOARD_ONLY();
    if (temp == NULL || sensorType != NVML_TEMPERATURE_GPU) return NVML_ERROR_INVALID_ARGUMENT;
    *temp = temperature_c(dev_);
    return NVML_SUCCESS;
}

/* nvml.h 13's successor of nvmlDeviceGetTemperature (which it marks deprecated); nvitop asks it. */
nvmlReturn_t DECLDIR nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_t *temperature) {
    ENTER(device);
    BOARD_ONLY();
    if (temperature == NULL || temperature->sensorType != NVML_TEMPERATURE_GPU) return NVML_ERROR_INVALID_ARGUMENT;
    if (temperature->version != nvmlTemperature_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    temperature->temperature = (int)temperature_c(dev_);
    return NVML_SUCCESS;
}

/* --- GPM ----------------------------------------------------------------------------------------------- */

/* What nvmlGpmSampleAlloc hands out: the device a sample is of and when it was taken. */
struct nvmlGpmSample_st {
    uint32_t magic;
    int dev;          /* -1 until taken */
    int64_t taken_ns;
};

static int gpm_device(int dev) { return g_view.st->cc_major >= 9 && dev >= 0; }

nvmlReturn_t DECLDIR nvmlGpmQueryDeviceSupport(nvmlDevice_t device, nvmlGpmSupport_t *gpmSupport) {
    ENTER(device);
    if (gpmSupport == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (gpmSupport->version != NVML_GPM_SUPPORT_VERSION) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    gpmSupport->isSupportedDevice = (unsigned int)gpm_device(dev_);  /* Hopper or newer */
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlGpmSampleAlloc(nvmlGpmSample_t *gpmSample) {
    SYSTEM_ENTER();
    if (gpmSample == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    struct nvmlGpmSample_st *s = calloc(1, sizeof *s);
    if (s == NULL) return NVML_ERROR_MEMORY;
    s->magic = SAMPLE_MAGIC;
    s->dev = -1;
    *gpmSample = s;
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlGpmSampleFree(nvmlGpmSample_t gpmSample) {
    SYSTEM_ENTER();
    if (gpmSample == NULL || gpmSample->magic != SAMPLE_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    gpmSample->magic = 0;
    free(gpmSample);
    return NVML_SUCCESS;
}

static nvmlReturn_t take_sample(int dev, nvmlGpmSample_t gpmSample) {
    if (gpmSample == NULL || gpmSample->magic != SAMPLE_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    if (!gpm_device(dev)) return NVML_ERROR_NOT_SUPPORTED;
    gpmSample->dev = dev;
    gpmSample->taken_ns = vgpu_now_ns();
    return NVML_SUCCESS;
}

nvmlReturn_t DECLDIR nvmlGpmSampleGet(nvmlDevice_t device, nvmlGpmSample_t gpmSample) {
    ENTER(device);  /* a GPU's handle or a MIG device's (nvml.h: "supports the device handle and MIG device handle") */
    return take_sample(dev_, gpmSample);
}

nvmlReturn_t DECLDIR nvmlGpmMigSampleGet(nvmlDevice_t device, unsigned int gpuInstanceId, nvmlGpmSample_t gpmSample) {
    ENTER(device);
    if (!vgpu_mig_mode(g_view.st, dev_)) return NVML_ERROR_NOT_SUPPORTED;
    int mig = vgpu_mig_by_gi(g_view.st, dev_, (int)gpuInstanceId);
    if (mig < 0) return NVML_ERROR_NOT_FOUND;
    return take_sample(mig, gpmSample);
}

nvmlReturn_t DECLDIR nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *metricsGet) {
    SYSTEM_ENTER();
    if (metricsGet == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (metricsGet->version != NVML_GPM_METRICS_GET_VERSION) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    const struct nvmlGpmSample_st *s1 = metricsGet->sample1, *s2 = metricsGet->sample2;
    if (s1 == NULL || s2 == NULL || s1->magic != SAMPLE_MAGIC || s2->magic != SAMPLE_MAGIC || s1->dev < 0 ||
        s1->dev != s2->dev || metricsGet->numMetrics > NVML_GPM_METRIC_MAX)
        return NVML_ERROR_INVALID_ARGUMENT;
    int64_t a = s1->taken_ns < s2->taken_ns ? s1->taken_ns : s2->taken_ns;
    int64_t b = s1->taken_ns < s2->taken_ns ? s2->taken_ns : s1->taken_ns;
    double gr = 0, sm = 0, occ = 0;
    pthread_mutex_lock(&g_mu);
    vgpu_lock(&g_view);
    vgpu_gpm_integrals(g_view.st, s1->dev, a, b, &gr, &sm, &occ);
    vgpu_unlock(&g_view);
    pthread_mutex_unlock(&g_mu);
    double span = b > a ? (double)(b - a) : 1.0;
    for (unsigned int i = 0; i < metricsGet->numMetrics; i++) {
        nvmlGpmMetric_t *m = &metricsGet->metrics[i];
        m->nvmlReturn = NVML_SUCCESS;
        m->metricInfo.unit = (char *)"%";
        switch (m->metricId) {
        case NVML_GPM_METRIC_GRAPHICS_UTIL:
            m->value = 100.0 * gr / span;
            m->metricInfo.shortName = (char *)"gr_util";
            m->metricInfo.longName = (char *)"graphics utilization";
            break;
        case NVML_GPM_METRIC_SM_UTIL:
            m->value = 100.0 * sm / span;
            m->metricInfo.shortName = (char *)"sm_util";
            m->metricInfo.longName = (char *)"SM utilization";
            break;
        case NVML_GPM_METRIC_SM_OCCUPANCY:
            m->value = 100.0 * occ / span;
            m->metricInfo.shortName = (char *)"sm_occupancy";
            m->metricInfo.longName = (char *)"SM occupancy";
            break;
        default:
            m->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;  /* the virtual GPU models these three only */
            m->value = 0;
            m->metricInfo.shortName = m->metricInfo.longName = m->metricInfo.unit = NULL;
        }
    }
    return NVML_SUCCESS;
}

/* --- every other function nvml.h declares ------------------------------------------------------------------ */

/* What a function the virtual GPU does not model answers: NOT_SUPPORTED, once NVML is initialised. */
static nvmlReturn_t unmodelled(const char *fn) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    vgpu_nvml_unmodelled(&g_view, fn);
    return NVML_ERROR_NOT_SUPPORTED;
}

#include "nvml_stubs.inc"
