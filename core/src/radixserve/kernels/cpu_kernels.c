/* radixserve CPU kernels (float32): linear layers over panel-packed weights and the small
 * fused element-wise steps of a decoder layer (residual add + RMSNorm, SiLU * mul, RoPE).
 * Kernels only one backend uses live in its plugin (the torch_native attention backend's paged
 * decode attention, the torch_native MoE runner's grouped linear), built against cpu_common.h.
 *
 * Built once per machine by radixserve/kernels/cpu.py (cc -O3 -march=native) and called
 * through ctypes with raw pointers; every tensor is contiguous float32 unless stated.
 *
 * Threads: OpenMP, which resolves to the runtime torch already loaded, so the kernels run on
 * torch's worker threads (torch.set_num_threads applies). A pool of our own was tried: it
 * avoids OpenMP's end-of-region barrier, which stalls on a machine busier than its cores,
 * but its threads then compete with torch's spinning OpenMP workers for the same cores and
 * prefill ran ~15-60 % slower on an idle machine.
 *
 * Packed weight layout: the [N, K] weight is cut into panels of NR output columns
 * (NR = two native vectors); panel p holds W[p*NR + j, k] at [p][k][j], zero-padded past
 * N. A panel is one sequential stream, so batch-1 decode reads weights at streaming
 * bandwidth; for larger batches a panel stays in L2 while MR rows of x at a time are
 * multiplied against it, MR*2 vector accumulators held in registers.
 */
#include "cpu_common.h"

int rs_panel_width(void) { return NR; }
int rs_max_rows(void) { return MR; }

int rs_num_threads(void) { return omp_get_max_threads(); }

/* W [N, K] -> packed [ceil(N/NR)][K][NR]. */
void rs_pack(const float *w, int64_t n, int64_t k, float *out) {
    int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++) {
        float *dst = out + p * k * NR;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NR; j++) {
                int64_t col = p * NR + j;
                dst[kk * NR + j] = col < n ? w[col * k + kk] : 0.0f;
            }
    }
}

/* y[M, N] = x[M, K] @ W^T (+ bias) with W packed by rs_pack. Rows go in blocks of MB so
 * that a block of x stays in L2 while every panel streams past it. */
struct linear_args {
    const float *x, *packed, *bias;
    float *y;
    int64_t m, k, n, panels;
};

/* items: (row block, panel) pairs, panel-major within a block */
static void linear_range(const void *a_, int64_t begin, int64_t end) {
    const struct linear_args *a = a_;
    for (int64_t item = begin; item < end; item++) {
        int64_t b0 = item / a->panels * MB, p = item % a->panels;
        int64_t b1 = a->m - b0 < MB ? a->m : b0 + MB;
        const float *panel = a->packed + p * a->k * NR;
        tile_block(b0, b1, a->x, a->k, panel, a->bias, a->y, a->n, p * NR);
    }
}

void rs_linear(const float *x, int64_t m, int64_t k, const float *packed, const float *bias,
               int64_t n, float *y) {
    int64_t panels = (n + NR - 1) / NR;
    struct linear_args a = {x, packed, bias, y, m, k, n, panels};
    parallel_for(linear_range, &a, (m + MB - 1) / MB * panels, 1);
}


/* residual += x (when residual is given), then out = RMSNorm(residual or x) * w; rows of d. */
struct rmsnorm_args {
    const float *x, *w;
    float *residual, *out;
    float eps;
    int64_t d;
};

static void rmsnorm_range(const void *a_, int64_t begin, int64_t end) {
    const struct rmsnorm_args *a = a_;
    const float *x = a->x, *w = a->w;
    float *residual = a->residual, *out = a->out, eps = a->eps;
    int64_t d = a->d;
    for (int64_t i = begin; i < end; i++) {
        const float *src = x + i * d;
        if (residual) {
            float *r = residual + i * d;
            for (int64_t j = 0; j < d; j++) r[j] += src[j];
            src = r;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < d; j++) ss += src[j] * src[j];
        float scale = 1.0f / sqrtf(ss / (float)d + eps);
        float *o = out + i * d;
        for (int64_t j = 0; j < d; j++) o[j] = w[j] * (src[j] * scale);
    }
}


void rs_rmsnorm(const float *x, float *residual, const float *w, float eps, int64_t m, int64_t d,
                float *out) {
    struct rmsnorm_args a = {x, w, residual, out, eps, d};
    parallel_for(rmsnorm_range, &a, m, rows_per_task(m, d));
}


/* out[M, I] = silu(gu[:, :I]) * gu[:, I:] for gu [M, 2I]. */
struct silu_args {
    const float *gu;
    float *out;
    int64_t inter;
};

static void silu_range(const void *a_, int64_t begin, int64_t end) {
    const struct silu_args *a = a_;
    int64_t inter = a->inter;
    for (int64_t i = begin; i < end; i++) {
        const float *g = a->gu + i * 2 * inter, *u = g + inter;
        float *o = a->out + i * inter;
        int64_t j = 0;
        for (; j + VW <= inter; j += VW) {
            vf gv = *(const vf *)(g + j);
            *(vf *)(o + j) = gv / (1.0f + exp_vf(-gv)) * *(const vf *)(u + j);
        }
        for (; j < inter; j++) o[j] = g[j] / (1.0f + exp_vec(-g[j])) * u[j];
    }
}

void rs_silu_mul(const float *gu, int64_t m, int64_t inter, float *out) {
    struct silu_args a = {gu, out, inter};
    parallel_for(silu_range, &a, m, rows_per_task(m, inter));
}

/* RoPE (half-split layout) in place on the first `heads` heads of each row of x, rows
 * `stride` floats apart; cos/sin are [P, D/2] tables, pos the [M] int64 positions. */
struct rope_args {
    float *x;
    const float *cos_t, *sin_t;
    const int64_t *pos;
    int64_t stride, heads, head_dim;
};

static void rope_range(const void *a_, int64_t begin, int64_t end) {
    const struct rope_args *a = a_;
    float *x = a->x;
    const float *cos_t = a->cos_t, *sin_t = a->sin_t;
    int64_t stride = a->stride, heads = a->heads, head_dim = a->head_dim, half = head_dim / 2;
    for (int64_t i = begin; i < end; i++) {
        const int64_t *pos = a->pos;
        const float *c = cos_t + pos[i] * half, *s = sin_t + pos[i] * half;
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + i * stride + h * head_dim, *b = a + half;
#pragma omp simd
            for (int64_t j = 0; j < half; j++) {
                float x1 = a[j], x2 = b[j];
                a[j] = x1 * c[j] - x2 * s[j];
                b[j] = x2 * c[j] + x1 * s[j];
            }
        }
    }
}

void rs_rope(float *x, int64_t m, int64_t stride, int64_t heads, int64_t head_dim,
             const float *cos_t, const float *sin_t, const int64_t *pos) {
    struct rope_args a = {x, cos_t, sin_t, pos, stride, heads, head_dim};
    parallel_for(rope_range, &a, m, rows_per_task(m, 2 * heads * head_dim));
}


/* out[i] = argmax of row i of x [M, N] (rows `stride` floats apart), as torch.argmax: the first
 * index of the maximum, and the first NaN's index in a row that holds NaN. One pass per row:
 * per lane the best value and its first index, then the lanes' best with the lowest index. */
struct argmax_args {
    const float *x;
    int64_t *out;
    int64_t n, stride;
};

static void argmax_range(const void *a_, int64_t begin, int64_t end) {
    const struct argmax_args *a = a_;
    int64_t n = a->n;
    for (int64_t i = begin; i < end; i++) {
        const float *x = a->x + i * a->stride;
        int64_t best_i = 0, j = 0;
        float best = n ? x[0] : 0.0f;
        int nan = 0;
        if (n >= VW) {
            vf bv = *(const vf *)x;
            vi32 bi, lane, nanv = bv != bv;
            for (int l = 0; l < VW; l++) lane[l] = l;
            bi = lane;
            for (j = VW; j + VW <= n; j += VW) {
                vf v = *(const vf *)(x + j);
                vi32 gt = v > bv;
                nanv |= v != v;
                bv = (vf)(((vi32)bv & ~gt) | ((vi32)v & gt));
                bi = (bi & ~gt) | ((lane + (int32_t)j) & gt);
            }
            for (int l = 0; l < VW; l++) nan |= nanv[l] != 0;
            best = bv[0], best_i = bi[0];
            for (int l = 1; l < VW; l++)
                if (bv[l] > best || (bv[l] == best && bi[l] < best_i)) best = bv[l], best_i = bi[l];
        }
        for (; j < n && !nan; j++) {
            if (x[j] != x[j]) nan = 1;
            else if (x[j] > best) best = x[j], best_i = j;
        }
        if (nan) /* torch returns the first NaN */
            for (j = 0; j < n; j++)
                if (x[j] != x[j]) { best_i = j; break; }
        a->out[i] = best_i;
    }
}

void rs_argmax_rows(const float *x, int64_t m, int64_t n, int64_t stride, int64_t *out) {
    struct argmax_args a = {x, out, n, stride};
    parallel_for(argmax_range, &a, m, 1);
}

/* out[t] = table[ids[t]] for rows of row_bytes bytes (an embedding lookup); an id outside
 * [0, n_rows) gives a row of zeros (the callers check ids first; this keeps a bad id from
 * reading outside the table). */
void rs_gather_rows(const uint8_t *table, int64_t row_bytes, int64_t n_rows, const int64_t *ids, int64_t t,
                    uint8_t *out) {
    for (int64_t i = 0; i < t; i++) {
        if (ids[i] >= 0 && ids[i] < n_rows)
            memcpy(out + i * row_bytes, table + ids[i] * row_bytes, row_bytes);
        else
            memset(out + i * row_bytes, 0, row_bytes);
    }
}

/* In place: each of the first `heads` head vectors (head_dim floats) of each of m rows `stride`
 * floats apart becomes RMSNorm(v) * w (per-head q/k norms on a fused QKV output). */
struct head_norm_args {
    float *x;
    const float *w;
    float eps;
    int64_t stride, heads, d;
};

static void head_norm_range(const void *a_, int64_t begin, int64_t end) {
    const struct head_norm_args *a = a_;
    int64_t d = a->d;
    for (int64_t i = begin; i < end; i++) {
        for (int64_t h = 0; h < a->heads; h++) {
            float *v = a->x + i * a->stride + h * d, ss = 0.0f;
#pragma omp simd reduction(+ : ss)
            for (int64_t j = 0; j < d; j++) ss += v[j] * v[j];
            float scale = 1.0f / sqrtf(ss / (float)d + a->eps);
            for (int64_t j = 0; j < d; j++) v[j] = a->w[j] * (v[j] * scale);
        }
    }
}

void rs_head_rmsnorm(float *x, int64_t m, int64_t stride, int64_t heads, int64_t head_dim, const float *w,
                     float eps) {
    struct head_norm_args a = {x, w, eps, stride, heads, head_dim};
    parallel_for(head_norm_range, &a, m, rows_per_task(m, heads * head_dim));
}
