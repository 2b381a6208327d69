"""NSA's compressed attention and block selection as Triton kernels (the CUDA path), the results
of naive.py's definitions.

    TritonCompressedAttention  flash attention over the compressed blocks complete by each query,
        the block-causal mask built from positions (block c is visible to position t once
        c * stride + block - 1 <= t), its log-sum-exp saved. The backward recomputes the
        probabilities from it in two kernels without atomic adds: one program per tile of
        compressed blocks walks the queries that see them (dk, dv), one per tile of queries walks
        their blocks (dq).
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

from kernels import flops, triton_interpreting
from kernels.triton_tiles import pv, qk, tiles_usable

_TILE = 16  # queries and compressed blocks per tile: tensor-core tiles need 16


def check_supported(q: Tensor) -> None:
    dim = q.shape[-1]
    problems = []
    if dim < 16 or dim > 256 or dim & (dim - 1):
        problems.append(f"dim_head={dim} must be a power of two from 16 to 256")
    if not (q.is_cuda or triton_interpreting()):
        problems.append("the tensors must be on a CUDA device (or set TRITON_INTERPRET=1 to run on the CPU)")
    if problems:
        raise ValueError("the Triton compressed-attention kernels cannot run this: " + "; ".join(problems)
                         + ". Use model.kernel=torch")


@triton.jit
def _complete(t, BLOCK_C: tl.constexpr, STRIDE: tl.constexpr, num_blocks):
    """How many compressed blocks are complete at position(s) t."""
    return tl.minimum(tl.where(t + 1 >= BLOCK_C, (t + 1 - BLOCK_C) // STRIDE + 1, 0), num_blocks)


@triton.jit
def _forward(Q, KC, VC, OUT, LSE, start, seq_q, num_blocks, scale,
             D: tl.constexpr, BLOCK_C: tl.constexpr, STRIDE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             USE_DOT: tl.constexpr):
    tile, head, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    group = tl.num_programs(1)
    rows = tile * BM + tl.arange(0, BM)
    row_ok = rows < seq_q
    seen = _complete(start + rows, BLOCK_C, STRIDE, num_blocks)  # [BM]
    d = tl.arange(0, D)
    q_off = ((bh * group + head) * seq_q + rows[:, None]) * D + d[None, :]
    q = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0)
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    last = _complete(start + tl.minimum(tile * BM + BM, seq_q) - 1, BLOCK_C, STRIDE, num_blocks)
    for n0 in range(0, last, BN):  # only the blocks the tile's last query sees
        cols = n0 + tl.arange(0, BN)
        kv_off = (bh * num_blocks + cols[:, None]) * D + d[None, :]
        k = tl.load(KC + kv_off, mask=cols[:, None] < num_blocks, other=0.0)
        v = tl.load(VC + kv_off, mask=cols[:, None] < num_blocks, other=0.0)
        scores = tl.where(cols[None, :] < seen[:, None], qk(q, k, USE_DOT) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no block yet: keep everything at 0
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + pv(p, v, USE_DOT)
        m = m_new
    has_blocks = l > 0
    out = acc / tl.where(has_blocks, l, 1.0)[:, None]
    lse = tl.where(has_blocks, m + tl.log(tl.where(has_blocks, l, 1.0)), float("-inf"))
    tl.store(OUT + q_off, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + (bh * group + head) * seq_q + rows, lse, mask=row_ok)


@triton.jit
def _probabilities(q, k, lse, cols, seen, scale, USE_DOT: tl.constexpr):
    """Recomputed softmax probabilities [BM, BN] of queries q [BM, D] over blocks k [BN, D]; 0 where
    a block is not yet complete or the query sees none (lse -inf)."""
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    visible = cols[None, :] < seen[:, None]
    return tl.where(visible, tl.exp(qk(q, k, USE_DOT) * scale - lse[:, None]), 0.0)


@triton.jit
def _backward_kv(Q, KC, VC, DOUT, LSE, DELTA, DKC, DVC, start, seq_q, num_blocks, scale, group,
                 D: tl.constexpr, BLOCK_C: tl.constexpr, STRIDE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 USE_DOT: tl.constexpr):
    tile, bh = tl.program_id(0), tl.program_id(1)
    cols = tile * BN + tl.arange(0, BN)
    d = tl.arange(0, D)
    kv_off = (bh * num_blocks + cols[:, None]) * D + d[None, :]
    col_ok = cols[:, None] < num_blocks
    k = tl.load(KC + kv_off, mask=col_ok, other=0.0)
    v = tl.load(VC + kv_off, mask=col_ok, other=0.0)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    first = tl.maximum(tile * BN * STRIDE + BLOCK_C - 1 - start, 0)  # the first query that sees the tile
    for head in range(group):
        for m0 in range(first, seq_q, BM):
            rows = m0 + tl.arange(0, BM)
            row_ok = rows < seq_q
            row = (bh * group + head) * seq_q + rows
            q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
            do = tl.load(DOUT + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
            lse = tl.load(LSE + row, mask=row_ok, other=float("-inf"))
            delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
            seen = _complete(start + rows, BLOCK_C, STRIDE, num_blocks)
            p = _probabilities(q, k, lse, cols, seen, scale, USE_DOT)  # [BM, BN]
            dv += pv(tl.trans(p), do, USE_DOT)
            ds = p * (qk(do, v, USE_DOT) - delta[:, None])
            dk += pv(tl.trans(ds), q, USE_DOT)
    tl.store(DKC + kv_off, (dk * scale).to(DKC.dtype.element_ty), mask=col_ok)
    tl.store(DVC + kv_off, dv.to(DVC.dtype.element_ty), mask=col_ok)


@triton.jit
def _backward_q(Q, KC, VC, DOUT, LSE, DELTA, DQ, start, seq_q, num_blocks, scale,
                D: tl.constexpr, BLOCK_C: tl.constexpr, STRIDE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                USE_DOT: tl.constexpr):
    tile, head, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    group = tl.num_programs(1)
    rows = tile * BM + tl.arange(0, BM)
    row_ok = rows < seq_q
    row = (bh * group + head) * seq_q + rows
    d = tl.arange(0, D)
    q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DOUT + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + row, mask=row_ok, other=float("-inf"))
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    seen = _complete(start + rows, BLOCK_C, STRIDE, num_blocks)
    dq = tl.zeros([BM, D], tl.float32)
    last = _complete(start + tl.minimum(tile * BM + BM, seq_q) - 1, BLOCK_C, STRIDE, num_blocks)
    for n0 in range(0, last, BN):
        cols = n0 + tl.arange(0, BN)
        kv_off = (bh * num_blocks + cols[:, None]) * D + d[None, :]
        k = tl.load(KC + kv_off, mask=cols[:, None] < num_blocks, other=0.0)
        v = tl.load(VC + kv_off, mask=cols[:, None] < num_blocks, other=0.0)
        p = _probabilities(q, k, lse, cols, seen, scale, USE_DOT)
        ds = p * (qk(do, v, USE_DOT) - delta[:, None])
        dq += pv(ds, k, USE_DOT)
    tl.store(DQ + row[:, None] * D + d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


def _meta(q: Tensor, block: int, stride: int) -> dict:
    return dict(D=q.shape[-1], BLOCK_C=block, STRIDE=stride, BM=_TILE, BN=_TILE,
                USE_DOT=tiles_usable(q.dtype, _TILE, q.shape[-1]))


def _visible_pairs(m: int, start: int, blocks: int, block: int, stride: int) -> int:
    """(query, block) pairs with the block complete by the query, summed over queries start.."""
    t = torch.arange(start, start + m)
    return int(((t + 1 - block).div(stride, rounding_mode="floor") + 1).clamp(0, blocks).sum())


class TritonCompressedAttention(torch.autograd.Function):
    """q [bh, g, seq_q, d], kc, vc [bh, blocks, d] (blocks from 0), queries from position `start` ->
    out [bh, g, seq_q, d] (zeros where no block is complete yet) and lse [bh, g, seq_q] (fp32, -inf
    there)."""

    @staticmethod
    def forward(ctx, q, kc, vc, start, block, stride):
        check_supported(q)
        q, kc, vc = q.contiguous(), kc.to(q.dtype).contiguous(), vc.to(q.dtype).contiguous()
        bh, g, m, d = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(bh, g, m, device=q.device, dtype=torch.float32)
        if m:
            _forward[(triton.cdiv(m, _TILE), g, bh)](q, kc, vc, out, lse, start, m, kc.shape[1], d**-0.5,
                                                     **_meta(q, block, stride))
        ctx.save_for_backward(q, kc, vc, out, lse)
        ctx.knobs = start, block, stride
        ctx.pairs = lambda: bh * _visible_pairs(m, start, kc.shape[1], block, stride)
        flops.attention(ctx.pairs, g, d)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, kc, vc, out, lse = ctx.saved_tensors
        start, block, stride = ctx.knobs
        bh, g, m, d = q.shape
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1).contiguous()  # rowsum(dO * O)
        dq, dkc, dvc = torch.empty_like(q), torch.empty_like(kc), torch.empty_like(vc)
        meta = _meta(q, block, stride)
        blocks = kc.shape[1]
        if blocks:
            _backward_kv[(triton.cdiv(blocks, _TILE), bh)](q, kc, vc, dout, lse, delta, dkc, dvc, start, m, blocks,
                                                          d**-0.5, g, **meta)
        if m:
            _backward_q[(triton.cdiv(m, _TILE), g, bh)](q, kc, vc, dout, lse, delta, dq, start, m, blocks, d**-0.5,
                                                       **meta)
        flops.attention(ctx.pairs, g, d, backward=True)
        return dq, dkc, dvc, None, None, None


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
    seen = _complete(t, BLOCK_C, STRIDE, num_blocks)
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
        probs = _probabilities(q, k, lse, cols, tl.zeros([GP], tl.int32) + seen, scale, USE_DOT)  # [GP, BC]
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
    lse      [batch_kv, group, seq_q]            TritonCompressedAttention's log-sum-exp
    returns  scores, indices [batch_kv, seq_q, free]: importance (the group's probability mass on
             the fine block, by token overlap) and fine-block index, most important first, ties to
             the earlier block; score -inf (index 0) where no block is left for a slot
    """
    check_supported(q)
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
