"""NSA's compressed attention and block selection as Triton kernels (the CUDA path), the results
of naive.py's definitions.

    triton_compressed_attention  flash attention over the compressed blocks complete by each query
        (kernels/triton_flash.py with the block-causal mask built from positions), its log-sum-exp
        saved; the backward adds nothing atomically.
    triton_selection  each query's importance per fine block (its group's probabilities, recomputed
        from that log-sum-exp, spread onto fine blocks by token overlap) and its `free` most
        important fine blocks besides the forced ones, in one program per (query, batch * kv head):
        fine blocks are taken a tile at a time and merged into a running top-k held in registers,
        so no [seq, blocks] or [seq, fine blocks] tensor reaches memory.

Queries are [batch_kv, group, seq_q, dim_head] (all heads of a GQA group share the compressed keys).
Constraints, checked before launch: dim_head a power of two from 16 to 256. Runs on CUDA tensors,
or on CPU tensors under TRITON_INTERPRET=1 (slow: the tests use tiny shapes).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_flash import COMPRESSED, PositionalFlashAttention, check_supported, complete
from kernels.triton_tiles import qk, tiles_usable


def triton_compressed_attention(q: Tensor, kc: Tensor, vc: Tensor, start: int, block: int,
                                stride: int) -> tuple[Tensor, Tensor]:
    """q [bh, g, seq_q, d], kc, vc [bh, blocks, d] (blocks from 0), queries from position `start` ->
    out [bh, g, seq_q, d] (zeros where no block is complete yet), passing gradient to q, kc and vc,
    and lse [bh, g, seq_q] (fp32, -inf there)."""
    return PositionalFlashAttention.apply(q, kc, vc, start, COMPRESSED, block, stride)


@triton.jit
def _probabilities(q, k, lse, cols, seen, scale, USE_DOT: tl.constexpr):
    """Recomputed probabilities [GP, BC] of a query's heads q [GP, D] over blocks k [BC, D]; 0 where
    a block is not yet complete or the head sees none (lse -inf)."""
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    return tl.where(cols[None, :] < seen, tl.exp(qk(q, k, USE_DOT) * scale - lse[:, None]), 0.0)


@triton.jit
def _selection(Q, KC, LSE, SCORES, INDICES, start, seq_q, num_blocks, scale,
               G: tl.constexpr, D: tl.constexpr, BLOCK_C: tl.constexpr, STRIDE: tl.constexpr, FINE: tl.constexpr,
               FORCED: tl.constexpr, FREE: tl.constexpr, GP: tl.constexpr, BF: tl.constexpr, BC: tl.constexpr,
               KP: tl.constexpr, USE_DOT: tl.constexpr):
    row, bh = tl.program_id(0), tl.program_id(1)
    t = start + row
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    g_ok = g < G
    q = tl.load(Q + ((bh * G + g[:, None]) * seq_q + row) * D + d[None, :], mask=g_ok[:, None], other=0.0)
    lse = tl.load(LSE + (bh * G + g) * seq_q + row, mask=g_ok, other=float("-inf"))
    seen = complete(t, BLOCK_C, STRIDE, num_blocks)
    own = t // FINE
    slot = tl.arange(0, KP)
    top_score = tl.full([KP], float("-inf"), tl.float32)
    top_index = tl.zeros([KP], tl.int64)
    for f0 in range(0, own + 1, BF):  # fine blocks that start at or before t, BF at a time
        fine = f0 + tl.arange(0, BF)
        # the compressed blocks that overlap this tile's tokens: from the first that ends after its start
        reach = f0 * FINE - BLOCK_C
        cols = tl.where(reach >= 0, reach // STRIDE + 1, 0) + tl.arange(0, BC)
        k = tl.load(KC + (bh * num_blocks + cols[:, None]) * D + d[None, :], mask=cols[:, None] < seen, other=0.0)
        probs = _probabilities(q, k, lse, cols, seen, scale, USE_DOT)  # [GP, BC]
        per_block = tl.sum(tl.where(g_ok[:, None], probs, 0.0), axis=0)  # the group's sum, [BC]
        # token overlap of compressed block c with fine block f, as a share of the compressed block
        lo = tl.maximum(cols[:, None] * STRIDE, fine[None, :] * FINE)
        hi = tl.minimum(cols[:, None] * STRIDE + BLOCK_C, fine[None, :] * FINE + FINE)
        overlap = tl.maximum(hi - lo, 0).to(tl.float32) / BLOCK_C  # [BC, BF]
        importance = tl.sum(per_block[:, None] * overlap, axis=0)  # [BF]
        taken = (fine * FINE > t) | (fine == own)  # the future, and the forced blocks
        if FORCED >= 2:
            taken = taken | (fine == 0)
        if FORCED >= 3:
            taken = taken | (fine == own - 1)
        importance = tl.where(taken, float("-inf"), importance)
        # merge: the FREE largest of the running top-k and this tile, ties to the earlier block
        # (the running top-k holds only earlier blocks, and argmax takes the leftmost maximum)
        merged_score = tl.full([KP], float("-inf"), tl.float32)
        merged_index = tl.zeros([KP], tl.int64)
        for i in tl.static_range(FREE):
            best_top, best_new = tl.max(top_score, axis=0), tl.max(importance, axis=0)
            at_top, at_new = tl.argmax(top_score, axis=0), tl.argmax(importance, axis=0)
            from_top = best_top >= best_new
            index = tl.where(from_top, tl.sum(tl.where(slot == at_top, top_index, 0), axis=0),
                             (f0 + at_new).to(tl.int64))
            merged_score = tl.where(slot == i, tl.where(from_top, best_top, best_new), merged_score)
            merged_index = tl.where(slot == i, index, merged_index)
            top_score = tl.where(slot == at_top, tl.where(from_top, float("-inf"), top_score), top_score)
            importance = tl.where(tl.arange(0, BF) == at_new, tl.where(from_top, importance, float("-inf")), importance)
        top_score, top_index = merged_score, merged_index
    out = (bh * seq_q + row) * FREE + slot
    tl.store(SCORES + out, top_score, mask=slot < FREE)
    tl.store(INDICES + out, tl.where(top_score == float("-inf"), 0, top_index), mask=slot < FREE)


@torch.no_grad()
def triton_selection(q: Tensor, kc: Tensor, lse: Tensor, start: int, block: int, stride: int, fine_block: int,
                     forced: int, free: int) -> tuple[Tensor, Tensor]:
    """Each query's `free` most important fine blocks besides the `forced` ones (own, initial,
    previous, in that priority), from the compressed attention's log-sum-exp.

    q        [batch_kv, group, seq_q, dim_head]  queries from position `start`
    kc       [batch_kv, blocks, dim_head]        compressed keys, blocks from 0
    lse      [batch_kv, group, seq_q]            triton_compressed_attention's log-sum-exp
    returns  scores, indices [batch_kv, seq_q, free]: importance (the group's probability mass on
             the fine block, by token overlap) and fine-block index, most important first, ties to
             the earlier block; score -inf (index 0) where no block is left for a slot
    """
    check_supported(q, "block-selection")
    q, kc, lse = q.contiguous(), kc.to(q.dtype).contiguous(), lse.float().contiguous()
    bh, g, m, d = q.shape
    scores = torch.empty(bh, m, free, device=q.device, dtype=torch.float32)
    indices = torch.empty(bh, m, free, device=q.device, dtype=torch.int64)
    if m == 0 or free == 0:
        return scores, indices
    tile_fine = 16  # fine blocks per tile; the compressed blocks that overlap them:
    tile_blocks = triton.next_power_of_2((tile_fine * fine_block + block - 1) // stride + 1)
    use_dot = tiles_usable(q.dtype, 16, d)  # a group under 16 pads its rows with zeros for the tiles
    _selection[(m, bh)](q, kc, lse, scores, indices, start, m, kc.shape[1], d**-0.5, G=g, D=d, BLOCK_C=block,
                        STRIDE=stride, FINE=fine_block, FORCED=forced, FREE=free,
                        GP=max(16 if use_dot else 2, triton.next_power_of_2(g)), BF=tile_fine,
                        BC=max(16, tile_blocks), KP=max(2, triton.next_power_of_2(free)),
                        USE_DOT=use_dot)
    return scores, indices
