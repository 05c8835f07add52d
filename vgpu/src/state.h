/* The virtual GPU's shared state: one file, mapped by every process that loads the stand-in libraries.
 *
 * The state directory (environment variable VGPU_STATE) holds:
 *   state            this struct, mmap'd MAP_SHARED; flock(LOCK_EX) on it serialises every change
 *   slots/<i>        one lock file per process slot; its owner holds flock(LOCK_EX) on it for its lifetime,
 *                    so a slot whose lock can be taken belongs to a dead process (works across PID namespaces)
 *   kernels.jsonl    one JSON line per kernel, appended at launch: the ground truth of what ran
 *   unimplemented    one line per driver entry point called but not implemented
 *   modules.jsonl    one JSON line per module load (cuModuleLoadData, cuLibraryLoadData): what it was, the result
 *   nvml_unmodelled  one line per NVML function called that the stand-in does not model (it answered NOT_SUPPORTED)
 * The state also counts every NVML call per process and function (nvml_proc) and holds what each NVML
 * function costs (nvml_cost_ns: CPU the stand-in burns per call, to model a slow driver).
 * Times are CLOCK_MONOTONIC nanoseconds (one clock for every process and container on a host).
 */
#ifndef VGPU_STATE_H
#define VGPU_STATE_H

#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)

#define VGPU_MAGIC 0x55504756u /* "VGPU" */
#define VGPU_LAYOUT 7u /* 2 was taken twice: compute modes (main) and NVML call counters (nvml); 4: cc (light); 5: MIG, GPM;
                         * 6: minor numbers, GPU instance profiles and placements (announced); power by what runs
                         * (contexts, kernels' watts), the lean kernel's sleep (lean); 7: both */
#define VGPU_MAX_GPUS 8
#define VGPU_MAX_MIG 16 /* MIG devices in all (gpus x instances per GPU) */
#define VGPU_MAX_DEVS (VGPU_MAX_GPUS + VGPU_MAX_MIG) /* physical devices first, then MIG devices (mig.c) */
#define VGPU_MIG_SLOTS 7 /* nvmlDeviceGetMaxMigDeviceCount on an H100 in MIG mode: up to 7 GPU instances */
#define VGPU_SHAPES 16384 /* kernels kept per device for GPM (gpm.c) */
#define VGPU_MAX_PROCS 64
#define VGPU_RING 65536 /* busy intervals kept per device (merged when back to back) */
#define VGPU_NEVER INT64_MAX
#define VGPU_ENV "VGPU_STATE"
#define VGPU_NVML_FUNCS 64 /* room in the call counters for the stand-in's NVML functions (vgpu_nvml_names) */
#define VGPU_NVML_PROCS 128 /* processes whose NVML calls are counted (the later ones are not) */

typedef struct {
    int64_t start_ns, end_ns;
} vgpu_interval;

/* One kernel as GPM and the power model see it (gpm.c): its full waves from start to full_end, its last (partial)
 * wave to end; the share of the device's SMs with a block resident (sm_*) and of its warp slots filled (occ_*) in
 * each, and the watts it draws above the board's idle with a context (w_*: board watts, a MIG device's included). */
typedef struct {
    int64_t start_ns, full_end_ns, end_ns;
    float sm_full, sm_last, occ_full, occ_last;
    float w_full, w_last;
} vgpu_shape;

typedef struct {
    uint8_t uuid[16];
    char name[96];
    char pci_bus_id[32]; /* NVML form, "00000000:18:00.0" */
    uint32_t pci_bus;
    int64_t phase_ns;            /* sample windows end at phase_ns + k * window_ns */
    int64_t lost_at_ns;          /* lost from this time on (VGPU_NEVER: never) */
    int64_t lost_after_calls;    /* lost once NVML was asked this many device queries (-1: never) */
    uint64_t nvml_calls;         /* NVML device queries so far (atomic) */
    int32_t compute_mode;        /* NVML's and CUDA's value: 0 default, 2 prohibited, 3 exclusive process */
    int32_t minor;               /* physical device: its minor number (/dev/nvidia<minor>); by default its index */
    int32_t parent;              /* MIG device: its GPU's index; -1 for a physical device (mig.c) */
    int32_t mig;                 /* physical device: MIG devices under it (0: MIG mode off) */
    int32_t gi_id, ci_id;        /* MIG device: its GPU instance and compute instance IDs */
    int32_t sms;                 /* multiprocessors of this device (a MIG device: its share) */
    int32_t slot;                /* MIG device: its index under the parent (nvmlDeviceGetMigDeviceHandleByIndex) */
    uint64_t total_bytes;        /* device memory (a MIG device: its share) */
    char profile[16];            /* MIG device: its profile name, e.g. "2g.26gb" */
    int32_t gi_profile_id;       /* MIG device: its GPU instance's profile ID (nvidia-smi mig -lgip: 19 is 1g, ...) */
    int32_t placement_start;     /* MIG device: its GPU instance's placement in memory slices: start and size */
    int32_t placement_size;
    int32_t pad4;
    int64_t tail_ns;             /* end of the last kernel queued on the device (FIFO across contexts) */
    int64_t busy_queued_ns;      /* sum of the durations of every kernel ever queued */
    uint64_t kernels;            /* kernels ever queued */
    uint64_t ring_count;         /* intervals ever written; the newest is ring[(ring_count - 1) % VGPU_RING] */
    vgpu_interval ring[VGPU_RING];
    uint64_t shape_count;        /* kernels ever recorded for GPM; the newest is shapes[(shape_count - 1) % VGPU_SHAPES] */
    vgpu_shape shapes[VGPU_SHAPES];
    double kernel_j;             /* the energy of every kernel ever recorded, above the idle with a context (gpm.c) */
    int64_t ctx_since_ns;        /* physical device: when a context (any process's, on it or a MIG device of it)
                                    was last opened while none was, VGPU_NEVER while none is open */
    int64_t ctx_last_start_ns, ctx_last_end_ns; /* the last span with a context that has ended (0, 0: none) */
    int64_t ctx_closed_ns;       /* the length of every span with a context that has ended */
} vgpu_device;

typedef struct {
    uint32_t in_use;
    uint32_t generation;
    int32_t pid;        /* in its own PID namespace */
    uint32_t pad;
    uint64_t pidns;     /* inode of /proc/self/ns/pid */
    char comm[32];
    int64_t started_ns;
    uint8_t ctx_open[VGPU_MAX_DEVS];
    uint64_t ctx_bytes[VGPU_MAX_DEVS];
    uint64_t alloc_bytes[VGPU_MAX_DEVS];
} vgpu_proc;

/* One process's NVML calls, per function (index into vgpu_nvml_names); kept after the process is gone. */
typedef struct {
    uint32_t in_use;
    int32_t pid; /* in its own PID namespace */
    uint64_t pidns;
    char comm[32];
    uint64_t calls[VGPU_NVML_FUNCS]; /* atomic */
} vgpu_nvml_proc;

typedef struct {
    uint32_t magic, layout;
    int32_t gpus, sms, threads_per_sm, max_blocks_per_sm;
    int64_t wave_ns, overhead_ns, latency_ns, window_ns, history_ns;
    uint64_t total_bytes, reserved_bytes, context_bytes, alloc_granularity;
    int32_t timestamps_boot, hide_processes;
    int32_t idle_power_mw, max_power_mw;
    int64_t created_ns;      /* CLOCK_MONOTONIC at creation */
    int64_t unix_offset_ns;  /* CLOCK_REALTIME - CLOCK_MONOTONIC at creation */
    int32_t fastest_first[VGPU_MAX_GPUS]; /* CUDA_DEVICE_ORDER=FASTEST_FIRST: k-th CUDA device = this index */
    char not_supported[1024];             /* ",nvmlA,nvmlB," : NVML functions that answer NOT_SUPPORTED */
    vgpu_device dev[VGPU_MAX_DEVS];
    vgpu_proc proc[VGPU_MAX_PROCS];
    int64_t nvml_cost_ns[VGPU_NVML_FUNCS]; /* CPU burnt per call of each NVML function */
    vgpu_nvml_proc nvml_proc[VGPU_NVML_PROCS];
    int32_t cc_major, cc_minor; /* every device's compute capability (device attributes, image checks) */
    int32_t cuda_version;       /* what cuDriverGetVersion answers, e.g. 12090; bounds the PTX it JIT-compiles */
    int32_t pad2;
    int32_t mig;                /* MIG devices per GPU (0: MIG mode off on every GPU) */
    int32_t pad3;
    /* The power model (docs/design.md §15): the board draws idle_power - context_power bare, idle_power with a
     * context open, plus what the kernel that runs draws: a lean kernel light_sm per SM it holds; any other
     * kernel arithmetic, up to max_power on full waves. */
    int32_t context_power_mw;   /* what a context adds over bare idle */
    int32_t light_sm_uw;        /* an SM with a warp resident and no arithmetic, in microwatts */
    int32_t arith_static_mw;    /* the arithmetic units' static power with every SM active */
    int32_t sleep_ratio_ppm;    /* what the lean kernel's sleep quantum lasts over its request, in millionths */
    int32_t sleep_jitter_ppm;   /* +- this share of its length, drawn per lean kernel, in millionths */
    int32_t pad4;
} vgpu_state;

/* One process's view of the state (one per library: libcuda and libnvidia-ml each map it). */
typedef struct {
    vgpu_state *st;
    int fd;          /* the state file: flock here serialises changes */
    int kernels_fd;  /* kernels.jsonl, O_APPEND (libcuda only) */
    int unimpl_fd;   /* unimplemented, O_APPEND */
    int modules_fd;  /* modules.jsonl, O_APPEND (libcuda only) */
    int unmodelled_fd; /* nvml_unmodelled, O_APPEND (libnvidia-ml only) */
    int slot;        /* our process slot, -1 until the first context */
    int slot_fd;     /* held with flock(LOCK_EX) while this process lives */
    uint64_t pidns;
    char dir[4096];
} vgpu_view;

int64_t vgpu_now_ns(void);
/* Map the state named by $VGPU_STATE; 0 on success, else -1 with a one-line reason in `why`. */
int vgpu_attach(vgpu_view *v, char *why, size_t why_len);
void vgpu_detach(vgpu_view *v);
/* After fork in the child: a fresh lock descriptor (flock is per open file description) and no slot. */
void vgpu_after_fork_child(vgpu_view *v);
void vgpu_lock(vgpu_view *v);
void vgpu_unlock(vgpu_view *v);

/* Under the lock. Release the slots of processes that are gone (their slot lock can be taken). */
void vgpu_reap(vgpu_view *v);
/* Under the lock. This process's slot, claimed on first use; -1 when all are taken. */
int vgpu_own_slot(vgpu_view *v);

/* Device time: is it lost at `now_ns`? Counts an NVML query when `nvml_call`. */
int vgpu_lost(vgpu_view *v, int dev, int64_t now_ns, int nvml_call);

/* Under the lock: after a context opened or closed (or a dead process's went): bring each GPU's context spans up
 * to date at `now_ns` (the power model's context part). */
void vgpu_contexts_changed(vgpu_state *st, int64_t now_ns);
/* Under the lock: nanoseconds within [a, b) during which a context was open on the physical device `gpu`, and its
 * total up to `now_ns` (the energy counter's). */
int64_t vgpu_context_ns(const vgpu_state *st, int gpu, int64_t a_ns, int64_t b_ns);
int64_t vgpu_context_total_ns(const vgpu_state *st, int gpu, int64_t now_ns);

/* Under the lock: queue a kernel of `duration_ns` that could start at `ready_ns` on device `dev`. */
void vgpu_queue_kernel(vgpu_view *v, int dev, int64_t submit_ns, int64_t ready_ns, int64_t duration_ns,
                       int64_t *start_ns, int64_t *end_ns);
/* Under the lock: nanoseconds within [a, b) during which a kernel ran on `dev`. */
int64_t vgpu_busy_ns(const vgpu_state *st, int dev, int64_t a_ns, int64_t b_ns);
/* Under the lock: device memory in use by every live context and allocation (bytes, without reserved). */
uint64_t vgpu_used_bytes(const vgpu_state *st, int dev);
uint64_t vgpu_proc_bytes(const vgpu_state *st, int slot, int dev);
/* Device memory contexts and allocations may use: the device's less what the driver reserves (its share). */
uint64_t vgpu_usable_bytes(const vgpu_state *st, int dev);
uint64_t vgpu_reserved_bytes(const vgpu_state *st, int dev);

/* The NVML functions the stand-in exports, NULL-terminated; their index is their counter's. */
extern const char *const vgpu_nvml_names[];
/* The index of an NVML function's name, or -1. */
int vgpu_nvml_index(const char *name);
/* Under the lock: a fresh counter row for the calling process (its pid, pidns, comm); -1 when all are taken. */
int vgpu_nvml_claim(vgpu_view *v);
/* Burn `ns` of this thread's CPU time (a driver call that costs CPU, not a sleep). */
void vgpu_burn_cpu_ns(int64_t ns);

/* Record a call of an NVML function the stand-in does not model (once per name per process; no line on stderr:
 * NOT_SUPPORTED is an answer NVML's clients expect). */
void vgpu_nvml_unmodelled(vgpu_view *v, const char *fn);
/* Record a call to an entry point the stand-in does not implement (once per name per process). */
void vgpu_unimplemented(vgpu_view *v, const char *what);

/* Create a fresh state in `dir` from "key=value" lines; 0, or -1 with a one-line reason. */
int vgpu_create(const char *dir, const char *config, char *why, size_t why_len);

/* The devices a process sees, as in a container the NVIDIA container toolkit set up: NVIDIA_VISIBLE_DEVICES
 * "all" (or unset, empty or "void": no container, the host's view) sees every device; "none" none; otherwise a
 * comma-separated list of host indices and GPU UUIDs. They are numbered from 0 in the host's order (NVML
 * enumerates the devices a container has by PCI bus, not in the order the list names them). `out` gets the
 * host indices; returns how many. An entry that names no device is left out and said once on stderr. */
int vgpu_container_devices(const vgpu_state *st, int out[VGPU_MAX_GPUS]);

/* --- MIG (mig.c) --- */
/* Under creation: split every GPU into st->mig equal MIG devices (one GPU instance, one compute instance each). */
void vgpu_mig_create(vgpu_state *st);
/* The MIG device of GPU `gpu` at `slot` (0..mig-1), or -1. */
int vgpu_mig_device(const vgpu_state *st, int gpu, int slot);
/* The MIG device of GPU `gpu` with GPU instance `gi_id`, or -1. */
int vgpu_mig_by_gi(const vgpu_state *st, int gpu, int gi_id);
/* Is `dev` a MIG device, or a GPU in MIG mode? */
int vgpu_is_mig(const vgpu_state *st, int dev);
int vgpu_mig_mode(const vgpu_state *st, int dev);
/* The device index a MIG-<uuid> names (case-insensitive; a prefix must match one only), or -1. */
int vgpu_mig_by_uuid(const vgpu_state *st, const char *text, int prefix);
/* "MIG-xxxxxxxx-..." (the UUID as NVML prints a MIG device's). */
void vgpu_mig_uuid_string(const uint8_t uuid[16], char out[48]);

/* --- GPM (gpm.c) --- */
/* Under the lock: record a kernel of `grid` blocks of `threads` threads on `dev` from start to end for GPM and the
 * power model; `lean`: the lean kernel (no arithmetic), else any kernel (arithmetic). */
void vgpu_gpm_record(vgpu_state *st, int dev, int64_t start_ns, int64_t end_ns, uint64_t grid, uint64_t threads,
                     int lean);
/* Under the lock: the kernels' energy (J, above the idle with a context) on the physical device `gpu` (its MIG
 * devices' too) over [a, b), and up to `now_ns` since the state was created. */
double vgpu_kernel_j(const vgpu_state *st, int gpu, int64_t a_ns, int64_t b_ns);
double vgpu_kernel_total_j(const vgpu_state *st, int gpu, int64_t now_ns);
/* Under the lock: over [a, b) on `dev` (a GPU in MIG mode: all its MIG devices, weighted by SMs): nanoseconds a
 * kernel ran (graphics), SM-nanoseconds over SMs (sm), warp-slot-nanoseconds over slots (occupancy). */
void vgpu_gpm_integrals(const vgpu_state *st, int dev, int64_t a_ns, int64_t b_ns, double *graphics_ns,
                        double *sm_ns, double *occupancy_ns);

/* UUID as NVML prints it: "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (41 bytes with the NUL). */
void vgpu_uuid_string(const uint8_t uuid[16], char out[48]);

#pragma GCC visibility pop

#endif
