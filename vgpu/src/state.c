/* The virtual GPU's shared state (see state.h): mapping, locking, process slots, the device timeline. */
#define _GNU_SOURCE
#include "state.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int64_t vgpu_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* CLOCK_REALTIME - CLOCK_MONOTONIC at one instant: the real read between two monotonic reads, the closest of a few
   tries on their midpoint (a preemption between two reads would shift every Unix time the tests read by its length;
   forge_load/clock.py reads the filler's side the same way). */
static int64_t unix_minus_monotonic_ns(void) {
    int64_t best_gap = INT64_MAX, best = 0;
    for (int i = 0; i < 5 && best_gap > 20000; i++) {
        struct timespec real;
        int64_t before = vgpu_now_ns();
        clock_gettime(CLOCK_REALTIME, &real);
        int64_t after = vgpu_now_ns();
        if (after - before < best_gap) {
            best_gap = after - before;
            best = (int64_t)real.tv_sec * 1000000000 + real.tv_nsec - (before + (after - before) / 2);
        }
    }
    return best;
}

static void say(char *why, size_t why_len, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, why_len, fmt, ap);
    va_end(ap);
}

static uint64_t own_pidns(void) {
    struct stat sb;
    return stat("/proc/self/ns/pid", &sb) == 0 ? (uint64_t)sb.st_ino : 0;
}

static int open_in(const char *dir, const char *name, int flags) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return open(path, flags | O_CLOEXEC, 0666);
}

int vgpu_attach(vgpu_view *v, char *why, size_t why_len) {
    memset(v, 0, sizeof *v);
    v->fd = v->kernels_fd = v->unimpl_fd = v->modules_fd = v->unmodelled_fd = v->slot_fd = -1;
    v->slot = -1;
    const char *dir = getenv(VGPU_ENV);
    if (dir == NULL || dir[0] == '\0') {
        say(why, why_len, "%s is not set (run under scripts/vgpu)", VGPU_ENV);
        return -1;
    }
    if (strlen(dir) >= sizeof v->dir - 32) {
        say(why, why_len, "%s is too long", VGPU_ENV);
        return -1;
    }
    strcpy(v->dir, dir);
    v->fd = open_in(dir, "state", O_RDWR);
    if (v->fd < 0) {
        say(why, why_len, "cannot open %s/state: %s", dir, strerror(errno));
        return -1;
    }
    struct stat sb;
    if (fstat(v->fd, &sb) != 0 || (size_t)sb.st_size != sizeof(vgpu_state)) {
        say(why, why_len, "%s/state is not a virtual GPU state of this build (size)", dir);
        close(v->fd);
        return -1;
    }
    void *p = mmap(NULL, sizeof(vgpu_state), PROT_READ | PROT_WRITE, MAP_SHARED, v->fd, 0);
    if (p == MAP_FAILED) {
        say(why, why_len, "cannot map %s/state: %s", dir, strerror(errno));
        close(v->fd);
        return -1;
    }
    v->st = p;
    if (v->st->magic != VGPU_MAGIC || v->st->layout != VGPU_LAYOUT) {
        say(why, why_len, "%s/state is not a virtual GPU state of this build", dir);
        munmap(p, sizeof(vgpu_state));
        close(v->fd);
        v->st = NULL;
        return -1;
    }
    v->kernels_fd = open_in(dir, "kernels.jsonl", O_WRONLY | O_APPEND);
    v->unimpl_fd = open_in(dir, "unimplemented", O_WRONLY | O_APPEND);
    v->modules_fd = open_in(dir, "modules.jsonl", O_WRONLY | O_APPEND);
    v->unmodelled_fd = open_in(dir, "nvml_unmodelled", O_WRONLY | O_APPEND);
    v->pidns = own_pidns();
    return 0;
}

void vgpu_detach(vgpu_view *v) {
    if (v->st != NULL) munmap(v->st, sizeof(vgpu_state));
    if (v->fd >= 0) close(v->fd);
    if (v->kernels_fd >= 0) close(v->kernels_fd);
    if (v->unimpl_fd >= 0) close(v->unimpl_fd);
    if (v->modules_fd >= 0) close(v->modules_fd);
    if (v->unmodelled_fd >= 0) close(v->unmodelled_fd);
    if (v->slot_fd >= 0) close(v->slot_fd);  /* releases the slot: the next reap frees it */
    v->st = NULL;
    v->fd = v->kernels_fd = v->unimpl_fd = v->modules_fd = v->unmodelled_fd = v->slot_fd = -1;
    v->slot = -1;
}

void vgpu_after_fork_child(vgpu_view *v) {
    if (v->st == NULL) return;
    if (v->fd >= 0) close(v->fd);
    v->fd = open_in(v->dir, "state", O_RDWR);
    if (v->slot_fd >= 0) close(v->slot_fd);  /* the parent's descriptor still holds its lock */
    v->slot_fd = -1;
    v->slot = -1;
    v->pidns = own_pidns();
}

void vgpu_lock(vgpu_view *v) {
    while (flock(v->fd, LOCK_EX) != 0 && errno == EINTR) {
    }
}

void vgpu_unlock(vgpu_view *v) { flock(v->fd, LOCK_UN); }

void vgpu_reap(vgpu_view *v) {
    vgpu_state *st = v->st;
    int reaped = 0;
    for (int i = 0; i < VGPU_MAX_PROCS; i++) {
        if (!st->proc[i].in_use || i == v->slot) continue;
        char name[32];
        snprintf(name, sizeof name, "slots/%d", i);
        int fd = open_in(v->dir, name, O_RDONLY);
        if (fd < 0) continue;
        if (flock(fd, LOCK_EX | LOCK_NB) == 0) {  /* nobody holds it: that process is gone */
            uint32_t generation = st->proc[i].generation;
            memset(&st->proc[i], 0, sizeof st->proc[i]);
            st->proc[i].generation = generation + 1;
            flock(fd, LOCK_UN);
            reaped = 1;
        }
        close(fd);
    }
    if (reaped) vgpu_contexts_changed(st, vgpu_now_ns());  /* its contexts end here, when they are seen gone */
}

/* Is a context of any live process open on GPU `gpu` or on a MIG device of it? */
static int context_open_on(const vgpu_state *st, int gpu) {
    for (int p = 0; p < VGPU_MAX_PROCS; p++) {
        if (!st->proc[p].in_use) continue;
        for (int dev = 0; dev < VGPU_MAX_DEVS; dev++) {
            int board = dev < VGPU_MAX_GPUS ? dev : st->dev[dev].parent;
            if (board == gpu && st->proc[p].ctx_open[dev]) return 1;
        }
    }
    return 0;
}

void vgpu_contexts_changed(vgpu_state *st, int64_t now_ns) {
    for (int g = 0; g < st->gpus; g++) {
        vgpu_device *d = &st->dev[g];
        int open = context_open_on(st, g);
        if (open && d->ctx_since_ns == VGPU_NEVER) {
            d->ctx_since_ns = now_ns;
        } else if (!open && d->ctx_since_ns != VGPU_NEVER) {
            d->ctx_closed_ns += now_ns - d->ctx_since_ns;
            d->ctx_last_start_ns = d->ctx_since_ns;
            d->ctx_last_end_ns = now_ns;
            d->ctx_since_ns = VGPU_NEVER;
        }
    }
}

static int64_t span_overlap(int64_t s, int64_t e, int64_t a, int64_t b) {
    int64_t lo = s > a ? s : a, hi = e < b ? e : b;
    return hi > lo ? hi - lo : 0;
}

int64_t vgpu_context_ns(const vgpu_state *st, int gpu, int64_t a_ns, int64_t b_ns) {
    const vgpu_device *d = &st->dev[gpu];
    int64_t ns = span_overlap(d->ctx_last_start_ns, d->ctx_last_end_ns, a_ns, b_ns);  /* spans before it: not asked */
    if (d->ctx_since_ns != VGPU_NEVER) ns += span_overlap(d->ctx_since_ns, b_ns, a_ns, b_ns);
    return ns;
}

int64_t vgpu_context_total_ns(const vgpu_state *st, int gpu, int64_t now_ns) {
    const vgpu_device *d = &st->dev[gpu];
    return d->ctx_closed_ns + (d->ctx_since_ns != VGPU_NEVER && now_ns > d->ctx_since_ns ? now_ns - d->ctx_since_ns : 0);
}

int vgpu_own_slot(vgpu_view *v) {
    if (v->slot >= 0) return v->slot;
    vgpu_reap(v);
    vgpu_state *st = v->st;
    for (int i = 0; i < VGPU_MAX_PROCS; i++) {
        if (st->proc[i].in_use) continue;
        char name[32];
        snprintf(name, sizeof name, "slots/%d", i);
        int fd = open_in(v->dir, name, O_RDWR);
        if (fd < 0) continue;
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            close(fd);
            continue;
        }
        vgpu_proc *p = &st->proc[i];
        uint32_t generation = p->generation;
        memset(p, 0, sizeof *p);
        p->generation = generation + 1;
        p->in_use = 1;
        p->pid = (int32_t)getpid();
        p->pidns = v->pidns;
        p->started_ns = vgpu_now_ns();
        int cfd = open("/proc/self/comm", O_RDONLY | O_CLOEXEC);
        if (cfd >= 0) {
            ssize_t n = read(cfd, p->comm, sizeof p->comm - 1);
            if (n > 0 && p->comm[n - 1] == '\n') p->comm[n - 1] = '\0';
            close(cfd);
        }
        v->slot = i;
        v->slot_fd = fd;
        return i;
    }
    return -1;
}

int vgpu_lost(vgpu_view *v, int dev, int64_t now_ns, int nvml_call) {
    if (v->st->dev[dev].parent >= 0) dev = v->st->dev[dev].parent;  /* a MIG device is lost with its GPU */
    vgpu_device *d = &v->st->dev[dev];
    if (nvml_call && d->lost_after_calls >= 0) {
        uint64_t n = __atomic_add_fetch(&d->nvml_calls, 1, __ATOMIC_RELAXED);
        if ((int64_t)n > d->lost_after_calls) {
            int64_t old = __atomic_load_n(&d->lost_at_ns, __ATOMIC_RELAXED);
            while (old > now_ns &&
                   !__atomic_compare_exchange_n(&d->lost_at_ns, &old, now_ns, 0, __ATOMIC_RELAXED,
                                                __ATOMIC_RELAXED)) {
            }
        }
    }
    return __atomic_load_n(&d->lost_at_ns, __ATOMIC_RELAXED) <= now_ns;
}

void vgpu_queue_kernel(vgpu_view *v, int dev, int64_t submit_ns, int64_t ready_ns, int64_t duration_ns,
                       int64_t *start_ns, int64_t *end_ns) {
    (void)submit_ns;
    vgpu_device *d = &v->st->dev[dev];
    int64_t start = ready_ns > d->tail_ns ? ready_ns : d->tail_ns;
    int64_t end = start + duration_ns;
    d->tail_ns = end;
    d->busy_queued_ns += duration_ns;
    d->kernels++;
    if (d->ring_count > 0) {
        vgpu_interval *last = &d->ring[(d->ring_count - 1) % VGPU_RING];
        if (start <= last->end_ns) {  /* back to back: one busy interval */
            last->end_ns = end;
            *start_ns = start;
            *end_ns = end;
            return;
        }
    }
    vgpu_interval *slot = &d->ring[d->ring_count % VGPU_RING];
    slot->start_ns = start;
    slot->end_ns = end;
    d->ring_count++;
    *start_ns = start;
    *end_ns = end;
}

int64_t vgpu_busy_ns(const vgpu_state *st, int dev, int64_t a_ns, int64_t b_ns) {
    const vgpu_device *d = &st->dev[dev];
    uint64_t hi = d->ring_count;
    uint64_t lo = hi > VGPU_RING ? hi - VGPU_RING : 0;
    /* first interval that ends after a_ns (intervals are sorted and disjoint) */
    uint64_t l = lo, h = hi;
    while (l < h) {
        uint64_t m = l + (h - l) / 2;
        if (d->ring[m % VGPU_RING].end_ns > a_ns)
            h = m;
        else
            l = m + 1;
    }
    int64_t total = 0;
    for (uint64_t i = l; i < hi; i++) {
        const vgpu_interval *iv = &d->ring[i % VGPU_RING];
        if (iv->start_ns >= b_ns) break;
        int64_t s = iv->start_ns > a_ns ? iv->start_ns : a_ns;
        int64_t e = iv->end_ns < b_ns ? iv->end_ns : b_ns;
        if (e > s) total += e - s;
    }
    return total;
}

uint64_t vgpu_proc_bytes(const vgpu_state *st, int slot, int dev) {
    const vgpu_proc *p = &st->proc[slot];
    if (!p->in_use) return 0;
    uint64_t g = st->alloc_granularity ? st->alloc_granularity : 1;
    uint64_t alloc = (p->alloc_bytes[dev] + g - 1) / g * g;
    return (p->ctx_open[dev] ? p->ctx_bytes[dev] : 0) + alloc;
}

uint64_t vgpu_reserved_bytes(const vgpu_state *st, int dev) {
    if (st->dev[dev].parent < 0) return st->reserved_bytes;
    return (uint64_t)((double)st->reserved_bytes * (double)st->dev[dev].total_bytes / (double)st->total_bytes);
}

uint64_t vgpu_usable_bytes(const vgpu_state *st, int dev) {
    return st->dev[dev].total_bytes - vgpu_reserved_bytes(st, dev);
}

uint64_t vgpu_used_bytes(const vgpu_state *st, int dev) {
    uint64_t used = 0;
    for (int k = 0; k < st->dev[dev].mig; k++) used += vgpu_used_bytes(st, vgpu_mig_device(st, dev, k));
    for (int i = 0; i < VGPU_MAX_PROCS; i++) used += vgpu_proc_bytes(st, i, dev);
    return used;
}

/* Once per name per process: a hash set of the names already said (entry points of both libraries). */
static int first_time(const char *what) {
    static uint64_t seen[1024];
    uint64_t h = 1469598103934665603ull;
    for (const char *c = what; *c; c++) h = (h ^ (uint8_t)*c) * 1099511628211ull;
    h |= 1;
    for (unsigned i = 0; i < 1024; i++) {
        unsigned k = (unsigned)(h + i) % 1024;
        uint64_t cur = __atomic_load_n(&seen[k], __ATOMIC_RELAXED);
        if (cur == h) return 0;
        if (cur == 0) {
            if (__atomic_compare_exchange_n(&seen[k], &cur, h, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return 1;
            if (cur == h) return 0;
        }
    }
    return 1;
}

static void append_line(int fd, const char *what) {
    char line[512];
    int n = snprintf(line, sizeof line, "%s\n", what);
    if (n > (int)sizeof line - 1) n = (int)sizeof line - 1;
    if (fd >= 0 && write(fd, line, (size_t)n) < 0) {
        /* a record lost: nothing more to do */
    }
}

void vgpu_nvml_unmodelled(vgpu_view *v, const char *fn) {
    if (v != NULL && first_time(fn)) append_line(v->unmodelled_fd, fn);
}

void vgpu_unimplemented(vgpu_view *v, const char *what) {
    if (!first_time(what)) return;
    append_line(v != NULL ? v->unimpl_fd : -1, what);
    fprintf(stderr, "vgpu: %s is not implemented by the virtual GPU (it fails with an error)\n", what);
}

const char *const vgpu_nvml_names[] = {
    "nvmlInit",
    "nvmlInit_v2",
    "nvmlInitWithFlags",
    "nvmlShutdown",
    "nvmlErrorString",
    "nvmlSystemGetDriverVersion",
    "nvmlSystemGetNVMLVersion",
    "nvmlSystemGetCudaDriverVersion",
    "nvmlSystemGetCudaDriverVersion_v2",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetHandleByUUID",
    "nvmlDeviceGetHandleByPciBusId_v2",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetMinorNumber",
    "nvmlDeviceGetName",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetCudaComputeCapability",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetComputeMode",
    "nvmlDeviceGetPersistenceMode",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetSamples",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetGraphicsRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetPowerManagementLimit",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetPowerManagementLimitConstraints",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetTemperatureV",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
    "nvmlDeviceIsMigDeviceHandle",
    "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId",
    "nvmlDeviceGetAttributes_v2",
    "nvmlDeviceGetGpuInstanceById",
    "nvmlGpuInstanceGetInfo",
    "nvmlGpmQueryDeviceSupport",
    "nvmlGpmSampleAlloc",
    "nvmlGpmSampleFree",
    "nvmlGpmSampleGet",
    "nvmlGpmMigSampleGet",
    "nvmlGpmMetricsGet",
    NULL,
};
_Static_assert(sizeof vgpu_nvml_names / sizeof vgpu_nvml_names[0] <= VGPU_NVML_FUNCS + 1, "VGPU_NVML_FUNCS");

int vgpu_nvml_index(const char *name) {
    for (int i = 0; vgpu_nvml_names[i] != NULL; i++)
        if (strcmp(vgpu_nvml_names[i], name) == 0) return i;
    return -1;
}

int vgpu_nvml_claim(vgpu_view *v) {
    vgpu_state *st = v->st;
    for (int i = 0; i < VGPU_NVML_PROCS; i++) {
        vgpu_nvml_proc *p = &st->nvml_proc[i];
        if (p->in_use) continue;
        memset(p, 0, sizeof *p);
        p->in_use = 1;
        p->pid = (int32_t)getpid();
        p->pidns = v->pidns;
        int cfd = open("/proc/self/comm", O_RDONLY | O_CLOEXEC);
        if (cfd >= 0) {
            ssize_t n = read(cfd, p->comm, sizeof p->comm - 1);
            if (n > 0 && p->comm[n - 1] == '\n') p->comm[n - 1] = '\0';
            close(cfd);
        }
        return i;
    }
    return -1;
}

void vgpu_burn_cpu_ns(int64_t ns) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    int64_t end = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec + ns;
    for (;;) {
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
        if ((int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec >= end) return;
    }
}

void vgpu_uuid_string(const uint8_t u[16], char out[48]) {
    snprintf(out, 48, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
             u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

int vgpu_container_devices(const vgpu_state *st, int out[VGPU_MAX_GPUS]) {
    const char *env = getenv("NVIDIA_VISIBLE_DEVICES");
    int seen[VGPU_MAX_GPUS] = {0};
    int n = 0;
    if (env == NULL || env[0] == '\0' || strcmp(env, "void") == 0 || strcmp(env, "all") == 0) {
        for (int i = 0; i < st->gpus; i++) seen[i] = 1;
    } else if (strcmp(env, "none") != 0) {
        char buf[1024];
        snprintf(buf, sizeof buf, "%s", env);
        char *save = NULL;
        for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
            int dev = -1;
            if (strncmp(tok, "GPU-", 4) == 0) {
                for (int i = 0; i < st->gpus; i++) {
                    char uuid[48];
                    vgpu_uuid_string(st->dev[i].uuid, uuid);
                    if (strcasecmp(uuid, tok) == 0) dev = i;
                }
            } else {
                char *end = NULL;
                long k = strtol(tok, &end, 10);
                if (end != tok && *end == '\0' && k >= 0 && k < st->gpus) dev = (int)k;
            }
            if (dev < 0) {
                static int said;
                if (!said++) fprintf(stderr, "vgpu: NVIDIA_VISIBLE_DEVICES entry '%s' names no device: left out\n", tok);
                continue;
            }
            seen[dev] = 1;
        }
    }
    for (int i = 0; i < st->gpus; i++)
        if (seen[i]) out[n++] = i;
    return n;
}

/* --- creation ------------------------------------------------------------------------------------------ */

static const uint32_t PCI_BUSES[VGPU_MAX_GPUS] = {0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb};

static int parse_list_pairs(const char *value, int64_t out_by_dev[VGPU_MAX_GPUS], double scale, int gpus,
                            char *why, size_t why_len, const char *key) {
    /* "I@X,I@X": device I, value X (scaled) */
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", value);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *at = strchr(tok, '@');
        char *end = NULL;
        if (at == NULL) goto bad;
        long dev = strtol(tok, &end, 10);
        if (end != at || dev < 0 || dev >= gpus) goto bad;
        double x = strtod(at + 1, &end);
        if (*end != '\0' || x < 0) goto bad;
        out_by_dev[dev] = (int64_t)(x * scale);
        continue;
    bad:
        say(why, why_len, "%s=%s: expected DEVICE@VALUE[,...] with 0 <= DEVICE < %d and VALUE >= 0", key, value,
            gpus);
        return -1;
    }
    return 0;
}

int vgpu_create(const char *dir, const char *config, char *why, size_t why_len) {
    vgpu_state *st = calloc(1, sizeof *st);
    if (st == NULL) {
        say(why, why_len, "out of memory");
        return -1;
    }
    st->magic = VGPU_MAGIC;
    st->layout = VGPU_LAYOUT;
    st->gpus = 1;
    st->sms = 132;
    st->threads_per_sm = 2048;
    st->max_blocks_per_sm = 32;
    st->wave_ns = 100000;
    st->overhead_ns = 8000;
    st->latency_ns = 5000;
    st->window_ns = 166666667;
    st->history_ns = 15000000000;
    st->total_bytes = 81559ull << 20;
    st->reserved_bytes = 541ull << 20;
    st->context_bytes = 512ull << 20;
    st->alloc_granularity = 2ull << 20;
    st->idle_power_mw = 70000;     /* with a context, nothing running (docs/design.md §15: every figure a model) */
    st->max_power_mw = 700000;
    st->context_power_mw = 38000;  /* 26-50 W on HBM GPUs */
    st->light_sm_uw = 24625;       /* AccelWattch's Volta: 1.97 W of light-load static power over 80 SMs */
    st->arith_static_mw = 38620;   /* AccelWattch's Volta: INT+FP static, 18.6 W + 31 lanes x 0.645 W */
    st->sleep_ratio_ppm = 1200000; /* a sleep quantum lasts 1.2 times its request (nanosleep: 0 to 2 times) */
    st->sleep_jitter_ppm = 100000; /* +-10 % kernel to kernel */
    st->cc_major = 9;
    st->cc_minor = 0;
    st->cuda_version = 12090;
    char name[96] = "Virtual GPU (H100-like)";
    int64_t fail_s[VGPU_MAX_GPUS], fail_calls[VGPU_MAX_GPUS];
    int order[VGPU_MAX_GPUS];
    int have_order = 0;
    for (int i = 0; i < VGPU_MAX_GPUS; i++) fail_s[i] = fail_calls[i] = -1;
    char pending_fail_s[1024] = "", pending_fail_calls[1024] = "", pending_order[256] = "", pending_minors[256] = "";
    int32_t compute_mode = 0;

    char *text = strdup(config ? config : "");
    char *save = NULL;
    int rc = -1;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char *eq = strchr(line, '=');
        if (eq == NULL) {
            say(why, why_len, "config line %s: expected key=value", line);
            goto out;
        }
        *eq = '\0';
        const char *key = line, *val = eq + 1;
        char *end = NULL;
        double num = strtod(val, &end);
        int numeric = end != val && *end == '\0';
#define NUM(k, field, scale, lo, hi)                                                                  \
    if (strcmp(key, k) == 0) {                                                                        \
        if (!numeric || num < (lo) || num > (hi)) {                                                   \
            say(why, why_len, "%s=%s: expected a number from %g to %g", key, val, (double)(lo), (double)(hi)); \
            goto out;                                                                                 \
        }                                                                                             \
        st->field = (__typeof__(st->field))(num * (scale) + 0.5);                                   \
        continue;                                                                                     \
    }
        NUM("gpus", gpus, 1, 1, VGPU_MAX_GPUS)
        NUM("sms", sms, 1, 1, 1024)
        NUM("threads_per_sm", threads_per_sm, 1, 32, 65536)
        NUM("max_blocks_per_sm", max_blocks_per_sm, 1, 1, 1024)
        NUM("wave_s", wave_ns, 1e9, 0, 10)
        NUM("overhead_s", overhead_ns, 1e9, 0, 10)
        NUM("latency_s", latency_ns, 1e9, 0, 10)
        NUM("window_s", window_ns, 1e9, 0.001, 10)
        NUM("history_s", history_ns, 1e9, 0, 3600)
        NUM("total_mib", total_bytes, 1048576.0, 1, 1 << 24)
        NUM("reserved_mib", reserved_bytes, 1048576.0, 0, 1 << 24)
        NUM("context_mib", context_bytes, 1048576.0, 0, 1 << 24)
        NUM("alloc_granularity_mib", alloc_granularity, 1048576.0, 0, 1024)
        NUM("hide_processes", hide_processes, 1, 0, 1)
        NUM("idle_power_w", idle_power_mw, 1000, 0, 100000)
        NUM("max_power_w", max_power_mw, 1000, 0, 100000)
        NUM("context_power_w", context_power_mw, 1000, 0, 100000)
        NUM("light_sm_w", light_sm_uw, 1e6, 0, 100)
        NUM("arith_static_w", arith_static_mw, 1000, 0, 100000)
        NUM("sleep_ratio", sleep_ratio_ppm, 1e6, 0, 2)
        NUM("sleep_jitter", sleep_jitter_ppm, 1e6, 0, 1)
        NUM("cc_major", cc_major, 1, 1, 99)
        NUM("cc_minor", cc_minor, 1, 0, 9)
        NUM("cuda_version", cuda_version, 1, 1000, 99990)
        NUM("mig", mig, 1, 0, VGPU_MIG_SLOTS)
#undef NUM
        if (strcmp(key, "timestamps") == 0) {
            if (strcmp(val, "unix") == 0)
                st->timestamps_boot = 0;
            else if (strcmp(val, "boot") == 0)
                st->timestamps_boot = 1;
            else {
                say(why, why_len, "timestamps=%s: expected unix or boot", val);
                goto out;
            }
        } else if (strcmp(key, "name") == 0) {
            snprintf(name, sizeof name, "%s", val);
        } else if (strcmp(key, "fail_gpu") == 0) {
            snprintf(pending_fail_s, sizeof pending_fail_s, "%s", val);
        } else if (strcmp(key, "fail_gpu_calls") == 0) {
            snprintf(pending_fail_calls, sizeof pending_fail_calls, "%s", val);
        } else if (strcmp(key, "compute_mode") == 0) {
            /* every device, as `nvidia-smi -c` without -i sets them; NVML's and CUDA's values agree */
            if (strcmp(val, "default") == 0)
                compute_mode = 0;
            else if (strcmp(val, "prohibited") == 0)
                compute_mode = 2;
            else if (strcmp(val, "exclusive_process") == 0)
                compute_mode = 3;
            else {
                say(why, why_len, "compute_mode=%s: expected default, prohibited or exclusive_process", val);
                goto out;
            }
        } else if (strcmp(key, "fastest_first") == 0) {
            snprintf(pending_order, sizeof pending_order, "%s", val);
        } else if (strcmp(key, "minors") == 0) {
            snprintf(pending_minors, sizeof pending_minors, "%s", val);
        } else if (strcmp(key, "nvml_cost") == 0) {
            /* "FUNCTION:MS,FUNCTION:MS" */
            char buf[2048];
            snprintf(buf, sizeof buf, "%s", val);
            char *s3 = NULL;
            for (char *tok = strtok_r(buf, ",", &s3); tok; tok = strtok_r(NULL, ",", &s3)) {
                char *colon = strchr(tok, ':');
                char *end = NULL;
                double ms = -1;
                if (colon != NULL) {
                    *colon = '\0';
                    ms = strtod(colon + 1, &end);
                }
                int fi = vgpu_nvml_index(tok);
                if (colon == NULL || *end != '\0' || end == colon + 1 || !(ms >= 0 && ms <= 10000)) {
                    say(why, why_len, "nvml_cost=%s: expected FUNCTION:MS[,...] with 0 <= MS <= 10000", val);
                    goto out;
                }
                if (fi < 0) {
                    say(why, why_len, "nvml_cost: %s is not an NVML function of the virtual GPU", tok);
                    goto out;
                }
                st->nvml_cost_ns[fi] = (int64_t)(ms * 1e6 + 0.5);
            }
        } else if (strcmp(key, "not_supported") == 0) {
            if (strlen(val) + 3 > sizeof st->not_supported) {
                say(why, why_len, "not_supported: too long");
                goto out;
            }
            snprintf(st->not_supported, sizeof st->not_supported, ",%s,", val);
        } else {
            say(why, why_len, "unknown config key %s", key);
            goto out;
        }
    }
    if (pending_fail_s[0] &&
        parse_list_pairs(pending_fail_s, fail_s, 1e9, st->gpus, why, why_len, "fail_gpu") != 0)
        goto out;
    if (pending_fail_calls[0] &&
        parse_list_pairs(pending_fail_calls, fail_calls, 1, st->gpus, why, why_len, "fail_gpu_calls") != 0)
        goto out;
    if (pending_order[0]) {
        char buf[256];
        snprintf(buf, sizeof buf, "%s", pending_order);
        int n = 0, used[VGPU_MAX_GPUS] = {0};
        char *s2 = NULL;
        for (char *tok = strtok_r(buf, ",", &s2); tok; tok = strtok_r(NULL, ",", &s2)) {
            char *end = NULL;
            long k = strtol(tok, &end, 10);
            if (*end != '\0' || k < 0 || k >= st->gpus || used[k] || n >= st->gpus) {
                n = -1;
                break;
            }
            used[k] = 1;
            order[n++] = (int)k;
        }
        if (n != st->gpus) {
            say(why, why_len, "fastest_first=%s: expected a permutation of 0..%d", pending_order, st->gpus - 1);
            goto out;
        }
        have_order = 1;
    }
    int32_t minors[VGPU_MAX_GPUS];
    for (int i = 0; i < VGPU_MAX_GPUS; i++) minors[i] = i;  /* a host's usual numbering: minor = index */
    if (pending_minors[0]) {
        /* "M0,M1,...": GPU i's minor number, one per GPU, distinct; /dev/nvidia255 is nvidiactl's */
        char buf[256];
        snprintf(buf, sizeof buf, "%s", pending_minors);
        int n = 0;
        char *s2 = NULL;
        for (char *tok = strtok_r(buf, ",", &s2); tok; tok = strtok_r(NULL, ",", &s2)) {
            char *end = NULL;
            long m = strtol(tok, &end, 10);
            int dup = 0;
            for (int j = 0; j < n && j < VGPU_MAX_GPUS; j++) dup |= minors[j] == m;
            if (*end != '\0' || end == tok || m < 0 || m > 254 || dup || n >= st->gpus) {
                n = -1;
                break;
            }
            minors[n++] = (int32_t)m;
        }
        if (n != st->gpus) {
            say(why, why_len, "minors=%s: expected %d distinct minor numbers from 0 to 254, one per GPU",
                pending_minors, st->gpus);
            goto out;
        }
    }
    if (st->gpus * st->mig > VGPU_MAX_MIG) {
        say(why, why_len, "mig=%d: %d GPUs x %d MIG devices exceed the %d the virtual GPU holds", st->mig, st->gpus,
            st->mig, VGPU_MAX_MIG);
        goto out;
    }
    if (st->mig > 0 && st->cc_major * 10 + st->cc_minor < 80) {
        say(why, why_len, "mig=%d: MIG needs compute capability 8.0 or newer (Ampere), the devices are %d.%d", st->mig,
            st->cc_major, st->cc_minor);
        goto out;
    }
    if (st->reserved_bytes + st->context_bytes > st->total_bytes) {
        say(why, why_len, "reserved_mib + context_mib exceed total_mib");
        goto out;
    }
    if (st->context_power_mw > st->idle_power_mw || st->idle_power_mw > st->max_power_mw) {
        say(why, why_len, "the power model needs context_power_w <= idle_power_w <= max_power_w");
        goto out;
    }

    st->created_ns = vgpu_now_ns();
    st->unix_offset_ns = unix_minus_monotonic_ns();
    for (int i = 0; i < st->gpus; i++) {
        vgpu_device *d = &st->dev[i];
        uint64_t rnd[3] = {0, 0, 0};
        if (getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) {
            rnd[0] = (uint64_t)st->created_ns * 2654435761u + (uint64_t)i;
            rnd[1] = rnd[0] * 6364136223846793005ull + 1442695040888963407ull;
            rnd[2] = rnd[1] * 6364136223846793005ull + 1;
        }
        memcpy(d->uuid, rnd, 16);
        d->uuid[6] = (uint8_t)((d->uuid[6] & 0x0f) | 0x40);  /* a version 4 UUID */
        d->uuid[8] = (uint8_t)((d->uuid[8] & 0x3f) | 0x80);
        snprintf(d->name, sizeof d->name, "%s", name);
        d->pci_bus = PCI_BUSES[i];
        snprintf(d->pci_bus_id, sizeof d->pci_bus_id, "00000000:%02X:00.0", d->pci_bus);
        d->phase_ns = (int64_t)(rnd[2] % (uint64_t)st->window_ns);
        d->lost_at_ns = fail_s[i] >= 0 ? st->created_ns + fail_s[i] : VGPU_NEVER;
        d->lost_after_calls = fail_calls[i];
        st->fastest_first[i] = have_order ? order[i] : i;
        d->compute_mode = compute_mode;
        d->minor = minors[i];
        d->parent = -1;
        d->sms = st->sms;
        d->total_bytes = st->total_bytes;
        d->ctx_since_ns = VGPU_NEVER;  /* no context yet: the board is bare idle */
    }
    vgpu_mig_create(st);

    if (mkdir(dir, 0777) != 0 && errno != EEXIST) {
        say(why, why_len, "cannot create %s: %s", dir, strerror(errno));
        goto out;
    }
    chmod(dir, 0777);  /* shared with other users' processes (a container's non-root user) */
    char path[4200], tmp[4200];
    snprintf(path, sizeof path, "%s/slots", dir);
    if (mkdir(path, 0777) != 0 && errno != EEXIST) {
        say(why, why_len, "cannot create %s: %s", path, strerror(errno));
        goto out;
    }
    chmod(path, 0777);
    for (int i = 0; i < VGPU_MAX_PROCS; i++) {
        snprintf(path, sizeof path, "%s/slots/%d", dir, i);
        int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
        if (fd < 0) {
            say(why, why_len, "cannot create %s: %s", path, strerror(errno));
            goto out;
        }
        fchmod(fd, 0666);
        close(fd);
    }
    const char *files[] = {"kernels.jsonl", "unimplemented", "modules.jsonl", "nvml_unmodelled"};
    for (unsigned i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, files[i]);
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
        if (fd < 0) {
            say(why, why_len, "cannot create %s: %s", path, strerror(errno));
            goto out;
        }
        fchmod(fd, 0666);
        close(fd);
    }
    snprintf(tmp, sizeof tmp, "%s/state.tmp", dir);
    snprintf(path, sizeof path, "%s/state", dir);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0) {
        say(why, why_len, "cannot create %s: %s", tmp, strerror(errno));
        goto out;
    }
    fchmod(fd, 0666);
    /* Written sparse: the state is mostly empty rings, and every process maps it whole. */
    if (ftruncate(fd, (off_t)sizeof *st) != 0) {
        say(why, why_len, "cannot size %s: %s", tmp, strerror(errno));
        close(fd);
        goto out;
    }
    const char *p = (const char *)st;
    static const char zero[65536];
    for (size_t off = 0; off < sizeof *st; off += sizeof zero) {
        size_t len = sizeof *st - off < sizeof zero ? sizeof *st - off : sizeof zero;
        if (memcmp(p + off, zero, len) == 0) continue;
        if (pwrite(fd, p + off, len, (off_t)off) != (ssize_t)len) {
            say(why, why_len, "cannot write %s: %s", tmp, strerror(errno));
            close(fd);
            goto out;
        }
    }
    close(fd);
    if (rename(tmp, path) != 0) {
        say(why, why_len, "cannot rename %s: %s", tmp, strerror(errno));
        goto out;
    }
    rc = 0;
out:
    free(text);
    free(st);
    return rc;
}
