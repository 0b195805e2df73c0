/* The torch_native LoRA backend's CPU kernel (float32): one layer's adapter deltas for a batch
 * whose rows use different adapters, in one call. Built by radixserve_lora_torch/kernel.py
 * through the core's kernel builder, against the core's cpu_common.h (OpenMP work splitter).
 *
 * x [T, K] (rows x_stride floats apart). The rows with an adapter come in items of up to
 * ITEM_ROWS rows of one slot: item q holds rows order[bounds[q] .. bounds[q + 1]) of slot
 * item_slot[q] (the backend's prepare writes them, and their count, into fixed buffers once
 * per step).
 * a [S, PR, K] contiguous (the layer's parts' A stacked, R = PR / parts rows each);
 * b[p] [S, R, N_p] contiguous (B transposed); out[p]: part p's first output column, rows
 * out_stride apart. For each row t of slot s: h = scaling[s] * (a[s] @ x[t]), then for each
 * part p and rank i: out[p][t, :] += h[p R + i] * b[p][s, i, :].
 *
 * An item reads each row of a[s] once for all its rows (from L1 after the first), so the
 * adapter streams from L2 once per item, not once per row. */
#include "cpu_common.h"

#define MAX_PR 1024
#define ITEM_ROWS 8

struct lora_args {
    const float *x, *a, *scaling;
    const int64_t *order, *bounds, *item_slot;
    const float *const *b;
    float *const *out;
    const int64_t *n;
    int64_t x_stride, out_stride, k, pr, r, parts;
};

static inline __attribute__((always_inline)) float dot(const float *u, const float *v, int64_t k) {
    vf acc0 = {0}, acc1 = {0};
    int64_t i = 0;
    for (; i + 2 * VW <= k; i += 2 * VW) { /* two chains: the FMA latency hidden */
        acc0 += *(const vf *)(u + i) * *(const vf *)(v + i);
        acc1 += *(const vf *)(u + i + VW) * *(const vf *)(v + i + VW);
    }
    for (; i + VW <= k; i += VW) acc0 += *(const vf *)(u + i) * *(const vf *)(v + i);
    float t[VW], sum = 0.0f;
    acc0 += acc1;
    memcpy(t, &acc0, sizeof t);
    for (int j = 0; j < VW; j++) sum += t[j];
    for (; i < k; i++) sum += u[i] * v[i];
    return sum;
}

static void lora_items(const void *args, int64_t begin, int64_t end) {
    const struct lora_args *a = args;
    static __thread float h[ITEM_ROWS][MAX_PR];
    for (int64_t it = begin; it < end; it++) {
        int64_t lo = a->bounds[it], m = a->bounds[it + 1] - lo, s = a->item_slot[it];
        const float *as = a->a + s * a->pr * a->k;
        float scale = a->scaling[s];
        for (int64_t i = 0; i < a->pr; i++) {
            const float *ai = as + i * a->k;
            for (int64_t q = 0; q < m; q++) h[q][i] = scale * dot(ai, a->x + a->order[lo + q] * a->x_stride, a->k);
        }
        for (int64_t q = 0; q < m; q++) {
            int64_t t = a->order[lo + q];
            for (int64_t p = 0; p < a->parts; p++) {
                int64_t n = a->n[p], r = a->r, j = 0;
                const float *bp = a->b[p] + s * r * n, *hp = h[q] + p * r;
                float *o = a->out[p] + t * a->out_stride;
                for (; j + VW <= n; j += VW) { /* the output block stays in a register over the ranks */
                    vf acc = *(vf *)(o + j);
                    for (int64_t i = 0; i < r; i++) acc += bcast(hp + i) * *(const vf *)(bp + i * n + j);
                    *(vf *)(o + j) = acc;
                }
                for (; j < n; j++) {
                    float acc = o[j];
                    for (int64_t i = 0; i < r; i++) acc += hp[i] * bp[i * n + j];
                    o[j] = acc;
                }
            }
        }
    }
}

int rs_lora_item_rows(void) { return ITEM_ROWS; }
int rs_lora_max_pr(void) { return MAX_PR; }

/* ``*num_items`` is read when the call runs, so a kernel tape (radixserve.kernels.tape) that
 * recorded this call replays each step's items from the same buffers. P * R must be at most
 * MAX_PR (the caller checks: rs_lora_max_pr). */
void rs_lora_apply(const float *x, int64_t x_stride, int64_t k, const int64_t *order, const int64_t *bounds,
                   const int64_t *item_slot, const int64_t *num_items, const float *a, int64_t pr, int64_t parts,
                   const float *const *b, const int64_t *n, float *const *out, int64_t out_stride,
                   const float *scaling) {
    if (pr > MAX_PR || parts < 1 || *num_items <= 0) return;
    struct lora_args args = {x, a, scaling, order, bounds, item_slot, b, out, n, x_stride, out_stride, k, pr,
                             pr / parts, parts};
    parallel_for(lora_items, &args, *num_items, 1);
}

void rs_lora_apply_tape(const int64_t *a) {
    rs_lora_apply(RS_TAPE_P(0), RS_TAPE_I(1), RS_TAPE_I(2), RS_TAPE_P(3), RS_TAPE_P(4), RS_TAPE_P(5), RS_TAPE_P(6),
                  RS_TAPE_P(7), RS_TAPE_I(8), RS_TAPE_I(9), RS_TAPE_P(10), RS_TAPE_P(11), RS_TAPE_P(12),
                  RS_TAPE_I(13), RS_TAPE_P(14));
}
