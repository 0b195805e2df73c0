/* Kernel tapes: replaying a recorded decode step without Python (radixserve.kernels.tape).
 *
 * A tape is an int64 array of ``n`` rows of ``width`` values: the address of a kernel's tape
 * twin (``<kernel>_tape``, see RS_TAPE_P in cpu_common.h), then that call's arguments. The
 * runner calls each row's twin in order on the calling thread; each kernel opens its own
 * OpenMP region as it does when Python calls it, so a replay computes exactly what the
 * recorded calls computed. Plugins give their own kernels twins the same way. */
#include "cpu_common.h"

typedef void (*rs_tape_entry)(const int64_t *args);

void rs_tape_run(const int64_t *rows, int64_t n, int64_t width) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t *row = rows + i * width;
        ((rs_tape_entry)(intptr_t)row[0])(row + 1);
    }
}

/* the core kernels a decode step calls (defined in the other sources of this library) */
void rs_linear(const float *x, int64_t m, int64_t k, const float *packed, const float *bias, int64_t n, float *y);
void rs_rmsnorm(const float *x, float *residual, const float *w, float eps, int64_t m, int64_t d, float *out);
void rs_silu_mul(const float *gu, int64_t m, int64_t inter, float *out);
void rs_rope(float *x, int64_t m, int64_t stride, int64_t heads, int64_t head_dim, const float *cos_t,
             const float *sin_t, const int64_t *pos);
void rs_gguf_linear(int fmt, int64_t gs, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m,
                    const float *bias, float *y);
void rs_gguf_dequant_rows(int qtype, const uint8_t *data, int64_t row_bytes, const int64_t *ids, int64_t t,
                          int64_t k, float *out);
void rs_woq_int8_linear(const float *x, int64_t m, int64_t k, const int8_t *q, const float *scales,
                        const float *bias, int64_t n, float *y);
void rs_woq_int4_linear(const float *x, int64_t m, int64_t k, const uint8_t *q, const float *scales,
                        const float *mins, int64_t group, const float *bias, int64_t n, float *y);
void rs_woq_bf16_linear(const float *x, int64_t m, int64_t k, const uint16_t *q, const float *bias, int64_t n,
                        float *y);
void rs_woq_f16_linear(const float *x, int64_t m, int64_t k, const uint16_t *q, const float *bias, int64_t n,
                       float *y);

void rs_gather_rows(const uint8_t *table, int64_t row_bytes, int64_t n_rows, const int64_t *ids, int64_t t,
                    uint8_t *out);

void rs_gather_rows_tape(const int64_t *a) {
    rs_gather_rows(RS_TAPE_P(0), RS_TAPE_I(1), RS_TAPE_I(2), RS_TAPE_P(3), RS_TAPE_I(4), RS_TAPE_P(5));
}

void rs_head_rmsnorm(float *x, int64_t m, int64_t stride, int64_t heads, int64_t head_dim, const float *w,
                     float eps);

void rs_head_rmsnorm_tape(const int64_t *a) {
    rs_head_rmsnorm(RS_TAPE_P(0), RS_TAPE_I(1), RS_TAPE_I(2), RS_TAPE_I(3), RS_TAPE_I(4), RS_TAPE_P(5),
                    RS_TAPE_F(6));
}

void rs_half_rows(int fmt, const uint16_t *q, int64_t n, int64_t k, int64_t panels, const int64_t *ids, int64_t t,
                  float *out);

void rs_half_rows_tape(const int64_t *a) {
    rs_half_rows((int)RS_TAPE_I(0), RS_TAPE_P(1), RS_TAPE_I(2), RS_TAPE_I(3), RS_TAPE_I(4), RS_TAPE_P(5),
                 RS_TAPE_I(6), RS_TAPE_P(7));
}

void rs_linear_tape(const int64_t *a) {
    rs_linear(RS_TAPE_P(0), RS_TAPE_I(1), RS_TAPE_I(2), RS_TAPE_P(3), RS_TAPE_P(4), RS_TAPE_I(5), RS_TAPE_P(6));
}

void rs_rmsnorm_tape(const int64_t *a) {
    rs_rmsnorm(RS_TAPE_P(0), RS_TAPE_P(1), RS_TAPE_P(2), RS_TAPE_F(3), RS_TAPE_I(4), RS_TAPE_I(5), RS_TAPE_P(6));
}

void rs_silu_mul_tape(const int64_t *a) { rs_silu_mul(RS_TAPE_P(0), RS_TAPE_I(1), RS_TAPE_I(2), RS_TAPE_P(3)); }

void rs_rope_tape(const int64_t *a) {
    rs_rope(RS_TAPE_P(0), RS_TAPE_I(1), RS_TAPE_I(2), RS_TAPE_I(3), RS_TAPE_I(4), RS_TAPE_P(5), RS_TAPE_P(6),
            RS_TAPE_P(7));
}

void rs_gguf_linear_tape(const int64_t *a) {
    rs_gguf_linear((int)RS_TAPE_I(0), RS_TAPE_I(1), RS_TAPE_P(2), RS_TAPE_I(3), RS_TAPE_I(4), RS_TAPE_P(5),
                   RS_TAPE_I(6), RS_TAPE_P(7), RS_TAPE_P(8));
}

void rs_gguf_dequant_rows_tape(const int64_t *a) {
    rs_gguf_dequant_rows((int)RS_TAPE_I(0), RS_TAPE_P(1), RS_TAPE_I(2), RS_TAPE_P(3), RS_TAPE_I(4), RS_TAPE_I(5),
                         RS_TAPE_P(6));
}

void rs_woq_int8_linear_tape(const int64_t *a) {
    rs_woq_int8_linear(RS_TAPE_P(0), RS_TAPE_I(1), RS_TAPE_I(2), RS_TAPE_P(3), RS_TAPE_P(4), RS_TAPE_P(5),
                       RS_TAPE_I(6), RS_TAPE_P(7));
}

void rs_woq_int4_linear_tape(const int64_t *a) {
    rs_woq_int4_linear(RS_TAPE_P(0), RS_TAPE_I(1), RS_TAPE_I(2), RS_TAPE_P(3), RS_TAPE_P(4), RS_TAPE_P(5),
                       RS_TAPE_I(6), RS_TAPE_P(7), RS_TAPE_I(8), RS_TAPE_P(9));
}

void rs_woq_bf16_linear_tape(const int64_t *a) {
    rs_woq_bf16_linear(RS_TAPE_P(0), RS_TAPE_I(1), RS_TAPE_I(2), RS_TAPE_P(3), RS_TAPE_P(4), RS_TAPE_I(5),
                       RS_TAPE_P(6));
}

void rs_woq_f16_linear_tape(const int64_t *a) {
    rs_woq_f16_linear(RS_TAPE_P(0), RS_TAPE_I(1), RS_TAPE_I(2), RS_TAPE_P(3), RS_TAPE_P(4), RS_TAPE_I(5),
                      RS_TAPE_P(6));
}
