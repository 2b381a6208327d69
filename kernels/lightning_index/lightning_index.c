/* The lightning indexer on the CPU, I(r, s) = sum_j w(r, j) * ReLU(q(r, j) . k(s)) over indexer
 * heads j:
 * - index_topk_rows: from a chunk's products q . k (a matrix product, left to PyTorch), each
 *   query's scores and its top-k keys in one pass, ranked as reference.ranking_keys ranks them
 *   (score, then the later key), with a heap of top_k ranking keys per row;
 * - gathered_scores_*: the scores of each query's chosen keys, with their gradients, for DSA's
 *   sparse KL. Each chosen key row is read where it lies (no gathered copy) once for all indexer
 *   heads of its query. The backward adds each key's gradient into a buffer of the thread's own,
 *   which the caller sums.
 *
 * Layouts (fp32, contiguous):
 *   q, dq          [b, c, H, d]   queries of rows r = (batch, query) and indexer heads j
 *   w, dw          [b, c, H]
 *   k              [b, n, d]      dk [threads, b, n, d]
 *   indices        [b, c, S]      int64; outside [0, n): an unused slot (score 0, no gradient)
 *   scores, dscores [b, c, S]
 *   products       [b, c, H, visible]  a chunk's products, queries at positions first..
 *   out            [b, c, top_k]       int64 key positions, best first; -1 past a query's keys
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

/* The ranking key of key j with score x: reference.ranking_keys' (x's fp32 bits as an ordered
 * integer, -0.0 as +0.0, times 2^32, plus j), so that the order, ties included, is the same. */
INLINE int64_t ranking_key(float x, int64_t j) {
    union { float f; int32_t i; } bits = {.f = x};
    int32_t ordered = bits.i ^ ((bits.i >> 31) & 0x7FFFFFFF);
    if (ordered == -1) ordered = 0;
    return (int64_t)((uint64_t)(int64_t)ordered << 32 | (uint64_t)j);
}

/* heap[0..size) a min-heap: restores it below slot i */
static void sift_down(int64_t *heap, int64_t size, int64_t i) {
    for (;;) {
        int64_t least = i, left = 2 * i + 1, right = left + 1;
        if (left < size && heap[left] < heap[least]) least = left;
        if (right < size && heap[right] < heap[least]) least = right;
        if (least == i) return;
        const int64_t t = heap[i];
        heap[i] = heap[least], heap[least] = t;
        i = least;
    }
}

typedef struct {
    const float *products, *w;
    int64_t *out;
    int64_t c, H, visible, first, top_k;
} Chunk;

/* fp-contract off: a fused multiply-add would round the scores differently from the reference's
 * product then sum, and reorder near-ties */
__attribute__((optimize("fp-contract=off"))) static void *topk_work(void *arg) {
    Work *work = arg;
    const Chunk *p = work->problem;
    float *scores = malloc((size_t)(p->visible ? p->visible : 1) * sizeof(float));
    int64_t *heap = malloc((size_t)(p->top_k ? p->top_k : 1) * sizeof(int64_t));
    if (!scores || !heap) { work->failed = 1; free(scores), free(heap); return NULL; }
    for (int64_t r = work->first; r < work->last; r += work->step) {
        const int64_t position = p->first + r % p->c, keys = position + 1 < p->visible ? position + 1 : p->visible;
        const float *products = p->products + r * p->H * p->visible, *w = p->w + r * p->H;
        /* the heads summed in order, as the reference's sum over them */
#pragma omp simd
        for (int64_t j = 0; j < keys; j++) scores[j] = w[0] * (products[j] > 0.0f ? products[j] : 0.0f);
        for (int64_t h = 1; h < p->H; h++) {
            const float *row = products + h * p->visible;
#pragma omp simd
            for (int64_t j = 0; j < keys; j++) scores[j] += w[h] * (row[j] > 0.0f ? row[j] : 0.0f);
        }
        const int64_t size = keys < p->top_k ? keys : p->top_k;
        for (int64_t j = 0; j < size; j++) heap[j] = ranking_key(scores[j], j);
        for (int64_t i = size / 2 - 1; i >= 0; i--) sift_down(heap, size, i);
        /* a score below the least kept one loses whatever its position: most keys stop there */
        float floor = size ? scores[heap[0] & 0xFFFFFFFF] : 0.0f;
        for (int64_t j = size; size && j < keys; j++) {
            if (scores[j] < floor) continue;
            const int64_t key = ranking_key(scores[j], j);
            if (key > heap[0]) {
                heap[0] = key, sift_down(heap, size, 0);
                floor = scores[heap[0] & 0xFFFFFFFF];
            }
        }
        int64_t *out = p->out + r * p->top_k;
        for (int64_t s = size - 1; s >= 0; s--) { /* the least first off the heap: written from the end */
            out[s] = heap[0] & 0xFFFFFFFF;
            heap[0] = heap[s];
            sift_down(heap, s, 0);
        }
        for (int64_t s = size; s < p->top_k; s++) out[s] = -1;
    }
    free(scores), free(heap);
    return NULL;
}

int index_topk_rows(const float *products, const float *w, int64_t *out, int64_t b, int64_t c, int64_t H,
                    int64_t visible, int64_t first, int64_t top_k, float unused, int threads) {
    (void)unused;
    Chunk p = {.products = products, .w = w, .out = out, .c = c, .H = H, .visible = visible, .first = first,
               .top_k = top_k};
    return run_rows(&p, b * c, threads, 0, topk_work);
}
