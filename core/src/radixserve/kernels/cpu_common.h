/* Shared by radixserve's CPU kernel sources (cpu_kernels.c and the quantized linear kernels):
 * the vector width of the machine, the panel layout's sizes, the OpenMP work splitter and the
 * register-tiled panel product. Everything here is static: each source gets its own copy. */
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
