"""A Triton kernel small enough to compile in seconds, for tests of the tools that record and
compile launches: one program multiplies a [TILE, TILE] tile of a by one of b."""

import triton
import triton.language as tl


@triton.jit
def tile_product(a, b, out, n, TILE: tl.constexpr):
    rows, cols = tl.arange(0, TILE)[:, None], tl.arange(0, TILE)[None, :]
    inside = (rows < n) & (cols < n)
    x = tl.load(a + rows * n + cols, mask=inside, other=0.0)
    y = tl.load(b + rows * n + cols, mask=inside, other=0.0)
    tl.store(out + rows * n + cols, tl.dot(x, y).to(out.dtype.element_ty), mask=inside)
