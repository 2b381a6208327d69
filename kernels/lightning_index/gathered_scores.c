/* The lightning indexer's scores of each query's chosen keys, on the CPU, with their gradients:
 * I(r, s) = sum_j w(r, j) * ReLU(q(r, j) . k(indices(r, s))), for DSA's sparse KL. Each chosen key
 * row is read where it lies (no gathered copy) once for all indexer heads of its query. The
 * backward adds each key's gradient into a buffer of the thread's own, which the caller sums.
 *
 * Layouts (fp32, contiguous):
 *   q, dq          [b, c, H, d]   queries of rows r = (batch, query) and indexer heads j
 *   w, dw          [b, c, H]
 *   k              [b, n, d]      dk [threads, b, n, d]
 *   indices        [b, c, S]      int64; outside [0, n): an unused slot (score 0, no gradient)
 *   scores, dscores [b, c, S]
 */

#include "native.h"

typedef struct {
    const float *q, *k, *w, *dscores;
    const int64_t *indices;
    float *scores, *dq, *dk, *dw;
    int64_t b, c, H, d, n, S;
} Problem;

INLINE float dot(const float *x, const float *y, const int64_t d) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t e = 0; e < d; e++) total += x[e] * y[e];
    return total;
}

/* Prefetches the key row that slot s + 8 names: the rows are random, mostly out of L2. */
INLINE void fetch_ahead(const Problem *p, const float *keys, const int64_t *slots, int64_t s) {
    if (s + 8 < p->S && slots[s + 8] >= 0 && slots[s + 8] < p->n)
        for (int64_t e = 0; e < p->d; e += 16) __builtin_prefetch(keys + slots[s + 8] * p->d + e, 0, 3);
}

INLINE void forward_row(const Problem *p, int64_t r, const int64_t d) {
    const float *q = p->q + r * p->H * d, *w = p->w + r * p->H, *keys = p->k + r / p->c * p->n * d;
    const int64_t *slots = p->indices + r * p->S;
    for (int64_t s = 0; s < p->S; s++) {
        const int64_t j = slots[s];
        float score = 0.0f;
        fetch_ahead(p, keys, slots, s);
        if (j >= 0 && j < p->n)
            for (int64_t h = 0; h < p->H; h++) {
                const float product = dot(q + h * d, keys + j * d, d);
                score += product > 0.0f ? w[h] * product : 0.0f;
            }
        p->scores[r * p->S + s] = score;
    }
}

/* dq(j) = sum_s dI(s) w(j) [q(j) . k_s > 0] k_s, dw(j) = sum_s dI(s) ReLU(q(j) . k_s),
 * dk_s += dI(s) sum_j w(j) [q(j) . k_s > 0] q(j) */
INLINE void backward_row(const Problem *p, int64_t r, float *dk, const int64_t d) {
    const float *q = p->q + r * p->H * d, *w = p->w + r * p->H, *keys = p->k + r / p->c * p->n * d;
    const int64_t *slots = p->indices + r * p->S;
    float *dq = p->dq + r * p->H * d, *dw = p->dw + r * p->H;
    memset(dq, 0, p->H * d * sizeof(float));
    memset(dw, 0, p->H * sizeof(float));
    dk += r / p->c * p->n * d;
    for (int64_t s = 0; s < p->S; s++) {
        const int64_t j = slots[s];
        const float grad = p->dscores[r * p->S + s];
        fetch_ahead(p, keys, slots, s);
        if (j < 0 || j >= p->n || grad == 0.0f) continue;
        const float *key = keys + j * d;
        float *key_grad = dk + j * d;
        for (int64_t h = 0; h < p->H; h++) {
            const float product = dot(q + h * d, key, d);
            if (product <= 0.0f) continue;
            const float a = grad * w[h];
            dw[h] += grad * product;
#pragma omp simd
            for (int64_t e = 0; e < d; e++) {
                dq[h * d + e] += a * key[e];
                key_grad[e] += a * q[h * d + e];
            }
        }
    }
}

static void *forward_work(void *arg) {
    Work *work = arg;
    const Problem *p = work->problem;
    for (int64_t r = work->first; r < work->last; r += work->step) {
        if (p->d == 32) forward_row(p, r, 32); /* the configs' index_dim_head: loops unrolled */
        else forward_row(p, r, p->d);
    }
    return NULL;
}

static void *backward_work(void *arg) {
    Work *work = arg;
    const Problem *p = work->problem;
    float *dk = p->dk + work->thread * p->b * p->n * p->d; /* this thread's own, zeroed here */
    memset(dk, 0, (size_t)p->b * p->n * p->d * sizeof(float));
    for (int64_t r = work->first; r < work->last; r += work->step) {
        if (p->d == 32) backward_row(p, r, dk, 32);
        else backward_row(p, r, dk, p->d);
    }
    return NULL;
}

int gathered_scores_forward(const float *q, const float *k, const float *w, const int64_t *indices, float *scores,
                            int64_t b, int64_t c, int64_t H, int64_t d, int64_t n, int64_t S, float unused,
                            int threads) {
    (void)unused;
    Problem p = {.q = q, .k = k, .w = w, .indices = indices, .scores = scores, .b = b, .c = c, .H = H, .d = d,
                 .n = n, .S = S};
    return run_rows(&p, b * c, threads, 0, forward_work);
}

int gathered_scores_backward(const float *q, const float *k, const float *w, const int64_t *indices,
                             const float *dscores, float *dq, float *dk, float *dw, int64_t b, int64_t c, int64_t H,
                             int64_t d, int64_t n, int64_t S, float unused, int threads) {
    (void)unused;
    Problem p = {.q = q, .k = k, .w = w, .indices = indices, .dscores = dscores, .dq = dq, .dk = dk, .dw = dw,
                 .b = b, .c = c, .H = H, .d = d, .n = n, .S = S};
    return run_rows(&p, b * c, threads, 0, backward_work);
}
