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
in the interpreter, which numpy cannot take to tl.dot, uses the sum. Constraints, checked before
launch: dim_head <= 256 and a power of two (32, 64, 128 in practice), group <= 64, block <= 128 and
a power of two. Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (slow: the tests
use tiny shapes). The forward and the backward are custom operators
(`sparse_attention::selected_forward`, `selected_backward`), so torch.compile and CUDA graphs take
them whole; the softmax scale is a constexpr. The steps these kernels share with gather attention's
(kernels/gather_attention/triton.py) are in kernels/triton_tiles.py.
"""

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from kernels import flops
from kernels.selected_attention.reference import distinct_slots
from kernels.selected_attention import triton_problem
from kernels.triton_tiles import (backward_delta, key_grads_step, key_tile_start, load_backward_rows,
                                  load_keys, load_readers, padded_group, probabilities, pv,
                                  query_program, readers_per_tile, refuse, softmax_start, softmax_step,
                                  store_key_grads, store_softmax, tiles_usable, visible_to_readers, with_dim)


def check_supported(q: Tensor, block: int) -> None:
    refuse("selected-attention", q, triton_problem(q.shape[2], q.shape[3], block))


@triton.jit
def _selected_block(K, V, INDICES, VALID, batch_head, row, slot, query_pos, seq_q, seq_k, num_selected,
                    DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_PAD: tl.constexpr):
    """Slot `slot` of query `row`: its keys and values [BLOCK_PAD, DIM] (BLOCK_PAD >= BLOCK; zeros
    where masked) and which of them the query may see (in the block, at or before query_pos, slot
    in use)."""
    lane = tl.arange(0, BLOCK_PAD)
    block_index = tl.load(INDICES + (batch_head * seq_q + row) * num_selected + slot)
    in_use = tl.load(VALID + (batch_head * seq_q + row) * num_selected + slot + lane * 0) != 0  # one value
    key_pos = block_index * BLOCK + lane
    visible = (key_pos <= query_pos) & (key_pos < seq_k) & in_use & (lane < BLOCK)
    k, v, _ = load_keys(K, V, batch_head, key_pos, visible, seq_k, DIM)
    return k, v, visible


@triton.jit
def _forward(Q, K, V, INDICES, VALID, W, OUT, LSE, start, seq_k, num_selected, scale: tl.constexpr,
             GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_PAD: tl.constexpr,
             GROUP_PAD: tl.constexpr, USE_DOT: tl.constexpr, WEIGHTED: tl.constexpr):
    row, batch_head, seq_q, rows, head_ok = query_program(GROUP, GROUP_PAD)
    q = tl.load(Q + with_dim(rows, DIM), mask=head_ok[:, None], other=0.0)  # [GROUP_PAD, DIM]
    row_max, row_sum, acc = softmax_start(GROUP_PAD, DIM)
    for slot in range(num_selected):
        k, v, visible = _selected_block(K, V, INDICES, VALID, batch_head, row, slot, start + row, seq_q, seq_k,
                                        num_selected, DIM, BLOCK, BLOCK_PAD)
        weight = 1.0
        if WEIGHTED:
            weight = tl.load(W + (batch_head * seq_q + row) * num_selected + slot).to(tl.float32)
        row_max, row_sum, acc = softmax_step(q, k, v, visible, scale, weight, row_max, row_sum, acc, WEIGHTED,
                                             USE_DOT)
    store_softmax(OUT, LSE, rows, head_ok, acc, row_max, row_sum, DIM)


@triton.jit
def _backward_q(Q, K, V, INDICES, VALID, W, DOUT, LSE, DELTA, DQ, DW, start, seq_k, num_selected,
                scale: tl.constexpr, GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
                BLOCK_PAD: tl.constexpr, GROUP_PAD: tl.constexpr, USE_DOT: tl.constexpr, WEIGHTED: tl.constexpr):
    row, batch_head, seq_q, rows, head_ok = query_program(GROUP, GROUP_PAD)
    q, do, lse, delta = load_backward_rows(Q, DOUT, LSE, DELTA, rows, head_ok, DIM)
    dq = tl.zeros([GROUP_PAD, DIM], tl.float32)
    for slot in range(num_selected):
        k, v, visible = _selected_block(K, V, INDICES, VALID, batch_head, row, slot, start + row, seq_q, seq_k,
                                        num_selected, DIM, BLOCK, BLOCK_PAD)
        p, dp = probabilities(q, do, lse, k, v, visible[None, :] & head_ok[:, None], scale, USE_DOT)
        if WEIGHTED:  # out = sum_s w_s P_s V_s: w_s gets sum(P_s * dP_s)
            slot_offset = (batch_head * seq_q + row) * num_selected + slot
            tl.store(DW + slot_offset, tl.sum(tl.sum(p * dp, axis=1), axis=0))
            dp = dp * tl.load(W + slot_offset).to(tl.float32)
        dq += pv(p * (dp - delta[:, None]), k, USE_DOT)
    tl.store(DQ + with_dim(rows, DIM), (dq * scale).to(DQ.dtype.element_ty), mask=head_ok[:, None])


@triton.jit
def _backward_kv(Q, K, V, W, DOUT, LSE, DELTA, DK, DV, FIRST, PAIR_ROW, PAIR_SLOT, start, seq_q, seq_k, num_selected,
                 num_blocks, scale: tl.constexpr, GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCK_PAD: tl.constexpr, GROUP_PAD: tl.constexpr, READERS: tl.constexpr, USE_DOT: tl.constexpr,
                 WEIGHTED: tl.constexpr):
    """One key block's dk, dv [BLOCK_PAD, DIM] from the (query, slot) pairs that chose it:
    PAIR_ROW/PAIR_SLOT[FIRST[b] : FIRST[b + 1]] for b = batch_head * num_blocks + key block;
    READERS pairs at a time."""
    key_block = tl.program_id(0)
    batch_head = tl.program_id(1)
    key_pos, in_seq, k, v, kv_offsets, dk, dv = key_tile_start(K, V, batch_head, key_block, seq_k, BLOCK, BLOCK_PAD,
                                                               DIM)
    every_key = tl.full([READERS, BLOCK_PAD], 1, tl.int1)  # a pair chose its whole block
    pairs_end = tl.load(FIRST + batch_head * num_blocks + key_block + 1)
    for first_pair in range(tl.load(FIRST + batch_head * num_blocks + key_block), pairs_end, READERS):
        pair, pair_ok, row, head_ok, q, do, lse, delta = load_readers(Q, DOUT, LSE, DELTA, PAIR_ROW, first_pair,
                                                                      pairs_end, batch_head, seq_q, GROUP, DIM,
                                                                      GROUP_PAD, READERS)
        visible = visible_to_readers(head_ok, row, every_key, key_pos, in_seq, start, READERS * GROUP_PAD, BLOCK_PAD)
        weight = lse  # a placeholder where unweighted
        if WEIGHTED:
            slot = tl.load(PAIR_SLOT + pair, mask=pair_ok, other=0)
            w = tl.load(W + (batch_head * seq_q + row) * num_selected + slot, mask=pair_ok, other=0.0).to(tl.float32)
            weight = tl.reshape(tl.broadcast_to(w[:, None], (READERS, GROUP_PAD)), (READERS * GROUP_PAD,))
        dk, dv = key_grads_step(q, do, lse, delta, k, v, visible, weight, dk, dv, scale, WEIGHTED, USE_DOT)
    store_key_grads(DK, DV, kv_offsets, in_seq, dk, dv, scale)


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
    meta = dict(GROUP=group, DIM=dim, BLOCK=block, BLOCK_PAD=max(16 if use_dot else 1, block),
                GROUP_PAD=padded_group(group, use_dot), USE_DOT=use_dot, WEIGHTED=weights is not None)
    return (m, bh), (start, k.shape[1], indices.shape[-1], dim**-0.5), meta


@torch.library.custom_op("sparse_attention::selected_forward", mutates_args=())
def selected_forward(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, valid: Tensor, start: int, block: int,
                     weights: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """out, lse of selected attention (kernels/selected_attention/__init__.py for shapes), as a custom
    operator so torch.compile and CUDA graphs take it whole."""
    check_supported(q, block)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    valid = distinct_slots(indices, valid)  # a block in several slots counts once
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
    valid = distinct_slots(indices, valid)  # as the forward counted them
    indices, valid8 = indices.contiguous(), valid.to(torch.int8).contiguous()
    dout = dout.contiguous()
    w = valid8 if weights is None else weights.float().contiguous()
    dw = torch.zeros(indices.shape, device=q.device, dtype=torch.float32)
    delta = backward_delta(dout, out, dlse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # every key block has a program
    grid, scalars, meta = _launch_args(q, k, indices, start, block, weights)
    bh, m, group, dim = q.shape
    if m:
        _backward_q[grid](q, k, v, indices, valid8, w, dout, lse, delta, dq, dw, *scalars, **meta)
        num_blocks = triton.cdiv(k.shape[1], block)
        first, pair_row, pair_slot = _reverse_index(indices, valid8.bool(), num_blocks)
        rows, readers = readers_per_tile(group, meta["USE_DOT"])
        meta = dict(meta, GROUP_PAD=rows, READERS=readers)
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
