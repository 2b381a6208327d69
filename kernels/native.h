/* What the project's C kernels share: vector types, a vectorisable exp, dot products of one query
 * with keys stored in transposed tiles, and a split of rows over threads: PyTorch's own OpenMP
 * threads where kernels/native.py builds with -fopenmp (only when that links to the libgomp
 * PyTorch has loaded), POSIX threads otherwise. Built by kernels/native.py. */

#ifndef KERNELS_NATIVE_H
#define KERNELS_NATIVE_H

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16     /* keys per transposed tile: one AVX-512 register of fp32, two AVX2 ones */
#define MAX_DIM 256 /* widest head kept in registers */
#define INLINE static inline __attribute__((always_inline))

/* VEC: fp32 lanes of one vector register of the ISA this file is built for (-march, see
 * kernels/native.py). A generic vector wider than the hardware's is "expanded piecewise" by GCC,
 * through memory: 16-float vectors on an AVX2-only CPU made selection.c's pass ~10x slower than
 * PyTorch's SDPA forward on the same problem (AMD EPYC Zen 3). So `vec` is one register, and the
 * register-blocked loops take their widths from VEC and VEC_REGS. */
#if defined(__AVX512F__)
#define VEC 16
#define VEC_REGS 32
#elif defined(__AVX__)
#define VEC 8
#define VEC_REGS 16
#else /* SSE2, NEON: 128-bit */
#define VEC 4
#define VEC_REGS 16
#endif
#define VEC_PER_TILE (TILE / VEC)

/* VEC floats, loaded and stored unaligned: one vector register of this build */
typedef float vec __attribute__((vector_size(4 * VEC), aligned(4)));

/* A thread's scratch on whole cache lines (free() releases it): with malloc's 16-byte alignment
 * every other vector of a row crossed a line, and selection.c's backward ran ~10% slower at 32k
 * tokens (AMD EPYC Zen 3, AVX2). NULL where the memory is not there. */
INLINE void *line_aligned(size_t bytes) {
    void *buffer = NULL;
    return posix_memalign(&buffer, 64, bytes ? bytes : 64) ? NULL : buffer;
}

/* exp(x) for x <= 0 (scores less their maximum or log-sum-exp) in a form that vectorizes: x = k ln2
 * + r with |r| <= ln2 / 2, e^r by a degree-7 polynomial (Cephes' expf coefficients,
 * ~1 ulp), 2^k by the exponent bits; 0 below fp32's normal range. */
static inline float exp_nonpositive(float x) {
    const float k = rintf(x * 1.44269504f);
    const float r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
    float poly = 1.9875691500e-4f;
    poly = poly * r + 1.3981999507e-3f;
    poly = poly * r + 8.3334519073e-3f;
    poly = poly * r + 4.1665795894e-2f;
    poly = poly * r + 1.6666665459e-1f;
    poly = poly * r + 5.0000001201e-1f;
    const float er = poly * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)k + 127) << 23};
    return x < -87.0f ? 0.0f : er * scale.f;
}

/* x[0..count) <- exp(x - max x), count > 0; returns the log-sum-exp of the original x (the
 * softmax's denominator is exp(lse - max), the sum of the new x, which *total receives). */
INLINE float exp_less_max(float *x, int64_t count, float *total) {
    float top = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : top)
    for (int64_t c = 0; c < count; c++) top = x[c] > top ? x[c] : top;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < count; c++) {
        x[c] = exp_nonpositive(x[c] - top);
        sum += x[c];
    }
    *total = sum;
    return top + logf(sum);
}

/* scores[h][0..hi-lo) = scale * (q[h] . key j) for keys lo..hi-1 and nh = 1 or 2 query heads at once
 * (nh a constant after inlining), from the keys in tiles of TILE keys transposed ([n / TILE, d,
 * TILE]): each key tile is loaded once for both heads, and a tile's TILE scores accumulate in vector
 * registers along d, two partial sums a head, so that two heads fit the registers of AVX2 as well
 * as AVX-512 (four a head measured slower on a Zen 4); every tile is one contiguous run of memory
 * (a plain transpose, [d, n], would put a span's d rows n floats apart, on the same few cache sets). */
INLINE void tile_scores_heads(float *const *scores, const float *const *q, const int nh, const float *tiles,
                              int64_t d, int64_t lo, int64_t hi, float scale) {
    for (int64_t t0 = lo - lo % TILE; t0 < hi; t0 += TILE) {
        const float *tile = tiles + t0 * d;
        float acc[2][2][TILE] = {{{0.0f}}};
        int64_t e = 0;
        for (; e + 2 <= d; e += 2) {
            for (int u = 0; u < 2; u++) {
                for (int h = 0; h < nh; h++) {
                    const float qe = q[h][e + u];
#pragma omp simd
                    for (int l = 0; l < TILE; l++) acc[h][u][l] += qe * tile[(e + u) * TILE + l];
                }
            }
        }
        for (; e < d; e++) {
            for (int h = 0; h < nh; h++) {
#pragma omp simd
                for (int l = 0; l < TILE; l++) acc[h][0][l] += q[h][e] * tile[e * TILE + l];
            }
        }
        const int64_t first = t0 < lo ? lo - t0 : 0, last = t0 + TILE > hi ? hi - t0 : TILE;
        for (int h = 0; h < nh; h++)
            for (int64_t l = first; l < last; l++) scores[h][t0 + l - lo] = scale * (acc[h][0][l] + acc[h][1][l]);
    }
}

/* One thread's share: rows first, first + step, ... below last. */
typedef struct {
    const void *problem;
    int64_t first, last, step;
    int thread;
    int failed; /* set by the body when it could not allocate its scratch */
} Work;

/* Zeroes the key and value gradients dk, dv [threads or 1, bh, n, d] that a thread adds into: its
 * own buffer (all bh batch * kv heads), or with shared_grads the batch * kv heads its rows (m of
 * them each) belong to, which no other thread's rows do. */
INLINE void zero_key_grads(float *dk, float *dv, int64_t bh, int64_t m, int64_t n, int64_t d, int shared_grads,
                           const Work *work) {
    int64_t first = work->thread * bh, count = bh;
    if (shared_grads) {
        if (work->first >= work->last) return;
        first = work->first / m;
        count = (work->last - 1) / m + 1 - first;
    }
    memset(dk + first * n * d, 0, (size_t)count * n * d * sizeof(float));
    memset(dv + first * n * d, 0, (size_t)count * n * d * sizeof(float));
}

/* Runs body over `rows` rows on `threads` threads (the caller's among them); 0 on success.
 * interleave: thread t takes rows t, t + threads, ... (balanced when a row's cost grows with its
 * index); otherwise each thread takes one contiguous range.
 * Why OpenMP where it can be PyTorch's: after each of its operators PyTorch's idle OpenMP workers
 * spin for a while, and threads of our own then share the cores with them: on 2 cores the span
 * kernel ran no faster on 2 threads than on 1. In the same pool, those workers take the rows. */
static int run_rows(const void *problem, int64_t rows, int threads, int interleave, void *(*body)(void *)) {
    if (threads < 1) threads = 1;
    if (threads > 256) threads = 256;
    Work work[256];
    for (int t = 0; t < threads; t++)
        work[t] = interleave ? (Work){problem, t, rows, threads, t, 0}
                             : (Work){problem, rows * t / threads, rows * (t + 1) / threads, 1, t, 0};
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) body(&work[t]);
#else
    pthread_t ids[256];
    int started[256] = {0};
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&ids[t], NULL, body, &work[t]) == 0;
    body(&work[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else body(&work[t]); /* no thread to be had: the caller does that share too */
    }
#endif
    int failed = 0;
    for (int t = 0; t < threads; t++) failed |= work[t].failed;
    return failed;
}

/* y [rows, out] = x [rows, in] @ w [out, in]^T (+ bias [out]) for the few rows of a decoding step
 * (1 to 16): no packing of w, which a general matrix product copies on every call, and each vector
 * of w loaded once per block of rows, which a vector-matrix product per row loads once per row.
 * A block is OUTS outputs by up to MAX_ROWS rows of accumulators in registers; threads take
 * contiguous ranges of outputs (few_row_linear/, dense_decoding/). */
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
} FewRows;

INLINE float lane_sum(vec v) {
    float s = 0.0f;
    for (int l = 0; l < VEC; l++) s += v[l];
    return s;
}

/* y[r0 .. r0 + R, o0 .. o0 + OUTS): R is a constant where this is inlined, so the accumulators stay
 * in registers. Past the last output the last weight row is read again and its sums dropped. */
INLINE void few_rows_block(const FewRows *p, int64_t o0, int64_t r0, const int R) {
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

/* y [1, o0 .. o1): one weight row after another, each read as one stream with four sums in flight.
 * At one row the product streams weights from memory; rows of OUTS read together (four streams
 * interleaved) took 1.1-1.2x as long over decoding's 127 MB of weights (AMD EPYC Zen 4). */
static void one_row(const FewRows *p, int64_t o0, int64_t o1) {
    const int64_t in = p->in;
    for (int64_t o = o0; o < o1; o++) {
        const float *w = p->w + o * in;
        vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        int64_t i = 0;
        for (; i + 4 * VEC <= in; i += 4 * VEC) {
            a0 += *(const vec *)(w + i) * *(const vec *)(p->x + i);
            a1 += *(const vec *)(w + i + VEC) * *(const vec *)(p->x + i + VEC);
            a2 += *(const vec *)(w + i + 2 * VEC) * *(const vec *)(p->x + i + 2 * VEC);
            a3 += *(const vec *)(w + i + 3 * VEC) * *(const vec *)(p->x + i + 3 * VEC);
        }
        float s = lane_sum((a0 + a1) + (a2 + a3));
        for (; i < in; i++) s += w[i] * p->x[i];
        p->y[o] = s + (p->bias ? p->bias[o] : 0.0f);
    }
}

/* a thread's groups of OUTS outputs */
static void *few_rows_outputs(void *arg) {
    Work *work = arg;
    const FewRows *p = work->problem;
    if (p->rows == 1 && work->step == 1) {
        one_row(p, work->first * OUTS, work->last * OUTS < p->out ? work->last * OUTS : p->out);
        return NULL;
    }
    for (int64_t g = work->first; g < work->last; g += work->step)
        for (int64_t r0 = 0; r0 < p->rows; r0 += MAX_ROWS) {
            const int64_t left = p->rows - r0;
            switch (left < MAX_ROWS ? left : MAX_ROWS) { /* one inlined block per row count */
            case 1: few_rows_block(p, g * OUTS, r0, 1); break;
            case 2: few_rows_block(p, g * OUTS, r0, 2); break;
#if MAX_ROWS >= 6
            case 3: few_rows_block(p, g * OUTS, r0, 3); break;
            case 4: few_rows_block(p, g * OUTS, r0, 4); break;
            case 5: few_rows_block(p, g * OUTS, r0, 5); break;
            case 6: few_rows_block(p, g * OUTS, r0, 6); break;
#endif
            }
        }
    return NULL;
}

/* x, w, y contiguous fp32; bias fp32 or NULL; 0 on success */
static int few_rows_product(const float *x, const float *w, const float *bias, float *y, int64_t rows, int64_t in,
                            int64_t out, int threads) {
    FewRows p = {x, w, bias, y, rows, in, out};
    return run_rows(&p, (out + OUTS - 1) / OUTS, threads, 0, few_rows_outputs);
}

#endif
