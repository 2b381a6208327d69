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
 * of w loaded once for up to MAX_ROWS rows, which a vector-matrix product per row loads once per
 * row. Threads take contiguous ranges of outputs (few_row_linear/, dense_decoding/). */
#define OUTS 4     /* outputs a unit of the threads' split */
#define MAX_ROWS 6 /* rows a pass over the weights takes: 12 sums, 2 weight vectors and one of x */
/* floats ahead that a pass asks the caches for (2 KB: in a row, or the next pair's rows at in = 256):
 * at 6 rows the hardware's prefetch fell behind, 147-173 us for a [1024, 256] weight from memory
 * against 90-100 with this and 70-90 for one row (one core, AMD EPYC Zen 4) */
#define PREFETCH_AHEAD 512

typedef struct {
    const float *x, *w, *bias;
    float *y;
    int64_t rows, in, out;
} FewRows;

/* Merging two vectors of sums a, b whose lanes hold groups of `width` partial sums of one value
 * each: the sum of each group's halves, a's groups then b's, `width` / 2 lanes a group. After
 * log2 VEC merges, VEC vectors have become one whose lane k sums vector k: ~3 operations a sum,
 * where a scalar sum of each vector's lanes takes VEC (the few-row product's 2 x R sums of a pair
 * of weight rows, dense decoding's VEC scores at a time). */
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector) /* GCC 12, clang */
#define HAVE_SHUFFLEVECTOR 1
#endif
#endif
#if !defined(HAVE_SHUFFLEVECTOR)
#elif VEC == 16
#define MERGE16(a, b) (__builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) + \
                       __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
#define MERGE8(a, b) (__builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) + \
                      __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31))
#define MERGE4(a, b) (__builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) + \
                      __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31))
#define MERGE2(a, b) (__builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) + \
                      __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31))
#define MERGE(width, a, b) ((width) == 16 ? MERGE16(a, b) : (width) == 8 ? MERGE8(a, b) : (width) == 4 ? MERGE4(a, b) \
                                                                                                  : MERGE2(a, b))
#elif VEC == 8
#define MERGE8(a, b) (__builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + \
                      __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15))
#define MERGE4(a, b) (__builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13) + \
                      __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15))
#define MERGE2(a, b) (__builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) + \
                      __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15))
#define MERGE(width, a, b) ((width) == 8 ? MERGE8(a, b) : (width) == 4 ? MERGE4(a, b) : MERGE2(a, b))
#else
#define MERGE4(a, b) (__builtin_shufflevector(a, b, 0, 1, 4, 5) + __builtin_shufflevector(a, b, 2, 3, 6, 7))
#define MERGE2(a, b) (__builtin_shufflevector(a, b, 0, 2, 4, 6) + __builtin_shufflevector(a, b, 1, 3, 5, 7))
#define MERGE(width, a, b) ((width) == 4 ? MERGE4(a, b) : MERGE2(a, b))
#endif

/* sums[k] = the sum of v[k]'s lanes, k < n (n a constant where this is inlined); v is overwritten */
INLINE void lane_sums(vec *v, const int n, float *sums) {
#if !defined(HAVE_SHUFFLEVECTOR) /* older compilers: lane by lane */
    for (int k = 0; k < n; k++) {
        float s = 0.0f;
        for (int l = 0; l < VEC; l++) s += v[k][l];
        sums[k] = s;
    }
#else
    int count = n;
    for (int width = VEC; width > 1; width /= 2) {
        const int merged = (count + 1) / 2;
        for (int k = 0; k < merged; k++) {
            const vec a = v[2 * k], b = 2 * k + 1 < count ? v[2 * k + 1] : (vec){0};
            v[k] = MERGE(width, a, b);
        }
        count = merged;
    }
    for (int k = 0; k < n; k++) sums[k] = v[k / VEC][k % VEC];
#endif
}

/* y[r0 .. r0 + R, o0 .. o1): weight rows read two at a time, each as one stream, against R rows of
 * x (R a constant where this is inlined): each x vector loaded serves both, in U interleaved sets
 * of 2 R sums so that at least four are in flight. Four weight rows read together (four streams,
 * each x vector loaded four times for want of registers) ran the preset's verification pass of 6
 * rows at a third of the bandwidth of one row (AMD EPYC Zen 4). */
INLINE void rows_block(const FewRows *p, int64_t o0, int64_t o1, int64_t r0, const int R) {
    const int U = R >= 2 ? 1 : 2; /* 2 U R sums, at most 2 MAX_ROWS */
    const int64_t in = p->in;
    const float *x = p->x + r0 * in;
    for (int64_t o = o0; o < o1; o += 2) {
        const float *w0 = p->w + o * in, *w1 = p->w + (o + 1 < o1 ? o + 1 : o) * in;
        vec acc[2 * MAX_ROWS]; /* set u, row r, weight row j at (u * R + r) * 2 + j */
        for (int k = 0; k < 2 * U * R; k++) acc[k] = (vec){0};
        int64_t i = 0;
        for (; i + U * VEC <= in; i += U * VEC)
            for (int u = 0; u < U; u++) {
                __builtin_prefetch(w0 + i + u * VEC + PREFETCH_AHEAD);
                __builtin_prefetch(w1 + i + u * VEC + PREFETCH_AHEAD);
                const vec a = *(const vec *)(w0 + i + u * VEC), b = *(const vec *)(w1 + i + u * VEC);
                for (int r = 0; r < R; r++) {
                    const vec xv = *(const vec *)(x + r * in + i + u * VEC);
                    acc[(u * R + r) * 2] += a * xv;
                    acc[(u * R + r) * 2 + 1] += b * xv;
                }
            }
        for (int u = 1; u < U; u++)
            for (int k = 0; k < 2 * R; k++) acc[k] += acc[u * 2 * R + k];
        for (; i + VEC <= in; i += VEC) {
            const vec a = *(const vec *)(w0 + i), b = *(const vec *)(w1 + i);
            for (int r = 0; r < R; r++) {
                const vec xv = *(const vec *)(x + r * in + i);
                acc[2 * r] += a * xv;
                acc[2 * r + 1] += b * xv;
            }
        }
        float sums[2 * MAX_ROWS];
        lane_sums(acc, 2 * R, sums);
        for (int j = 0; j < 2 && o + j < o1; j++) {
            const float *w = j ? w1 : w0;
            for (int r = 0; r < R; r++) {
                float s = sums[2 * r + j];
                for (int64_t k = i; k < in; k++) s += w[k] * x[r * in + k]; /* in not a multiple of VEC */
                p->y[(r0 + r) * p->out + o + j] = s + (p->bias ? p->bias[o + j] : 0.0f);
            }
        }
    }
}

/* a thread's groups of OUTS outputs, every row: up to MAX_ROWS rows a pass over its weights */
static void *few_rows_outputs(void *arg) {
    Work *work = arg;
    const FewRows *p = work->problem;
    const int64_t o0 = work->first * OUTS, o1 = work->last * OUTS < p->out ? work->last * OUTS : p->out;
    for (int64_t r0 = 0; r0 < p->rows; r0 += MAX_ROWS) {
        const int64_t left = p->rows - r0;
        switch (left < MAX_ROWS ? left : MAX_ROWS) { /* one inlined block per row count */
        case 1: rows_block(p, o0, o1, r0, 1); break;
        case 2: rows_block(p, o0, o1, r0, 2); break;
        case 3: rows_block(p, o0, o1, r0, 3); break;
        case 4: rows_block(p, o0, o1, r0, 4); break;
        case 5: rows_block(p, o0, o1, r0, 5); break;
        case 6: rows_block(p, o0, o1, r0, 6); break;
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
