/* The torch_native attention backend's CPU kernel (float32): paged decode attention straight
 * from the KV pool. Built by radixserve_attention_torch/kernel.py through the core's kernel
 * builder (radixserve.plugin_api.kernels.load_cpu_library), against the core's cpu_common.h
 * (vector width, OpenMP work splitter, vectorised exp). */
#include "cpu_common.h"

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

/* the tape twin (radixserve.kernels.tape): a captured decode step replays this call from C */
void rs_decode_attention_tape(const int64_t *a) {
    rs_decode_attention(RS_TAPE_P(0), RS_TAPE_I(1), RS_TAPE_P(2), RS_TAPE_I(3), RS_TAPE_P(4), RS_TAPE_I(5),
                        RS_TAPE_P(6), RS_TAPE_P(7), RS_TAPE_P(8), RS_TAPE_P(9), RS_TAPE_I(10), RS_TAPE_P(11),
                        RS_TAPE_P(12), RS_TAPE_I(13), RS_TAPE_I(14), RS_TAPE_I(15), RS_TAPE_I(16), RS_TAPE_F(17),
                        RS_TAPE_P(18));
}
