/* Span attention on the CPU: each query attends, with every query head of its GQA group, to a few
 * spans of keys [start, end) given per query (NSA's sliding window and selected blocks).
 *
 * Everything of one query stays in cache: its scores are computed from the keys where they lie,
 * without gathering them, and its softmax, output and gradients follow in the same pass. The
 * backward recomputes the probabilities from the saved log-sum-exp, as flash attention does.
 * Rows (one query position of one batch * kv head) are split evenly over POSIX threads; each
 * thread adds its key and value gradients into a buffer of its own, which the caller sums.
 *
 * Layouts (contiguous fp32):
 *   q, out, dout  [bh, g, m, d]    lse, dlse [bh, g, m]
 *   k, v          [bh, n, d]       dk, dv    [threads, bh, n, d]
 *   k_t, v_t      [bh, n / TILE, d, TILE]  keys and values in transposed tiles (n padded to TILE)
 *   spans         [bh, m, S, 2]    int32 (start, end); end <= start: an unused slot; with
 *                                  spans_shared, [m, S, 2] for every bh
 *   weights       [bh, m, S]       slot s's share of the output is scaled by weights[s]; NULL: 1
 *   gate, dgate   [bh, g, m]       each head's whole output is scaled by its gate; NULL: 1
 */

#include "native.h"

typedef struct {
    const float *q, *k, *v, *k_t, *v_t, *weights, *gate, *dout, *dlse;
    const int32_t *spans;
    float *out, *lse, *dq, *dk, *dv, *dweights, *dgate;
    int64_t bh, g, m, d, n, n_tiled, S, max_keys;
    int spans_shared;
    float scale;
} Problem;

INLINE void axpy(float *y, float a, const float *x, int64_t d) {
#pragma omp simd
    for (int64_t e = 0; e < d; e++) y[e] += a * x[e];
}

static inline float slot_weight(const Problem *p, int64_t row, int64_t s) {
    return p->weights ? p->weights[row * p->S + s] : 1.0f;
}

static inline const int32_t *row_spans(const Problem *p, int64_t b, int64_t i) {
    return p->spans + ((p->spans_shared ? 0 : b * p->m) + i) * p->S * 2;
}

/* out[0..d) = sum over the spans' keys j (in order, c counting them) of coef[c] * rows[j]: the sum
 * stays in vector registers (when d is a constant multiple of TILE after inlining) instead of
 * going through memory once per key. */
INLINE void weighted_rows(float *out, const float *coef, const int32_t *span,
                                                                int64_t S, const float *rows, int64_t d) {
    if (d % TILE || d > MAX_DIM) { /* any other width: plain multiply-adds */
        memset(out, 0, d * sizeof(float));
        int64_t c = 0;
        for (int64_t s = 0; s < S; s++)
            for (int64_t j = span[2 * s]; j < span[2 * s + 1]; j++, c++) axpy(out, coef[c], rows + j * d, d);
        return;
    }
    vec acc[MAX_DIM / TILE];
    for (int64_t x = 0; x < d / TILE; x++) acc[x] = (vec){0};
    int64_t c = 0;
    for (int64_t s = 0; s < S; s++) {
        for (int64_t j = span[2 * s]; j < span[2 * s + 1]; j++, c++) {
            const float *row = rows + j * d;
            for (int64_t x = 0; x < d / TILE; x++) acc[x] += coef[c] * *(const vec *)(row + x * TILE);
        }
    }
    for (int64_t x = 0; x < d / TILE; x++) *(vec *)(out + x * TILE) = acc[x];
}

/* Scores of one query head over its spans, into scores[0..count); returns count. */
INLINE int64_t head_scores(const Problem *p, const int32_t *span, const float *q,
                                                                 const float *keys_t, float *scores, const int64_t d) {
    int64_t count = 0;
    for (int64_t s = 0; s < p->S; s++) {
        const int64_t lo = span[2 * s], hi = span[2 * s + 1];
        if (hi <= lo) continue;
        tile_scores(scores + count, q, keys_t, d, lo, hi, p->scale);
        count += hi - lo;
    }
    return count;
}

INLINE void forward_row_of(const Problem *p, int64_t b, int64_t i, float *scores,
                                                                  const int64_t d) {
    const int64_t g = p->g, m = p->m, row = b * m + i;
    const int32_t *span = row_spans(p, b, i);
    const float *keys_t = p->k_t + b * p->n_tiled * d, *values = p->v + b * p->n * d;
    for (int64_t h = 0; h < g; h++) {
        const int64_t head_row = (b * g + h) * m + i;
        float *out = p->out + head_row * d;
        const int64_t count = head_scores(p, span, p->q + head_row * d, keys_t, scores, d);
        if (count == 0) { /* nothing visible: zeros, and a log-sum-exp of -inf */
            memset(out, 0, d * sizeof(float));
            p->lse[head_row] = -INFINITY;
            continue;
        }
        float total;
        p->lse[head_row] = exp_less_max(scores, count, &total);
        const float gate = p->gate ? p->gate[head_row] : 1.0f;
        int64_t c = 0;
        for (int64_t s = 0; s < p->S; s++) {
            const float w = gate * slot_weight(p, row, s) / total;
            for (int64_t j = span[2 * s]; j < span[2 * s + 1]; j++, c++) scores[c] *= w;
        }
        weighted_rows(out, scores, span, p->S, values, d);
    }
}

INLINE void backward_row_of(const Problem *p, int64_t b, int64_t i, int thread,
                                                                   float *probs, float *dprobs, const int64_t d) {
    const int64_t g = p->g, m = p->m, n = p->n, row = b * m + i;
    const int32_t *span = row_spans(p, b, i);
    const float *keys = p->k + b * n * d, *keys_t = p->k_t + b * p->n_tiled * d, *values_t = p->v_t + b * p->n_tiled * d;
    float *dk = p->dk + (thread * p->bh + b) * n * d, *dv = p->dv + (thread * p->bh + b) * n * d;
    for (int64_t h = 0; h < g; h++) {
        const int64_t head_row = (b * g + h) * m + i;
        const float *q = p->q + head_row * d, *dout = p->dout + head_row * d;
        float *dq = p->dq + head_row * d;
        const float lse = p->lse[head_row];
        if (lse == -INFINITY) { /* nothing visible: the output was 0 */
            memset(dq, 0, d * sizeof(float));
            if (p->dgate) p->dgate[head_row] = 0.0f;
            continue;
        }
        const int64_t count = head_scores(p, span, q, keys_t, probs, d);
#pragma omp simd
        for (int64_t c = 0; c < count; c++) probs[c] = exp_nonpositive(probs[c] - lse);
        /* dP = dO . v_j for every key, along the keys as the scores are */
        int64_t c = 0;
        for (int64_t s = 0; s < p->S; s++) {
            const int64_t lo = span[2 * s], hi = span[2 * s + 1];
            if (hi <= lo) continue;
            tile_scores(dprobs + c, dout, values_t, d, lo, hi, 1.0f);
            c += hi - lo;
        }
        /* dS = P * (dP' - sum(P * dP') + dlse), dP' = gate * w * dP: the slot weights scale each
         * share, the gate the whole output (its gradient is dO . the ungated output) */
        const float gate = p->gate ? p->gate[head_row] : 1.0f;
        float delta = p->dlse ? -p->dlse[head_row] : 0.0f, gate_grad = 0.0f;
        c = 0;
        for (int64_t s = 0; s < p->S; s++) {
            const float w = slot_weight(p, row, s);
            float slot_grad = 0.0f;
            for (int64_t j = span[2 * s]; j < span[2 * s + 1]; j++, c++) {
                slot_grad += probs[c] * dprobs[c];
                dprobs[c] *= gate * w;
                delta += probs[c] * dprobs[c];
            }
            gate_grad += w * slot_grad;
            if (p->dweights) p->dweights[row * p->S + s] += gate * slot_grad;
        }
        if (p->dgate) p->dgate[head_row] = gate_grad;
        c = 0;
        for (int64_t s = 0; s < p->S; s++) {
            const float w = gate * slot_weight(p, row, s);
            for (int64_t j = span[2 * s]; j < span[2 * s + 1]; j++, c++) {
                const float dscore = probs[c] * (dprobs[c] - delta) * p->scale;
                axpy(dk + j * d, dscore, q, d);
                axpy(dv + j * d, w * probs[c], dout, d);
                dprobs[c] = dscore;
            }
        }
        weighted_rows(dq, dprobs, span, p->S, keys, d);
    }
}

/* Each row's work specialized for the common head width (loops unrolled, sums in registers) */
static void forward_row(const Problem *p, int64_t b, int64_t i, float *scores) {
    if (p->d == 64) forward_row_of(p, b, i, scores, 64);
    else forward_row_of(p, b, i, scores, p->d);
}

static void backward_row(const Problem *p, int64_t b, int64_t i, int thread, float *probs, float *dprobs) {
    if (p->d == 64) backward_row_of(p, b, i, thread, probs, dprobs, 64);
    else backward_row_of(p, b, i, thread, probs, dprobs, p->d);
}

static void *forward_work(void *arg) {
    Work *work = arg;
    const Problem *p = work->problem;
    float *scores = malloc((size_t)(p->max_keys + 1) * sizeof(float));
    if (!scores) { work->failed = 1; return NULL; }
    for (int64_t r = work->first; r < work->last; r += work->step) forward_row(p, r / p->m, r % p->m, scores);
    free(scores);
    return NULL;
}

static void *backward_work(void *arg) {
    Work *work = arg;
    const Problem *p = work->problem;
    float *buffer = malloc((size_t)(2 * p->max_keys + 2) * sizeof(float));
    if (!buffer) { work->failed = 1; return NULL; }
    for (int64_t r = work->first; r < work->last; r += work->step)
        backward_row(p, r / p->m, r % p->m, work->thread, buffer, buffer + p->max_keys + 1);
    free(buffer);
    return NULL;
}

int span_attention_forward(const float *q, const float *k_t, const float *v, const int32_t *spans,
                           const float *weights, const float *gate, float *out, float *lse, int64_t bh, int64_t g,
                           int64_t m,
                           int64_t d, int64_t n, int64_t S, int64_t max_keys, int64_t spans_shared, float scale,
                           int threads) {
    Problem p = {.q = q, .k_t = k_t, .v = v, .weights = weights, .gate = gate, .spans = spans, .out = out, .lse = lse,
                 .bh = bh, .g = g, .m = m, .d = d, .n = n, .n_tiled = (n + TILE - 1) / TILE * TILE, .S = S, .max_keys = max_keys,
                 .spans_shared = spans_shared, .scale = scale};
    return run_rows(&p, bh * m, threads, 0, forward_work);
}

int span_attention_backward(const float *q, const float *k, const float *k_t, const float *v_t,
                            const int32_t *spans,
                            const float *weights, const float *gate, const float *lse, const float *dout,
                            const float *dlse, float *dq, float *dk, float *dv, float *dweights, float *dgate,
                            int64_t bh, int64_t g, int64_t m,
                            int64_t d, int64_t n, int64_t S, int64_t max_keys, int64_t spans_shared, float scale,
                            int threads) {
    Problem p = {.q = q, .k = k, .k_t = k_t, .v_t = v_t, .weights = weights, .gate = gate, .spans = spans,
                 .lse = (float *)lse,
                 .dout = dout, .dlse = dlse, .dq = dq, .dk = dk, .dv = dv, .dweights = dweights, .dgate = dgate,
                 .bh = bh, .g = g, .m = m, .d = d, .n = n, .n_tiled = (n + TILE - 1) / TILE * TILE, .S = S, .max_keys = max_keys,
                 .spans_shared = spans_shared, .scale = scale};
    return run_rows(&p, bh * m, threads, 0, backward_work);
}
