/* Shared by radixserve's CPU kernel sources (cpu_kernels.c and the quantized linear kernels)
 * and by the plugins that build kernels of their own against it (the torch_native attention
 * backend's decode attention, the torch_native MoE runner's grouped linear): the vector width
 * of the machine, the panel layout's sizes, the OpenMP work splitter, the register-tiled
 * panel product and a vectorised exp. Everything here is static: each source gets its own copy. */
#pragma once
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#define MR 8
#elif defined(__AVX__)
#define VW 8
#define MR 6
#else
#define VW 4
#define MR 4
#endif
#define NR (2 * VW)

typedef float vf __attribute__((vector_size(VW * 4), aligned(4), may_alias));

#if defined(__AVX__)
#include <immintrin.h>
#endif
/* One float as a whole vector: a broadcast load (a load-port uop only on AVX2/AVX-512) */
static inline __attribute__((always_inline)) vf bcast(const float *p) {
#if VW == 16 && defined(__AVX512F__)
    return (vf)_mm512_set1_ps(*p);
#elif VW == 8 && defined(__AVX__)
    return (vf)_mm256_broadcast_ss(p);
#else
    float s = *p;
    return (vf){s, s, s, s};
#endif
}


/* ------------------------------------------------------------------ threads */
typedef void (*task_fn)(const void *args, int64_t begin, int64_t end);

/* fn(args, begin, end) over [0, n) in chunks of `chunk` items, on OpenMP's threads. */
static void parallel_for(task_fn fn, const void *args, int64_t n, int64_t chunk) {
    if (n <= chunk) {
        if (n > 0) fn(args, 0, n);
        return;
    }
    int64_t chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t b = c * chunk, e = b + chunk < n ? b + chunk : n;
        fn(args, b, e);
    }
}

/* y[m0:m0+rows, p*NR : p*NR+NR] = x[m0:m0+rows] @ panel (+ bias), rows <= MR. */
static inline __attribute__((always_inline)) void tile(
    int rows, const float *x, int64_t k, const float *panel, const float *bias,
    float *y, int64_t n, int64_t col0) {
    vf acc0[MR], acc1[MR];
    for (int r = 0; r < rows; r++) {
        acc0[r] = (vf){0};
        acc1[r] = (vf){0};
    }
    for (int64_t kk = 0; kk < k; kk++) {
        vf w0 = *(const vf *)(panel + kk * NR);
        vf w1 = *(const vf *)(panel + kk * NR + VW);
#if defined(__x86_64__)
        /* in registers: with few rows the compiler would fold the loads into every FMA, and
         * the reloads made a 4-row tile slower than a 5-row one (load-bound) */
        __asm__("" : "+v"(w0), "+v"(w1));
#endif
        for (int r = 0; r < rows; r++) {
            float b = x[r * k + kk];
            acc0[r] += b * w0;
            acc1[r] += b * w1;
        }
    }
    int64_t width = n - col0 < NR ? n - col0 : NR;
    for (int r = 0; r < rows; r++) {
        float tmp[NR];
        *(vf *)tmp = acc0[r];
        *(vf *)(tmp + VW) = acc1[r];
        if (bias)
            for (int64_t j = 0; j < width; j++) tmp[j] += bias[col0 + j];
        memcpy(y + r * n + col0, tmp, width * sizeof(float));
    }
}

static void tile_rows(int rows, const float *x, int64_t k, const float *panel, const float *bias,
                      float *y, int64_t n, int64_t col0) {
    switch (rows) { /* constant row counts let the compiler keep accumulators in registers */
#define CASE(R) case R: tile(R, x, k, panel, bias, y, n, col0); break;
        CASE(1) CASE(2) CASE(3) CASE(4)
#if MR > 4
        CASE(5) CASE(6)
#endif
#if MR > 6
        CASE(7) CASE(8)
#endif
#undef CASE
    }
}

/* y[m0:m1, p*NR : p*NR+NR] = x[m0:m1] @ panel (+ bias): the rows in ceil((m1-m0)/MR) tiles of
 * as even a size as possible (16 rows as 6+5+5, not 6+6+4: a tile of few rows costs nearly
 * as much as a full one). */
static void tile_block(int64_t m0, int64_t m1, const float *x, int64_t k, const float *panel,
                       const float *bias, float *y, int64_t n, int64_t col0) {
    int64_t total = m1 - m0, tiles = (total + MR - 1) / MR;
    for (int64_t t = 0, r0 = m0; t < tiles; t++) {
        int rows = (int)(total / tiles + (t < total % tiles));
        tile_rows(rows, x + r0 * k, k, panel, bias, y + r0 * n, n, col0);
        r0 += rows;
    }
}

/* Rows of x per block of the panel products (a block of x stays in L2 while panels stream). */
#define MB 64

/* Rows per work item for the element-wise kernels: at least ELEMWISE_MIN_WORK values each, so
 * a decode step's few rows (microseconds of work) stay on the calling thread. An OpenMP
 * region costs a few microseconds even when its threads spin, and far more when the machine
 * is busier than its cores: a descheduled worker holds the end-of-region barrier for a time
 * slice (measured: a 32-row RMSNorm at 1.3 ms with 2 threads under load, ~5 us on one). */
#define ELEMWISE_MIN_WORK 65536
static inline int64_t rows_per_task(int64_t m, int64_t work_per_row) {
    int64_t rows = ELEMWISE_MIN_WORK / (work_per_row > 0 ? work_per_row : 1);
    return rows < 1 ? 1 : (rows > m && m > 0 ? m : rows);
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

/* Kernel tapes (radixserve.kernels.tape): a kernel that a captured decode step may call has a
 * twin ``<name>_tape(const int64_t *a)`` taking its arguments as one int64 array, in order:
 * pointers and integers as they are, floats as the bits of a double (RS_TAPE_F). The tape
 * runner calls the twins one after another without going back to Python. */
#define RS_TAPE_P(i) ((void *)(intptr_t)a[i])
#define RS_TAPE_I(i) (a[i])
#define RS_TAPE_F(i) rs_tape_float(a[i])
static inline __attribute__((unused)) float rs_tape_float(int64_t bits) {
    double d;
    memcpy(&d, &bits, sizeof d);
    return (float)d;
}
