"""NSA's selected-block attention as Triton kernels, same signature and results as reference.py.

Group-centric, as the paper's kernel: one program per (batch * kv_head, query position) loads all
query heads of the GQA group at that position together and walks the position's selected blocks,
each key/value block fetched once for the whole group. Online softmax (running max and sum); the
log-sum-exp is saved for the backward pass. The backward recomputes the probabilities from it in
two kernels and adds nothing atomically (its results are the same to the bit on every run):
one program per query position writes dq (and the slot weights' gradient); one program per key
block writes that block's dk and dv, walking the (query, slot) pairs that chose it through a
reverse index (the pairs sorted by block), a tile of queries at a time. The tile holds
queries x group rows, so a small group fills a tensor-core tile with several queries instead of
padding rows of zeros. Optional per-slot weights scale each slot's share of the output (NSA's
differentiable selection).

Inner products are tensor-core tiles (tl.dot, fp32 accumulation, IEEE precision for fp32 inputs),
the group padded to 16 rows and a block under 16 keys padded to 16 masked keys, so a GPU runs
every shape through the tiles the interpreter checks (a block of 4 at a group of 16 in fp32 once
took a broadcast multiply-and-sum that the interpreter computed right and a GPU did not); only bf16
in the interpreter, which numpy cannot take to tl.dot, uses the sum. Constraints, checked before launch: dim_head <= 256 and a power of two
(32, 64, 128 in practice), group <= 64, block <= 128 and a power of two. Runs on CUDA tensors, or
on CPU tensors under TRITON_INTERPRET=1 (slow: the tests use tiny shapes). The forward and the
backward are custom operators (`sparse_attention::selected_forward`, `selected_backward`), so
torch.compile and CUDA graphs take them whole; the softmax scale is a constexpr.
"""

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from kernels import flops
from kernels.triton_tiles import power_of_two, pv, qk, refuse, tiles_usable


def check_supported(q: Tensor, block: int) -> None:
    group, dim = q.shape[2], q.shape[3]
    refuse("selected-attention", q, power_of_two("dim_head", dim, 256),
           group > 64 and f"the GQA group (heads / kv_heads = {group}) must be at most 64",
           power_of_two("fine_block_size", block, 128))


@triton.jit
def _selected_block(K, V, IDX, VALID, bh, row, s, t, seq_q, seq_k, num_selected, j, d, D: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Slot s of query `row`: its keys and values [KB, D] (j = arange(KB), KB >= BLOCK; zeros where
    masked), which of them the query may see (in the block, at or before t, slot in use), and their
    offsets."""
    block_index = tl.load(IDX + (bh * seq_q + row) * num_selected + s)
    ok = tl.load(VALID + (bh * seq_q + row) * num_selected + s + j * 0) != 0  # [KB], one value
    key_pos = block_index * BLOCK + j
    key_ok = (key_pos <= t) & (key_pos < seq_k) & ok & (j < BLOCK)
    kv_off = (bh * seq_k + key_pos[:, None]) * D + d[None, :]
    k = tl.load(K + kv_off, mask=key_ok[:, None], other=0.0)
    v = tl.load(V + kv_off, mask=key_ok[:, None], other=0.0)
    return k, v, key_ok, kv_off


@triton.jit
def _forward(Q, K, V, IDX, VALID, W, OUT, LSE, start, seq_k, num_selected, scale: tl.constexpr,
             G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, KB: tl.constexpr, GP: tl.constexpr, USE_DOT: tl.constexpr,
             WEIGHTED: tl.constexpr):
    row = tl.program_id(0)  # query position within the sequence
    bh = tl.program_id(1)
    seq_q = tl.num_programs(0)
    t = start + row
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    j = tl.arange(0, KB)
    q_ptr = Q + ((bh * seq_q + row) * G + g[:, None]) * D + d[None, :]
    q = tl.load(q_ptr, mask=g[:, None] < G, other=0.0)  # [GP, D]
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for s in range(num_selected):
        k, v, key_ok, kv_off = _selected_block(K, V, IDX, VALID, bh, row, s, t, seq_q, seq_k, num_selected, j, d, D,
                                               BLOCK)
        scores = qk(q, k, USE_DOT) * scale  # [GP, KB]
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep everything at 0
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        if WEIGHTED:  # the slot's share of the output, not of the normaliser
            p = p * tl.load(W + (bh * seq_q + row) * num_selected + s).to(tl.float32)
        acc = acc * alpha[:, None] + pv(p, v, USE_DOT)
        m = m_new
    has_keys = l > 0
    out = acc / tl.where(has_keys, l, 1.0)[:, None]  # fp32 until the store
    lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, l, 1.0)), float("-inf"))
    tl.store(OUT + ((bh * seq_q + row) * G + g[:, None]) * D + d[None, :], out.to(OUT.dtype.element_ty),
             mask=g[:, None] < G)
    tl.store(LSE + (bh * seq_q + row) * G + g, lse, mask=g < G)


@triton.jit
def _backward_q(Q, K, V, IDX, VALID, W, DOUT, LSE, DELTA, DQ, DW, start, seq_k, num_selected, scale: tl.constexpr,
                G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, KB: tl.constexpr, GP: tl.constexpr, USE_DOT: tl.constexpr,
                WEIGHTED: tl.constexpr):
    row = tl.program_id(0)
    bh = tl.program_id(1)
    seq_q = tl.num_programs(0)
    t = start + row
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    j = tl.arange(0, KB)
    rows = ((bh * seq_q + row) * G + g[:, None]) * D + d[None, :]
    g_ok = g < G
    q = tl.load(Q + rows, mask=g_ok[:, None], other=0.0)
    do = tl.load(DOUT + rows, mask=g_ok[:, None], other=0.0)
    lse = tl.load(LSE + (bh * seq_q + row) * G + g, mask=g_ok, other=float("-inf"))
    lse = tl.where(lse == float("-inf"), 0.0, lse)  # an empty row: its probabilities come out 0
    delta = tl.load(DELTA + (bh * seq_q + row) * G + g, mask=g_ok, other=0.0)
    dq = tl.zeros([GP, D], tl.float32)
    for s in range(num_selected):
        k, v, key_ok, kv_off = _selected_block(K, V, IDX, VALID, bh, row, s, t, seq_q, seq_k, num_selected, j, d, D,
                                               BLOCK)
        scores = qk(q, k, USE_DOT) * scale
        p = tl.where(key_ok[None, :] & g_ok[:, None], tl.exp(scores - lse[:, None]), 0.0)  # [GP, KB]
        dp = qk(do, v, USE_DOT)
        if WEIGHTED:  # out = sum_s w_s P_s V_s: w_s gets sum(P_s * dP_s)
            slot = (bh * seq_q + row) * num_selected + s
            tl.store(DW + slot, tl.sum(tl.sum(p * dp, axis=1), axis=0))
            dp = dp * tl.load(W + slot).to(tl.float32)
        dq += pv(p * (dp - delta[:, None]), k, USE_DOT)
    tl.store(DQ + rows, (dq * scale).to(DQ.dtype.element_ty), mask=g_ok[:, None])


@triton.jit
def _backward_kv(Q, K, V, W, DOUT, LSE, DELTA, DK, DV, FIRST, PAIR_ROW, PAIR_SLOT, start, seq_q, seq_k, num_selected,
                 num_blocks, scale: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, KB: tl.constexpr, GP: tl.constexpr,
                 BQ: tl.constexpr, USE_DOT: tl.constexpr, WEIGHTED: tl.constexpr):
    """One key block's dk, dv [KB, D] from the (query, slot) pairs that chose it:
    PAIR_ROW/PAIR_SLOT[FIRST[b] : FIRST[b + 1]] for block b = bh * num_blocks + key block."""
    key_block = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh * num_blocks + key_block
    j = tl.arange(0, KB)
    d = tl.arange(0, D)
    g = tl.arange(0, GP)
    key_pos = key_block * BLOCK + j
    kv_off = (bh * seq_k + key_pos[:, None]) * D + d[None, :]
    in_seq = (key_pos < seq_k) & (j < BLOCK)
    k = tl.load(K + kv_off, mask=in_seq[:, None], other=0.0)
    v = tl.load(V + kv_off, mask=in_seq[:, None], other=0.0)
    dk = tl.zeros([KB, D], tl.float32)
    dv = tl.zeros([KB, D], tl.float32)
    pairs_end = tl.load(FIRST + b + 1)
    for p0 in range(tl.load(FIRST + b), pairs_end, BQ):
        pair = p0 + tl.arange(0, BQ)
        pair_ok = pair < pairs_end
        row = tl.load(PAIR_ROW + pair, mask=pair_ok, other=0)  # [BQ] query positions
        head = ((bh * seq_q + row[:, None]) * G + g[None, :])  # [BQ, GP] rows of q, lse, delta
        ok = pair_ok[:, None] & (g[None, :] < G)
        q = tl.reshape(tl.load(Q + head[:, :, None] * D + d[None, None, :], mask=ok[:, :, None], other=0.0),
                       (BQ * GP, D))
        do = tl.reshape(tl.load(DOUT + head[:, :, None] * D + d[None, None, :], mask=ok[:, :, None], other=0.0),
                        (BQ * GP, D))
        lse = tl.load(LSE + head, mask=ok, other=0.0)
        lse = tl.reshape(tl.where(lse == float("-inf"), 0.0, lse), (BQ * GP,))
        delta = tl.reshape(tl.load(DELTA + head, mask=ok, other=0.0), (BQ * GP,))
        # a key counts for a pair where it is at or before the query (and in the sequence)
        visible = ok[:, :, None] & (key_pos[None, None, :] <= start + row[:, None, None]) & in_seq[None, None, :]
        visible = tl.reshape(visible, (BQ * GP, KB))
        scores = qk(q, k, USE_DOT) * scale
        p = tl.where(visible, tl.exp(scores - lse[:, None]), 0.0)  # [BQ * GP, KB]
        dp = qk(do, v, USE_DOT)
        if WEIGHTED:
            slot = tl.load(PAIR_SLOT + pair, mask=pair_ok, other=0)
            w = tl.load(W + (bh * seq_q + row) * num_selected + slot, mask=pair_ok, other=0.0).to(tl.float32)
            w = tl.reshape(tl.broadcast_to(w[:, None], (BQ, GP)), (BQ * GP,))
            dv += pv(tl.trans(p * w[:, None]), do, USE_DOT)
            dp = dp * w[:, None]
        else:
            dv += pv(tl.trans(p), do, USE_DOT)
        dk += pv(tl.trans(p * (dp - delta[:, None])), q, USE_DOT)
    tl.store(DK + kv_off, (dk * scale).to(DK.dtype.element_ty), mask=in_seq[:, None])
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=in_seq[:, None])


def _reverse_index(indices: Tensor, valid: Tensor, num_blocks: int) -> tuple[Tensor, Tensor, Tensor]:
    """The (query, slot) pairs that chose each key block: indices, valid [bh, m, slots] ->
    first [bh * num_blocks + 1] (block b's pairs are first[b]:first[b + 1]), and each pair's query
    position and slot [pairs], sorted by block."""
    bh, m, slots = indices.shape
    block = indices + torch.arange(bh, device=indices.device)[:, None, None] * num_blocks
    block = block.masked_fill(~valid, bh * num_blocks).flatten()  # unused slots sort last
    order = torch.argsort(block, stable=True)  # all of them: no host sync to count the used slots
    counts = torch.bincount(block, minlength=bh * num_blocks + 1)[:-1]
    first = F.pad(torch.cumsum(counts, 0), (1, 0)).to(torch.int32)
    return first, ((order // slots) % m).to(torch.int32), (order % slots).to(torch.int32)


def _launch_args(q: Tensor, k: Tensor, indices: Tensor, start: int, block: int, weights):
    bh, m, group, dim = q.shape
    # tensor-core tiles need every side >= 16: the group is padded up to 16 rows, and a block under 16
    # keys to 16 masked keys, so every shape takes the same tiles on a GPU as in the interpreter
    use_dot = tiles_usable(q.dtype, dim)
    padded = triton.next_power_of_2(group)
    meta = dict(G=group, D=dim, BLOCK=block, KB=max(16 if use_dot else 1, block), GP=max(16 if use_dot else 2, padded),
                USE_DOT=use_dot)
    meta["WEIGHTED"] = weights is not None
    return (m, bh), (start, k.shape[1], indices.shape[-1], dim**-0.5), meta


@torch.library.custom_op("sparse_attention::selected_forward", mutates_args=())
def selected_forward(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, valid: Tensor, start: int, block: int,
                     weights: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """out, lse of selected attention (kernels/selected_attention/__init__.py for shapes), as a custom
    operator so torch.compile and CUDA graphs take it whole."""
    check_supported(q, block)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    indices, valid8 = indices.contiguous(), valid.to(torch.int8).contiguous()
    w = valid8 if weights is None else weights.float().contiguous()  # a placeholder pointer when unweighted
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    grid, scalars, meta = _launch_args(q, k, indices, start, block, weights)
    if q.shape[1]:
        _forward[grid](q, k, v, indices, valid8, w, out, lse, *scalars, **meta)
    # whole blocks: a query's own block is masked, not skipped
    flops.attention(lambda: int(valid.sum()) * block, q.shape[2], q.shape[-1])  # q [bh, m, group, d]
    return out, lse.to(q.dtype) if q.dtype == torch.float64 else lse


@selected_forward.register_fake
def _(q, k, v, indices, valid, start, block, weights):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=q.dtype if q.dtype == torch.float64 else torch.float32)


@torch.library.custom_op("sparse_attention::selected_backward", mutates_args=())
def selected_backward(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, indices: Tensor,
                      valid: Tensor, out: Tensor, lse: Tensor, start: int, block: int,
                      weights: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv and the slot weights' gradient (zeros without weights)."""
    q, k, v, out, lse = q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.float().contiguous()
    indices, valid8 = indices.contiguous(), valid.to(torch.int8).contiguous()
    dout = dout.contiguous()
    w = valid8 if weights is None else weights.float().contiguous()
    dw = torch.zeros(indices.shape, device=q.device, dtype=torch.float32)
    delta = (dout.float() * out.float()).sum(-1)  # rowsum(dO * O), minus the lse's own gradient
    if dlse is not None:
        delta = delta - dlse.float()
    delta = delta.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # every key block has a program
    grid, scalars, meta = _launch_args(q, k, indices, start, block, weights)
    bh, m, group, dim = q.shape
    if m:
        _backward_q[grid](q, k, v, indices, valid8, w, dout, lse, delta, dq, dw, *scalars, **meta)
        num_blocks = triton.cdiv(k.shape[1], block)
        first, pair_row, pair_slot = _reverse_index(indices, valid8.bool(), num_blocks)
        # queries per tile: the tile's rows (queries x padded group) at least 16 for tensor cores
        rows = triton.next_power_of_2(group) if meta["USE_DOT"] else meta["GP"]
        meta = dict(meta, GP=rows, BQ=max(1, 64 // rows))
        start, seq_k, num_selected, scale = scalars
        _backward_kv[(num_blocks, bh)](q, k, v, w, dout, lse, delta, dk, dv, first, pair_row, pair_slot, start,
                                       m, seq_k, num_selected, num_blocks, scale, **meta)
    flops.attention(lambda: int(valid.sum()) * block, q.shape[2], q.shape[-1], backward=True)
    return dq, dk, dv, dw if weights is None else dw.to(weights.dtype)


@selected_backward.register_fake
def _(dout, dlse, q, k, v, indices, valid, out, lse, start, block, weights):
    dw = indices.new_empty(indices.shape, dtype=torch.float32 if weights is None else weights.dtype)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dw


def _setup_context(ctx, inputs, output):
    q, k, v, indices, valid, start, block, weights = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, indices, valid, out, lse, weights)
    ctx.start, ctx.block, ctx.weighted = start, block, weights is not None


def _backward(ctx, dout, dlse):
    q, k, v, indices, valid, out, lse, weights = ctx.saved_tensors
    dq, dk, dv, dw = selected_backward(dout, dlse, q, k, v, indices, valid, out, lse, ctx.start, ctx.block, weights)
    return dq, dk, dv, None, None, None, None, dw if ctx.weighted else None


selected_forward.register_autograd(_backward, setup_context=_setup_context)
