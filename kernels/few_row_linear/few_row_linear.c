/* y [rows, out] = x [rows, in] @ w [out, in]^T (+ bias [out]) for the few rows of a decoding step
 * (1 to 16): no packing of w, which a general matrix product copies on every call, and each vector
 * of w loaded once per block of rows, which a vector-matrix product per row loads once per row.
 * A block is OUTS outputs by up to MAX_ROWS rows of accumulators in registers; threads take
 * contiguous ranges of outputs. Built by kernels/native.py. */

#include "native.h"

#define OUTS 4 /* weight rows a block reads together: each x vector loaded serves OUTS of them */
#if VEC_REGS >= 32
#define MAX_ROWS 6 /* OUTS * MAX_ROWS accumulators, OUTS weight vectors and one x vector: 29 of 32 registers */
#else
#define MAX_ROWS 2 /* the same in 16: 13 */
#endif

typedef struct {
    const float *x, *w, *bias;
    float *y;
    int64_t rows, in, out;
} Problem;

INLINE float lane_sum(vec v) {
    float s = 0.0f;
    for (int l = 0; l < VEC; l++) s += v[l];
    return s;
}

/* y[r0 .. r0 + R, o0 .. o0 + OUTS): R is a constant where this is inlined, so the accumulators stay
 * in registers. Past the last output the last weight row is read again and its sums dropped. */
INLINE void block(const Problem *p, int64_t o0, int64_t r0, const int R) {
    const int64_t in = p->in;
    const float *w[OUTS];
    for (int j = 0; j < OUTS; j++) w[j] = p->w + (o0 + j < p->out ? o0 + j : p->out - 1) * in;
    const float *x = p->x + r0 * in;
    vec acc[OUTS][MAX_ROWS];
    for (int j = 0; j < OUTS; j++)
        for (int r = 0; r < R; r++) acc[j][r] = (vec){0};
    int64_t i = 0;
    for (; i + VEC <= in; i += VEC) {
        vec wv[OUTS];
        for (int j = 0; j < OUTS; j++) wv[j] = *(const vec *)(w[j] + i);
        for (int r = 0; r < R; r++) {
            const vec xv = *(const vec *)(x + r * in + i);
            for (int j = 0; j < OUTS; j++) acc[j][r] += wv[j] * xv;
        }
    }
    for (int j = 0; j < OUTS && o0 + j < p->out; j++)
        for (int r = 0; r < R; r++) {
            float s = lane_sum(acc[j][r]);
            for (int64_t k = i; k < in; k++) s += w[j][k] * x[r * in + k]; /* in not a multiple of VEC */
            p->y[(r0 + r) * p->out + o0 + j] = s + (p->bias ? p->bias[o0 + j] : 0.0f);
        }
}

static void *outputs(void *arg) {
    Work *work = arg;
    const Problem *p = work->problem;
    for (int64_t g = work->first; g < work->last; g += work->step)
        for (int64_t r0 = 0; r0 < p->rows; r0 += MAX_ROWS) {
            const int64_t left = p->rows - r0;
            switch (left < MAX_ROWS ? left : MAX_ROWS) { /* one inlined block per row count */
            case 1: block(p, g * OUTS, r0, 1); break;
            case 2: block(p, g * OUTS, r0, 2); break;
#if MAX_ROWS >= 6
            case 3: block(p, g * OUTS, r0, 3); break;
            case 4: block(p, g * OUTS, r0, 4); break;
            case 5: block(p, g * OUTS, r0, 5); break;
            case 6: block(p, g * OUTS, r0, 6); break;
#endif
            }
        }
    return NULL;
}

/* x, w, y contiguous fp32; bias fp32 or NULL. `unused`: native.py's common signature. */
int few_row_linear(const float *x, const float *w, const float *bias, float *y, int64_t rows, int64_t in, int64_t out,
                   float unused, int threads) {
    (void)unused;
    Problem p = {x, w, bias, y, rows, in, out};
    return run_rows(&p, (out + OUTS - 1) / OUTS, threads, 0, outputs);
}
