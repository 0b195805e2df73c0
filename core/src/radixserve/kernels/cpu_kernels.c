/* radixserve CPU kernels (float32): linear layers over panel-packed weights, and the
 * small fused element-wise steps of a decoder layer (residual add + RMSNorm, SiLU * mul,
 * RoPE).
 *
 * Built once per machine by radixserve/kernels/cpu.py (cc -O3 -march=native) and called
 * through ctypes with raw pointers; every tensor is contiguous float32 unless stated.
 *
 * Threads: a small pool of its own (rs_set_threads), not OpenMP. An OpenMP parallel region
 * ends in a barrier that waits for every thread of the team, so on a busy 2-core machine
 * one descheduled worker stalls every call for a scheduler time slice (a 17 ms batch-1 step
 * took 100+ ms under load). Here the caller and the helpers claim chunks of work from one
 * atomic counter and the caller waits only for chunks a helper has actually claimed: when a
 * helper is not running, the caller simply does all the work.
 *
 * Packed weight layout: the [N, K] weight is cut into panels of NR output columns
 * (NR = two native vectors); panel p holds W[p*NR + j, k] at [p][k][j], zero-padded past
 * N. A panel is one sequential stream, so batch-1 decode reads weights at streaming
 * bandwidth; for larger batches a panel stays in L2 while MR rows of x at a time are
 * multiplied against it, MR*2 vector accumulators held in registers.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

int rs_panel_width(void) { return NR; }
int rs_max_rows(void) { return MR; }

/* ------------------------------------------------------------------ thread pool */
typedef void (*task_fn)(const void *args, int64_t begin, int64_t end);

#define MAX_HELPERS 63
#define SPIN_NS 50000 /* a helper spins this long for the next job, then sleeps */
#define STALL_NS 300000 /* a wait this long for a helper means it was descheduled ... */
#define SOLO_NS 20000000 /* ... so the caller works alone this long before trying again */

static struct {
    _Atomic uint64_t next;   /* (generation << 32) | first unclaimed item of the current job */
    _Atomic int64_t done;    /* items finished in the current job */
    _Atomic uint32_t wake;   /* futex word, bumped on every new job */
    _Atomic int sleepers;
    _Atomic(task_fn) fn;     /* the current job: written before its generation is published */
    _Atomic(const void *) args;
    _Atomic int64_t n, chunk;
    int helpers;
    int64_t solo_until;      /* now_ns() before which jobs run on the caller alone */
    pthread_mutex_t lock;    /* serialises callers (jobs are one at a time) and set_threads */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Claim and run chunks of job `gen` until none is left (or the job changed). A claim is a
 * compare-and-swap that also checks the generation, so a late helper never touches a newer
 * job with an older job's parameters. */
static void work(uint32_t gen) {
    for (;;) {
        uint64_t v = atomic_load_explicit(&pool.next, memory_order_acquire);
        if ((uint32_t)(v >> 32) != gen) return;
        int64_t n = atomic_load_explicit(&pool.n, memory_order_relaxed);
        int64_t chunk = atomic_load_explicit(&pool.chunk, memory_order_relaxed);
        task_fn fn = atomic_load_explicit(&pool.fn, memory_order_relaxed);
        const void *args = atomic_load_explicit(&pool.args, memory_order_relaxed);
        int64_t i = (int64_t)(v & 0xffffffffu);
        if (i >= n) return;
        int64_t e = i + chunk < n ? i + chunk : n;
        if (!atomic_compare_exchange_weak_explicit(&pool.next, &v, ((uint64_t)gen << 32) | (uint64_t)e,
                                                   memory_order_acq_rel, memory_order_relaxed))
            continue;
        fn(args, i, e);
        atomic_fetch_add_explicit(&pool.done, e - i, memory_order_release);
    }
}

static void *helper_main(void *unused) {
    (void)unused;
    uint32_t seen = (uint32_t)(atomic_load(&pool.next) >> 32);
    for (;;) {
        int64_t start = now_ns();
        int spins = 0;
        for (;;) {
            uint32_t gen = (uint32_t)(atomic_load_explicit(&pool.next, memory_order_acquire) >> 32);
            if (gen != seen) {
                seen = gen;
                work(gen);
                start = now_ns();
                continue;
            }
            cpu_relax();
            if (++spins % 256 == 0 && now_ns() - start > SPIN_NS) break;
        }
        uint32_t w = atomic_load(&pool.wake);
        atomic_fetch_add(&pool.sleepers, 1);
        if ((uint32_t)(atomic_load(&pool.next) >> 32) == seen) {
#if defined(__linux__)
            syscall(SYS_futex, (uint32_t *)&pool.wake, FUTEX_WAIT_PRIVATE, w, NULL, NULL, 0);
#else
            struct timespec ts = {0, 50000};
            nanosleep(&ts, NULL);
#endif
        }
        atomic_fetch_sub(&pool.sleepers, 1);
    }
    return NULL;
}

/* Use `threads` threads in all (the caller plus threads - 1 helpers); helpers are only ever
 * added. Returns the number of threads now in use. */
int rs_set_threads(int threads) {
    pthread_mutex_lock(&pool.lock);
    while (pool.helpers < threads - 1 && pool.helpers < MAX_HELPERS) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, helper_main, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pool.helpers++;
    }
    int total = pool.helpers + 1;
    pthread_mutex_unlock(&pool.lock);
    return total;
}

/* fn(args, begin, end) over [0, n) in chunks, on the caller and the helpers. */
static void parallel_for(task_fn fn, const void *args, int64_t n, int64_t chunk) {
    if (n <= 0) return;
    if (pool.helpers == 0 || n <= chunk || (pool.solo_until && now_ns() < pool.solo_until)) {
        fn(args, 0, n);
        return;
    }
    pthread_mutex_lock(&pool.lock);
    uint32_t gen = (uint32_t)(atomic_load(&pool.next) >> 32) + 1;
    atomic_store_explicit(&pool.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&pool.args, args, memory_order_relaxed);
    atomic_store_explicit(&pool.n, n, memory_order_relaxed);
    atomic_store_explicit(&pool.chunk, chunk, memory_order_relaxed);
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.next, (uint64_t)gen << 32, memory_order_release);
    atomic_fetch_add(&pool.wake, 1);
#if defined(__linux__)
    if (atomic_load(&pool.sleepers) > 0)
        syscall(SYS_futex, (uint32_t *)&pool.wake, FUTEX_WAKE_PRIVATE, MAX_HELPERS, NULL, NULL, 0);
#endif
    work(gen);
    /* only chunks a helper claimed and has not finished are left: wait for those. On a
     * machine busier than its cores a helper holding a chunk can be descheduled for a whole
     * time slice; after such a stall the caller works alone for a while. */
    int64_t wait_start = 0;
    pool.solo_until = 0;
    for (int spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < n; spins++) {
        cpu_relax();
        if (spins % 1024 == 1023) {
            int64_t t = now_ns();
            if (!wait_start) wait_start = t;
            else if (t - wait_start > STALL_NS) pool.solo_until = t + SOLO_NS;
            sched_yield();
        }
    }
    pthread_mutex_unlock(&pool.lock);
}

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
