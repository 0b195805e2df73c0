/* Weight-only quantised linear layers with float32 activations: y[M, N] = x[M, K] @ W^T (+ bias)
 * where W is stored as per-channel int8, per-group asymmetric int4, bfloat16 or float16. Quantisation and
 * packing happen once in radixserve/kernels/woq.py (which also holds the PyTorch reference);
 * this file only multiplies. Accumulation is float32 throughout and activations are never rounded.
 *
 * Packed layouts (NR = two native vectors, VW = one; P = ceil(N / NR) panels, zero padded past N):
 *   int8  q [P][K][NR] int8, scales [P * NR] float: W[n, k] = q * scale[n]
 *   bf16  q [P][K][VW][2] bfloat16 bits (uint16), [p][k][j] = (row p*NR + j, row p*NR + VW + j),
 *         so that one 32-bit lane yields both floats with a shift and a mask: W = bits << 16
 *   f16   q [P][K][NR] float16 bits (uint16), widened with the F16C / AVX-512 conversion (exact)
 *   int4  q [P][K][VW] bytes, scales and mins [P][G][NR] float, G = ceil(K / group):
 *         byte [p][k][j] holds row p*NR + j in its low nibble and row p*NR + VW + j in its high
 *         nibble; W[n, k] = q * scale[n, k / group] + min[n, k / group], q in 0..15 (the last
 *         group may be shorter than `group`).
 *
 * Two ways through a panel:
 *   - decode in registers (int8 and bf16 at every M, int4 up to WOQ_INT4_DIRECT_ROWS rows, f16 up
 *     to WOQ_F16_DIRECT_ROWS): the
 *     packed weights stream once per block of rows and become floats in registers inside the
 *     product, MR rows at a time as in rs_linear. Batch-1 decode is bandwidth bound, so reading
 *     1/4 (int8), ~1/7 (int4) or 1/2 (bf16) of the float32 bytes is the win; the widening and
 *     int->float conversion run beside the FMAs, so at M = 32 int8 and bf16 keep the float32
 *     rate without a float copy of the panel. At M = 1, int4 keeps per-group accumulators:
 *     sum_k x*(q*s + m) = s * dot(q, x) + m * sum(x) over the group, one FMA per group for the
 *     scale and min (sum(x) per group computed once per call); 2-3 rows do the same with 12
 *     accumulators (int4_tile), 4 rows dequantise q*s + m in registers (small_tile).
 *   - f16 above WOQ_F16_DIRECT_ROWS rows: the conversions compete with the FMAs for ports, so a
 *     panel is widened once into a float panel as for int4 below (measured on the default
 *     model as F16: prefill 0.85x -> 0.98x of float32, batch 32 0.83x -> 0.91x).
 *   - int4 above WOQ_INT4_DIRECT_ROWS rows: decoding int4 in registers costs an extra FMA per
 *     weight vector (q*s + m) and more registers than AVX2 has, so a panel is dequantised once
 *     into a thread-local float panel [K][NR] and rs_linear's register-tiled product (tile_rows)
 *     runs on it at the float32 FMA rate, the dequantisation amortised over up to MB rows.
 * Work items pair a block of up to MB rows with a panel, about four chunks of them per thread
 * (coarse, for 2 cores).
 */
#include "cpu_common.h"

enum { WOQ_INT8 = 0, WOQ_INT4 = 1, WOQ_BF16 = 2, WOQ_F16 = 3 };

#define WOQ_MB 64 /* rows of x per work item (a block of x stays in L2 while panels stream past) */
#ifndef WOQ_PREFETCH
#define WOQ_PREFETCH 2048 /* software prefetch distance (bytes) on the batch-1 weight stream; 0: none */
#endif
#ifndef WOQ_F16_DIRECT_ROWS
#define WOQ_F16_DIRECT_ROWS 4 /* float16 widens in registers up to this many rows, above via a float panel */
#endif
#ifndef WOQ_INT4_DIRECT_ROWS
#define WOQ_INT4_DIRECT_ROWS 4 /* int4 decodes in registers up to this many rows, above via a float panel */
#endif

typedef int32_t vi __attribute__((vector_size(VW * 4), aligned(4), may_alias));
typedef uint32_t vu __attribute__((vector_size(VW * 4), aligned(4), may_alias));

/* VW narrow integers widened to int32 lanes. GCC's __builtin_convertvector on 8- and 16-byte
 * integer vectors goes through scalar byte moves, so the native widening loads are spelled out. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline vi widen_i8(const void *p) { return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(p)); }
static inline vi widen_u8(const void *p) { return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(p)); }
#elif defined(__AVX2__)
#include <immintrin.h>
static inline vi widen_i8(const void *p) { return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(p)); }
static inline vi widen_u8(const void *p) { return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64(p)); }
#else
static inline vi widen_i8(const void *p) {
    vi v;
    for (int j = 0; j < VW; j++) v[j] = ((const int8_t *)p)[j];
    return v;
}
static inline vi widen_u8(const void *p) {
    vi v;
    for (int j = 0; j < VW; j++) v[j] = ((const uint8_t *)p)[j];
    return v;
}
#endif

/* One float16 (its bits) widened to float32, exactly, without F16C. */
static inline __attribute__((unused)) float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        float f = (float)man * (1.0f / 16777216.0f);
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* VW float16 values widened to float32 (exactly: every float16 is a float32). */
#if defined(__AVX512F__)
static inline vf widen_f16(const void *p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(p)); }
#elif defined(__AVX__) && defined(__F16C__)
static inline vf widen_f16(const void *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128(p)); }
#else
static inline vf widen_f16(const void *p) {
    vf v;
    for (int j = 0; j < VW; j++) v[j] = f16_to_f32(((const uint16_t *)p)[j]);
    return v;
}
#endif

int rs_woq_panel_width(void) { return NR; }
int rs_woq_int4_direct_rows(void) { return WOQ_INT4_DIRECT_ROWS; }

struct woq_args {
    int fmt;
    const float *x, *scales, *mins, *bias, *xsum;
    const uint8_t *q;
    float *y;
    int64_t m, k, n, panels, group, groups, blocks;
};

/* The NR weights of panel row kk as two float vectors (int4: the raw q, 0..15). */
static inline __attribute__((always_inline)) void decode(int fmt, const uint8_t *panel, int64_t kk,
                                                         vf *lo, vf *hi) {
    if (fmt == WOQ_INT8) {
        const int8_t *p = (const int8_t *)panel + kk * NR;
        *lo = __builtin_convertvector(widen_i8(p), vf);
        *hi = __builtin_convertvector(widen_i8(p + VW), vf);
    } else if (fmt == WOQ_BF16) { /* bfloat16 -> float32 is the bits, 16 places up */
        vu v = *(const vu *)((const uint16_t *)panel + kk * NR); /* lane j: column j | column VW + j */
        *lo = (vf)(v << 16);
        *hi = (vf)(v & 0xffff0000u);
    } else if (fmt == WOQ_F16) {
        const uint16_t *p = (const uint16_t *)panel + kk * NR;
        *lo = widen_f16(p);
        *hi = widen_f16(p + VW);
    } else {
        vi u = widen_u8(panel + kk * VW);
        *lo = __builtin_convertvector(u & 15, vf);
        *hi = __builtin_convertvector(u >> 4, vf);
    }
}

/* bytes of one panel row (NR weights) */
static inline __attribute__((always_inline)) int64_t row_bytes(int fmt) {
    return fmt == WOQ_INT8 ? NR : (fmt == WOQ_BF16 || fmt == WOQ_F16) ? 2 * NR : VW;
}

static inline const uint8_t *panel_base(const struct woq_args *a, int64_t p) {
    switch (a->fmt) {
    case WOQ_INT8: return a->q + p * a->k * NR;
    case WOQ_BF16:
    case WOQ_F16: return a->q + p * a->k * NR * 2;
    default: return a->q + p * a->k * VW;
    }
}

/* (lo, hi) = x[k0:k1] . panel rows k0..k1 (decoded), four independent accumulator pairs so
 * the FMA latency chain does not limit a single row. */
static inline __attribute__((always_inline)) void dot_run(int fmt, const uint8_t *panel, const float *x,
                                                          int64_t k0, int64_t k1, vf *lo, vf *hi) {
    vf a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0}, c0 = {0}, c1 = {0}, d0 = {0}, d1 = {0};
    int64_t kk = k0;
    for (; kk + 4 <= k1; kk += 4) {
        vf l, h;
#if WOQ_PREFETCH
        const uint8_t *ahead = panel + (kk * row_bytes(fmt) + WOQ_PREFETCH);
        __builtin_prefetch(ahead);
        if (fmt == WOQ_BF16 || fmt == WOQ_F16) __builtin_prefetch(ahead + 64);
#endif
        decode(fmt, panel, kk, &l, &h);
        a0 += x[kk] * l;
        a1 += x[kk] * h;
        decode(fmt, panel, kk + 1, &l, &h);
        b0 += x[kk + 1] * l;
        b1 += x[kk + 1] * h;
        decode(fmt, panel, kk + 2, &l, &h);
        c0 += x[kk + 2] * l;
        c1 += x[kk + 2] * h;
        decode(fmt, panel, kk + 3, &l, &h);
        d0 += x[kk + 3] * l;
        d1 += x[kk + 3] * h;
    }
    for (; kk < k1; kk++) {
        vf l, h;
        decode(fmt, panel, kk, &l, &h);
        a0 += x[kk] * l;
        a1 += x[kk] * h;
    }
    *lo = (a0 + b0) + (c0 + d0);
    *hi = (a1 + b1) + (c1 + d1);
}

static inline void store_cols(const struct woq_args *a, int64_t row, int64_t p, vf lo, vf hi) {
    int64_t col0 = p * NR, width = a->n - col0 < NR ? a->n - col0 : NR;
    float tmp[NR];
    *(vf *)tmp = lo;
    *(vf *)(tmp + VW) = hi;
    if (a->bias)
        for (int64_t j = 0; j < width; j++) tmp[j] += a->bias[col0 + j];
    memcpy(a->y + row * a->n + col0, tmp, width * sizeof(float));
}

/* One row of x against panel p, weights decoded in registers. */
static inline __attribute__((always_inline)) void gemv_panel(int fmt, const struct woq_args *a, int64_t row,
                                                             int64_t p) {
    const uint8_t *panel = panel_base(a, p);
    const float *x = a->x + row * a->k;
    vf lo, hi;
    if (fmt == WOQ_INT4) {
        const float *s = a->scales + p * a->groups * NR, *mn = a->mins + p * a->groups * NR;
        const float *xs = a->xsum + row * a->groups;
        vf acc0 = {0}, acc1 = {0};
        for (int64_t g = 0; g < a->groups; g++) {
            int64_t k0 = g * a->group, k1 = k0 + a->group < a->k ? k0 + a->group : a->k;
            dot_run(WOQ_INT4, panel, x, k0, k1, &lo, &hi);
            acc0 += *(const vf *)(s + g * NR) * lo + xs[g] * *(const vf *)(mn + g * NR);
            acc1 += *(const vf *)(s + g * NR + VW) * hi + xs[g] * *(const vf *)(mn + g * NR + VW);
        }
        lo = acc0;
        hi = acc1;
    } else {
        dot_run(fmt, panel, x, 0, a->k, &lo, &hi);
        if (fmt == WOQ_INT8) {
            lo *= *(const vf *)(a->scales + p * NR);
            hi *= *(const vf *)(a->scales + p * NR + VW);
        }
    }
    store_cols(a, row, p, lo, hi);
}

/* rows (2..MR) of x against panel p, weights decoded in registers once for all rows. */
static inline __attribute__((always_inline)) void small_tile(int fmt, int rows, const struct woq_args *a,
                                                             int64_t row0, int64_t p) {
    const uint8_t *panel = panel_base(a, p);
    const float *x = a->x + row0 * a->k;
    int64_t k = a->k;
    vf acc0[MR], acc1[MR];
    for (int r = 0; r < rows; r++) acc0[r] = acc1[r] = (vf){0};
    int64_t group = fmt == WOQ_INT4 ? a->group : k;
    for (int64_t k0 = 0; k0 < k; k0 += group) {
        int64_t k1 = k0 + group < k ? k0 + group : k;
        vf s0 = {0}, s1 = {0}, m0 = {0}, m1 = {0};
        if (fmt == WOQ_INT4) {
            int64_t g = k0 / group, off = (p * a->groups + g) * NR;
            s0 = *(const vf *)(a->scales + off);
            s1 = *(const vf *)(a->scales + off + VW);
            m0 = *(const vf *)(a->mins + off);
            m1 = *(const vf *)(a->mins + off + VW);
        }
        for (int64_t kk = k0; kk < k1; kk++) {
            vf l, h;
            decode(fmt, panel, kk, &l, &h);
            if (fmt == WOQ_INT4) {
                l = l * s0 + m0;
                h = h * s1 + m1;
            }
            for (int r = 0; r < rows; r++) {
                float b = x[r * k + kk];
                acc0[r] += b * l;
                acc1[r] += b * h;
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        if (fmt == WOQ_INT8) {
            acc0[r] *= *(const vf *)(a->scales + p * NR);
            acc1[r] *= *(const vf *)(a->scales + p * NR + VW);
        }
        store_cols(a, row0 + r, p, acc0[r], acc1[r]);
    }
}

/* int4, rows (2..INT4_TILE) of x against panel p: per-group accumulators of x * q (q as decoded,
 * 0..15), folded in at the end of each group as scale * acc + min * sum(x), so the weights cost
 * no FMA of their own (12 accumulators for 3 rows: what AVX2's 16 registers hold). */
#define INT4_TILE 3
static inline __attribute__((always_inline)) void int4_tile(int rows, const struct woq_args *a, int64_t row0,
                                                            int64_t p) {
    const uint8_t *panel = panel_base(a, p);
    const float *x = a->x + row0 * a->k, *xs = a->xsum + row0 * a->groups;
    int64_t k = a->k;
    vf acc0[INT4_TILE], acc1[INT4_TILE];
    for (int r = 0; r < rows; r++) acc0[r] = acc1[r] = (vf){0};
    for (int64_t g = 0; g < a->groups; g++) {
        int64_t k0 = g * a->group, k1 = k0 + a->group < k ? k0 + a->group : k;
        vf g0[INT4_TILE], g1[INT4_TILE];
        for (int r = 0; r < rows; r++) g0[r] = g1[r] = (vf){0};
        for (int64_t kk = k0; kk < k1; kk++) {
            vf l, h;
            decode(WOQ_INT4, panel, kk, &l, &h);
            for (int r = 0; r < rows; r++) {
                float b = x[r * k + kk];
                g0[r] += b * l;
                g1[r] += b * h;
            }
        }
        int64_t off = (p * a->groups + g) * NR;
        vf s0 = *(const vf *)(a->scales + off), s1 = *(const vf *)(a->scales + off + VW);
        vf m0 = *(const vf *)(a->mins + off), m1 = *(const vf *)(a->mins + off + VW);
        for (int r = 0; r < rows; r++) {
            acc0[r] += s0 * g0[r] + xs[r * a->groups + g] * m0;
            acc1[r] += s1 * g1[r] + xs[r * a->groups + g] * m1;
        }
    }
    for (int r = 0; r < rows; r++) store_cols(a, row0 + r, p, acc0[r], acc1[r]);
}

/* items: (row block, panel) pairs, panel-major within a block as in rs_linear, so a block of x
 * stays in L2 while the panels stream past it. */
static inline __attribute__((always_inline)) void direct_range_fmt(int fmt, const struct woq_args *a,
                                                                   int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; item++) {
        int64_t b0 = item / a->panels * WOQ_MB, p = item % a->panels;
        int64_t b1 = a->m - b0 < WOQ_MB ? a->m : b0 + WOQ_MB;
        if (fmt == WOQ_INT4) { /* measured: 2-3 rows per-group accumulators, 4 rows q*s+m per weight */
            for (int64_t m0 = b0; m0 < b1; m0 += 4) {
                switch (b1 - m0 < 4 ? b1 - m0 : 4) {
                case 1: gemv_panel(fmt, a, m0, p); break;
                case 2: int4_tile(2, a, m0, p); break;
                case 3: int4_tile(3, a, m0, p); break;
                case 4: small_tile(fmt, 4, a, m0, p); break;
                }
            }
            continue;
        }
        for (int64_t m0 = b0; m0 < b1; m0 += MR) {
            switch (b1 - m0 < MR ? b1 - m0 : MR) {
            case 1: gemv_panel(fmt, a, m0, p); break;
#define CASE(R) case R: small_tile(fmt, R, a, m0, p); break;
            CASE(2) CASE(3) CASE(4)
#if MR > 4
            CASE(5) CASE(6)
#endif
#if MR > 6
            CASE(7) CASE(8)
#endif
#undef CASE
            }
        }
    }
}

static void direct_range(const void *a_, int64_t begin, int64_t end) {
    const struct woq_args *a = a_;
    switch (a->fmt) {
    case WOQ_INT8: direct_range_fmt(WOQ_INT8, a, begin, end); break;
    case WOQ_INT4: direct_range_fmt(WOQ_INT4, a, begin, end); break;
    case WOQ_F16: direct_range_fmt(WOQ_F16, a, begin, end); break;
    default: direct_range_fmt(WOQ_BF16, a, begin, end); break;
    }
}

/* Panel p as floats [K][NR], exactly the values woq.py's dequantize() gives. */
static inline __attribute__((always_inline)) void dequant_fmt(int fmt, const struct woq_args *a, int64_t p,
                                                              float *out) {
    const uint8_t *panel = panel_base(a, p);
    int64_t k = a->k;
    if (fmt == WOQ_INT4) {
        const float *s = a->scales + p * a->groups * NR, *mn = a->mins + p * a->groups * NR;
        for (int64_t g = 0; g < a->groups; g++) {
            vf s0 = *(const vf *)(s + g * NR), s1 = *(const vf *)(s + g * NR + VW);
            vf m0 = *(const vf *)(mn + g * NR), m1 = *(const vf *)(mn + g * NR + VW);
            int64_t k0 = g * a->group, k1 = k0 + a->group < k ? k0 + a->group : k;
            for (int64_t kk = k0; kk < k1; kk++) {
                vf l, h;
                decode(fmt, panel, kk, &l, &h);
                *(vf *)(out + kk * NR) = l * s0 + m0;
                *(vf *)(out + kk * NR + VW) = h * s1 + m1;
            }
        }
    } else {
        vf s0 = {0}, s1 = {0};
        if (fmt == WOQ_INT8) {
            s0 = *(const vf *)(a->scales + p * NR);
            s1 = *(const vf *)(a->scales + p * NR + VW);
        }
        for (int64_t kk = 0; kk < k; kk++) {
            vf l, h;
            decode(fmt, panel, kk, &l, &h);
            if (fmt == WOQ_INT8) {
                l *= s0;
                h *= s1;
            }
            *(vf *)(out + kk * NR) = l;
            *(vf *)(out + kk * NR + VW) = h;
        }
    }
}

static void dequant_panel(const struct woq_args *a, int64_t p, float *out) {
    switch (a->fmt) {
    case WOQ_INT8: dequant_fmt(WOQ_INT8, a, p, out); break;
    case WOQ_INT4: dequant_fmt(WOQ_INT4, a, p, out); break;
    case WOQ_F16: dequant_fmt(WOQ_F16, a, p, out); break;
    default: dequant_fmt(WOQ_BF16, a, p, out); break;
    }
}

/* Each OpenMP worker keeps one float panel for the life of the process (grown on demand). */
static __thread float *tl_panel;
static __thread int64_t tl_panel_floats;

static float *thread_panel(int64_t floats) {
    if (tl_panel_floats < floats) {
        free(tl_panel);
        tl_panel = aligned_alloc(64, (size_t)((floats * 4 + 63) / 64 * 64));
        tl_panel_floats = tl_panel ? floats : 0;
    }
    return tl_panel;
}

/* items: (panel, row block) pairs, block-major within a panel, so a thread that takes
 * consecutive items dequantises each panel once for all of its blocks. */
static void panel_range(const void *a_, int64_t begin, int64_t end) {
    const struct woq_args *a = a_;
    float *buf = thread_panel(a->k * NR);
    if (!buf) abort();
    int64_t have = -1;
    for (int64_t item = begin; item < end; item++) {
        int64_t p = item / a->blocks, b0 = item % a->blocks * WOQ_MB;
        int64_t b1 = a->m - b0 < WOQ_MB ? a->m : b0 + WOQ_MB;
        if (p != have) {
            dequant_panel(a, p, buf);
            have = p;
        }
        tile_block(b0, b1, a->x, a->k, buf, a->bias, a->y, a->n, p * NR);
    }
}

/* Coarse work items: about four chunks per thread, so two cores each take a few long runs. */
static int64_t chunk_for(int64_t items) {
    int64_t chunks = 4 * (int64_t)omp_get_max_threads();
    int64_t c = (items + chunks - 1) / chunks;
    return c < 1 ? 1 : c;
}

static void woq_linear(struct woq_args *a) {
    a->panels = (a->n + NR - 1) / NR;
    if (a->m <= 0 || a->n <= 0) return;
    a->blocks = (a->m + WOQ_MB - 1) / WOQ_MB;
    int64_t items = a->panels * a->blocks;
    int64_t direct_rows = a->fmt == WOQ_INT4 ? WOQ_INT4_DIRECT_ROWS : a->fmt == WOQ_F16 ? WOQ_F16_DIRECT_ROWS : a->m;
    if (a->m <= direct_rows) {
        float *xsum = NULL;
        if (a->fmt == WOQ_INT4) { /* per-group sums of x for the min * sum(x) terms */
            xsum = malloc(sizeof(float) * a->groups * a->m);
            if (!xsum) abort();
            for (int64_t r = 0; r < a->m; r++)
                for (int64_t g = 0; g < a->groups; g++) {
                    int64_t k0 = g * a->group, k1 = k0 + a->group < a->k ? k0 + a->group : a->k;
                    float s = 0;
                    for (int64_t kk = k0; kk < k1; kk++) s += a->x[r * a->k + kk];
                    xsum[r * a->groups + g] = s;
                }
            a->xsum = xsum;
        }
        parallel_for(direct_range, a, items, chunk_for(items));
        free(xsum);
        return;
    }
    parallel_for(panel_range, a, items, chunk_for(items));
}

void rs_woq_int8_linear(const float *x, int64_t m, int64_t k, const int8_t *q, const float *scales,
                        const float *bias, int64_t n, float *y) {
    struct woq_args a = {.fmt = WOQ_INT8, .x = x, .scales = scales, .bias = bias, .q = (const uint8_t *)q,
                         .y = y, .m = m, .k = k, .n = n, .group = k, .groups = 1};
    woq_linear(&a);
}

void rs_woq_int4_linear(const float *x, int64_t m, int64_t k, const uint8_t *q, const float *scales,
                        const float *mins, int64_t group, const float *bias, int64_t n, float *y) {
    struct woq_args a = {.fmt = WOQ_INT4, .x = x, .scales = scales, .mins = mins, .bias = bias, .q = q,
                         .y = y, .m = m, .k = k, .n = n, .group = group, .groups = (k + group - 1) / group};
    woq_linear(&a);
}

void rs_woq_bf16_linear(const float *x, int64_t m, int64_t k, const uint16_t *q, const float *bias,
                        int64_t n, float *y) {
    struct woq_args a = {.fmt = WOQ_BF16, .x = x, .bias = bias, .q = (const uint8_t *)q,
                         .y = y, .m = m, .k = k, .n = n, .group = k, .groups = 1};
    woq_linear(&a);
}

void rs_woq_f16_linear(const float *x, int64_t m, int64_t k, const uint16_t *q, const float *bias,
                       int64_t n, float *y) {
    struct woq_args a = {.fmt = WOQ_F16, .x = x, .bias = bias, .q = (const uint8_t *)q,
                         .y = y, .m = m, .k = k, .n = n, .group = k, .groups = 1};
    woq_linear(&a);
}

/* out[t, :] = row ids[t] of an [N, K] float16 (fmt WOQ_F16) or bfloat16 (WOQ_BF16) weight,
 * widened to float32 (exactly): from the panels the linear kernels read (panels != 0) or from a
 * row-major table (panels == 0). An id outside [0, n) gives zeros. A token embedding that
 * shares a tied LM head's 16-bit weight looks its rows up here. */
static inline float half_bits_to_f32(uint16_t h, int bf16) {
    if (!bf16)
        return f16_to_f32(h);
    uint32_t bits = (uint32_t)h << 16; /* bfloat16 -> float32 is the bits, 16 places up */
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

void rs_half_rows(int fmt, const uint16_t *q, int64_t n, int64_t k, int64_t panels, const int64_t *ids, int64_t t,
                  float *out) {
    int bf16 = fmt == WOQ_BF16;
    for (int64_t i = 0; i < t; i++) {
        float *o = out + i * k;
        int64_t r = ids[i];
        if (r < 0 || r >= n) {
            memset(o, 0, k * sizeof(float));
            continue;
        }
        if (!panels) {
            const uint16_t *row = q + r * k;
            for (int64_t c = 0; c < k; c++) o[c] = half_bits_to_f32(row[c], bf16);
            continue;
        }
        /* f16 panels: [P][K][NR]; bf16 panels: [P][K][VW][2], rows j and VW + j side by side */
        const uint16_t *panel = q + (r / NR) * k * NR;
        int64_t j = r % NR, at = bf16 ? 2 * (j % VW) + j / VW : j;
        for (int64_t c = 0; c < k; c++) o[c] = half_bits_to_f32(panel[c * NR + at], bf16);
    }
}
