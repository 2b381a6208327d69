/* One decoding step through the blocks of a dense pre-norm transformer (models/transformer.py's
 * Block over DenseAttention with rotary positions and FeedForward with exact GELU), for the few
 * new tokens of one sequence, in one call: per token PyTorch runs ~30 operators a block, and at
 * one row most of their time is their own overhead, not arithmetic. Built by kernels/native.py.
 *
 * Per block, for rows new tokens at positions start .. start + rows - 1:
 *     x += to_out(attention(rotary(q), rotary(k), v))   (q, k, v = to_qkv(layer_norm(x)))
 *     x += ff2(gelu(ff1(layer_norm(x))))
 * with keys and values written into the layer's cache [heads, capacity, dim_head] at their
 * positions, and query r attending to the keys up to its own position. */

#include "native.h"

/* a block's pointers in the table, one row of FIELDS int64 per block */
enum { LN1_W, LN1_B, QKV_W, OUT_W, LN2_W, LN2_B, FF1_W, FF1_B, FF2_W, FF2_B, KEYS, VALUES, FIELDS };

typedef struct {
    const float *qkv; /* [rows, 3, heads, dim_head] */
    const float *keys, *values; /* [heads, capacity, dim_head] */
    float *out, *scores; /* [rows, heads, dim_head]; [rows * heads, start + rows] */
    int64_t rows, heads, d, start, capacity;
} Attention;

/* y [dim] = layer_norm(x [dim]) * w + b (biased variance, as torch.nn.LayerNorm) */
static void layer_norm(const float *x, const float *w, const float *b, float *y, int64_t dim, float eps) {
    float mean = 0.0f, var = 0.0f;
#pragma omp simd reduction(+ : mean)
    for (int64_t i = 0; i < dim; i++) mean += x[i];
    mean /= (float)dim;
#pragma omp simd reduction(+ : var)
    for (int64_t i = 0; i < dim; i++) var += (x[i] - mean) * (x[i] - mean);
    const float inv = 1.0f / sqrtf(var / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) y[i] = (x[i] - mean) * inv * w[i] + b[i];
}

/* erf(x) by Abramowitz and Stegun 7.1.26 (|error| <= 1.5e-7), in a form that vectorizes */
static inline float erf_approx(float x) {
    const float a = fabsf(x), t = 1.0f / (1.0f + 0.3275911f * a);
    const float poly = ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t + 0.254829592f) * t;
    const float e = 1.0f - poly * exp_nonpositive(-a * a);
    return x < 0.0f ? -e : e;
}

/* x [n] <- gelu(x) = x / 2 * (1 + erf(x / sqrt 2)) */
static void gelu(float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] = 0.5f * x[i] * (1.0f + erf_approx(x[i] * 0.70710678f));
}

/* x [rows, heads, 2 * pairs] <- each pair rotated by its row's angles: phases [positions, pairs, 2]
 * holds (cos, sin) of position p's angles */
static void rotate(float *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t d, const float *phases,
                   int64_t start) {
    for (int64_t r = 0; r < rows; r++) {
        const float *phase = phases + (start + r) * d;
        for (int64_t h = 0; h < heads; h++) {
            float *pairs = x + r * row_stride + h * d;
#pragma omp simd
            for (int64_t i = 0; i < d / 2; i++) {
                const float a = pairs[2 * i], b = pairs[2 * i + 1], c = phase[2 * i], s = phase[2 * i + 1];
                pairs[2 * i] = a * c - b * s;
                pairs[2 * i + 1] = a * s + b * c;
            }
        }
    }
}

/* one (row, head) a unit of work: softmax(scale q . keys) @ values over keys 0 .. start + row */
static void *attend(void *arg) {
    Work *work = arg;
    const Attention *p = work->problem;
    const int64_t d = p->d, width = 3 * p->heads * d;
    const float scale = 1.0f / sqrtf((float)d);
    for (int64_t u = work->first; u < work->last; u += work->step) {
        const int64_t r = u / p->heads, h = u % p->heads, n = p->start + r + 1;
        const float *q = p->qkv + r * width + h * d;
        const float *keys = p->keys + h * p->capacity * d, *values = p->values + h * p->capacity * d;
        float *scores = p->scores + u * (p->start + p->rows), total;
        /* VEC keys at a time, their dot products' lanes summed together (native.h's lane_sums):
         * a sum of each one's lanes cost several times its products at dim_head 64 */
        for (int64_t j0 = 0; j0 < n; j0 += VEC) {
            vec acc[VEC];
            for (int t = 0; t < VEC; t++) {
                const float *k = keys + (j0 + t < n ? j0 + t : j0) * d;
                vec a = {0};
                for (int64_t e = 0; e + VEC <= d; e += VEC) a += *(const vec *)(q + e) * *(const vec *)(k + e);
                acc[t] = a;
            }
            float sums[VEC];
            lane_sums(acc, VEC, sums);
            for (int64_t t = 0; t < VEC && j0 + t < n; t++) {
                const float *k = keys + (j0 + t) * d;
                float s = sums[t];
                for (int64_t e = d - d % VEC; e < d; e++) s += q[e] * k[e]; /* dim_head not a multiple of VEC */
                scores[j0 + t] = scale * s;
            }
        }
        exp_less_max(scores, n, &total);
        float *out = p->out + (r * p->heads + h) * d;
        if (d % VEC == 0 && d <= MAX_DIM) { /* the output in registers, not stored and loaded per key */
            vec o[MAX_DIM / VEC];
            const int64_t c = d / VEC;
            for (int64_t k = 0; k < c; k++) o[k] = (vec){0};
            for (int64_t j = 0; j < n; j++) {
                const float w = scores[j] / total;
                for (int64_t k = 0; k < c; k++) o[k] += w * *(const vec *)(values + j * d + k * VEC);
            }
            for (int64_t k = 0; k < c; k++) *(vec *)(out + k * VEC) = o[k];
            continue;
        }
        for (int64_t e = 0; e < d; e++) out[e] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const float w = scores[j] / total;
#pragma omp simd
            for (int64_t e = 0; e < d; e++) out[e] += w * values[j * d + e];
        }
    }
    return NULL;
}

/* x [rows, dim] (updated in place) through `layers` blocks; table [layers, FIELDS] (int64 addresses);
 * phases [positions, dim_head / 2, 2]; scratch: rows * (2 dim + 4 heads dim_head + hidden) + rows *
 * heads * (start + rows) floats. Returns 0: nothing in it allocates, so nothing in it fails. */
int dense_decoding(float *x, const int64_t *table, const float *phases, float *scratch, int64_t rows, int64_t dim,
                   int64_t heads, int64_t dim_head, int64_t hidden, int64_t layers, int64_t start, int64_t capacity,
                   float eps, int threads) {
    const int64_t inner = heads * dim_head;
    float *normed = scratch, *qkv = normed + rows * dim, *attended = qkv + 3 * rows * inner;
    float *wide = attended + rows * inner, *delta = wide + rows * hidden, *scores = delta + rows * dim;
    for (int64_t l = 0; l < layers; l++) {
        const int64_t *f = table + l * FIELDS;
#define FIELD(i) ((float *)(intptr_t)f[i])
        for (int64_t r = 0; r < rows; r++) layer_norm(x + r * dim, FIELD(LN1_W), FIELD(LN1_B), normed + r * dim, dim, eps);
        few_rows_product(normed, FIELD(QKV_W), NULL, qkv, rows, dim, 3 * inner, threads);
        rotate(qkv, rows, 3 * inner, 2 * heads, dim_head, phases, start); /* q and k: the first 2 heads * d */
        for (int64_t r = 0; r < rows; r++)
            for (int64_t h = 0; h < heads; h++) {
                const size_t at = (size_t)(h * capacity + start + r) * dim_head;
                memcpy(FIELD(KEYS) + at, qkv + r * 3 * inner + inner + h * dim_head, dim_head * sizeof(float));
                memcpy(FIELD(VALUES) + at, qkv + r * 3 * inner + 2 * inner + h * dim_head, dim_head * sizeof(float));
            }
        Attention a = {qkv, FIELD(KEYS), FIELD(VALUES), attended, scores, rows, heads, dim_head, start, capacity};
        run_rows(&a, rows * heads, threads, 1, attend);
        few_rows_product(attended, FIELD(OUT_W), NULL, delta, rows, inner, dim, threads);
        for (int64_t i = 0; i < rows * dim; i++) x[i] += delta[i];
        for (int64_t r = 0; r < rows; r++) layer_norm(x + r * dim, FIELD(LN2_W), FIELD(LN2_B), normed + r * dim, dim, eps);
        few_rows_product(normed, FIELD(FF1_W), FIELD(FF1_B), wide, rows, dim, hidden, threads);
        gelu(wide, rows * hidden);
        few_rows_product(wide, FIELD(FF2_W), FIELD(FF2_B), delta, rows, hidden, dim, threads);
        for (int64_t i = 0; i < rows * dim; i++) x[i] += delta[i];
#undef FIELD
    }
    return 0;
}
