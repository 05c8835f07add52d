/* MIG on the virtual GPU: every GPU split into st->mig equal MIG devices, each one GPU instance with one compute
 * instance that covers it. A MIG device is a device of its own in the state (index VGPU_MAX_GPUS + gpu x mig +
 * slot), so its kernels queue on its own timeline (instances run side by side), and its contexts, memory and
 * processes are its own. Profiles and GPU instance IDs follow an H100's placements (NVIDIA's MIG user guide,
 * "Supported MIG Profiles"): 7 compute slices and 8 memory slices; 1 instance is 7g (GI 0), 2 are 3g (GIs 1, 2),
 * 3 are 2g (GIs 3, 4, 5), 4 to 7 are 1g (GIs 7 to 13). SMs are the GPU's in proportion to compute slices. Each GPU
 * instance has the H100 80GB's profile ID of its profile (`nvidia-smi mig -lgip`: 1g.10gb 19, 2g.20gb 14, 3g.40gb 9,
 * 7g.80gb 0) and a placement among that profile's (memory slices {0..6}:1, {0,2,4}:2, {0,4}:4, {0}:8): the k-th
 * instance starts at k x its size. */
#define _GNU_SOURCE
#include "state.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>

static const int FIRST_GI[8] = {0, 7, 3, 1, 1, 1, 1, 0}; /* by compute slices: 1g 7.., 2g 3.., 3g 1.., 7g 0 */
static const int MEM_SLICES[8] = {0, 1, 2, 4, 4, 4, 4, 8};
static const int PROFILE_ID[8] = {0, 19, 14, 9, 5, 5, 5, 0}; /* by compute slices (4g.40gb is 5; never made here) */

void vgpu_mig_create(vgpu_state *st) {
    for (int g = 0; g < st->gpus; g++) {
        vgpu_device *gpu = &st->dev[g];
        gpu->mig = st->mig;
        if (st->mig == 0) continue;
        int slices = 7 / st->mig;
        for (int k = 0; k < st->mig; k++) {
            int i = VGPU_MAX_GPUS + g * st->mig + k;
            vgpu_device *d = &st->dev[i];
            memcpy(d->uuid, gpu->uuid, 16);
            uint32_t mix = (uint32_t)(k + 1) * 2654435761u;  /* distinct from the GPU's and each other's */
            for (int b = 0; b < 4; b++) d->uuid[10 + b] ^= (uint8_t)(mix >> (8 * b));
            d->uuid[15] ^= (uint8_t)(0x5a + k);
            d->parent = g;
            d->slot = k;
            d->gi_id = FIRST_GI[slices] + k;
            d->ci_id = 0;
            d->gi_profile_id = PROFILE_ID[slices];
            d->placement_size = MEM_SLICES[slices];
            d->placement_start = k * MEM_SLICES[slices];
            d->sms = st->sms * slices / 7;
            if (d->sms < 1) d->sms = 1;
            d->total_bytes = (st->total_bytes * (uint64_t)MEM_SLICES[slices] / 8) >> 20 << 20;
            unsigned gb = (unsigned)((d->total_bytes + (512ull << 20)) >> 30);
            char profile[16], name[96];
            snprintf(profile, sizeof profile, "%dg.%ugb", slices, gb);
            snprintf(name, sizeof name, "%.70s MIG %s", gpu->name, profile);
            memcpy(d->profile, profile, sizeof profile);
            memcpy(d->name, name, sizeof name);
            memcpy(d->pci_bus_id, gpu->pci_bus_id, sizeof d->pci_bus_id);
            d->pci_bus = gpu->pci_bus;
            d->phase_ns = gpu->phase_ns;
            d->lost_at_ns = VGPU_NEVER;  /* vgpu_lost asks the parent */
            d->lost_after_calls = -1;
            d->compute_mode = gpu->compute_mode;
        }
    }
}

int vgpu_mig_device(const vgpu_state *st, int gpu, int slot) {
    if (gpu < 0 || gpu >= st->gpus || slot < 0 || slot >= st->dev[gpu].mig) return -1;
    return VGPU_MAX_GPUS + gpu * st->mig + slot;
}

int vgpu_mig_by_gi(const vgpu_state *st, int gpu, int gi_id) {
    for (int k = 0; gpu >= 0 && gpu < st->gpus && k < st->dev[gpu].mig; k++) {
        int i = vgpu_mig_device(st, gpu, k);
        if (st->dev[i].gi_id == gi_id) return i;
    }
    return -1;
}

int vgpu_is_mig(const vgpu_state *st, int dev) { return st->dev[dev].parent >= 0; }

int vgpu_mig_mode(const vgpu_state *st, int dev) { return st->dev[dev].parent < 0 && st->dev[dev].mig > 0; }

void vgpu_mig_uuid_string(const uint8_t u[16], char out[48]) {
    char gpu[48];
    vgpu_uuid_string(u, gpu);
    snprintf(out, 48, "MIG-%s", gpu + 4);
}

int vgpu_mig_by_uuid(const vgpu_state *st, const char *text, int prefix) {
    int found = -1, matches = 0;
    size_t len = strlen(text);
    for (int g = 0; g < st->gpus; g++)
        for (int k = 0; k < st->dev[g].mig; k++) {
            int i = vgpu_mig_device(st, g, k);
            char s[48];
            vgpu_mig_uuid_string(st->dev[i].uuid, s);
            if (prefix ? strncasecmp(s, text, len) == 0 : strcasecmp(s, text) == 0) {
                found = i;
                matches++;
            }
        }
    return matches == 1 ? found : -1;
}
