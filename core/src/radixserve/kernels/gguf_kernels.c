/* Linear layers over GGUF-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
 * without dequantising the weight to memory, and row lookups (embeddings) in raw GGUF data.
 *
 * Prepared layout (built once at load by rs_gguf_pack, at the end; gguf.py's pack_reference
 * builds the same bytes in numpy): every type is rewritten
 * as "w = s * q + o" over groups of GS consecutive k (GS = 32; 16 for Q6_K), with s and o
 * float32 (for the K-quants s = d * sc and o = -dmin * m, which are exact in float32, so each
 * dequantised weight is the single rounding of s*q + o: exactly gguf's value). Rows are cut,
 * like rs_pack's panels, into panels of NR rows (zero rows past N), and a panel is one
 * sequential stream of groups:
 *   U4 (Q4_0, Q4_1, Q4_K):  s[NR] o[NR] | for each chunk c of 8 k, for each VW-row half h:
 *                            VW uint32, word i = sum_j q[row h*VW+i][8c+j] << 4j (see dec_u45)
 *   U5 (Q5_0, Q5_1, Q5_K):  as U4 (the low four bits), then one uint32 per row holding the
 *                            group's fifth bits (see u5_high)
 *   I8 (Q8_0, Q6_K):        s[NR] | for each k, NR int8 (Q6_K's q - 32, o = 0)
 * Vector lanes are rows, so a k's weights for VW rows decode into one float vector with no
 * shuffles (U4/U5: mask, convert; I8: sign-extend, convert): small batches (M <= GEMV_MAX)
 * accumulate per group bs = sum_k q * x[k] (x[k] broadcast from the compact x once per k and
 * row, for both halves of the panel) and then acc += s * bs + o * sum(x over the group), so the
 * weights are never scaled one by one (3 vector ops per VW weights for U4 and I8); larger
 * batches dequantise one panel at a time into a thread-local float panel [K][NR], exactly
 * rs_pack's panel, and run the float32 tile_rows over it.
 *
 * Numerics: the panels hold gguf's float32 weights exactly; the in-register path factors s
 * and o out of each group's sum, so both differ from x @ w.T (float64) only by float32
 * rounding of sums: relative error ~1e-7 of |x| @ |w|.T at K ~ 500 in the tests. */
#include "cpu_common.h"

typedef int32_t vi __attribute__((vector_size(VW * 4), aligned(4), may_alias));
typedef uint8_t vb __attribute__((vector_size(VW), aligned(1), may_alias));
typedef int8_t vsb __attribute__((vector_size(VW), aligned(1), may_alias));
#define NH (NR / VW) /* vectors per panel row of k */

enum { FMT_U4 = 0, FMT_U5 = 1, FMT_I8 = 2 };

int rs_gguf_vector_width(void) { return VW; }

static int64_t group_bytes(int fmt, int64_t gs) {
    switch (fmt) {
    case FMT_U4: return 2 * NR * 4 + gs * NR / 2;
    case FMT_U5: return 2 * NR * 4 + gs * NR / 2 + NR * 4;
    default: return NR * 4 + gs * NR;
    }
}

/* ---------------------------------------------------------------- decoding */
/* VW bytes at p, zero- (u8) or sign- (s8) extended to int32 lanes. */
static inline __attribute__((always_inline)) vi widen_u8(const uint8_t *p) {
#if VW == 16 && defined(__AVX512F__)
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif VW == 8 && defined(__AVX2__)
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    return __builtin_convertvector(*(const vb *)p, vi);
#endif
}

static inline __attribute__((always_inline)) vi widen_s8(const uint8_t *p) {
#if VW == 16 && defined(__AVX512F__)
    return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif VW == 8 && defined(__AVX2__)
    return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    return __builtin_convertvector(*(const vsb *)p, vi);
#endif
}

/* U4/U5: chunk c (k = 8c .. 8c+7 of the group), half h -> one uint32 word per row, nibble j
 * holding q at k = 8c + j. Nibbles are masked in place and converted, q * 16^(j % 4) exactly
 * (the upper four from the word shifted down 16 bits, so four masks serve all eight and bit
 * 31 never reads as a sign); the caller multiplies by x[k] * 16^-(j % 4) (also exact), so the
 * products round exactly as q * x[k] would. */
typedef uint32_t vu __attribute__((vector_size(VW * 4), aligned(4), may_alias));
static inline __attribute__((always_inline)) vu u4_words(const uint8_t *grp, int c, int h) {
    return *(const vu *)(grp + 2 * NR * 4 + (c * NH + h) * VW * 4);
}

/* U5: the fifth bits of a row's 32 k in one uint32 word, placed so that one shift per
 * half-chunk u = 2c + (j >= 4) brings all four to bit 4 + 4 * (j % 4), just above nibble j's
 * masked position: bit 4 * (j % 4) + 4 + U5_SHIFT[u] of the word (all 32 distinct). */
static const int U5_SHIFT[8] = {-4, -3, -2, -1, 12, 13, 14, 15};
static inline __attribute__((always_inline)) vu u5_high(const uint8_t *grp, int64_t gs, int u, int h) {
    vu w = *(const vu *)(grp + 2 * NR * 4 + gs * NR / 2 + h * VW * 4);
    return U5_SHIFT[u] < 0 ? w << -U5_SHIFT[u] : w >> U5_SHIFT[u];
}
/* q * 16^(j % 4) of nibble j (U4), with the fifth bit from u5_high's word hv (U5) */
static inline __attribute__((always_inline)) vf dec_u45(int fmt, vu v, vu v16, vu hv, int j) {
    vu q = (j < 4 ? v : v16) & (15u << (4 * (j % 4)));
    if (fmt == FMT_U5) q |= hv & (16u << (4 * (j % 4)));
    return __builtin_convertvector((vi)q, vf);
}

/* k index kk of an I8 group, half h -> VW rows' q as floats. */
static inline __attribute__((always_inline)) vf dec_i8(const uint8_t *grp, int64_t kk, int h) {
    return __builtin_convertvector(widen_s8(grp + NR * 4 + kk * NR + h * VW), vf);
}

/* ---------------------------------------------------------------- small M: in-register dot */
/* y[0:rows, col0:col0+NR] for one panel, rows <= GEMV_ROWS of x (row stride k; for U4/U5
 * pre-scaled, see rs_gguf_linear); xsum holds each x row's group sums (row stride groups).
 * Per k the panel's NH weight vectors are decoded once and every row's x[k] is broadcast
 * once and multiplied into all NH of them. */
#if VW == 16
/* 32 vector registers hold 8 rows' group sums for both halves with the decoded weights */
#define GEMV_ROWS 8
#else
#define GEMV_ROWS 4
#endif
static inline __attribute__((always_inline)) void gemv_panel(
    int fmt, int64_t gs, int rows, const uint8_t *pw, const float *x, int64_t k,
    const float *xsum, int64_t groups, const float *bias, float *y, int64_t n, int64_t col0) {
    vf acc[GEMV_ROWS][NH];
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < NH; h++) acc[r][h] = (vf){0};
    /* independent FMA chains per (row, half): 4 for one row, 2 for two, 1 for three or four
     * (latency hiding) */
    const int nacc = rows == 1 ? 4 : rows == 2 ? 2 : 1;
    int64_t gb = group_bytes(fmt, gs);
    for (int64_t g = 0; g < groups; g++, pw += gb) {
        const float *xg = x + g * gs;
        /* the weights are one stream: software prefetch 2 KiB ahead (lm_head-sized matrices,
         * streamed from DRAM, ran 1.4-1.6x faster on Zen 3; cache-resident ones the same) */
        for (int64_t off = 0; off < gb; off += 64) __builtin_prefetch(pw + 2048 + off);
        vf bs[GEMV_ROWS][NH][4];
        for (int r = 0; r < rows; r++)
            for (int h = 0; h < NH; h++)
                for (int c = 0; c < 4; c++) bs[r][h][c] = (vf){0};
        if (fmt == FMT_I8) {
#pragma GCC unroll 32
            for (int kk = 0; kk < gs; kk++) {
                vf a[NH];
                for (int h = 0; h < NH; h++) a[h] = dec_i8(pw, kk, h);
                for (int r = 0; r < rows; r++) {
                    vf b = bcast(xg + r * k + kk);
                    for (int h = 0; h < NH; h++) bs[r][h][kk % nacc] += a[h] * b;
                }
            }
        } else { /* U4, U5; x here is pre-scaled: x[k] * 16^-(k % 4) */
#pragma GCC unroll 4
            for (int c = 0; c < gs / 8; c++) {
                vu v[NH], v16[NH], hv[NH];
                for (int h = 0; h < NH; h++) {
                    v[h] = u4_words(pw, c, h);
                    v16[h] = v[h] >> 16;
                    hv[h] = (vu){0};
                }
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++) {
                    vf a[NH];
                    for (int h = 0; h < NH; h++) {
                        if (fmt == FMT_U5 && j % 4 == 0) hv[h] = u5_high(pw, gs, 2 * c + j / 4, h);
                        a[h] = dec_u45(fmt, v[h], v16[h], hv[h], j);
                    }
                    for (int r = 0; r < rows; r++) {
                        vf b = bcast(xg + r * k + 8 * c + j);
                        for (int h = 0; h < NH; h++) bs[r][h][j % nacc] += a[h] * b;
                    }
                }
            }
        }
        for (int h = 0; h < NH; h++) {
            vf s = *(const vf *)((const float *)pw + h * VW);
            for (int r = 0; r < rows; r++) {
                vf sum = bs[r][h][0];
                for (int c = 1; c < nacc; c++) sum += bs[r][h][c];
                acc[r][h] += s * sum;
                if (fmt != FMT_I8) acc[r][h] += *(const vf *)((const float *)pw + NR + h * VW) * xsum[r * groups + g];
            }
        }
    }
    int64_t width = n - col0 < NR ? n - col0 : NR;
    for (int r = 0; r < rows; r++) {
        float tmp[NR];
        for (int h = 0; h < NH; h++) *(vf *)(tmp + h * VW) = acc[r][h];
        if (bias)
            for (int64_t j = 0; j < width; j++) tmp[j] += bias[col0 + j];
        memcpy(y + r * n + col0, tmp, width * sizeof(float));
    }
}

struct gguf_args {
    const uint8_t *w;
    const float *x, *xsum, *bias;
    float *y;
    int64_t m, k, n, gs, groups, panels, panel_bytes;
    int fmt;
    int64_t mb; /* rows per block on the panel path (see rs_gguf_linear) */
};

/* Specialised copies per (format, group size, rows) so every loop bound is a constant. */
#define GEMV_TILE(FMT, GS, ROWS)                                                            \
    gemv_panel(FMT, GS, ROWS, pw, x, a->k, xs, a->groups, a->bias, y, a->n, p * NR)
#if GEMV_ROWS == 8
#define GEMV_WIDE(FMT, GS)                                                                   \
    case 5: GEMV_TILE(FMT, GS, 5); break;                                                    \
    case 6: GEMV_TILE(FMT, GS, 6); break;                                                    \
    case 7: GEMV_TILE(FMT, GS, 7); break;                                                    \
    case 8: GEMV_TILE(FMT, GS, 8); break;
#else
#define GEMV_WIDE(FMT, GS)
#endif
#define GEMV_FN(NAME, FMT, GS)                                                               \
    static void NAME(const void *a_, int64_t begin, int64_t end) {                          \
        const struct gguf_args *a = a_;                                                      \
        for (int64_t p = begin; p < end; p++) {                                              \
            const uint8_t *pw = a->w + p * a->panel_bytes;                                   \
            for (int64_t m0 = 0; m0 < a->m; m0 += GEMV_ROWS) {                               \
                const float *x = a->x + m0 * a->k, *xs = a->xsum + m0 * a->groups;           \
                float *y = a->y + m0 * a->n;                                                 \
                int64_t left = a->m - m0;                                                    \
                switch (left < GEMV_ROWS ? left : GEMV_ROWS) {                               \
                case 1: GEMV_TILE(FMT, GS, 1); break;                                        \
                case 2: GEMV_TILE(FMT, GS, 2); break;                                        \
                case 3: GEMV_TILE(FMT, GS, 3); break;                                        \
                GEMV_WIDE(FMT, GS)                                                           \
                default: GEMV_TILE(FMT, GS, 4); break;                                       \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }
GEMV_FN(gemv_u4, FMT_U4, 32)
GEMV_FN(gemv_u5, FMT_U5, 32)
GEMV_FN(gemv_i8_32, FMT_I8, 32)
GEMV_FN(gemv_i8_16, FMT_I8, 16)

/* ---------------------------------------------------------------- larger M: float panels */
/* Panel p -> float [K][NR], the layout tile_rows reads (w = s * q + o, one rounding). */
static inline __attribute__((always_inline)) void dequant_panel(
    int fmt, int64_t gs, const uint8_t *pw, int64_t groups, float *out) {
    int64_t gb = group_bytes(fmt, gs);
    /* both halves of a k row are written together: whole cache lines, once each */
    for (int64_t g = 0; g < groups; g++, pw += gb, out += gs * NR) {
        vf s[NH], o[NH], sj[NH][4];
        for (int h = 0; h < NH; h++) {
            s[h] = *(const vf *)((const float *)pw + h * VW);
            if (fmt == FMT_I8) continue;
            o[h] = *(const vf *)((const float *)pw + NR + h * VW);
            /* s * 16^-j is exact, so (s * 16^-j) * (q * 16^j) is s * q exactly */
            for (int j = 0; j < 4; j++) sj[h][j] = s[h] * (1.0f / (float)(1 << (4 * j)));
        }
        if (fmt == FMT_I8) {
            for (int64_t kk = 0; kk < gs; kk++)
                for (int h = 0; h < NH; h++)
                    *(vf *)(out + kk * NR + h * VW) = s[h] * dec_i8(pw, kk, h);
            continue;
        }
        if (fmt == FMT_U5) { /* too many live masks for both halves at once: one at a time */
            for (int h = 0; h < NH; h++)
                for (int c = 0; c < gs / 8; c++) {
                    vu v = u4_words(pw, c, h), v16 = v >> 16, hv = {0};
                    for (int j = 0; j < 8; j++) {
                        if (j % 4 == 0) hv = u5_high(pw, gs, 2 * c + j / 4, h);
                        *(vf *)(out + (8 * c + j) * NR + h * VW) =
                            sj[h][j % 4] * dec_u45(fmt, v, v16, hv, j) + o[h];
                    }
                }
            continue;
        }
        for (int c = 0; c < gs / 8; c++) {
            vu v[NH], v16[NH], hv[NH];
            for (int h = 0; h < NH; h++) {
                v[h] = u4_words(pw, c, h);
                v16[h] = v[h] >> 16;
                hv[h] = (vu){0};
            }
            for (int j = 0; j < 8; j++)
                for (int h = 0; h < NH; h++) {
                    if (fmt == FMT_U5 && j % 4 == 0) hv[h] = u5_high(pw, gs, 2 * c + j / 4, h);
                    *(vf *)(out + (8 * c + j) * NR + h * VW) =
                        sj[h][j % 4] * dec_u45(fmt, v[h], v16[h], hv[h], j) + o[h];
                }
        }
    }
}

/* Rows go in blocks of about MB (a block of x stays in L2 while the panels stream past it);
 * items are (row block, panel) pairs, panel-major within a block; each item dequantises its
 * panel once into this thread's buffer and multiplies every row of the block against it. Every
 * block dequantises the whole matrix again, so M is cut into round(M / MB) blocks of equal
 * size (at most 1.5 MB rows), not into blocks of MB and a short tail: a mixed step of 64 prompt
 * tokens and 8 decode rows (M = 72) paid a second full dequantisation for 8 rows. */
#define MB 64
static __thread float *panel_buf;
static __thread int64_t panel_cap;

#define PANEL_FN(NAME, FMT, GS)                                                               \
    static void NAME(const void *a_, int64_t begin, int64_t end) {                           \
        const struct gguf_args *a = a_;                                                       \
        int64_t need = a->k * NR;                                                             \
        if (panel_cap < need) {                                                               \
            free(panel_buf);                                                                  \
            panel_buf = aligned_alloc(64, (need * sizeof(float) + 63) / 64 * 64);             \
            panel_cap = need;                                                                 \
        }                                                                                     \
        for (int64_t item = begin; item < end; item++) {                                      \
            int64_t b0 = item / a->panels * a->mb, p = item % a->panels;                      \
            int64_t b1 = a->m - b0 < a->mb ? a->m : b0 + a->mb;                               \
            dequant_panel(FMT, GS, a->w + p * a->panel_bytes, a->groups, panel_buf);          \
            tile_block(b0, b1, a->x, a->k, panel_buf, a->bias, a->y, a->n, p * NR);           \
        }                                                                                     \
    }
PANEL_FN(panel_u4, FMT_U4, 32)
PANEL_FN(panel_u5, FMT_U5, 32)
PANEL_FN(panel_i8_32, FMT_I8, 32)
PANEL_FN(panel_i8_16, FMT_I8, 16)

/* Batches up to this many rows take the in-register path (the weights decoded once per tile
 * of up to GEMV_ROWS rows, from L1 after the first tile; four-row tiles ran 7-12% faster than
 * pairs at 3-8 rows for Q4_1 on Zen 3: benchmarks/bench_kernel_ab.py); larger ones the float panels. Measured on Zen 3
 * (AVX2), one thread, N=1536 K=576: the in-register path wins up to ~8 rows for U4 and I8,
 * where one float32 tile pass (<= MR rows) costs about as much as the panel's dequantisation.
 * With AVX-512 (Zen 5, two threads) eight-row tiles made 6-8 rows 6-16% faster than tiles of
 * four, and the in-register path up to 16 rows (tiles of 8) halved the default model's lm_head
 * at 10-16 rows (a 16-token verify forward 3.8 -> 2.8 one-row steps) while the small
 * attention matrices lost 10-17% against the panels. */
#if VW == 16
#define GEMV_MAX 16
#else
#define GEMV_MAX 8
#endif

int rs_gguf_gemv_max(void) { return GEMV_MAX; }

int64_t rs_gguf_panel_bytes(int fmt, int64_t gs, int64_t k) { return k / gs * group_bytes(fmt, gs); }

/* y[M, N] = x[M, K] @ W^T (+ bias), W prepared as described at the top (fmt, gs). */
void rs_gguf_linear(int fmt, int64_t gs, const uint8_t *w, int64_t n, int64_t k,
                    const float *x, int64_t m, const float *bias, float *y) {
    int64_t groups = k / gs, panels = (n + NR - 1) / NR;
    int64_t blocks = (m + MB / 2) / MB < 1 ? 1 : (m + MB / 2) / MB;
    struct gguf_args a = {w, x, NULL, bias, y, m, k, n, gs, groups, panels,
                          groups * group_bytes(fmt, gs), fmt, (m + blocks - 1) / blocks};
    if (m <= GEMV_MAX) {
        /* per calling thread, kept between calls: a fresh one would be mmap'ed (and page
         * faulted) per call once it passes malloc's threshold at a few rows of large K */
        static __thread float *x_buf;
        static __thread int64_t x_cap;
        int64_t need = m * k + m * groups + 16;
        if (x_cap < need) {
            free(x_buf);
            x_buf = aligned_alloc(64, (need * sizeof(float) + 63) / 64 * 64);
            x_cap = need;
        }
        float *xs = x_buf, *xsum = x_buf + m * k;
        for (int64_t r = 0; r < m; r++)
            for (int64_t g = 0; g < groups; g++) {
                float s = 0.0f;
                for (int64_t j = 0; j < gs; j++) s += x[r * k + g * gs + j];
                xsum[r * groups + g] = s;
            }
        a.xsum = xsum;
        /* for U4/U5 x scaled by 16^-(k % 4), the nibble positions' weights (see dec_u45) */
        for (int64_t i = 0; i < m * k; i += 4) /* k % 16 == 0 */
            for (int j = 0; j < 4; j++)
                xs[i + j] = fmt != FMT_I8 ? x[i + j] * (1.0f / (float)(1 << (4 * j))) : x[i + j];
        a.x = xs;
        task_fn fn = fmt == FMT_U4 ? gemv_u4 : fmt == FMT_U5 ? gemv_u5
                   : gs == 16 ? gemv_i8_16 : gemv_i8_32;
        /* ~64 KiB of weights per work item: coarse enough for a couple of threads */
        int64_t chunk = (65536 + a.panel_bytes - 1) / a.panel_bytes;
        int64_t threads = omp_get_max_threads();
        if (chunk * threads * 4 > panels) chunk = (panels + threads * 4 - 1) / (threads * 4);
        parallel_for(fn, &a, panels, chunk < 1 ? 1 : chunk);
    } else {
        task_fn fn = fmt == FMT_U4 ? panel_u4 : fmt == FMT_U5 ? panel_u5
                   : gs == 16 ? panel_i8_16 : panel_i8_32;
        parallel_for(fn, &a, (m + a.mb - 1) / a.mb * panels, 1);
    }
}

/* ---------------------------------------------------------------- raw GGUF row lookup */
static float half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | p[1] << 8);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 31) {
        bits = sign | 0x7F800000u | man << 13;
    } else if (exp == 0) {
        float f = (float)man * (1.0f / 16777216.0f); /* subnormal: man * 2^-24, exact */
        return sign ? -f : f;
    } else {
        bits = sign | (exp + 112) << 23 | man << 13;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block. */
static void k_scale_min(const uint8_t *sc, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = sc[j] & 63;
        *min = sc[j + 4] & 63;
    } else {
        *scale = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4);
        *min = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

/* One raw GGUF row of k weights -> floats, with gguf's own order of float32 operations
 * (every product d * q is exact, so each value is gguf's to the bit). */
static void dequant_row(int qtype, const uint8_t *b, int64_t k, float *out) {
    switch (qtype) {
    case 2: /* Q4_0 */
        for (int64_t i = 0; i < k; i += 32, b += 18, out += 32) {
            float d = half_to_float(b);
            for (int j = 0; j < 16; j++) {
                out[j] = d * (float)((b[2 + j] & 15) - 8);
                out[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
            }
        }
        break;
    case 3: /* Q4_1 */
        for (int64_t i = 0; i < k; i += 32, b += 20, out += 32) {
            float d = half_to_float(b), m = half_to_float(b + 2);
            for (int j = 0; j < 16; j++) {
                out[j] = d * (float)(b[4 + j] & 15) + m;
                out[j + 16] = d * (float)(b[4 + j] >> 4) + m;
            }
        }
        break;
    case 6: /* Q5_0 */
    case 7: /* Q5_1 */
        for (int64_t i = 0; i < k; i += 32, out += 32) {
            int has_m = qtype == 7;
            float d = half_to_float(b), m = has_m ? half_to_float(b + 2) : 0.0f;
            const uint8_t *qhp = b + 2 + 2 * has_m, *qs = qhp + 4;
            uint32_t qh = (uint32_t)qhp[0] | (uint32_t)qhp[1] << 8 | (uint32_t)qhp[2] << 16 |
                          (uint32_t)qhp[3] << 24;
            for (int j = 0; j < 16; j++) {
                int q0 = (qs[j] & 15) | ((qh >> j) & 1) << 4;
                int q1 = (qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4;
                if (has_m) {
                    out[j] = d * (float)q0 + m;
                    out[j + 16] = d * (float)q1 + m;
                } else {
                    out[j] = d * (float)(q0 - 16);
                    out[j + 16] = d * (float)(q1 - 16);
                }
            }
            b += has_m ? 24 : 22;
        }
        break;
    case 8: /* Q8_0 */
        for (int64_t i = 0; i < k; i += 32, b += 34, out += 32) {
            float d = half_to_float(b);
            for (int j = 0; j < 32; j++) out[j] = (float)(int8_t)b[2 + j] * d;
        }
        break;
    case 12: /* Q4_K */
    case 13: /* Q5_K */
        for (int64_t i = 0; i < k; i += 256, out += 256) {
            int five = qtype == 13;
            float d = half_to_float(b), dmin = half_to_float(b + 2);
            const uint8_t *sc = b + 4, *qh = b + 16, *qs = b + 16 + (five ? 32 : 0);
            for (int j = 0; j < 8; j++) {
                int s, mn;
                k_scale_min(sc, j, &s, &mn);
                float ds = d * (float)s, dm = dmin * (float)mn;
                for (int l = 0; l < 32; l++) {
                    int q = (qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 15;
                    if (five) q |= ((qh[l] >> j) & 1) << 4;
                    out[32 * j + l] = ds * (float)q - dm;
                }
            }
            b += five ? 176 : 144;
        }
        break;
    case 14: /* Q6_K */
        for (int64_t i = 0; i < k; i += 256, b += 210, out += 256) {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            float d = half_to_float(b + 208);
            for (int e = 0; e < 256; e++) {
                int h = e / 128, r = e % 128;
                int lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 15;
                int hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
                out[e] = (d * (float)sc[e / 16]) * (float)((lo | hi << 4) - 32);
            }
        }
        break;
    }
}

struct rows_args {
    const uint8_t *data;
    const int64_t *ids;
    float *out;
    int64_t row_bytes, k;
    int qtype;
};

static void rows_range(const void *a_, int64_t begin, int64_t end) {
    const struct rows_args *a = a_;
    for (int64_t t = begin; t < end; t++)
        dequant_row(a->qtype, a->data + a->ids[t] * a->row_bytes, a->k, a->out + t * a->k);
}

/* out[T, K] = dequantised rows ids[0:T] of the raw GGUF matrix data [N, row_bytes]. */
void rs_gguf_dequant_rows(int qtype, const uint8_t *data, int64_t row_bytes, const int64_t *ids,
                          int64_t t, int64_t k, float *out) {
    struct rows_args a = {data, ids, out, row_bytes, k, qtype};
    parallel_for(rows_range, &a, t, 16);
}

/* ---------------------------------------------------------------- packing (at load) */
/* The prepared layout (top of file) from raw GGUF rows, byte for byte what gguf.py's numpy
 * reference (_unpack, _pack) builds: each row is first decoded to q (the 4/5-bit values, or
 * int8 for I8) and per-group s, o, with the same float32 operations as the reference (s, o
 * are single products of exact floats), then scattered into its panel. */
static int gguf_format(int qtype, int *fmt, int64_t *gs) {
    switch (qtype) {
    case 2: case 3: case 12: *fmt = FMT_U4; *gs = 32; return 0;  /* Q4_0, Q4_1, Q4_K */
    case 6: case 7: case 13: *fmt = FMT_U5; *gs = 32; return 0;  /* Q5_0, Q5_1, Q5_K */
    case 8: *fmt = FMT_I8; *gs = 32; return 0;                   /* Q8_0 */
    case 14: *fmt = FMT_I8; *gs = 16; return 0;                  /* Q6_K */
    default: return -1;
    }
}

/* NB (16 or 32) bytes of packed nibbles -> q[0:NB] the low nibbles, q[NB:2 NB] the high ones */
static inline __attribute__((always_inline)) void split_nibbles(const uint8_t *qs, int nb, uint8_t *q) {
    uint64_t x[4], lo[4], hi[4];
    memcpy(x, qs, nb);
    for (int i = 0; i < nb / 8; i++) {
        lo[i] = x[i] & 0x0F0F0F0F0F0F0F0Full;
        hi[i] = x[i] >> 4 & 0x0F0F0F0F0F0F0F0Full;
    }
    memcpy(q, lo, nb);
    memcpy(q + nb, hi, nb);
}

/* One raw row of k weights -> q[k], s[k / gs], o[k / gs] (o untouched for I8). */
static void unpack_row(int qtype, const uint8_t *b, int64_t k, uint8_t *q, float *s, float *o) {
    switch (qtype) {
    case 2: /* Q4_0 */
        for (int64_t i = 0; i < k; i += 32, b += 18, q += 32, s++, o++) {
            float d = half_to_float(b);
            *s = d;
            *o = d * -8.0f;
            split_nibbles(b + 2, 16, q);
        }
        break;
    case 3: /* Q4_1 */
        for (int64_t i = 0; i < k; i += 32, b += 20, q += 32, s++, o++) {
            *s = half_to_float(b);
            *o = half_to_float(b + 2);
            split_nibbles(b + 4, 16, q);
        }
        break;
    case 6: /* Q5_0 */
    case 7: /* Q5_1 */
        for (int64_t i = 0; i < k; i += 32, q += 32, s++, o++) {
            int has_m = qtype == 7;
            float d = half_to_float(b);
            const uint8_t *qhp = b + 2 + 2 * has_m, *qs = qhp + 4;
            uint32_t qh = (uint32_t)qhp[0] | (uint32_t)qhp[1] << 8 | (uint32_t)qhp[2] << 16 |
                          (uint32_t)qhp[3] << 24;
            *s = d;
            *o = has_m ? half_to_float(b + 2) : d * -16.0f;
            split_nibbles(qs, 16, q);
            for (int j = 0; j < 32; j++) q[j] |= (uint8_t)(((qh >> j) & 1) << 4);
            b += has_m ? 24 : 22;
        }
        break;
    case 8: /* Q8_0 */
        for (int64_t i = 0; i < k; i += 32, b += 34, q += 32, s++) {
            *s = half_to_float(b);
            memcpy(q, b + 2, 32);
        }
        break;
    case 12: /* Q4_K */
    case 13: /* Q5_K */
        for (int64_t i = 0; i < k; i += 256) {
            int five = qtype == 13;
            float d = half_to_float(b), dmin = half_to_float(b + 2);
            const uint8_t *sc = b + 4, *qh = b + 16, *qs = b + 16 + (five ? 32 : 0);
            for (int i = 0; i < 4; i++) split_nibbles(qs + 32 * i, 32, q + 64 * i); /* groups 2i, 2i + 1 */
            for (int j = 0; j < 8; j++, q += 32, s++, o++) {
                int sv, mn;
                k_scale_min(sc, j, &sv, &mn);
                *s = d * (float)sv;
                *o = -(dmin * (float)mn);
                if (five)
                    for (int l = 0; l < 32; l++) q[l] |= (uint8_t)(((qh[l] >> j) & 1) << 4);
            }
            b += five ? 176 : 144;
        }
        break;
    case 14: /* Q6_K */
        for (int64_t i = 0; i < k; i += 256, b += 210, q += 256) {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            float d = half_to_float(b + 208);
            for (int g = 0; g < 16; g++) *s++ = d * (float)sc[g];
            for (int e = 0; e < 256; e++) {
                int h = e / 128, r = e % 128;
                int lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 15;
                int hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
                q[e] = (uint8_t)(int8_t)((lo | hi << 4) - 32);
            }
        }
        break;
    }
}

struct pack_args {
    const uint8_t *raw;
    uint8_t *out;
    int64_t row_bytes, n, k, gs, panel_bytes;
    int qtype, fmt;
};

/* 8 bytes (little-endian in x), each < 16 -> one uint32 with byte j as nibble j */
static inline uint32_t nibbles8(uint64_t x) {
    x = (x | x >> 4) & 0x00FF00FF00FF00FFull;
    x = (x | x >> 8) & 0x0000FFFF0000FFFFull;
    return (uint32_t)(x | x >> 16);
}

static void pack_range(const void *a_, int64_t begin, int64_t end) {
    const struct pack_args *a = a_;
    int64_t k = a->k, gs = a->gs, groups = k / gs, gb = group_bytes(a->fmt, gs);
    /* decoded rows: q [K] (+ 8 bytes of slack), s and o [G]; I8 decodes a whole panel of
     * rows first ([NR][K], transposed k by k), the others one row at a time */
    int64_t qrows = a->fmt == FMT_I8 ? NR : 1;
    uint8_t *q = malloc(qrows * k + 8 + 2 * qrows * groups * sizeof(float));
    if (!q) abort();
    float *s = (float *)(q + qrows * k + 8), *o = s + qrows * groups;
    /* U5: one shift per half-chunk u = 2c + (j >= 4) takes a chunk's fifth bits, gathered
     * at bit 4j, to u5_high's positions 4 (j % 4) + 4 + U5_SHIFT[u] */
    int u5_sh[8];
    for (int u = 0; u < 8; u++) u5_sh[u] = 4 + U5_SHIFT[u];
    for (int64_t p = begin; p < end; p++) {
        int64_t rows = a->n - p * NR < NR ? a->n - p * NR : NR;
        uint8_t *panel = a->out + p * a->panel_bytes;
        if (a->fmt == FMT_I8) {
            if (rows < NR) /* rows past N: zeros */
                memset(q, 0, qrows * k + 8 + 2 * qrows * groups * sizeof(float));
            for (int64_t r = 0; r < rows; r++)
                unpack_row(a->qtype, a->raw + (p * NR + r) * a->row_bytes, k, q + r * k, s + r * groups, o);
            uint8_t *pw = panel;
            for (int64_t g = 0; g < groups; g++, pw += gb) {
                for (int r = 0; r < NR; r++) memcpy(pw + r * 4, s + r * groups + g, 4);
                for (int64_t kk = 0; kk < gs; kk++) {
                    uint8_t col[NR];
                    for (int r = 0; r < NR; r++) col[r] = q[r * k + g * gs + kk];
                    memcpy(pw + NR * 4 + kk * NR, col, NR);
                }
            }
            continue;
        }
        if (rows < NR) memset(panel, 0, a->panel_bytes); /* rows past N: zeros */
        /* row by row, each scattered into the panel (a few KiB: it stays in L1) */
        for (int64_t r = 0; r < rows; r++) {
            unpack_row(a->qtype, a->raw + (p * NR + r) * a->row_bytes, k, q, s, o);
            uint8_t *pw = panel;
            for (int64_t g = 0; g < groups; g++, pw += gb) {
                const uint8_t *qg = q + g * gs;
                memcpy(pw + r * 4, s + g, 4);
                memcpy(pw + (NR + r) * 4, o + g, 4);
                uint8_t *words = pw + 2 * NR * 4;
                uint32_t hi = 0;
                for (int64_t c = 0; c < gs / 8; c++) {
                    uint64_t x;
                    memcpy(&x, qg + 8 * c, 8);
                    uint32_t w = nibbles8(x & 0x0F0F0F0F0F0F0F0Full);
                    memcpy(words + (c * NR + r) * 4, &w, 4);
                    if (a->fmt == FMT_U5) {
                        uint32_t h = nibbles8((x >> 4) & 0x0101010101010101ull); /* bit 4j */
                        hi |= (h & 0xFFFF) << u5_sh[2 * c] | (h >> 16) << u5_sh[2 * c + 1];
                    }
                }
                if (a->fmt == FMT_U5) memcpy(words + (gs / 8 * NR + r) * 4, &hi, 4);
            }
        }
    }
    free(q);
}

/* out[ceil(N / NR) * rs_gguf_panel_bytes] = raw GGUF rows [N, row_bytes] of type qtype (K
 * weights each) in the prepared layout; returns the format (FMT_*), or -1 for a type without
 * a kernel (nothing written). Threaded over panels. */
int rs_gguf_pack(int qtype, const uint8_t *raw, int64_t row_bytes, int64_t n, int64_t k, uint8_t *out) {
    int fmt;
    int64_t gs;
    if (gguf_format(qtype, &fmt, &gs)) return -1;
    struct pack_args a = {raw, out, row_bytes, n, k, gs, k / gs * group_bytes(fmt, gs), qtype, fmt};
    int64_t panels = (n + NR - 1) / NR;
    /* ~2 MiB of output per work item: a layer's matrices (a few MiB at most in small models)
     * pack on the calling thread (an OpenMP region costs more than that on a busy machine) */
    int64_t chunk = ((int64_t)2 << 20) / (a.panel_bytes ? a.panel_bytes : 1);
    parallel_for(pack_range, &a, panels, chunk < 1 ? 1 : chunk);
    return fmt;
}
