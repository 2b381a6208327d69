/* NSA's block selection from position 0 on the CPU, in one pass per query: its compressed-attention
 * probabilities (each head of the GQA group over the compressed blocks complete by then), summed
 * over the group, spread onto fine blocks by token overlap, and the most important fine blocks
 * besides the forced ones, never in the future. No [n, blocks] score matrix exists, and no
 * gradient is kept (selection passes none).
 * Given the compressed values, the same probabilities also give the compressed branch's output
 * and log-sum-exp, so that a training step scores each query against the compressed keys once (as
 * the paper reuses them). Its backward (compressed_backward, below) recomputes each query's
 * probabilities from the log-sum-exp the pass kept, as flash attention's does, over the same
 * visible blocks, with the same register-blocked products.
 *
 * Layouts (contiguous):
 *   q        [bh, g, m, d] fp32, the query of head h at position t of batch * kv head b at
 *            (b / heads) q_b + (b % heads) q_h + h q_g + t q_m (a view of the projection, say)
 *   kc_t     [bh, blocks / TILE, d, TILE] fp32, the compressed keys in transposed tiles
 *   vc       [bh, blocks, d] fp32, the compressed values, or NULL (no blocks): no output
 *   out      [bh, g, m, d] fp32 out (with vc): each head's attention over its visible blocks, 0 where none
 *   lse      [bh, g, m] fp32 out (with vc): its log-sum-exp, -inf where no block is visible
 *   scores   [bh, m, free] fp32 out: the chosen blocks' importance, -inf for a slot with no block left
 *   indices  [bh, m, free] int64 out: the chosen fine blocks, most important first (ties: the earlier
 *            block), 0 for an empty slot
 * Compressed block j covers tokens [j * stride, j * stride + block) and is complete at its last
 * token. Forced blocks (not chosen here, as many as `forced`, in this priority): the query's own
 * block, the initial block, the previous block. */

#include "native.h"

#define QUERIES 8      /* consecutive queries scored together: each key tile loaded serves them all */
#define ROWS_AT_ONCE 4 /* queries weighting the values together: each value row loaded serves them all */
/* Both passes take HEADS_AT_ONCE heads of the GQA group together (their rows share the compressed
 * keys and values) and the blocks in chunks of CHUNK where they can (the output's products, the whole
 * backward): each chunk's keys, values and gradient rows (CHUNK * d floats each) are read from memory
 * once for all those rows and stay in the core's caches for the products that use them. Each head's
 * 8 rows over every visible block in turn streamed every [blocks, d] array from L3 once per product
 * and 8 rows (at 32k tokens, 4,095 blocks: 1 MB each). */
#define HEADS_AT_ONCE 2
#define GROUP_ROWS (HEADS_AT_ONCE * QUERIES)
#define CHUNK 64 /* blocks: a multiple of TILE */

typedef struct {
    const float *q, *kc_t, *vc;
    float *scores, *out, *lse;
    int64_t *indices;
    int64_t bh, g, m, d, blocks, blocks_tiled, block, stride, fine_block, unit, forced, free;
    int64_t heads, q_b, q_h, q_g, q_m;
    float scale;
    /* the backward's (compressed_backward) */
    const float *vc_t, *dout, *out_f, *kc;
    float *dq, *dkc, *dvc; /* dkc, dvc: [threads, bh, blocks, d] partial sums, one per thread */
} Problem;

INLINE int64_t visible_blocks(const Problem *p, int64_t t) {
    if (t + 1 < p->block) return 0;
    const int64_t count = (t + 1 - p->block) / p->stride + 1;
    return count < p->blocks ? count : p->blocks;
}

/* scores[r][0..hi) = scale * (q_r . key j) for nrows query rows at once (row stride d; a multiple
 * of SCORE_ROWS, a constant after inlining), so that each tile of keys loaded serves several rows:
 * one vector multiply-add per row, register and dimension. The rows go in blocks whose
 * accumulators fill half the ISA's registers (AVX-512: 8 rows, one register a tile; AVX2: 4 rows,
 * two registers a tile), the rest holding keys. Whole tiles are written: up to hi rounded up to TILE. */
#define SCORE_ROWS (VEC_REGS / 2 / VEC_PER_TILE < QUERIES ? VEC_REGS / 2 / VEC_PER_TILE : QUERIES)
INLINE void rows_scores(float *scores, int64_t ld, const float *q, const float *tiles, int64_t d, int64_t hi,
                        float scale, const int nrows) {
    for (int64_t t0 = 0; t0 < hi; t0 += TILE) {
        const float *tile = tiles + t0 * d;
        for (int r0 = 0; r0 < nrows; r0 += SCORE_ROWS) {
            vec acc[SCORE_ROWS][VEC_PER_TILE];
            for (int r = 0; r < SCORE_ROWS; r++)
                for (int x = 0; x < VEC_PER_TILE; x++) acc[r][x] = (vec){0};
            for (int64_t e = 0; e < d; e++) {
                vec keys[VEC_PER_TILE];
                for (int x = 0; x < VEC_PER_TILE; x++) keys[x] = *(const vec *)(tile + e * TILE + x * VEC);
                for (int r = 0; r < SCORE_ROWS; r++)
                    for (int x = 0; x < VEC_PER_TILE; x++) acc[r][x] += q[(r0 + r) * d + e] * keys[x];
            }
            for (int r = 0; r < SCORE_ROWS; r++)
                for (int x = 0; x < VEC_PER_TILE; x++)
                    *(vec *)(scores + (r0 + r) * ld + t0 + x * VEC) = acc[r][x] * scale;
        }
    }
}

/* out[r] += inverse[r] * sum over j < count of weights[r][j] * values[j], for ROWS_AT_ONCE rows
 * (row stride ld for weights, d for out; a NULL row is skipped; callers zero out, then add a chunk
 * of blocks at a time): each value row loaded serves them all, the sums in vector registers (d a
 * constant multiple of VEC after inlining), d in pieces of VALUE_REGS registers so that the sums
 * fill half the ISA's registers (AVX-512: d = 64 in one piece; AVX2: 16 floats a piece). Weights
 * past a row's own count are 0. */
#define VALUE_REGS (VEC_REGS / 2 / ROWS_AT_ONCE)
/* registers x0..x0+regs of rows_weighted_values (regs a constant after inlining, so that the sums
 * are registers: a width known only at run time put them on the stack) */
INLINE void weighted_values_piece(float *const *out, const float *weights, int64_t ld, const float *inverse,
                                  const float *values, int64_t count, const int64_t d, int64_t x0, const int regs) {
    vec acc[ROWS_AT_ONCE][VALUE_REGS];
    for (int r = 0; r < ROWS_AT_ONCE; r++)
        for (int x = 0; x < regs; x++) acc[r][x] = (vec){0};
    for (int64_t j = 0; j < count; j++) {
        const float *row = values + j * d + x0 * VEC;
        for (int x = 0; x < regs; x++) {
            const vec v = *(const vec *)(row + x * VEC);
            for (int r = 0; r < ROWS_AT_ONCE; r++) acc[r][x] += weights[r * ld + j] * v;
        }
    }
    for (int r = 0; r < ROWS_AT_ONCE; r++)
        if (out[r])
            for (int x = 0; x < regs; x++) *(vec *)(out[r] + (x0 + x) * VEC) += acc[r][x] * inverse[r];
}

INLINE void rows_weighted_values(float *const *out, const float *weights, int64_t ld, const float *inverse,
                                 const float *values, int64_t count, const int64_t d) {
    if (d % VEC) { /* any other width: plain multiply-adds */
        for (int r = 0; r < ROWS_AT_ONCE; r++) {
            if (!out[r]) continue;
            for (int64_t j = 0; j < count; j++) {
                const float a = weights[r * ld + j] * inverse[r];
#pragma omp simd
                for (int64_t e = 0; e < d; e++) out[r][e] += a * values[j * d + e];
            }
        }
        return;
    }
    int64_t x0 = 0;
    for (; x0 + VALUE_REGS <= d / VEC; x0 += VALUE_REGS)
        weighted_values_piece(out, weights, ld, inverse, values, count, d, x0, VALUE_REGS);
    for (; x0 < d / VEC; x0++) weighted_values_piece(out, weights, ld, inverse, values, count, d, x0, 1);
}

/* For the QUERIES queries from t0 of batch * kv head b and heads h0..h0+nh-1 of its group (nh <=
 * HEADS_AT_ONCE, a constant after inlining; row i is head h0 + i / QUERIES, query t0 + i % QUERIES):
 * probs[r][0..visible_r) += each head's softmax over the compressed blocks visible to query t0 + r
 * (rows past the sequence repeat its last query), heads in order; with values, each head's output
 * and log-sum-exp too. */
INLINE void heads_probabilities(const Problem *p, int64_t b, int64_t t0, int64_t h0, const int nh,
                                const int64_t *visible, float *scores, float *probs, float *q, const int64_t d) {
    const int nrows = nh * QUERIES;
    const int64_t ld = p->blocks_tiled, last = p->m - 1, most = visible[QUERIES - 1];
    for (int i = 0; i < nrows; i++) {
        const int64_t t = t0 + i % QUERIES < last ? t0 + i % QUERIES : last;
        memcpy(q + i * d,
               p->q + (b / p->heads) * p->q_b + (b % p->heads) * p->q_h + (h0 + i / QUERIES) * p->q_g + t * p->q_m,
               d * sizeof(float));
    }
    rows_scores(scores, ld, q, p->kc_t + b * ld * d, d, most, p->scale, nrows);
    float inverse[GROUP_ROWS], *out[GROUP_ROWS];
    for (int i = 0; i < nrows; i++) {
        const int r = i % QUERIES;
        float *row = scores + i * ld, *sum = probs + r * ld;
        const int64_t count = visible[r], head_row = (b * p->g + h0 + i / QUERIES) * p->m + t0 + r;
        const int kept = p->vc && t0 + r < p->m;
        out[i] = kept ? p->out + head_row * d : NULL;
        for (int64_t j = count; j < most; j++) row[j] = 0.0f; /* blocks this query cannot see yet */
        inverse[i] = 0.0f;
        if (count == 0) {
            if (kept) p->lse[head_row] = -INFINITY;
            continue;
        }
        float total;
        const float lse = exp_less_max(row, count, &total);
        if (kept) p->lse[head_row] = lse;
        inverse[i] = 1.0f / total;
#pragma omp simd
        for (int64_t j = 0; j < count; j++) sum[j] += row[j] * inverse[i];
    }
    if (!p->vc) return;
    for (int i = 0; i < nrows; i++)
        if (out[i]) memset(out[i], 0, d * sizeof(float));
    const float *values = p->vc + b * p->blocks * d;
    for (int64_t c0 = 0; c0 < most; c0 += CHUNK) {
        const int64_t n = most - c0 < CHUNK ? most - c0 : CHUNK;
        for (int r0 = 0; r0 < nrows; r0 += ROWS_AT_ONCE)
            rows_weighted_values(out + r0, scores + r0 * ld + c0, ld, inverse + r0, values + c0 * d, n, d);
    }
}

/* probs[r][0..visible_r) = the group's summed softmax over the compressed blocks visible to query
 * t0 + r, for the QUERIES queries from t0; with values, each head's output and log-sum-exp too */
INLINE void group_probabilities(const Problem *p, int64_t b, int64_t t0, const int64_t *visible, float *scores,
                                float *probs, float *q, const int64_t d) {
    memset(probs, 0, QUERIES * p->blocks_tiled * sizeof(float));
    int64_t h0 = 0;
    for (; h0 + HEADS_AT_ONCE <= p->g; h0 += HEADS_AT_ONCE)
        heads_probabilities(p, b, t0, h0, HEADS_AT_ONCE, visible, scores, probs, q, d);
    for (; h0 < p->g; h0++) heads_probabilities(p, b, t0, h0, 1, visible, scores, probs, q, d);
}

/* importance[f] = share * (fine block f's `per` segments summed in their order), f < fine: `per` a
 * constant after inlining, so that the loop over f vectorizes, each lane adding its segments in the
 * order one block at a time would (the sums, and so the choice, are the same to the bit). Scalar, with
 * a chain of dependent adds per block, this was a third of choose's time at 32k tokens. */
INLINE void fine_sums(float *importance, const float *segments, int64_t fine, const int per, float share) {
#pragma omp simd
    for (int64_t f = 0; f < fine; f++) {
        float total = 0.0f;
        for (int c = 0; c < per; c++) total += segments[f * per + c];
        importance[f] = total * share;
    }
}

#define SCAN 16 /* fine blocks whose importance is compared with the slots' least at once */

/* Query t's choice from its summed probabilities over its visible blocks. */
static void choose(const Problem *p, int64_t b, int64_t t, int64_t visible, const float *probs, float *segments,
                   float *importance) {
    const int64_t fine = t / p->fine_block + 1, own = t / p->fine_block;
    /* each block's probability spread evenly over its segments of `unit` tokens, summed per fine
     * block: strided adds, no division per block */
    const int64_t step = p->stride / p->unit, per_block = p->block / p->unit, per_fine = p->fine_block / p->unit;
    memset(segments, 0, fine * per_fine * sizeof(float));
    if (step == 1) { /* the stride is the unit (it divides the block and the fine block): contiguous adds */
        for (int64_t r = 0; r < per_block; r++) {
            float *to = segments + r;
#pragma omp simd
            for (int64_t j = 0; j < visible; j++) to[j] += probs[j];
        }
    } else {
        for (int64_t r = 0; r < per_block; r++) {
#pragma omp simd
            for (int64_t j = 0; j < visible; j++) segments[r + j * step] += probs[j];
        }
    }
    const float share = 1.0f / (float)per_block;
    switch (per_fine) {
    case 1: fine_sums(importance, segments, fine, 1, share); break;
    case 2: fine_sums(importance, segments, fine, 2, share); break;
    case 4: fine_sums(importance, segments, fine, 4, share); break;
    case 8: fine_sums(importance, segments, fine, 8, share); break;
    default:
        for (int64_t f = 0; f < fine; f++) {
            float total = 0.0f;
            for (int64_t c = 0; c < per_fine; c++) total += segments[f * per_fine + c];
            importance[f] = total * share;
        }
    }
    importance[own] = -INFINITY; /* forced blocks are not chosen */
    if (p->forced >= 2) importance[0] = -INFINITY;
    if (p->forced >= 3 && own >= 1) importance[own - 1] = -INFINITY;
    float *best = p->scores + (b * p->m + t) * p->free;
    int64_t *chosen = p->indices + (b * p->m + t) * p->free;
    for (int64_t s = 0; s < p->free; s++) best[s] = -INFINITY, chosen[s] = 0;
    if (p->free == 0) return;
    /* insertion into the sorted few (equal ones keep their order), SCAN blocks at a time: a run of
     * blocks none of which beats the least kept one (most of them, once the slots fill) is passed
     * over by one vector compare; -inf and NaN never beat it, as one at a time */
    for (int64_t f0 = 0; f0 < fine; f0 += SCAN) {
        const int64_t n = fine - f0 < SCAN ? fine - f0 : SCAN;
        const float least = best[p->free - 1];
        int beats = 0;
#pragma omp simd reduction(| : beats)
        for (int64_t f = 0; f < n; f++) beats |= importance[f0 + f] > least;
        if (!beats) continue;
        for (int64_t f = f0; f < f0 + n; f++) {
            const float value = importance[f];
            if (!(value > best[p->free - 1])) continue;
            int64_t s = p->free - 1;
            while (s > 0 && best[s - 1] < value) {
                best[s] = best[s - 1], chosen[s] = chosen[s - 1];
                s--;
            }
            best[s] = value, chosen[s] = f;
        }
    }
}

INLINE void select_rows_of(const Problem *p, int64_t b, int64_t t0, float *scores, float *probs, float *q,
                           float *segments, float *importance, const int64_t d) {
    int64_t visible[QUERIES];
    for (int r = 0; r < QUERIES; r++) visible[r] = visible_blocks(p, t0 + r < p->m ? t0 + r : p->m - 1);
    group_probabilities(p, b, t0, visible, scores, probs, q, d);
    for (int r = 0; r < QUERIES && t0 + r < p->m; r++)
        choose(p, b, t0 + r, visible[r], probs + r * p->blocks_tiled, segments, importance);
}

static void *select_work(void *arg) {
    Work *work = arg;
    const Problem *p = work->problem;
    const int64_t fine = (p->m - 1) / p->fine_block + 1, ld = p->blocks_tiled, groups = (p->m + QUERIES - 1) / QUERIES;
    const int64_t segments_size = fine * (p->fine_block / p->unit);
    float *scores =
        line_aligned((size_t)(GROUP_ROWS * (ld + p->d) + QUERIES * ld + segments_size + fine) * sizeof(float));
    if (!scores) { work->failed = 1; return NULL; }
    float *probs = scores + GROUP_ROWS * ld, *q = probs + QUERIES * ld, *segments = q + GROUP_ROWS * p->d;
    float *importance = segments + segments_size;
    for (int64_t r = work->first; r < work->last; r += work->step) {
        const int64_t b = r / groups, t0 = r % groups * QUERIES;
        if (p->d == 64) select_rows_of(p, b, t0, scores, probs, q, segments, importance, 64);
        else select_rows_of(p, b, t0, scores, probs, q, segments, importance, p->d);
    }
    free(scores);
    return NULL;
}

/* acc[j] += sum over the nrows rows r of weights[r][j] * rows[r], for j < count (acc rows of d
 * floats, weights with row stride ld): dkc += ds^T q and dvc += p^T dout, as a matrix product in
 * register tiles of OUTER_J accumulator rows by OUTER_X registers (half the ISA's registers;
 * AVX2: 4 rows of 16 floats, AVX-512: 4 rows of 64), each loaded and stored once per call while
 * the nrows rows stream past: 2 + OUTER_J loads per 2 * OUTER_J multiply-adds on AVX2, with no
 * chain of adds into one register (one accumulator row at a time waited on its own adds). The
 * rows are added in their order, as one at a time would. nj, regs, nrows: constants after inlining. */
#define OUTER_J 4
#define OUTER_X (VEC_REGS / 2 / OUTER_J)
INLINE void outer_tile(float *acc, const float *weights, int64_t ld, const float *rows, int64_t j0, const int nj,
                       const int64_t d, int64_t x0, const int regs, const int nrows) {
    vec sum[OUTER_J][OUTER_X];
    for (int jj = 0; jj < nj; jj++)
        for (int x = 0; x < regs; x++) sum[jj][x] = *(const vec *)(acc + (j0 + jj) * d + (x0 + x) * VEC);
    for (int r = 0; r < nrows; r++) {
        vec row[OUTER_X];
        for (int x = 0; x < regs; x++) row[x] = *(const vec *)(rows + r * d + (x0 + x) * VEC);
        for (int jj = 0; jj < nj; jj++) {
            const float a = weights[r * ld + j0 + jj];
            for (int x = 0; x < regs; x++) sum[jj][x] += a * row[x];
        }
    }
    for (int jj = 0; jj < nj; jj++)
        for (int x = 0; x < regs; x++) *(vec *)(acc + (j0 + jj) * d + (x0 + x) * VEC) = sum[jj][x];
}

INLINE void outer_columns(float *acc, const float *weights, int64_t ld, const float *rows, int64_t count,
                          const int64_t d, int64_t x0, const int regs, const int nrows) {
    int64_t j0 = 0;
    for (; j0 + OUTER_J <= count; j0 += OUTER_J) outer_tile(acc, weights, ld, rows, j0, OUTER_J, d, x0, regs, nrows);
    switch (count - j0) { /* the last rows, with a constant count each */
    case 3: outer_tile(acc, weights, ld, rows, j0, 3, d, x0, regs, nrows); break;
    case 2: outer_tile(acc, weights, ld, rows, j0, 2, d, x0, regs, nrows); break;
    case 1: outer_tile(acc, weights, ld, rows, j0, 1, d, x0, regs, nrows); break;
    default: break;
    }
}

INLINE void rows_outer_accumulate(float *acc, const float *weights, int64_t ld, const float *rows, int64_t count,
                                  const int64_t d, const int nrows) {
    if (d % VEC) { /* any other width: plain multiply-adds */
        for (int64_t j = 0; j < count; j++)
            for (int r = 0; r < nrows; r++) {
                const float a = weights[r * ld + j];
#pragma omp simd
                for (int64_t e = 0; e < d; e++) acc[j * d + e] += a * rows[r * d + e];
            }
        return;
    }
    int64_t x0 = 0;
    for (; x0 + OUTER_X <= d / VEC; x0 += OUTER_X) outer_columns(acc, weights, ld, rows, count, d, x0, OUTER_X, nrows);
    for (; x0 < d / VEC; x0++) outer_columns(acc, weights, ld, rows, count, d, x0, 1, nrows);
}

/* The backward of QUERIES queries from t0 of batch * kv head b, for heads h0..h0+nh-1 of its group
 * (nh <= HEADS_AT_ONCE, a constant after inlining; row i is head h0 + i / QUERIES, query
 * t0 + i % QUERIES): p = exp(scale q.k - lse) over the visible blocks, dp = dout . v,
 * ds = scale p (dp - dout . out); dq += ds kc, and this thread's dkc += ds q, dvc += p dout.
 * Rows past the sequence are zeros and see no block. */
INLINE void backward_rows_of(const Problem *p, int64_t b, int64_t t0, int64_t h0, const int nh, float *probs,
                             float *dprobs, float *q, float *dout, int thread, const int64_t d) {
    const int nrows = nh * QUERIES;
    int64_t visible[GROUP_ROWS], most = 0;
    float delta[GROUP_ROWS], lse[GROUP_ROWS];
    float *dq[GROUP_ROWS];
    for (int i = 0; i < nrows; i++) {
        const int64_t t = t0 + i % QUERIES, head = (b * p->g + h0 + i / QUERIES) * p->m;
        visible[i] = t < p->m ? visible_blocks(p, t) : 0;
        most = visible[i] > most ? visible[i] : most;
        dq[i] = NULL, delta[i] = 0.0f, lse[i] = 0.0f;
        if (t >= p->m) {
            memset(q + i * d, 0, d * sizeof(float)), memset(dout + i * d, 0, d * sizeof(float));
            continue;
        }
        memcpy(q + i * d,
               p->q + (b / p->heads) * p->q_b + (b % p->heads) * p->q_h + (h0 + i / QUERIES) * p->q_g + t * p->q_m,
               d * sizeof(float));
        memcpy(dout + i * d, p->dout + (head + t) * d, d * sizeof(float));
        const float *o = p->out_f + (head + t) * d;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t e = 0; e < d; e++) dot += dout[i * d + e] * o[e];
        delta[i] = dot, lse[i] = p->lse[head + t], dq[i] = p->dq + (head + t) * d;
    }
    if (most == 0) return; /* dq stays 0 (zeroed by the caller) */
    const int64_t ld = p->blocks_tiled;
    const float *kc_t = p->kc_t + b * ld * d, *vc_t = p->vc_t + b * ld * d, *kc = p->kc + b * p->blocks * d;
    float *dkc = p->dkc + (thread * p->bh + b) * p->blocks * d, *dvc = p->dvc + (thread * p->bh + b) * p->blocks * d;
    const float ones[ROWS_AT_ONCE] = {1.0f, 1.0f, 1.0f, 1.0f};
    for (int64_t c0 = 0; c0 < most; c0 += CHUNK) {
        const int64_t n = most - c0 < CHUNK ? most - c0 : CHUNK;
        rows_scores(probs, CHUNK, q, kc_t + c0 * d, d, n, p->scale, nrows);
        rows_scores(dprobs, CHUNK, dout, vc_t + c0 * d, d, n, 1.0f, nrows);
        for (int i = 0; i < nrows; i++) {
            float *pr = probs + i * CHUNK, *dr = dprobs + i * CHUNK;
            const int64_t count = visible[i] - c0 < 0 ? 0 : visible[i] - c0 < n ? visible[i] - c0 : n;
            const float top = lse[i], dot = delta[i], scale = p->scale;
#pragma omp simd
            for (int64_t j = 0; j < count; j++) {
                pr[j] = exp_nonpositive(pr[j] - top);
                dr[j] = scale * pr[j] * (dr[j] - dot);
            }
            for (int64_t j = count; j < n; j++) pr[j] = 0.0f, dr[j] = 0.0f; /* blocks it cannot see */
        }
        for (int r0 = 0; r0 < nrows; r0 += ROWS_AT_ONCE)
            rows_weighted_values(dq + r0, dprobs + r0 * CHUNK, CHUNK, ones, kc + c0 * d, n, d);
        rows_outer_accumulate(dkc + c0 * d, dprobs, CHUNK, q, n, d, nrows);
        rows_outer_accumulate(dvc + c0 * d, probs, CHUNK, dout, n, d, nrows);
    }
}

INLINE void backward_group(const Problem *p, int64_t b, int64_t t0, float *probs, float *dprobs, float *q,
                           float *dout, int thread, const int64_t d) {
    int64_t h0 = 0;
    for (; h0 + HEADS_AT_ONCE <= p->g; h0 += HEADS_AT_ONCE)
        backward_rows_of(p, b, t0, h0, HEADS_AT_ONCE, probs, dprobs, q, dout, thread, d);
    for (; h0 < p->g; h0++) backward_rows_of(p, b, t0, h0, 1, probs, dprobs, q, dout, thread, d);
}

static void *backward_work(void *arg) {
    Work *work = arg;
    const Problem *p = work->problem;
    const int64_t groups = (p->m + QUERIES - 1) / QUERIES;
    float *probs = line_aligned((size_t)(GROUP_ROWS * (2 * CHUNK + 2 * p->d)) * sizeof(float));
    if (!probs) { work->failed = 1; return NULL; }
    float *dprobs = probs + GROUP_ROWS * CHUNK, *q = dprobs + GROUP_ROWS * CHUNK, *dout = q + GROUP_ROWS * p->d;
    for (int64_t r = work->first; r < work->last; r += work->step) {
        const int64_t b = r / groups, t0 = r % groups * QUERIES;
        if (p->d == 64) backward_group(p, b, t0, probs, dprobs, q, dout, work->thread, 64);
        else backward_group(p, b, t0, probs, dprobs, q, dout, work->thread, p->d);
    }
    free(probs);
    return NULL;
}

/* The gradients of block_selection's attention output (q, kc_t and lse as there; all contiguous):
 *   vc_t       [bh, blocks / TILE, d, TILE]  the compressed values in transposed tiles
 *   kc         [bh, blocks, d]               the compressed keys as rows
 *   dout, out  [bh, g, m, d]                 the output's gradient and the output
 *   dq         [bh, g, m, d] out, zeroed by the caller
 *   dkc, dvc   [threads, bh, blocks, d] out, zeroed by the caller: each thread's share, to be summed */
int compressed_backward(const float *q, const float *kc_t, const float *vc_t, const float *kc, const float *dout,
                        const float *out, const float *lse, float *dq, float *dkc, float *dvc, int64_t bh, int64_t g,
                        int64_t m, int64_t d, int64_t blocks, int64_t block, int64_t stride, int64_t heads,
                        int64_t q_b, int64_t q_h, int64_t q_g, int64_t q_m, float scale, int threads) {
    if (threads < 1) threads = 1;
    if (threads > 256) threads = 256; /* as run_rows clamps them: one partial sum per thread */
    Problem p = {.q = q, .kc_t = kc_t, .lse = (float *)lse, .bh = bh, .g = g, .m = m, .d = d, .blocks = blocks,
                 .blocks_tiled = (blocks + TILE - 1) / TILE * TILE, .block = block, .stride = stride, .heads = heads,
                 .q_b = q_b, .q_h = q_h, .q_g = q_g, .q_m = q_m, .scale = scale, .vc_t = vc_t, .dout = dout,
                 .out_f = out, .kc = kc, .dq = dq, .dkc = dkc, .dvc = dvc};
    return run_rows(&p, bh * ((m + QUERIES - 1) / QUERIES), threads, 1, backward_work);
}

static int64_t gcd(int64_t a, int64_t b) { return b ? gcd(b, a % b) : a; }

int block_selection(const float *q, const float *kc_t, const float *vc, float *scores, int64_t *indices, float *out,
                    float *lse, int64_t bh, int64_t g, int64_t m, int64_t d, int64_t blocks, int64_t block,
                    int64_t stride, int64_t fine_block, int64_t forced, int64_t free, int64_t heads, int64_t q_b,
                    int64_t q_h, int64_t q_g, int64_t q_m, float scale, int threads) {
    Problem p = {.q = q, .kc_t = kc_t, .vc = vc, .scores = scores, .indices = indices, .out = out, .lse = lse,
                 .bh = bh, .g = g, .m = m, .d = d,
                 .blocks = blocks, .blocks_tiled = (blocks + TILE - 1) / TILE * TILE, .block = block,
                 .stride = stride, .fine_block = fine_block, .unit = gcd(gcd(block, stride), fine_block),
                 .forced = forced, .free = free, .heads = heads, .q_b = q_b, .q_h = q_h, .q_g = q_g, .q_m = q_m,
                 .scale = scale};
    /* later queries see more blocks: interleaved groups of queries keep the threads' shares even */
    return run_rows(&p, bh * ((m + QUERIES - 1) / QUERIES), threads, 1, select_work);
}
