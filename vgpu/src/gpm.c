/* GPM and power on the virtual GPU: what a kernel's shape does to SM activity, occupancy and board power, kept per
 * device so that NVML's GPM metrics, power and energy (nvml.c) can be computed over any span. A kernel of `grid`
 * blocks runs in waves of SMs x resident blocks per SM (a lean kernel of at most one block per SM: one wave, as long
 * as its sleep, cuda.c); blocks spread over the SMs before they stack, so a wave of B blocks keeps min(B, SMs) SMs
 * active and B x warps per block warp slots filled. Every wave but the last is full; the launch overhead counts with
 * the full waves (with the last wave where there is only one).
 *
 * Power (a model, docs/design.md §15), in board watts above the idle with a context: a lean kernel draws light_sm
 * for each SM with a warp of it; any other kernel is arithmetic: light_sm per active SM, arith_static times the
 * board's share of SMs active, and the rest up to max_power by the board's share of warp slots filled, so full
 * waves over the whole GPU draw max_power. */
#define _GNU_SOURCE
#include "state.h"

/* Board watts above the idle with a context while `sm_share` of the device's SMs hold a block of the kernel and
 * `occ_share` of its warp slots are filled. */
static float kernel_watts(const vgpu_state *st, const vgpu_device *d, double sm_share, double occ_share, int lean) {
    const vgpu_device *board = d->parent >= 0 ? &st->dev[d->parent] : d;
    double of_board = (double)d->sms / (double)board->sms;  /* a MIG device's share of the board */
    double light_w = (double)st->light_sm_uw / 1e6;
    double active_sms = sm_share * (double)d->sms;
    double w = light_w * active_sms;
    if (!lean) {
        double arith_w = (double)st->arith_static_mw / 1e3;
        double dynamic_w = (double)(st->max_power_mw - st->idle_power_mw) / 1e3 - light_w * board->sms - arith_w;
        if (dynamic_w < 0) dynamic_w = 0;
        w += arith_w * sm_share * of_board + dynamic_w * occ_share * of_board;
    }
    return (float)w;
}

void vgpu_gpm_record(vgpu_state *st, int dev, int64_t start_ns, int64_t end_ns, uint64_t grid, uint64_t threads,
                     int lean) {
    vgpu_device *d = &st->dev[dev];
    uint64_t sms = (uint64_t)d->sms;
    uint64_t resident = threads > 0 ? (uint64_t)st->threads_per_sm / threads : 1;
    if (resident > (uint64_t)st->max_blocks_per_sm) resident = (uint64_t)st->max_blocks_per_sm;
    if (resident == 0) resident = 1;
    uint64_t per_wave = resident * sms;
    uint64_t waves = (grid + per_wave - 1) / per_wave;
    uint64_t last = grid - (waves - 1) * per_wave;
    double warps_per_block = (double)((threads + 31) / 32);
    double warp_slots = (double)sms * (double)st->threads_per_sm / 32.0;
    vgpu_shape *s = &d->shapes[d->shape_count % VGPU_SHAPES];
    s->start_ns = start_ns;
    s->end_ns = end_ns;
    s->full_end_ns = waves <= 1 ? start_ns : (last == per_wave ? end_ns : end_ns - st->wave_ns);
    if (s->full_end_ns < start_ns) s->full_end_ns = start_ns;
    s->sm_full = 1.0f;
    s->occ_full = (float)((double)per_wave * warps_per_block / warp_slots);
    s->sm_last = (float)((double)(last < sms ? last : sms) / (double)sms);
    s->occ_last = (float)((double)last * warps_per_block / warp_slots);
    if (s->occ_full > 1.0f) s->occ_full = 1.0f;
    if (s->occ_last > 1.0f) s->occ_last = 1.0f;
    s->w_full = kernel_watts(st, d, s->sm_full, s->occ_full, lean);
    s->w_last = kernel_watts(st, d, s->sm_last, s->occ_last, lean);
    d->kernel_j += ((double)s->w_full * (double)(s->full_end_ns - s->start_ns) +
                    (double)s->w_last * (double)(s->end_ns - s->full_end_ns)) / 1e9;
    d->shape_count++;
}

static int64_t overlap(int64_t s, int64_t e, int64_t a, int64_t b) {
    int64_t lo = s > a ? s : a, hi = e < b ? e : b;
    return hi > lo ? hi - lo : 0;
}

static void one_device(const vgpu_state *st, int dev, int64_t a, int64_t b, double *gr, double *sm, double *occ) {
    const vgpu_device *d = &st->dev[dev];
    uint64_t hi = d->shape_count, lo = hi > VGPU_SHAPES ? hi - VGPU_SHAPES : 0;
    uint64_t l = lo, h = hi;
    while (l < h) { /* the first kernel that ends after a (one device's kernels run one after another) */
        uint64_t m = l + (h - l) / 2;
        if (d->shapes[m % VGPU_SHAPES].end_ns > a)
            h = m;
        else
            l = m + 1;
    }
    for (uint64_t i = l; i < hi; i++) {
        const vgpu_shape *s = &d->shapes[i % VGPU_SHAPES];
        if (s->start_ns >= b) break;
        int64_t full = overlap(s->start_ns, s->full_end_ns, a, b), part = overlap(s->full_end_ns, s->end_ns, a, b);
        *gr += (double)(full + part);
        *sm += (double)full * s->sm_full + (double)part * s->sm_last;
        *occ += (double)full * s->occ_full + (double)part * s->occ_last;
    }
}

/* One device's kernels' energy (J) over [a, b). */
static double device_j(const vgpu_state *st, int dev, int64_t a, int64_t b) {
    const vgpu_device *d = &st->dev[dev];
    uint64_t hi = d->shape_count, lo = hi > VGPU_SHAPES ? hi - VGPU_SHAPES : 0;
    uint64_t l = lo, h = hi;
    while (l < h) {
        uint64_t m = l + (h - l) / 2;
        if (d->shapes[m % VGPU_SHAPES].end_ns > a)
            h = m;
        else
            l = m + 1;
    }
    double j = 0;
    for (uint64_t i = l; i < hi; i++) {
        const vgpu_shape *s = &d->shapes[i % VGPU_SHAPES];
        if (s->start_ns >= b) break;
        j += (double)s->w_full * (double)overlap(s->start_ns, s->full_end_ns, a, b) +
             (double)s->w_last * (double)overlap(s->full_end_ns, s->end_ns, a, b);
    }
    return j / 1e9;
}

/* One device's kernels' energy up to now: all that was recorded less what is still ahead (kernels are queued). */
static double device_total_j(const vgpu_state *st, int dev, int64_t now) {
    const vgpu_device *d = &st->dev[dev];
    uint64_t hi = d->shape_count, lo = hi > VGPU_SHAPES ? hi - VGPU_SHAPES : 0;
    double ahead = 0;
    for (uint64_t i = hi; i > lo; i--) {
        const vgpu_shape *s = &d->shapes[(i - 1) % VGPU_SHAPES];
        if (s->end_ns <= now) break;
        ahead += (double)s->w_full * (double)overlap(s->start_ns, s->full_end_ns, now, INT64_MAX) +
                 (double)s->w_last * (double)overlap(s->full_end_ns, s->end_ns, now, INT64_MAX);
    }
    return d->kernel_j - ahead / 1e9;
}

double vgpu_kernel_j(const vgpu_state *st, int gpu, int64_t a_ns, int64_t b_ns) {
    if (!vgpu_mig_mode(st, gpu)) return device_j(st, gpu, a_ns, b_ns);
    double j = 0;
    for (int k = 0; k < st->dev[gpu].mig; k++) j += device_j(st, vgpu_mig_device(st, gpu, k), a_ns, b_ns);
    return j;
}

double vgpu_kernel_total_j(const vgpu_state *st, int gpu, int64_t now_ns) {
    if (!vgpu_mig_mode(st, gpu)) return device_total_j(st, gpu, now_ns);
    double j = 0;
    for (int k = 0; k < st->dev[gpu].mig; k++) j += device_total_j(st, vgpu_mig_device(st, gpu, k), now_ns);
    return j;
}

void vgpu_gpm_integrals(const vgpu_state *st, int dev, int64_t a_ns, int64_t b_ns, double *graphics_ns,
                        double *sm_ns, double *occupancy_ns) {
    *graphics_ns = *sm_ns = *occupancy_ns = 0.0;
    const vgpu_device *d = &st->dev[dev];
    if (!vgpu_mig_mode(st, dev)) {
        one_device(st, dev, a_ns, b_ns, graphics_ns, sm_ns, occupancy_ns);
        return;
    }
    /* A GPU in MIG mode: its MIG devices, each weighted by its share of the GPU's SMs. */
    for (int k = 0; k < d->mig; k++) {
        int i = vgpu_mig_device(st, dev, k);
        double gr = 0, sm = 0, occ = 0, w = (double)st->dev[i].sms / (double)d->sms;
        one_device(st, i, a_ns, b_ns, &gr, &sm, &occ);
        *graphics_ns += gr * w;
        *sm_ns += sm * w;
        *occupancy_ns += occ * w;
    }
}
