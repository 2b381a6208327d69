/* Gather attention on the CPU: each query attends, with every query head of its GQA group, to the
 * keys its indices name (DeepSeek Sparse Attention's top-k tokens), causal.
 *
 * One pass per query row (one position of one batch * kv head): its slots are resolved first into
 * a list of distinct visible keys (unused slots, -1, and keys after the query dropped; a key named
 * again counts once: a per-thread stamp per key position says whether this row has listed it), then
 * the heads of its group go through the list together, up to HEADS at a time, so that each
 * gathered key and value row is read once for them. Everything of one row stays in cache. The
 * backward recomputes the probabilities from the saved log-sum-exp, as flash attention does.
 * Rows are split into contiguous ranges over threads. Where each thread's rows are whole batch * kv
 * heads (shared_grads), the threads' key and value gradients never meet and go straight into one
 * buffer; otherwise each thread adds them into a buffer of its own, which the caller sums. Each
 * thread zeroes what it will add into. gather_attention_probabilities recomputes each slot's
 * probability, summed over the group's heads, for DSA's indexer to learn from.
 *
 * Layouts (fp32; the last dimension contiguous, the others strided as given):
 *   q, dout     [bh, m, g, d]   row (b, i, h) at b q_b + i q_m + h q_g (dout: o_b, o_m, o_g)
 *   k, v        [bh, n, d]      row (b, j) at b k_b + j k_n (v: v_b, v_n)
 *   indices     [bh, m, S]      int64 key positions, contiguous; < 0: an unused slot
 *   out, dq     [bh, m, g, d]   contiguous     lse, dlse [bh, m, g] contiguous (dlse may be NULL)
 *   dk, dv      [shared_grads ? 1 : threads, bh, n, d] contiguous
 * Query i sits at position start + i and sees keys j <= start + i.
 */

#include "native.h"

#define HEADS 4 /* heads of a group that share one pass over the keys: 4 x 2 dot products in flight */
#define AHEAD 8 /* keys ahead whose rows are prefetched: gathered rows are random, mostly out of L2 */

typedef struct {
    const float *q, *k, *v, *dout, *dlse;
    const int64_t *indices;
    float *out, *lse, *dq, *dk, *dv;
    int64_t bh, m, g, d, n, S, start;
    int64_t q_b, q_m, q_g, k_b, k_n, v_b, v_n, o_b, o_m, o_g;
    int shared_grads;
    float scale;
} Problem;

/* What one thread keeps: the stamp of the last row that listed each key position (n), the row's
 * keys and the slot that named each first (S), and the scores (probabilities) of up to HEADS heads
 * and their gradients. */
typedef struct {
    int64_t *seen, *keys, *slots;
    float *scores, *grads;
} Scratch;

static int scratch_new(Scratch *s, const Problem *p) {
    s->seen = malloc((size_t)(p->n ? p->n : 1) * sizeof(int64_t));
    s->keys = malloc((size_t)2 * (p->S + 1) * sizeof(int64_t));
    s->scores = malloc((size_t)2 * HEADS * (p->S + 1) * sizeof(float));
    if (!s->seen || !s->keys || !s->scores) return 1;
    for (int64_t j = 0; j < p->n; j++) s->seen[j] = -1;
    s->grads = s->scores + HEADS * (p->S + 1);
    s->slots = s->keys + p->S + 1;
    return 0;
}

static void scratch_free(Scratch *s) {
    free(s->seen), free(s->keys), free(s->scores);
}

/* The distinct keys that row r (query i of batch * kv head b) may see, in slot order, into keys
 * (the slot that names each first into slots); returns how many. */
INLINE int64_t row_keys(const Problem *p, int64_t r, int64_t i, Scratch *s) {
    const int64_t *slots = p->indices + r * p->S, last = p->start + i < p->n - 1 ? p->start + i : p->n - 1;
    int64_t count = 0;
    for (int64_t c = 0; c < p->S; c++) {
        const int64_t j = slots[c];
        if (j < 0 || j > last || s->seen[j] == r) continue;
        s->seen[j] = r;
        s->slots[count] = c;
        s->keys[count++] = j;
    }
    return count;
}

/* A table of rows a later pass over the keys reads or writes (rows NULL: none), fetched ahead */
typedef struct {
    const float *rows;
    int64_t stride;
} Table;

/* Asks for row keys[c + AHEAD] of `table` (d floats) to be brought into cache. */
INLINE void prefetch_ahead(Table table, const int64_t *keys, int64_t c, int64_t count, int64_t d) {
    if (!table.rows || c + AHEAD >= count) return;
    const float *row = table.rows + keys[c + AHEAD] * table.stride;
    for (int64_t e = 0; e < d; e += 64 / sizeof(float)) __builtin_prefetch(row + e, 0, 3);
}

INLINE float sum_lanes(vec x) {
    float total = 0.0f;
    for (int l = 0; l < VEC; l++) total += x[l];
    return total;
}

/* dots[h][c] = scale * (x[h] . row keys[c]) for nh heads (a constant after inlining); each row is
 * loaded once for every head, two partial sums a head so that the multiply-adds overlap. The rows
 * are fetched AHEAD keys ahead, with those of the tables `later` (two, or NULL) that the next passes
 * take: this pass does enough work a key to hide the latency, a plain pass over rows does not. */
INLINE void key_dots(float *dots, int64_t stride, const float *const *x, const int nh, const float *rows,
                     int64_t row_stride, const int64_t *keys, int64_t count, const int64_t d, float scale,
                     const Table *later) {
    const Table own = {rows, row_stride}, none = {NULL, 0}, first = later ? later[0] : none,
                second = later ? later[1] : none;
    if (d % (2 * VEC)) { /* any other width: plain loops */
        for (int64_t c = 0; c < count; c++) {
            const float *row = rows + keys[c] * row_stride;
            prefetch_ahead(own, keys, c, count, d), prefetch_ahead(first, keys, c, count, d);
            prefetch_ahead(second, keys, c, count, d);
            for (int h = 0; h < nh; h++) {
                float total = 0.0f;
#pragma omp simd reduction(+ : total)
                for (int64_t e = 0; e < d; e++) total += x[h][e] * row[e];
                dots[h * stride + c] = scale * total;
            }
        }
        return;
    }
    for (int64_t c = 0; c < count; c++) {
        const float *row = rows + keys[c] * row_stride;
        prefetch_ahead(own, keys, c, count, d), prefetch_ahead(first, keys, c, count, d);
        prefetch_ahead(second, keys, c, count, d);
        vec acc[HEADS][2];
        for (int h = 0; h < nh; h++) acc[h][0] = acc[h][1] = (vec){0};
        for (int64_t e = 0; e < d; e += 2 * VEC) {
            const vec r0 = *(const vec *)(row + e), r1 = *(const vec *)(row + e + VEC);
            for (int h = 0; h < nh; h++) {
                acc[h][0] += *(const vec *)(x[h] + e) * r0;
                acc[h][1] += *(const vec *)(x[h] + e + VEC) * r1;
            }
        }
        for (int h = 0; h < nh; h++) dots[h * stride + c] = scale * sum_lanes(acc[h][0] + acc[h][1]);
    }
}

/* y[h][0..d) = sum over c of coef[h][c] * row keys[c], for nh heads, a piece of 2 VEC columns at a
 * time: the sums stay in registers across the keys (4 heads: 8 sums and 2 rows of 16 registers). */
INLINE void weighted_rows(float *const *y, const float *coef, int64_t stride, const int nh, const float *rows,
                          int64_t row_stride, const int64_t *keys, int64_t count, const int64_t d) {
    if (d % (2 * VEC)) {
        for (int h = 0; h < nh; h++) memset(y[h], 0, d * sizeof(float));
        for (int64_t c = 0; c < count; c++) {
            const float *row = rows + keys[c] * row_stride;
            for (int h = 0; h < nh; h++) {
                const float a = coef[h * stride + c];
#pragma omp simd
                for (int64_t e = 0; e < d; e++) y[h][e] += a * row[e];
            }
        }
        return;
    }
    for (int64_t e = 0; e < d; e += 2 * VEC) {
        vec acc[HEADS][2];
        for (int h = 0; h < nh; h++) acc[h][0] = acc[h][1] = (vec){0};
        for (int64_t c = 0; c < count; c++) {
            const float *row = rows + keys[c] * row_stride + e;
            const vec r0 = *(const vec *)row, r1 = *(const vec *)(row + VEC);
            for (int h = 0; h < nh; h++) {
                const float a = coef[h * stride + c];
                acc[h][0] += a * r0;
                acc[h][1] += a * r1;
            }
        }
        for (int h = 0; h < nh; h++) {
            *(vec *)(y[h] + e) = acc[h][0];
            *(vec *)(y[h] + e + VEC) = acc[h][1];
        }
    }
}

/* row[0..d) += sum over h < nh of a[h] * x[h]: one read and write of the row for every head */
INLINE void add_heads(float *row, const float *a, const float *const *x, const int nh, const int64_t d) {
#pragma omp simd
    for (int64_t e = 0; e < d; e++) {
        float total = row[e];
        for (int h = 0; h < nh; h++) total += a[h] * x[h][e];
        row[e] = total;
    }
}

/* Heads h0 .. h0 + nh - 1 of row r over its count keys. */
INLINE void forward_heads(const Problem *p, int64_t b, int64_t i, int64_t h0, const int nh, int64_t count,
                          Scratch *s, const int64_t d) {
    const int64_t r = b * p->m + i, stride = p->S + 1;
    const float *q[HEADS];
    float *out[HEADS];
    for (int h = 0; h < nh; h++) {
        q[h] = p->q + b * p->q_b + i * p->q_m + (h0 + h) * p->q_g;
        out[h] = p->out + (r * p->g + h0 + h) * d;
    }
    const Table values[2] = {{p->v + b * p->v_b, p->v_n}, {NULL, 0}};
    key_dots(s->scores, stride, q, nh, p->k + b * p->k_b, p->k_n, s->keys, count, d, p->scale, values);
    for (int h = 0; h < nh; h++) {
        float total, *probs = s->scores + h * stride;
        p->lse[r * p->g + h0 + h] = exp_less_max(probs, count, &total);
        const float inverse = 1.0f / total;
#pragma omp simd
        for (int64_t c = 0; c < count; c++) probs[c] *= inverse;
    }
    weighted_rows(out, s->scores, stride, nh, p->v + b * p->v_b, p->v_n, s->keys, count, d);
}

/* The backward of forward_heads. */
INLINE void backward_heads(const Problem *p, int64_t b, int64_t i, int64_t h0, const int nh, int64_t count,
                           float *dk, float *dv, Scratch *s, const int64_t d) {
    const int64_t r = b * p->m + i, stride = p->S + 1;
    const float *q[HEADS], *dout[HEADS];
    float *dq[HEADS], *probs = s->scores, *dprobs = s->grads;
    for (int h = 0; h < nh; h++) {
        q[h] = p->q + b * p->q_b + i * p->q_m + (h0 + h) * p->q_g;
        dout[h] = p->dout + b * p->o_b + i * p->o_m + (h0 + h) * p->o_g;
        dq[h] = p->dq + (r * p->g + h0 + h) * d;
    }
    const Table values[2] = {{p->v + b * p->v_b, p->v_n}, {NULL, 0}}, grads[2] = {{dk, d}, {dv, d}};
    key_dots(probs, stride, q, nh, p->k + b * p->k_b, p->k_n, s->keys, count, d, p->scale, values);
    key_dots(dprobs, stride, dout, nh, p->v + b * p->v_b, p->v_n, s->keys, count, d, 1.0f, grads); /* dP = dO . v */
    for (int h = 0; h < nh; h++) {
        /* dS = P * (dP - sum(P * dP) + dlse) */
        const float lse = p->lse[r * p->g + h0 + h];
        float *ph = probs + h * stride, *dph = dprobs + h * stride;
        float total = p->dlse ? -p->dlse[r * p->g + h0 + h] : 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t c = 0; c < count; c++) {
            ph[c] = exp_nonpositive(ph[c] - lse);
            total += ph[c] * dph[c];
        }
#pragma omp simd
        for (int64_t c = 0; c < count; c++) dph[c] = ph[c] * (dph[c] - total) * p->scale;
    }
    for (int64_t c = 0; c < count; c++) {
        const int64_t j = s->keys[c];
        float dscore[HEADS], share[HEADS];
        for (int h = 0; h < nh; h++) dscore[h] = dprobs[h * stride + c], share[h] = probs[h * stride + c];
        add_heads(dk + j * d, dscore, q, nh, d);
        add_heads(dv + j * d, share, dout, nh, d);
    }
    weighted_rows(dq, dprobs, stride, nh, p->k + b * p->k_b, p->k_n, s->keys, count, d);
}

/* Each row's heads HEADS at a time (the last few fewer), specialized for the common head width
 * (loops unrolled, sums in registers) */
#define EACH_HEAD_BLOCK(call)                                  \
    for (int64_t h = 0; h < p->g; h += HEADS) {                 \
        switch (p->g - h < HEADS ? p->g - h : HEADS) {          \
        case 1: call(1); break;                                 \
        case 2: call(2); break;                                 \
        case 3: call(3); break;                                 \
        default: call(HEADS); break;                            \
        }                                                       \
    }

static void forward_row(const Problem *p, int64_t b, int64_t i, Scratch *s) {
    const int64_t r = b * p->m + i, count = row_keys(p, r, i, s);
    if (count == 0) { /* nothing visible: zeros, and a log-sum-exp of -inf */
        memset(p->out + r * p->g * p->d, 0, p->g * p->d * sizeof(float));
        for (int64_t h = 0; h < p->g; h++) p->lse[r * p->g + h] = -INFINITY;
        return;
    }
#define FORWARD_64(nh) forward_heads(p, b, i, h, nh, count, s, 64)
#define FORWARD_D(nh) forward_heads(p, b, i, h, nh, count, s, p->d)
    if (p->d == 64) EACH_HEAD_BLOCK(FORWARD_64)
    else EACH_HEAD_BLOCK(FORWARD_D)
}

static void backward_row(const Problem *p, int64_t b, int64_t i, float *dk, float *dv, Scratch *s) {
    const int64_t r = b * p->m + i, count = row_keys(p, r, i, s);
    if (count == 0) { /* the output was 0 whatever q, k and v */
        memset(p->dq + r * p->g * p->d, 0, p->g * p->d * sizeof(float));
        return;
    }
#define BACKWARD_64(nh) backward_heads(p, b, i, h, nh, count, dk, dv, s, 64)
#define BACKWARD_D(nh) backward_heads(p, b, i, h, nh, count, dk, dv, s, p->d)
    if (p->d == 64) EACH_HEAD_BLOCK(BACKWARD_64)
    else EACH_HEAD_BLOCK(BACKWARD_D)
}

static void *forward_work(void *arg) {
    Work *work = arg;
    const Problem *p = work->problem;
    Scratch s;
    if (scratch_new(&s, p)) { work->failed = 1; scratch_free(&s); return NULL; }
    for (int64_t r = work->first; r < work->last; r += work->step) forward_row(p, r / p->m, r % p->m, &s);
    scratch_free(&s);
    return NULL;
}

static void *backward_work(void *arg) {
    Work *work = arg;
    const Problem *p = work->problem;
    zero_key_grads(p->dk, p->dv, p->bh, p->m, p->n, p->d, p->shared_grads, work);
    Scratch s;
    if (scratch_new(&s, p)) { work->failed = 1; scratch_free(&s); return NULL; }
    const int64_t buffer = p->shared_grads ? 0 : work->thread * p->bh;
    for (int64_t r = work->first; r < work->last; r += work->step) {
        const int64_t b = r / p->m, at = (buffer + b) * p->n * p->d;
        backward_row(p, b, r % p->m, p->dk + at, p->dv + at, &s);
    }
    scratch_free(&s);
    return NULL;
}

/* Heads h0 .. h0 + nh - 1 of row r: their probabilities of its keys, added into probs[0..S). */
INLINE void probability_heads(const Problem *p, int64_t b, int64_t i, int64_t h0, const int nh, int64_t count,
                              float *probs, Scratch *s, const int64_t d) {
    const int64_t r = b * p->m + i, stride = p->S + 1;
    const float *q[HEADS];
    for (int h = 0; h < nh; h++) q[h] = p->q + b * p->q_b + i * p->q_m + (h0 + h) * p->q_g;
    key_dots(s->scores, stride, q, nh, p->k + b * p->k_b, p->k_n, s->keys, count, d, p->scale, NULL);
    for (int h = 0; h < nh; h++) {
        const float lse = p->lse[r * p->g + h0 + h], *scores = s->scores + h * stride;
        for (int64_t c = 0; c < count; c++) probs[s->slots[c]] += exp_nonpositive(scores[c] - lse);
    }
}

static void *probabilities_work(void *arg) {
    Work *work = arg;
    const Problem *p = work->problem;
    Scratch s;
    if (scratch_new(&s, p)) { work->failed = 1; scratch_free(&s); return NULL; }
    for (int64_t r = work->first; r < work->last; r += work->step) {
        const int64_t b = r / p->m, i = r % p->m, count = row_keys(p, r, i, &s);
        float *probs = p->out + r * p->S;
        memset(probs, 0, p->S * sizeof(float));
#define PROBABILITIES_64(nh) probability_heads(p, b, i, h, nh, count, probs, &s, 64)
#define PROBABILITIES_D(nh) probability_heads(p, b, i, h, nh, count, probs, &s, p->d)
        if (count == 0) continue;
        if (p->d == 64) EACH_HEAD_BLOCK(PROBABILITIES_64)
        else EACH_HEAD_BLOCK(PROBABILITIES_D)
    }
    scratch_free(&s);
    return NULL;
}

/* probs [bh, m, S] (contiguous): each slot's attention probability summed over the group's heads,
 * from the log-sum-exps of gather_attention_forward; 0 in a slot that names no visible key or one
 * an earlier slot names. */
int gather_attention_probabilities(const float *q, const float *k, const int64_t *indices, const float *lse,
                                   float *probs, int64_t bh, int64_t m, int64_t g, int64_t d, int64_t n, int64_t S,
                                   int64_t start, int64_t q_b, int64_t q_m, int64_t q_g, int64_t k_b, int64_t k_n,
                                   float scale, int threads) {
    Problem p = {.q = q, .k = k, .indices = indices, .lse = (float *)lse, .out = probs, .bh = bh, .m = m, .g = g,
                 .d = d, .n = n, .S = S, .start = start, .q_b = q_b, .q_m = q_m, .q_g = q_g, .k_b = k_b, .k_n = k_n,
                 .scale = scale};
    return run_rows(&p, bh * m, threads, 0, probabilities_work);
}

int gather_attention_forward(const float *q, const float *k, const float *v, const int64_t *indices, float *out,
                             float *lse, int64_t bh, int64_t m, int64_t g, int64_t d, int64_t n, int64_t S,
                             int64_t start, int64_t q_b, int64_t q_m, int64_t q_g, int64_t k_b, int64_t k_n,
                             int64_t v_b, int64_t v_n, float scale, int threads) {
    Problem p = {.q = q, .k = k, .v = v, .indices = indices, .out = out, .lse = lse, .bh = bh, .m = m, .g = g,
                 .d = d, .n = n, .S = S, .start = start, .q_b = q_b, .q_m = q_m, .q_g = q_g, .k_b = k_b, .k_n = k_n,
                 .v_b = v_b, .v_n = v_n, .scale = scale};
    return run_rows(&p, bh * m, threads, 0, forward_work);
}

int gather_attention_backward(const float *q, const float *k, const float *v, const int64_t *indices,
                              const float *lse, const float *dout, const float *dlse, float *dq, float *dk, float *dv,
                              int64_t bh, int64_t m, int64_t g, int64_t d, int64_t n, int64_t S, int64_t start,
                              int64_t shared_grads, int64_t q_b, int64_t q_m, int64_t q_g, int64_t k_b, int64_t k_n,
                              int64_t v_b, int64_t v_n, int64_t o_b, int64_t o_m, int64_t o_g, float scale,
                              int threads) {
    Problem p = {.q = q, .k = k, .v = v, .dout = dout, .dlse = dlse, .indices = indices, .lse = (float *)lse,
                 .dq = dq, .dk = dk, .dv = dv, .bh = bh, .m = m, .g = g, .d = d, .n = n, .S = S, .start = start,
                 .q_b = q_b, .q_m = q_m, .q_g = q_g, .k_b = k_b, .k_n = k_n, .v_b = v_b, .v_n = v_n, .o_b = o_b,
                 .o_m = o_m, .o_g = o_g, .shared_grads = (int)shared_grads, .scale = scale};
    return run_rows(&p, bh * m, threads, 0, backward_work);
}
