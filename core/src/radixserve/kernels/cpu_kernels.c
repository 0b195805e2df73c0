/* radixserve CPU kernels (float32): linear layers over panel-packed weights, the small
 * fused element-wise steps of a decoder layer (residual add + RMSNorm, SiLU * mul, RoPE)
 * and paged decode attention straight from the KV pool.
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
#define MB 64
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
        for (int64_t m0 = b0; m0 < b1; m0 += MR) {
            int rows = b1 - m0 < MR ? (int)(b1 - m0) : MR;
            tile_rows(rows, a->x + m0 * a->k, a->k, panel, a->bias, a->y + m0 * a->n, a->n, p * NR);
        }
    }
}

void rs_linear(const float *x, int64_t m, int64_t k, const float *packed, const float *bias,
               int64_t n, float *y) {
    int64_t panels = (n + NR - 1) / NR;
    struct linear_args a = {x, packed, bias, y, m, k, n, panels};
    parallel_for(linear_range, &a, (m + MB - 1) / MB * panels, 1);
}

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
        for (int64_t m0 = b0; m0 < b1; m0 += MR) {
            int rows = b1 - m0 < MR ? (int)(b1 - m0) : MR;
            tile_rows(rows, a->x + m0 * a->k, a->k, panel, NULL, a->y + m0 * a->n, a->n, p * NR);
        }
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
    parallel_for(rmsnorm_range, &a, m, 8);
}

/* exp(x) to ~2 ulp, written so that loops over it vectorize: x = n ln2 + r with |r| <= ln2/2,
 * exp(r) by its degree-6 Taylor-like minimax polynomial, 2^n by building the exponent bits. */
static inline float exp_vec(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
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
#pragma omp simd
        for (int64_t j = 0; j < inter; j++) o[j] = g[j] / (1.0f + exp_vec(-g[j])) * u[j];
    }
}

void rs_silu_mul(const float *gu, int64_t m, int64_t inter, float *out) {
    struct silu_args a = {gu, out, inter};
    parallel_for(silu_range, &a, m, 4);
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
    parallel_for(rope_range, &a, m, 16);
}

/* Paged decode attention, one query token per request, reading K/V straight from the pool.
 *
 * q [B, H, D] (token rows q_stride floats apart, heads contiguous); the new k, v [B, Hkv, D]
 * (rows k_stride, v_stride apart) are first written to the pool buffers [slots, Hkv, D] at loc[b].
 * Request b attends to the slots table[rows[b] * table_stride + l] for l < lens[b]; the G =
 * H / Hkv query heads of a KV head share its scores pass. out [B, H, D] contiguous. */
struct attn_args {
    const float *q, *k_buf, *v_buf;
    const int64_t *table, *rows, *lens;
    float *out;
    int64_t q_stride, table_stride, h, hkv, d;
    float scale;
};

/* items: (request, KV head) pairs */
static void attn_range(const void *a_, int64_t begin, int64_t end) {
    const struct attn_args *a = a_;
    const float *q = a->q, *k_buf = a->k_buf, *v_buf = a->v_buf;
    const int64_t *table = a->table, *rows = a->rows, *lens = a->lens;
    float *out = a->out, scale = a->scale;
    int64_t q_stride = a->q_stride, table_stride = a->table_stride, h = a->h, hkv = a->hkv, d = a->d;
    int64_t g = h / hkv, slot_size = hkv * d;
    for (int64_t task = begin; task < end; task++) {
        int64_t i = task / hkv, kh = task % hkv, len = lens[i];
        const int64_t *slots = table + rows[i] * table_stride;
        float *scores = malloc(sizeof(float) * g * len);
        float *acc = out + (i * h + kh * g) * d; /* the G output heads of this KV head */
        for (int64_t qh = 0; qh < g; qh++) {
            const float *qv = q + i * q_stride + (kh * g + qh) * d;
            float *s = scores + qh * len, mx = -INFINITY;
            for (int64_t l = 0; l < len; l++) {
                const float *kv = k_buf + slots[l] * slot_size + kh * d;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t j = 0; j < d; j++) dot += qv[j] * kv[j];
                s[l] = dot * scale;
                mx = s[l] > mx ? s[l] : mx;
            }
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t l = 0; l < len; l++) {
                s[l] = exp_vec(s[l] - mx);
                sum += s[l];
            }
            float inv = 1.0f / sum;
            for (int64_t l = 0; l < len; l++) s[l] *= inv;
            memset(acc + qh * d, 0, d * sizeof(float));
        }
        for (int64_t l = 0; l < len; l++) {
            const float *vv = v_buf + slots[l] * slot_size + kh * d;
            for (int64_t qh = 0; qh < g; qh++) {
                float p = scores[qh * len + l], *o = acc + qh * d;
#pragma omp simd
                for (int64_t j = 0; j < d; j++) o[j] += p * vv[j];
            }
        }
        free(scores);
    }
}

void rs_decode_attention(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                         const float *v, int64_t v_stride, float *k_buf, float *v_buf, const int64_t *loc,
                         const int64_t *table, int64_t table_stride, const int64_t *rows,
                         const int64_t *lens, int64_t b, int64_t h, int64_t hkv, int64_t d,
                         float scale, float *out) {
    int64_t slot_size = hkv * d;
    for (int64_t i = 0; i < b; i++) {
        memcpy(k_buf + loc[i] * slot_size, k + i * k_stride, slot_size * sizeof(float));
        memcpy(v_buf + loc[i] * slot_size, v + i * v_stride, slot_size * sizeof(float));
    }
    struct attn_args a = {q, k_buf, v_buf, table, rows, lens, out, q_stride, table_stride, h, hkv, d,
                          scale};
    parallel_for(attn_range, &a, b * hkv, 1);
}
