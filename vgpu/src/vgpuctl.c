/* vgpuctl: creates a virtual GPU's state and shows it, for the Python API (vgpu/__init__.py) and scripts/vgpu.
 *
 *   vgpuctl create DIR < config      key=value lines (see vgpu_create in state.c); exit 2 on a bad config
 *   vgpuctl show DIR                 one JSON object: devices, live processes with their contexts and memory
 *   vgpuctl calls DIR                one JSON object: every process's NVML calls so far, per function
 *
 * It never loads the stand-in libraries, so the process that asks (pytest) stays off the virtual GPU.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "state.h"

static void json_string(const char *s) {
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20)
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    putchar('"');
}

/* Attach to the state in `dir`; 0, or 1 with the reason said on stderr. */
static int attach_dir(const char *dir, vgpu_view *v) {
    setenv(VGPU_ENV, dir, 1);
    char why[512];
    if (vgpu_attach(v, why, sizeof why) != 0) {
        fprintf(stderr, "vgpuctl: %s\n", why);
        return 1;
    }
    return 0;
}

static int show(const char *dir) {
    vgpu_view v;
    if (attach_dir(dir, &v) != 0)
        return 1;
    vgpu_lock(&v);
    vgpu_reap(&v);
    const vgpu_state *st = v.st;
    int64_t now = vgpu_now_ns();
    double off = (double)st->unix_offset_ns;
    printf("{\"now\":%.6f,\"created\":%.6f,\"gpus\":%d,\"sms\":%d,\"window_s\":%.9f,\"timestamps\":\"%s\","
           "\"hide_processes\":%s,\"context_mib\":%.3f,\"reserved_mib\":%.3f,\"total_mib\":%.3f,\"devices\":[",
           ((double)now + off) / 1e9, ((double)st->created_ns + off) / 1e9, st->gpus, st->sms,
           (double)st->window_ns / 1e9, st->timestamps_boot ? "boot" : "unix", st->hide_processes ? "true" : "false",
           (double)st->context_bytes / 1048576.0, (double)st->reserved_bytes / 1048576.0,
           (double)st->total_bytes / 1048576.0);
    for (int i = 0; i < st->gpus; i++) {
        const vgpu_device *d = &st->dev[i];
        char uuid[48];
        vgpu_uuid_string(d->uuid, uuid);
        printf("%s{\"index\":%d,\"uuid\":\"%s\",\"name\":", i ? "," : "", i, uuid);
        json_string(d->name);
        printf(",\"pci_bus_id\":\"%s\",\"lost\":%s,\"used_mib\":%.3f,\"kernels\":%llu,\"busy_s\":%.9f,"
               "\"nvml_calls\":%llu,\"compute_mode\":%d,\"minor\":%d",
               d->pci_bus_id, d->lost_at_ns <= now ? "true" : "false",
               (double)vgpu_used_bytes(st, i) / 1048576.0, (unsigned long long)d->kernels,
               (double)d->busy_queued_ns / 1e9, (unsigned long long)d->nvml_calls, (int)d->compute_mode,
               (int)d->minor);
        printf(",\"mig\":[");  /* its MIG devices (mig.c), with their GPU instance IDs */
        for (int k = 0; k < d->mig; k++) {
            int m = vgpu_mig_device(st, i, k);
            const vgpu_device *md = &st->dev[m];
            char muuid[48];
            vgpu_mig_uuid_string(md->uuid, muuid);
            printf("%s{\"uuid\":\"%s\",\"gi\":%d,\"ci\":%d,\"profile\":\"%s\",\"profile_id\":%d,"
                   "\"placement\":[%d,%d],\"sms\":%d,\"total_mib\":%.3f,"
                   "\"used_mib\":%.3f,\"kernels\":%llu,\"busy_s\":%.9f}",
                   k ? "," : "", muuid, md->gi_id, md->ci_id, md->profile, md->gi_profile_id, md->placement_start,
                   md->placement_size, md->sms,
                   (double)md->total_bytes / 1048576.0, (double)vgpu_used_bytes(st, m) / 1048576.0,
                   (unsigned long long)md->kernels, (double)md->busy_queued_ns / 1e9);
        }
        printf("]}");
    }
    printf("],\"processes\":[");
    int first = 1;
    for (int s = 0; s < VGPU_MAX_PROCS; s++) {
        const vgpu_proc *p = &st->proc[s];
        if (!p->in_use) continue;
        printf("%s{\"slot\":%d,\"pid\":%d,\"pidns\":%llu,\"comm\":", first ? "" : ",", s, p->pid,
               (unsigned long long)p->pidns);
        json_string(p->comm);
        printf(",\"contexts\":[");
        int first_ctx = 1;
        for (int i = 0; i < VGPU_MAX_DEVS; i++) {
            if (i >= st->gpus && st->dev[i].parent < 0) continue;  /* no device there */
            uint64_t bytes = vgpu_proc_bytes(st, s, i);
            if (!p->ctx_open[i] && bytes == 0) continue;
            char mig[16] = "null";
            if (st->dev[i].parent >= 0) snprintf(mig, sizeof mig, "%d", st->dev[i].gi_id);
            printf("%s{\"device\":%d,\"mig\":%s,\"open\":%s,\"mib\":%.3f}", first_ctx ? "" : ",",
                   st->dev[i].parent >= 0 ? st->dev[i].parent : i, mig, p->ctx_open[i] ? "true" : "false",
                   (double)bytes / 1048576.0);
            first_ctx = 0;
        }
        printf("]}");
        first = 0;
    }
    printf("]}\n");
    vgpu_unlock(&v);
    vgpu_detach(&v);
    return 0;
}

static int calls(const char *dir) {
    vgpu_view v;
    if (attach_dir(dir, &v) != 0)
        return 1;
    const vgpu_state *st = v.st;  /* counters are atomic: no lock, so a slow driver call holds nobody up */
    printf("{\"now\":%.6f,\"cost_ms\":{", ((double)vgpu_now_ns() + (double)st->unix_offset_ns) / 1e9);
    int first = 1;
    for (int f = 0; vgpu_nvml_names[f] != NULL; f++) {
        if (st->nvml_cost_ns[f] <= 0) continue;
        printf("%s\"%s\":%.6f", first ? "" : ",", vgpu_nvml_names[f], (double)st->nvml_cost_ns[f] / 1e6);
        first = 0;
    }
    printf("},\"processes\":[");
    first = 1;
    for (int i = 0; i < VGPU_NVML_PROCS; i++) {
        const vgpu_nvml_proc *p = &st->nvml_proc[i];
        if (!__atomic_load_n(&p->in_use, __ATOMIC_ACQUIRE)) continue;
        printf("%s{\"pid\":%d,\"pidns\":%llu,\"comm\":", first ? "" : ",", p->pid, (unsigned long long)p->pidns);
        json_string(p->comm);
        printf(",\"calls\":{");
        int first_fn = 1;
        for (int f = 0; vgpu_nvml_names[f] != NULL; f++) {
            unsigned long long n = __atomic_load_n(&p->calls[f], __ATOMIC_RELAXED);
            if (n == 0) continue;
            printf("%s\"%s\":%llu", first_fn ? "" : ",", vgpu_nvml_names[f], n);
            first_fn = 0;
        }
        printf("}}");
        first = 0;
    }
    printf("]}\n");
    vgpu_detach(&v);
    return 0;
}

static int create(const char *dir) {
    size_t cap = 65536, len = 0;
    char *text = malloc(cap);
    if (text == NULL) return 1;
    size_t n;
    while ((n = fread(text + len, 1, cap - len - 1, stdin)) > 0) {
        len += n;
        if (len + 1 >= cap) {
            fprintf(stderr, "vgpuctl: config too long\n");
            free(text);
            return 2;
        }
    }
    text[len] = '\0';
    char why[512];
    int rc = vgpu_create(dir, text, why, sizeof why);
    free(text);
    if (rc != 0) {
        fprintf(stderr, "vgpuctl: %s\n", why);
        return 2;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "create") == 0) return create(argv[2]);
    if (argc == 3 && strcmp(argv[1], "show") == 0) return show(argv[2]);
    if (argc == 3 && strcmp(argv[1], "calls") == 0) return calls(argv[2]);
    fprintf(stderr, "usage: vgpuctl create DIR < config | vgpuctl show DIR | vgpuctl calls DIR\n");
    return 2;
}
