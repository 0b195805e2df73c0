/* The torch_native MoE runner's CPU kernel (float32): one grouped linear over every expert's
 * panel-packed weights (packed by the core's rs_pack, CpuKernels.pack_grouped). Built by
 * radixserve_moe_torch/kernel.py through the core's kernel builder
 * (radixserve.plugin_api.kernels.load_cpu_library), against the core's cpu_common.h (panel
 * layout, register-tiled panel product, OpenMP work splitter). */
#include "cpu_common.h"

/* Grouped linear, the building block of an MoE layer's experts: rows [off[g], off[g+1]) of
 * x [P, K] are multiplied by weight g, which rs_pack packed at packed + g * panels * K * NR
 * (panels = ceil(N / NR)), into the same rows of y [P, N]. Groups without rows are skipped
 * and their weights never read. Work items are (group, row block, panel) triples, so a
 * batch-1 decode over a few groups still spreads over every thread, and a group's rows
 * share each panel pass (one read of an expert's weights serves all its tokens). */
struct grouped_args {
    const float *x, *packed;
    float *y;
    const int64_t *off, *first_item; /* first_item[g]: items before group g (G + 1 entries) */
    int64_t groups, k, n, panels;
};

static void grouped_range(const void *a_, int64_t begin, int64_t end) {
    const struct grouped_args *a = a_;
    int64_t lo = 0, hi = a->groups - 1; /* the group holding item `begin` */
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (a->first_item[mid] <= begin) lo = mid; else hi = mid - 1;
    }
    int64_t g = lo;
    for (int64_t item = begin; item < end; item++) {
        while (a->first_item[g + 1] <= item) g++;
        int64_t local = item - a->first_item[g], p = local % a->panels;
        int64_t b0 = a->off[g] + local / a->panels * MB;
        int64_t b1 = a->off[g + 1] - b0 < MB ? a->off[g + 1] : b0 + MB;
        const float *panel = a->packed + (g * a->panels + p) * a->k * NR;
        tile_block(b0, b1, a->x, a->k, panel, NULL, a->y, a->n, p * NR);
    }
}

void rs_grouped_linear(const float *x, const int64_t *off, int64_t groups, const float *packed,
                       int64_t k, int64_t n, float *y) {
    int64_t panels = (n + NR - 1) / NR;
    int64_t *first_item = malloc(sizeof(int64_t) * (groups + 1));
    first_item[0] = 0;
    for (int64_t g = 0; g < groups; g++) {
        int64_t rows = off[g + 1] - off[g];
        first_item[g + 1] = first_item[g] + (rows + MB - 1) / MB * panels;
    }
    struct grouped_args a = {x, packed, y, off, first_item, groups, k, n, panels};
    parallel_for(grouped_range, &a, first_item[groups], 1);
    free(first_item);
}
