"""NSA's compressed-branch attention and the fine-block selection it implies, in one pass.

Query t attends to the compressed blocks complete by t (block i covers tokens
[i * stride, i * stride + block)), all query heads of a GQA group together. The same probabilities,
summed over the group's heads and spread onto fine blocks by token overlap, are the importance
that ranks fine blocks for selection: the paper computes them once and reuses them, and so does
this function. The importance of a chunk of queries is handed to the caller's `choose` as soon as
it exists, so the [n, n / fine_block] importance of a whole sequence is never held.

From position 0 (training, a prompt) the attention itself is fused flash attention: grouping
the queries by their offset inside a stride makes the block mask exactly causal over a square
[blocks, blocks] problem (query t = block - 1 + s * stride + o sees blocks 0..s), and the
importance is one forward-only pass over chunks of queries. Otherwise (after a cache, or when the
importance must pass gradient) both come from one chunked pass. A chunk reads only the blocks
complete by its last query (nothing past it is computed) and masks only the few blocks that its
earlier queries cannot see yet, from positions. The backward pass recomputes each chunk's
probabilities (as flash attention does), so what is kept for it is q and the compressed keys and
values: O(n), never O(n^2 / stride).

Spreading onto fine blocks is a banded sum, not a [compressed, fine] product: tokens are cut into
segments of u = gcd(block, stride, fine_block) tokens; compressed block i spreads its probability
evenly over its block / u segments, and a fine block sums its fine_block / u segments. That is the
token-overlap fraction exactly, in O(blocks * block / u) per query.

On CUDA the compressed branch and the selection run inside NSA's fused kernels
(kernels/nsa_attention/).

On the CPU, `cpu_compressed_selection` does a training step's selection and the compressed
branch's forward in C (selection.c, compiled on first use by kernels/native.py): one pass per query
from its scores to its output and its chosen blocks, so each query is scored against the compressed
blocks once, not once for selection and again for attention. Its backward is C too: each query's
probabilities recomputed from the log-sum-exp the pass kept, over the blocks it sees (PyTorch's
flash-attention backward over the rows of blocks above, which it replaced, was 23% of an NSA step
at 8k on an AVX2-only EPYC).
"""

import ctypes
import math
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import dispatch, flops
from kernels.nsa_attention.blocks import visible_compressed
from kernels.nsa_attention.compressed_chunked import CompressedAttention, Layout, select
from kernels.native import load, pointer, row_strides, rows_as_they_lie, transposed_tiles

# choose(importance [bh, chunk, fine blocks up to the chunk's last query], first position)
#   -> (scores, indices) [bh, chunk, selected]
Choose = Callable[[Tensor, int], tuple[Tensor, Tensor]]

def compressed_attention(q: Tensor, kc: Tensor, vc: Tensor, start: int, block: int, stride: int,
                         fine_block: int, choose: Choose, importance_grad: bool = False
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """Attention over the complete compressed blocks, and the fine blocks `choose` picks by importance.

    q        [batch_kv, group, seq_q, dim_head]  queries of one GQA group (batch * kv_heads first)
    kc, vc   [batch_kv, blocks, dim_head]        compressed keys and values, blocks from 0
    start    position of the first query
    choose   called per chunk of queries with their importance [batch_kv, chunk, fine blocks] (fp32:
             the probability mass on each fine block up to the chunk's last query, summed over the
             group, so each row sums to `group`, or 0 before the first complete block) and the
             chunk's first position; returns (scores, indices) [batch_kv, chunk, selected]
    returns  out [batch_kv, group, seq_q, dim_head] (zeros where no block is complete yet), and the
             scores and indices [batch_kv, seq_q, selected] that `choose` gave

    importance_grad: the scores pass gradient to q and kc (differentiable selection); otherwise
    they are constants.
    """
    layout = Layout(q, kc.shape[1], start, block, stride, fine_block)
    if start == 0 and not importance_grad:
        return causal_block_attention(q, kc, vc, block, stride), *select(q, kc, layout, choose)
    return CompressedAttention.apply(q, kc, vc, layout, choose, importance_grad)


def block_selection(q: Tensor, kc: Tensor, start: int, block: int, stride: int, fine_block: int,
                    choose: Choose) -> tuple[Tensor, Tensor]:
    """What `choose` picks from each chunk's importance, without the attention output and without
    gradient: -> scores, indices [batch_kv, seq_q, selected] (shapes as in compressed_attention)."""
    return select(q, kc, Layout(q, kc.shape[1], start, block, stride, fine_block), choose)


def causal_block_attention(q: Tensor, kc: Tensor, vc: Tensor, block: int, stride: int) -> Tensor:
    """The compressed attention of queries from position 0, as causal flash attention over rows of
    blocks: q [bh, g, seq, d], kc, vc [bh, blocks, d] -> [bh, g, seq, d], zeros before the first
    complete block."""
    if kc.shape[1] == 0:
        return torch.zeros_like(q)
    out = F.scaled_dot_product_attention(_to_rows(q, block, stride, kc.shape[1]), kc[:, None].to(q.dtype),
                                         vc[:, None].to(q.dtype), is_causal=True, enable_gqa=True)
    return _from_rows(out, block, stride, q.shape[2])


def _to_rows(x: Tensor, block: int, stride: int, blocks: int) -> Tensor:
    """Queries from position 0 [..., g, seq, d] (leading dimensions [bh] or [b, h], any strides) ->
    rows of blocks [bh, g * stride, blocks, d]: the queries that see blocks 0..s at row index s,
    those that see none left out, zeros past the end. One pass over x (a pad and then a reshape
    would copy it twice)."""
    *lead, g, m, d = x.shape
    first, whole, rest = _row_split(m, block, stride)
    rows = x.new_empty(*lead, g, stride, blocks, d)  # [..., g, offset in the stride, row, d]
    rows[..., :whole, :] = x[..., first : first + whole * stride, :].unflatten(-2, (whole, stride)).transpose(-2, -3)
    if whole < blocks:  # the last row holds the queries left, then zeros
        rows[..., rest:, whole, :] = 0
        rows[..., :rest, whole, :] = x[..., first + whole * stride :, :]
    return rows.view(-1, g * stride, blocks, d)


def _from_rows(rows: Tensor, block: int, stride: int, m: int) -> Tensor:
    """The inverse of _to_rows for [bh, g * stride, blocks, ...] -> [bh, g, m, ...], zeros where no
    block is visible, in one pass."""
    bh, g = rows.shape[0], rows.shape[1] // stride
    first, whole, rest = _row_split(m, block, stride)
    rows = rows.unflatten(1, (g, stride))  # [bh, g, offset, row, ...]
    x = rows.new_empty(bh, g, m, *rows.shape[4:])
    x[:, :, :first] = 0
    x[:, :, first : first + whole * stride].unflatten(2, (whole, stride)).copy_(rows[:, :, :, :whole].transpose(2, 3))
    if rest:
        x[:, :, first + whole * stride :] = rows[:, :, :rest, whole]
    return x


def _row_split(m: int, block: int, stride: int) -> tuple[int, int, int]:
    """(queries before the first complete block, rows whose every offset holds a query, queries in
    the last, partial row)."""
    first = min(m, block - 1)
    return first, (m - first) // stride, (m - first) % stride


@dispatch.constant_result  # torch.compile reads the answer, never the compiler's files
def cpu_selection_available() -> bool:
    """Whether cpu_compressed_selection's C kernel is built (or can be built) here."""
    return _library() is not None


def cpu_compressed_selection(q: Tensor, kc: Tensor, vc: Tensor, block: int, stride: int, fine_block: int, forced: int,
                             free: int) -> tuple[Tensor, Tensor, Tensor]:
    """The compressed branch's attention (as causal_block_attention) and the `free` most important
    fine blocks of each query from position 0, from one pass of the CPU kernel.

    q        [batch_kv, group, seq_q, dim_head], or [batch, kv_heads, group, seq_q, dim_head]; any
             strides with dim_head contiguous (a view of a projection is read where it lies)
    kc, vc   [batch_kv, blocks, dim_head]  compressed keys and values, blocks from 0
    forced   how many of (own block, initial block, previous block), in that priority, are always
             attended and so never chosen here
    returns  out [batch_kv, group, seq_q, dim_head] in q's dtype, passing gradient to q, kc and vc;
             scores, indices [batch_kv, seq_q, free] without gradient: importance (as
             compressed_attention's, summed over the group) and fine-block index, most important
             first, ties to the earlier block; score -inf (index 0) where no block is left for a slot

    The pass and its backward run in fp32 (C, selection.c); both are custom operators
    (`sparse_attention::compressed_selection` and `..._backward`), so torch.compile traces through them.
    """
    if not cpu_selection_available():
        raise RuntimeError("the block-selection CPU kernel could not be built here (no working C compiler)")
    out, _, scores, indices = _compressed_selection(q, kc, vc, block, stride, fine_block, forced, free)
    return out, scores, indices


@torch.library.custom_op("sparse_attention::compressed_selection", mutates_args=())
def _compressed_selection(q: Tensor, kc: Tensor, vc: Tensor, block: int, stride: int, fine_block: int, forced: int,
                          free: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> out [bh, g, m, d] in q's dtype, its log-sum-exp [bh, g, m] (fp32, for the backward),
    scores [bh, m, free] (fp32) and indices [bh, m, free] (int64)."""
    g, m, d = q.shape[-3:]
    bh = q.shape[:-3].numel()
    q32, vc32 = rows_as_they_lie(q.float()), vc.float().contiguous()
    kc_t = transposed_tiles(kc.float())  # held here: a pointer does not keep its tensor alive
    out, lse = q32.new_empty(bh, g, m, d), q32.new_empty(bh, g, m)
    scores = q32.new_empty(bh, m, free)
    indices = torch.empty(bh, m, free, dtype=torch.int64)
    status = _library().block_selection(pointer(q32), pointer(kc_t), pointer(vc32), pointer(scores), pointer(indices),
                                        pointer(out), pointer(lse), bh, g, m, d, kc.shape[1], block, stride,
                                        fine_block, forced, free, *row_strides(q32, q.dim() == 5),
                                        ctypes.c_float(d**-0.5), torch.get_num_threads())
    if status:
        raise MemoryError("block selection: a thread could not allocate its scores")
    if kc.shape[1] == 0:  # no block at all: vc's empty data reads as NULL in C, which writes no output
        out.zero_(), lse.fill_(float("-inf"))
    flops.attention(lambda: bh * int(visible_compressed(torch.arange(m), block, stride, kc.shape[1]).sum()), g, d)
    return out.to(q.dtype), lse, scores, indices


@_compressed_selection.register_fake
def _(q, kc, vc, block, stride, fine_block, forced, free):
    *lead, g, m, d = q.shape
    bh = math.prod(lead)
    return (q.new_empty(bh, g, m, d), q.new_empty(bh, g, m, dtype=torch.float32),
            q.new_empty(bh, m, free, dtype=torch.float32), q.new_empty(bh, m, free, dtype=torch.int64))


def _selection_setup_context(ctx, inputs, output):
    q, kc, vc, *ctx.knobs = inputs
    out, lse, scores, indices = output
    ctx.save_for_backward(q, kc, vc, out, lse)
    ctx.mark_non_differentiable(lse, scores, indices)
    ctx.set_materialize_grads(False)  # no zero gradients filled for those three


def _selection_backward(ctx, dout, _lse, _scores, _indices):
    """The C backward (selection.c's compressed_backward): each query's probabilities recomputed from
    its saved log-sum-exp over the blocks it sees, in fp32, gradients in the inputs' dtypes. It
    replaced PyTorch's CPU flash-attention backward over the rows of blocks, which took 23% of an
    NSA step at 8k on an AVX2 EPYC (issue 64)."""
    if dout is None:  # the output passed no gradient
        return (None,) * 8
    q, kc, vc, out, lse = ctx.saved_tensors
    block, stride = ctx.knobs[:2]
    return (*_compressed_backward(q, kc, vc, out, lse, dout, block, stride), *[None] * 5)


@torch.library.custom_op("sparse_attention::compressed_selection_backward", mutates_args=())
def _compressed_backward(q: Tensor, kc: Tensor, vc: Tensor, out: Tensor, lse: Tensor, dout: Tensor, block: int,
                         stride: int) -> tuple[Tensor, Tensor, Tensor]:
    """-> dq, dkc, dvc in the dtypes of q, kc, vc."""
    g, m, d = q.shape[-3:]
    bh, blocks = kc.shape[0], kc.shape[1]
    if blocks == 0:  # contiguous, as below (zeros_like would keep a strided query view's strides)
        return q.new_zeros(q.shape), kc.new_zeros(kc.shape), vc.new_zeros(vc.shape)
    threads = max(1, min(torch.get_num_threads(), 256))
    q32 = rows_as_they_lie(q.float())
    kc32, vc32 = kc.float().contiguous(), vc.float().contiguous()
    kc_t, vc_t = transposed_tiles(kc32), transposed_tiles(vc32)  # held here while C runs
    dout32, out32 = dout.float().reshape(bh, g, m, d).contiguous(), out.float().reshape(bh, g, m, d).contiguous()
    dq = q32.new_zeros(bh, g, m, d)
    dkc, dvc = kc32.new_zeros(threads, bh, blocks, d), kc32.new_zeros(threads, bh, blocks, d)
    status = _library().compressed_backward(
        pointer(q32), pointer(kc_t), pointer(vc_t), pointer(kc32), pointer(dout32), pointer(out32),
        pointer(lse.contiguous()), pointer(dq), pointer(dkc), pointer(dvc), bh, g, m, d, blocks, block, stride,
        *row_strides(q32, q.dim() == 5), ctypes.c_float(d**-0.5), threads)
    if status:
        raise MemoryError("compressed backward: a thread could not allocate its scores")
    flops.attention(lambda: bh * int(visible_compressed(torch.arange(m), block, stride, blocks).sum()), g, d,
                    backward=True)
    return dq.view(q.shape).to(q.dtype), dkc.sum(0).to(kc.dtype), dvc.sum(0).to(vc.dtype)


@_compressed_backward.register_fake
def _(q, kc, vc, out, lse, dout, block, stride):
    # contiguous, as the kernel returns them: empty_like would keep a strided query view's strides
    return q.new_empty(q.shape), kc.new_empty(kc.shape), vc.new_empty(vc.shape)


_compressed_selection.register_autograd(_selection_backward, setup_context=_selection_setup_context)


def _library() -> Optional[ctypes.CDLL]:
    return load(Path(__file__).with_name("selection.c"), (("block_selection", 7, 15), ("compressed_backward", 10, 12)))
