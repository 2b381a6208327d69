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
"""

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.compressed_attention.reference import CompressedAttention, Layout, select

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
    bh, g, m, d = q.shape
    first, blocks = min(m, block - 1), kc.shape[1]
    if blocks == 0:
        return torch.zeros_like(q)
    rows = F.pad(q[:, :, first:], (0, 0, 0, blocks * stride - (m - first)))
    rows = rows.view(bh, g, blocks, stride, d).transpose(2, 3).reshape(bh, g * stride, blocks, d)
    out = F.scaled_dot_product_attention(rows, kc[:, None].to(q.dtype), vc[:, None].to(q.dtype), is_causal=True,
                                         enable_gqa=True)
    out = out.view(bh, g, stride, blocks, d).transpose(2, 3).reshape(bh, g, blocks * stride, d)[:, :, : m - first]
    return F.pad(out, (0, 0, first, 0))


