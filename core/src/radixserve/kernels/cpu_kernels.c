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
        tile_block(b0, b1, a->x, a->k, panel, a->bias, a->y, a->n, p * NR);
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

/* Rows per work item for the element-wise kernels: at least ELEMWISE_MIN_WORK values each, so
 * a decode step's few rows (microseconds of work) stay on the calling thread. An OpenMP
 * region costs a few microseconds even when its threads spin, and far more when the machine
 * is busier than its cores: a descheduled worker holds the end-of-region barrier for a time
 * slice (measured: a 32-row RMSNorm at 1.3 ms with 2 threads under load, ~5 us on one). */
#define ELEMWISE_MIN_WORK 65536
static int64_t rows_per_task(int64_t m, int64_t work_per_row) {
    int64_t rows = ELEMWISE_MIN_WORK / (work_per_row > 0 ? work_per_row : 1);
    return rows < 1 ? 1 : (rows > m && m > 0 ? m : rows);
}

void rs_rmsnorm(const float *x, float *residual, const float *w, float eps, int64_t m, int64_t d,
                float *out) {
    struct rmsnorm_args a = {x, w, residual, out, eps, d};
    parallel_for(rmsnorm_range, &a, m, rows_per_task(m, d));
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

/* exp_vec on a whole vector: the same operations lane by lane, written with vector types
 * because the clamps keep the compiler from vectorising loops that call exp_vec. */
typedef int32_t vi32 __attribute__((vector_size(VW * 4), aligned(4), may_alias));
static inline __attribute__((always_inline)) vf exp_vf(vf x) {
    vf lo = (vf){0} - 87.0f, hi = (vf){0} + 88.0f;
    vi32 m = x < lo;
    x = (vf)(((vi32)x & ~m) | ((vi32)lo & m));
    m = x > hi;
    x = (vf)(((vi32)x & ~m) | ((vi32)hi & m));
    vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi32 bits = (__builtin_convertvector(n, vi32) + 127) << 23;
    return p * (vf)bits;
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

static inline __attribute__((always_inline)) float hsum(vf v) {
    float t[VW], sum = 0.0f;
    memcpy(t, &v, sizeof t);
    for (int j = 0; j < VW; j++) sum += t[j];
    return sum;
}

/* q . k over d floats (d % VW == 0 on the vector path; a scalar tail otherwise), four k rows
 * at a time: four independent FMA chains, each q vector loaded once. */
static inline __attribute__((always_inline)) void dot4(const float *qv, const float *k0, const float *k1,
                                                       const float *k2, const float *k3, int64_t d, float *out) {
    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t j = 0;
    for (; j + VW <= d; j += VW) {
        vf x = *(const vf *)(qv + j);
        a0 += x * *(const vf *)(k0 + j);
        a1 += x * *(const vf *)(k1 + j);
        a2 += x * *(const vf *)(k2 + j);
        a3 += x * *(const vf *)(k3 + j);
    }
    float s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
    for (; j < d; j++) {
        s0 += qv[j] * k0[j];
        s1 += qv[j] * k1[j];
        s2 += qv[j] * k2[j];
        s3 += qv[j] * k3[j];
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

/* q . k for eight k rows: eight independent FMA chains (two FMAs a cycle despite their
 * latency) and one transposing reduction of the eight accumulators into out[0:8]. */
static inline __attribute__((always_inline)) void dot8(const float *qv, const float *const *kr, int64_t d,
                                                       float *out) {
    vf acc[8];
    const float *k[8];
    for (int c = 0; c < 8; c++) {
        acc[c] = (vf){0};
        k[c] = kr[c];
    }
    int64_t j = 0;
    for (; j + VW <= d; j += VW) {
        vf x = *(const vf *)(qv + j);
        for (int c = 0; c < 8; c++) acc[c] += x * *(const vf *)(k[c] + j);
    }
#if (VW == 8 || VW == 16) && defined(__AVX2__)
    __m256 h[8];
    for (int c = 0; c < 8; c++) {
#if VW == 16
        __m512 z = (__m512)acc[c];
        h[c] = _mm256_add_ps(_mm512_castps512_ps256(z), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));
#else
        h[c] = (__m256)acc[c];
#endif
    }
    __m256 t0 = _mm256_hadd_ps(h[0], h[1]), t1 = _mm256_hadd_ps(h[2], h[3]);
    __m256 t2 = _mm256_hadd_ps(h[4], h[5]), t3 = _mm256_hadd_ps(h[6], h[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* per 128-bit lane */
    __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    _mm256_storeu_ps(out, r);
#else
    for (int c = 0; c < 8; c++) out[c] = hsum(acc[c]);
#endif
    for (; j < d; j++)
        for (int c = 0; c < 8; c++) out[c] += qv[j] * k[c][j];
}

/* Keys per block of the online softmax: the block's K and V rows for one KV head stay in L1
 * while the G query heads pass over them. */
#define ATTN_KB 32
/* Output vectors kept in registers while a block's P @ V accumulates (ATTN_NV x VW floats). */
#define ATTN_NV 8

/* o[0 : nv*VW] = alpha * o + sum_l p[l] * vrows[l][off : off + nv*VW], accumulated in registers. */
static inline __attribute__((always_inline)) void pv_chunk(int nv, float *o, float alpha, const float *p,
                                                           const float *const *vrows, int64_t off, int64_t n) {
    vf acc[ATTN_NV];
    for (int t = 0; t < nv; t++) acc[t] = *(const vf *)(o + t * VW) * alpha;
    for (int64_t l = 0; l < n; l++) {
        vf pl = bcast(p + l);
        const float *vr = vrows[l] + off;
        for (int t = 0; t < nv; t++) acc[t] += pl * *(const vf *)(vr + t * VW);
    }
    for (int t = 0; t < nv; t++) *(vf *)(o + t * VW) = acc[t];
}

/* One (request, KV head, key range) item: the G query heads' unnormalised outputs o [G][D]
 * (overwritten), running maxima m [G] and sums [G] over keys [lb, le) of request i, by the
 * online softmax over blocks of ATTN_KB keys. */
static void attn_item(const struct attn_args *a, int64_t i, int64_t kh, int64_t lb, int64_t le,
                      float *o, float *m, float *sums) {
    int64_t g = a->h / a->hkv, d = a->d, slot_size = a->hkv * d;
    const int64_t *slots = a->table + a->rows[i] * a->table_stride;
    const float *qbase = a->q + i * a->q_stride + kh * g * d;
    const float *krows[ATTN_KB], *vrows[ATTN_KB];
    float s[ATTN_KB] __attribute__((aligned(64)));
    int64_t dv = d / VW * VW; /* the vector part of a head; a tail (d % VW) goes scalar */
    for (int64_t qh = 0; qh < g; qh++) {
        m[qh] = -INFINITY;
        sums[qh] = 0.0f;
        memset(o + qh * d, 0, d * sizeof(float));
    }
    for (int64_t l0 = lb; l0 < le; l0 += ATTN_KB) {
        int64_t n = le - l0 < ATTN_KB ? le - l0 : ATTN_KB;
        for (int64_t l = 0; l < n; l++) {
            krows[l] = a->k_buf + slots[l0 + l] * slot_size + kh * d;
            vrows[l] = a->v_buf + slots[l0 + l] * slot_size + kh * d;
        }
        for (int64_t qh = 0; qh < g; qh++) {
            const float *qv = qbase + qh * d;
            float *oq = o + qh * d;
            int64_t l = 0;
            for (; l + 8 <= n; l += 8) dot8(qv, krows + l, d, s + l);
            for (; l + 4 <= n; l += 4) dot4(qv, krows[l], krows[l + 1], krows[l + 2], krows[l + 3], d, s + l);
            for (; l < n; l++) {
                float t[4];
                dot4(qv, krows[l], krows[l], krows[l], krows[l], d, t);
                s[l] = t[0];
            }
            float mx = m[qh];
            for (l = 0; l < n; l++) {
                s[l] *= a->scale;
                mx = s[l] > mx ? s[l] : mx;
            }
            /* the running sum and output rescale to the new maximum (alpha 0 before the
             * first block: nothing to rescale) */
            float alpha = m[qh] == -INFINITY ? 0.0f : exp_vec(m[qh] - mx), bsum = 0.0f;
            vf vsum = {0};
            for (l = 0; l + VW <= n; l += VW) {
                vf e = exp_vf(*(vf *)(s + l) - mx);
                *(vf *)(s + l) = e;
                vsum += e;
            }
            for (; l < n; l++) {
                s[l] = exp_vec(s[l] - mx);
                bsum += s[l];
            }
            sums[qh] = sums[qh] * alpha + bsum + hsum(vsum);
            m[qh] = mx;
            int64_t j0 = 0;
            for (; j0 + ATTN_NV * VW <= dv; j0 += ATTN_NV * VW) pv_chunk(ATTN_NV, oq + j0, alpha, s, vrows, j0, n);
            switch ((dv - j0) / VW) { /* constant vector counts keep the accumulators in registers */
#define CASE(NV) case NV: pv_chunk(NV, oq + j0, alpha, s, vrows, j0, n); break;
                CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7)
#undef CASE
            default: break;
            }
            for (int64_t j = dv; j < d; j++) {
                float acc = oq[j] * alpha;
                for (l = 0; l < n; l++) acc += s[l] * vrows[l][j];
                oq[j] = acc;
            }
        }
    }
}

/* Items are (request, KV head, split) triples: with too few (request, KV head) pairs to keep
 * every thread busy, each pair's keys are cut into `splits` ranges, merged afterwards. */
struct attn_task {
    const struct attn_args *a;
    int64_t splits;
    float *part; /* splits > 1: per item o [G][D], then m [G] and sums [G] */
};

static void attn_range(const void *t_, int64_t begin, int64_t end) {
    const struct attn_task *t = t_;
    const struct attn_args *a = t->a;
    int64_t g = a->h / a->hkv, d = a->d;
    float m[g], sums[g];
    for (int64_t item = begin; item < end; item++) {
        int64_t pair = item / t->splits, sp = item % t->splits;
        int64_t i = pair / a->hkv, kh = pair % a->hkv, len = a->lens[i];
        int64_t step = (len + t->splits - 1) / t->splits;
        int64_t lb = sp * step < len ? sp * step : len, le = lb + step < len ? lb + step : len;
        if (t->splits == 1) {
            float *o = a->out + (i * a->h + kh * g) * d; /* the G output heads of this KV head */
            attn_item(a, i, kh, lb, le, o, m, sums);
            for (int64_t qh = 0; qh < g; qh++) {
                float inv = sums[qh] > 0.0f ? 1.0f / sums[qh] : 0.0f;
                for (int64_t j = 0; j < d; j++) o[qh * d + j] *= inv;
            }
        } else {
            float *o = t->part + item * g * (d + 2);
            attn_item(a, i, kh, lb, le, o, o + g * d, o + g * d + g);
        }
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
    /* items of at least ELEMWISE_MIN_WORK multiply-adds on average (QK^T and PV): a short
     * batch stays on the calling thread */
    int64_t work = 0, pairs = b * hkv, longest = 0, threads = omp_get_max_threads(), g = h / hkv;
    for (int64_t i = 0; i < b; i++) {
        work += lens[i];
        longest = lens[i] > longest ? lens[i] : longest;
    }
    work *= 2 * h * d;
    int64_t chunk = work > 0 ? pairs * ELEMWISE_MIN_WORK / work : pairs;
    struct attn_task t = {&a, 1, NULL};
    /* fewer than two pairs per thread (batch 1 of a model with few KV heads): each pair's keys
     * in up to `splits` ranges of at least 8 blocks */
    if (chunk < 1 && pairs < 2 * threads && threads > 1) {
        int64_t splits = (2 * threads + pairs - 1) / pairs, most = longest / (8 * ATTN_KB);
        t.splits = splits < most ? splits : most;
        if (t.splits < 1) t.splits = 1;
    }
    if (t.splits == 1) {
        parallel_for(attn_range, &t, pairs, chunk < 1 ? 1 : chunk);
        return;
    }
    static __thread float *part_buf;
    static __thread int64_t part_cap;
    int64_t per = g * (d + 2), need = pairs * t.splits * per;
    if (part_cap < need) {
        free(part_buf);
        part_buf = aligned_alloc(64, (need * sizeof(float) + 63) / 64 * 64);
        part_cap = need;
    }
    t.part = part_buf;
    parallel_for(attn_range, &t, pairs * t.splits, 1);
    for (int64_t pair = 0; pair < pairs; pair++) {
        int64_t i = pair / hkv, kh = pair % hkv;
        const float *parts = part_buf + pair * t.splits * per;
        for (int64_t qh = 0; qh < g; qh++) {
            float mx = -INFINITY, sum = 0.0f, *o = out + (i * h + kh * g + qh) * d;
            for (int64_t sp = 0; sp < t.splits; sp++) {
                float ms = parts[sp * per + g * d + qh];
                mx = ms > mx ? ms : mx;
            }
            memset(o, 0, d * sizeof(float));
            for (int64_t sp = 0; sp < t.splits; sp++) {
                const float *ps = parts + sp * per;
                if (ps[g * d + qh] == -INFINITY) continue; /* an empty range */
                float w = exp_vec(ps[g * d + qh] - mx);
                sum += w * ps[g * d + g + qh];
                for (int64_t j = 0; j < d; j++) o[j] += w * ps[qh * d + j];
            }
            float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            for (int64_t j = 0; j < d; j++) o[j] *= inv;
        }
    }
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
