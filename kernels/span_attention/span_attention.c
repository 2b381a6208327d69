/* Span attention on the CPU: each query attends, with every query head of its GQA group, to a few
 * spans of keys [start, end) given per query (NSA's sliding window and selected blocks).
 *
 * Everything of one query stays in cache: its scores are computed from the keys where they lie,
 * without gathering them, and its softmax, output and gradients follow in the same pass. The
 * backward recomputes the probabilities from the saved log-sum-exp, as flash attention does.
 * The heads of a GQA group go in pairs: each key and value is read, and each key and value
 * gradient written, once for both heads of a pair.
 * Rows (one query position of one batch * kv head) are split evenly over threads. Where each
 * thread's rows are whole batch * kv heads (shared_grads), the threads' key and value gradients
 * never meet and go straight into one buffer; otherwise each thread adds them into a buffer of its
 * own, which the caller sums. Each thread zeroes what it will add into.
 * With rotary phases, queries are rotated by position as each row is read, and their gradients
 * rotated back as each is written: the caller keeps no rotated copy of q. Keys come rotated.
 *
 * Layouts (fp32; contiguous unless strides are given):
 *   q             [bh, g, m, d]    row (b, h, i) at (b / heads) q_b + (b % heads) q_h + h q_g + i q_m
 *   out, dq       [bh, g, m, d]    lse, dlse [bh, g, m]
 *   dout          [bh, g, m, d]    strided as q, with strides of its own (o_b, o_h, o_g, o_m)
 *   k             [bh, n, d]       dk, dv    [shared_grads ? 1 : threads, bh, n, d]
 *   v             [bh, n, d]       row (b, j) at (b / heads) v_b + (b % heads) v_h + j v_n (forward)
 *   k_t, v_t      [bh, n / TILE, d, TILE]  keys and values in transposed tiles (n padded to TILE)
 *   spans         [bh, m, S, 2]    int32 (start, end); end <= start: an unused slot; with
 *                                  spans_shared, [m, S, 2] for every bh
 *   weights       [bh, m, S]       slot s's share of the output is scaled by weights[s]; NULL: 1
 *   gate, dgate   [bh, g, m]       each head's whole output is scaled by its gate; NULL: 1
 *   phases        [m, d / 2, 2]    (cos, sin) of each channel pair's angle at each query position:
 *                                  pair (x[2e], x[2e+1]) -> (x[2e] cos - x[2e+1] sin, x[2e] sin +
 *                                  x[2e+1] cos); NULL: no rotation
 */

#include "native.h"

typedef struct {
    const float *q, *k, *v, *k_t, *v_t, *weights, *gate, *phases, *dout, *dlse;
    const int32_t *spans;
    float *out, *lse, *dq, *dk, *dv, *dweights, *dgate;
    int64_t bh, g, m, d, n, n_tiled, S, max_keys;
    int64_t heads, q_b, q_h, q_g, q_m, v_b, v_h, v_n, o_b, o_h, o_g, o_m;
    int spans_shared, shared_grads;
    float scale;
} Problem;

/* Where batch * kv head b begins in a tensor of batch stride sb and head stride sh */
INLINE int64_t head_offset(const Problem *p, int64_t b, int64_t sb, int64_t sh) {
    return (b / p->heads) * sb + (b % p->heads) * sh;
}

INLINE const float *query_row(const Problem *p, int64_t b, int64_t h, int64_t i) {
    return p->q + head_offset(p, b, p->q_b, p->q_h) + h * p->q_g + i * p->q_m;
}

/* y = x with each channel pair rotated by `phase` (d / 2 (cos, sin) pairs), or back with inverse */
INLINE void rotate_row(float *y, const float *x, const float *phase, int64_t d, const int inverse) {
    const float sign = inverse ? -1.0f : 1.0f;
#pragma omp simd
    for (int64_t e = 0; e < d; e += 2) {
        const float c = phase[e], s = sign * phase[e + 1], a = x[e], b = x[e + 1];
        y[e] = a * c - b * s;
        y[e + 1] = a * s + b * c;
    }
}

/* y += a[0] x[0] (+ a[1] x[1] when nh = 2): one read and write of y for both heads */
INLINE void axpy_heads(float *y, const float *a, const float *const *x, const int nh, int64_t d) {
    if (nh == 2) {
#pragma omp simd
        for (int64_t e = 0; e < d; e++) y[e] += a[0] * x[0][e] + a[1] * x[1][e];
    } else {
#pragma omp simd
        for (int64_t e = 0; e < d; e++) y[e] += a[0] * x[0][e];
    }
}

static inline float slot_weight(const Problem *p, int64_t row, int64_t s) {
    return p->weights ? p->weights[row * p->S + s] : 1.0f;
}

static inline const int32_t *row_spans(const Problem *p, int64_t b, int64_t i) {
    return p->spans + ((p->spans_shared ? 0 : b * p->m) + i) * p->S * 2;
}

/* d in pieces of ROW_REGS registers a head, so that the sums fill half the ISA's registers (AVX-512:
 * d = 64 in one piece; AVX2: two pieces of 32 floats); regs a constant after inlining, so that the
 * sums are registers (a width known only at run time put them on the stack) */
#define ROW_REGS (VEC_REGS / 4)
INLINE void weighted_rows_piece(float *const *out, const float *const *coef, const int nh, const int32_t *span,
                                int64_t S, const float *rows, int64_t row_stride, int64_t x0, const int regs) {
    vec acc[2][ROW_REGS];
    for (int h = 0; h < nh; h++)
        for (int x = 0; x < regs; x++) acc[h][x] = (vec){0};
    int64_t c = 0;
    for (int64_t s = 0; s < S; s++) {
        for (int64_t j = span[2 * s]; j < span[2 * s + 1]; j++, c++) {
            const float *row = rows + j * row_stride + x0 * VEC;
            for (int x = 0; x < regs; x++) {
                const vec r = *(const vec *)(row + x * VEC);
                for (int h = 0; h < nh; h++) acc[h][x] += coef[h][c] * r;
            }
        }
    }
    for (int h = 0; h < nh; h++)
        for (int x = 0; x < regs; x++) *(vec *)(out[h] + (x0 + x) * VEC) = acc[h][x];
}

/* out[h][0..d) = sum over the spans' keys j (in order, c counting them) of coef[h][c] * row j, for
 * nh = 1 or 2 heads in one pass over the rows: the sums stay in vector registers (when d is a
 * constant multiple of VEC after inlining) instead of going through memory once per key. */
INLINE void weighted_rows(float *const *out, const float *const *coef, const int nh, const int32_t *span,
                          int64_t S, const float *rows, int64_t row_stride, int64_t d) {
    if (d % VEC) { /* any other width: plain multiply-adds */
        for (int h = 0; h < nh; h++) memset(out[h], 0, d * sizeof(float));
        int64_t c = 0;
        for (int64_t s = 0; s < S; s++)
            for (int64_t j = span[2 * s]; j < span[2 * s + 1]; j++, c++)
                for (int h = 0; h < nh; h++) {
                    const float a = coef[h][c], *x = rows + j * row_stride;
                    float *y = out[h];
#pragma omp simd
                    for (int64_t e = 0; e < d; e++) y[e] += a * x[e];
                }
        return;
    }
    if (d / VEC <= ROW_REGS) { /* the row in one piece (AVX-512, d = 64: 4 registers a head), each row read once:
                                * in pieces of one register it was read 4 times, each head's sum one chain of
                                * dependent multiply-adds (the backward's hottest loop on the Zen 4) */
        weighted_rows_piece(out, coef, nh, span, S, rows, row_stride, 0, (int)(d / VEC));
        return;
    }
    int64_t x0 = 0;
    for (; x0 + ROW_REGS <= d / VEC; x0 += ROW_REGS) weighted_rows_piece(out, coef, nh, span, S, rows, row_stride, x0, ROW_REGS);
    for (; x0 < d / VEC; x0++) weighted_rows_piece(out, coef, nh, span, S, rows, row_stride, x0, 1);
}

/* Scores of nh query heads over the spans, into scores[h][0..count); returns count. */
INLINE int64_t span_scores(const Problem *p, const int32_t *span, const float *const *q, const int nh,
                           const float *keys_t, float *const *scores, float scale, const int64_t d) {
    int64_t count = 0;
    for (int64_t s = 0; s < p->S; s++) {
        const int64_t lo = span[2 * s], hi = span[2 * s + 1];
        if (hi <= lo) continue;
        float *at[2] = {scores[0] + count, nh == 2 ? scores[1] + count : NULL};
        tile_scores_heads(at, q, nh, keys_t, d, lo, hi, scale);
        count += hi - lo;
    }
    return count;
}

/* The rows of query i of batch * kv head b for heads h0 .. h0 + nh - 1, rotated into `buffer`
 * (nh * d floats) where there are phases. */
INLINE void query_rows(const Problem *p, int64_t b, int64_t i, int64_t h0, const int nh, float *buffer,
                       const float **q, const int64_t d) {
    for (int h = 0; h < nh; h++) {
        q[h] = query_row(p, b, h0 + h, i);
        if (p->phases) {
            rotate_row(buffer + h * d, q[h], p->phases + i * d, d, 0);
            q[h] = buffer + h * d;
        }
    }
}

/* Query i of batch * kv head b, for its heads h0 .. h0 + nh - 1 (nh = 1 or 2): each key and value is
 * read once for both heads of a pair. `scores` holds 2 * (max_keys + 1) + 2 * d floats. */
INLINE void forward_heads(const Problem *p, int64_t b, int64_t i, int64_t h0, const int nh, float *scores,
                          const int64_t d) {
    const int64_t m = p->m, row = b * m + i, stride = p->max_keys + 1;
    const int32_t *span = row_spans(p, b, i);
    const float *keys_t = p->k_t + b * p->n_tiled * d;
    const float *values = p->v + head_offset(p, b, p->v_b, p->v_h);
    int64_t head_row[2];
    const float *q[2];
    float *out[2], *probs[2];
    query_rows(p, b, i, h0, nh, scores + 2 * stride, q, d);
    for (int h = 0; h < nh; h++) {
        head_row[h] = (b * p->g + h0 + h) * m + i;
        out[h] = p->out + head_row[h] * d;
        probs[h] = scores + h * stride;
    }
    const int64_t count = span_scores(p, span, q, nh, keys_t, probs, p->scale, d);
    if (count == 0) { /* nothing visible: zeros, and a log-sum-exp of -inf */
        for (int h = 0; h < nh; h++) {
            memset(out[h], 0, d * sizeof(float));
            p->lse[head_row[h]] = -INFINITY;
        }
        return;
    }
    for (int h = 0; h < nh; h++) {
        float total;
        p->lse[head_row[h]] = exp_less_max(probs[h], count, &total);
        const float gate = p->gate ? p->gate[head_row[h]] : 1.0f;
        int64_t c = 0;
        for (int64_t s = 0; s < p->S; s++) {
            const float w = gate * slot_weight(p, row, s) / total;
            for (int64_t j = span[2 * s]; j < span[2 * s + 1]; j++, c++) probs[h][c] *= w;
        }
    }
    weighted_rows(out, (const float *const *)probs, nh, span, p->S, values, p->v_n, d);
}

/* The backward of forward_heads. `buffer` holds 4 * (max_keys + 1) + 4 * d floats. */
INLINE void backward_heads(const Problem *p, int64_t b, int64_t i, int64_t h0, const int nh, int thread,
                           float *buffer, const int64_t d) {
    const int64_t m = p->m, n = p->n, row = b * m + i, stride = p->max_keys + 1;
    const int32_t *span = row_spans(p, b, i);
    const float *keys = p->k + b * n * d, *keys_t = p->k_t + b * p->n_tiled * d, *values_t = p->v_t + b * p->n_tiled * d;
    const int64_t grads = (p->shared_grads ? 0 : thread) * p->bh + b;
    float *dk = p->dk + grads * n * d, *dv = p->dv + grads * n * d;
    float *rotated = buffer + 4 * stride; /* 2 * d floats of rotated queries, then 2 * d of their gradients */
    int64_t head_row[2];
    const float *q[2], *dout[2];
    float *dq[2], *probs[2], *dprobs[2], gate[2], delta[2];
    query_rows(p, b, i, h0, nh, rotated, q, d);
    for (int h = 0; h < nh; h++) {
        head_row[h] = (b * p->g + h0 + h) * m + i;
        dout[h] = p->dout + head_offset(p, b, p->o_b, p->o_h) + (h0 + h) * p->o_g + i * p->o_m;
        dq[h] = p->phases ? rotated + (2 + h) * d : p->dq + head_row[h] * d;
        probs[h] = buffer + h * stride;
        dprobs[h] = buffer + (2 + h) * stride;
        gate[h] = p->gate ? p->gate[head_row[h]] : 1.0f;
    }
    if (p->lse[head_row[0]] == -INFINITY) { /* nothing visible (for every head): the output was 0 */
        for (int h = 0; h < nh; h++) {
            memset(p->dq + head_row[h] * d, 0, d * sizeof(float));
            if (p->dgate) p->dgate[head_row[h]] = 0.0f;
        }
        return;
    }
    const int64_t count = span_scores(p, span, q, nh, keys_t, probs, p->scale, d);
    span_scores(p, span, dout, nh, values_t, dprobs, 1.0f, d); /* dP = dO . v_j, along the keys as the scores */
    for (int h = 0; h < nh; h++) {
        const float lse = p->lse[head_row[h]];
#pragma omp simd
        for (int64_t c = 0; c < count; c++) probs[h][c] = exp_nonpositive(probs[h][c] - lse);
        /* dS = P * (dP' - sum(P * dP') + dlse), dP' = gate * w * dP: the slot weights scale each
         * share, the gate the whole output (its gradient is dO . the ungated output) */
        float gate_grad = 0.0f;
        delta[h] = p->dlse ? -p->dlse[head_row[h]] : 0.0f;
        int64_t c = 0;
        for (int64_t s = 0; s < p->S; s++) {
            const float w = slot_weight(p, row, s);
            float slot_grad = 0.0f;
            for (int64_t j = span[2 * s]; j < span[2 * s + 1]; j++, c++) {
                slot_grad += probs[h][c] * dprobs[h][c];
                dprobs[h][c] *= gate[h] * w;
                delta[h] += probs[h][c] * dprobs[h][c];
            }
            gate_grad += w * slot_grad;
            if (p->dweights) p->dweights[row * p->S + s] += gate[h] * slot_grad;
        }
        if (p->dgate) p->dgate[head_row[h]] = gate_grad;
    }
    int64_t c = 0;
    for (int64_t s = 0; s < p->S; s++) {
        const float w = slot_weight(p, row, s);
        for (int64_t j = span[2 * s]; j < span[2 * s + 1]; j++, c++) {
            float dscore[2], share[2];
            for (int h = 0; h < nh; h++) {
                dscore[h] = probs[h][c] * (dprobs[h][c] - delta[h]) * p->scale;
                share[h] = gate[h] * w * probs[h][c];
                dprobs[h][c] = dscore[h];
            }
            axpy_heads(dk + j * d, dscore, q, nh, d);
            axpy_heads(dv + j * d, share, dout, nh, d);
        }
    }
    weighted_rows(dq, (const float *const *)dprobs, nh, span, p->S, keys, d, d);
    if (p->phases) /* the gradient of the rotated query, rotated back */
        for (int h = 0; h < nh; h++) rotate_row(p->dq + head_row[h] * d, dq[h], p->phases + i * d, d, 1);
}

/* Each row's heads in pairs (an odd group's last head alone), specialized for the common head
 * width (loops unrolled, sums in registers) */
#define EACH_HEAD_PAIR(call_pair, call_one)       \
    for (int64_t h = 0; h < p->g; h += 2) {        \
        if (h + 1 < p->g) call_pair; else call_one; \
    }

static void forward_row(const Problem *p, int64_t b, int64_t i, float *scores) {
    if (p->d == 64) EACH_HEAD_PAIR(forward_heads(p, b, i, h, 2, scores, 64), forward_heads(p, b, i, h, 1, scores, 64))
    else EACH_HEAD_PAIR(forward_heads(p, b, i, h, 2, scores, p->d), forward_heads(p, b, i, h, 1, scores, p->d))
}

static void backward_row(const Problem *p, int64_t b, int64_t i, int thread, float *buffer) {
    if (p->d == 64)
        EACH_HEAD_PAIR(backward_heads(p, b, i, h, 2, thread, buffer, 64), backward_heads(p, b, i, h, 1, thread, buffer, 64))
    else
        EACH_HEAD_PAIR(backward_heads(p, b, i, h, 2, thread, buffer, p->d),
                       backward_heads(p, b, i, h, 1, thread, buffer, p->d))
}

static void *forward_work(void *arg) {
    Work *work = arg;
    const Problem *p = work->problem;
    float *scores = malloc(((size_t)2 * (p->max_keys + 1) + 2 * p->d) * sizeof(float));
    if (!scores) { work->failed = 1; return NULL; }
    for (int64_t r = work->first; r < work->last; r += work->step) forward_row(p, r / p->m, r % p->m, scores);
    free(scores);
    return NULL;
}

static void *backward_work(void *arg) {
    Work *work = arg;
    const Problem *p = work->problem;
    zero_key_grads(p->dk, p->dv, p->bh, p->m, p->n, p->d, p->shared_grads, work);
    float *buffer = malloc(((size_t)4 * (p->max_keys + 1) + 4 * p->d) * sizeof(float));
    if (!buffer) { work->failed = 1; return NULL; }
    for (int64_t r = work->first; r < work->last; r += work->step) backward_row(p, r / p->m, r % p->m, work->thread, buffer);
    free(buffer);
    return NULL;
}

int span_attention_forward(const float *q, const float *k_t, const float *v, const int32_t *spans,
                           const float *weights, const float *gate, const float *phases, float *out, float *lse,
                           int64_t bh, int64_t g, int64_t m, int64_t d, int64_t n, int64_t S, int64_t max_keys,
                           int64_t spans_shared, int64_t heads, int64_t q_b, int64_t q_h, int64_t q_g, int64_t q_m,
                           int64_t v_b, int64_t v_h, int64_t v_n, float scale, int threads) {
    Problem p = {.q = q, .k_t = k_t, .v = v, .weights = weights, .gate = gate, .phases = phases, .spans = spans,
                 .out = out, .lse = lse, .bh = bh, .g = g, .m = m, .d = d, .n = n,
                 .n_tiled = (n + TILE - 1) / TILE * TILE, .S = S, .max_keys = max_keys, .heads = heads, .q_b = q_b,
                 .q_h = q_h, .q_g = q_g, .q_m = q_m, .v_b = v_b, .v_h = v_h, .v_n = v_n,
                 .spans_shared = spans_shared, .scale = scale};
    return run_rows(&p, bh * m, threads, 0, forward_work);
}

int span_attention_backward(const float *q, const float *k, const float *k_t, const float *v_t,
                            const int32_t *spans, const float *weights, const float *gate, const float *phases,
                            const float *lse, const float *dout, const float *dlse, float *dq, float *dk, float *dv,
                            float *dweights, float *dgate, int64_t bh, int64_t g, int64_t m, int64_t d, int64_t n,
                            int64_t S, int64_t max_keys, int64_t spans_shared, int64_t shared_grads, int64_t heads,
                            int64_t q_b, int64_t q_h, int64_t q_g, int64_t q_m, int64_t o_b, int64_t o_h, int64_t o_g,
                            int64_t o_m, float scale, int threads) {
    Problem p = {.q = q, .k = k, .k_t = k_t, .v_t = v_t, .weights = weights, .gate = gate, .phases = phases,
                 .spans = spans, .lse = (float *)lse, .dout = dout, .dlse = dlse, .dq = dq, .dk = dk, .dv = dv,
                 .dweights = dweights, .dgate = dgate, .bh = bh, .g = g, .m = m, .d = d, .n = n,
                 .n_tiled = (n + TILE - 1) / TILE * TILE, .S = S, .max_keys = max_keys, .heads = heads, .q_b = q_b,
                 .q_h = q_h, .q_g = q_g, .q_m = q_m, .o_b = o_b, .o_h = o_h, .o_g = o_g, .o_m = o_m,
                 .spans_shared = spans_shared, .shared_grads = shared_grads,
                 .scale = scale};
    return run_rows(&p, bh * m, threads, 0, backward_work);
}

/* The most keys one query's spans hold, into *max_keys, over `rows` rows of S spans; returns 2, and
 * sets nothing, where a span in use (end > start) reaches outside [0, n): the kernels above trust
 * every span and would read there. Serial: one pass over the spans, which the kernels read anyway. */
int span_extent(const int32_t *spans, int64_t *max_keys, int64_t rows, int64_t S, int64_t n, float unused,
                int threads) {
    (void)unused, (void)threads;
    int64_t most = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t keys = 0;
        for (const int32_t *span = spans + r * S * 2, *last = span + S * 2; span < last; span += 2) {
            if (span[1] <= span[0]) continue;
            if (span[0] < 0 || span[1] > n) return 2;
            keys += span[1] - span[0];
        }
        most = keys > most ? keys : most;
    }
    *max_keys = most;
    return 0;
}
