/* few_rows_product (native.h) as a kernel of its own: models/sampling.py's decoding_linears times it
 * beside PyTorch's products. Built by kernels/native.py. */

#include "native.h"

/* x, w, y contiguous fp32; bias fp32 or NULL. `unused`: native.py's common signature. */
int few_row_linear(const float *x, const float *w, const float *bias, float *y, int64_t rows, int64_t in, int64_t out,
                   float unused, int threads) {
    (void)unused;
    return few_rows_product(x, w, bias, y, rows, in, out, threads);
}
