"""Gather attention as Triton kernels, same signature and results as reference.py.

Group-centric, as NSA's selected-attention kernel: one program per (batch * kv_head, query
position) holds every query head of its GQA group and walks the position's chosen keys a tile of
SLOT_TILE indices at a time, each key and value row loaded once for the whole group, with an online
softmax; the log-sum-exp is saved. The backward recomputes the probabilities from it and adds
nothing atomically (its results are the same to the bit on every run): one program per query
position writes dq; one program per tile of KEY_TILE consecutive keys writes their dk and dv,
walking the queries that chose any key of the tile. Those come from a reverse index built on the
device without a host sync: each (query, key tile) once, with a bit mask of the keys it chose
there, sorted by tile; a program multiplies a tile of such queries with all its keys and masks the
products to the chosen ones. Selections with locality (DSA's indexer keeps neighbouring tokens
together) fill those tiles; scattered ones waste up to KEY_TILE - 1 of every KEY_TILE products, which
`kernels.counters` reports as visited against needed pairs.

Inner products are tensor-core tiles (tl.dot, fp32 accumulation, IEEE precision for fp32 inputs)
when dim_head is at least 16, the group padded to 16 rows; smaller shapes use a broadcast
multiply-and-sum. Constraints, checked before launch: dim_head a power of two up to 256, group
at most 64. Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (slow: the tests use
tiny shapes). The steps these kernels share with selected attention's
(kernels/selected_attention/triton.py) are in kernels/triton_tiles.py.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import counters, flops
from kernels.gather_attention import triton_problem
from kernels.selected_attention.reference import distinct_slots
from kernels.triton_tiles import (backward_delta, key_grads_step, key_tile_start, load_backward_rows,
                                  load_keys, load_readers, padded_group, probabilities, pv,
                                  query_program, readers_per_tile, refuse, softmax_start, softmax_step,
                                  store_key_grads, store_softmax, tiles_usable, visible_to_readers, with_dim)

KEY_TILE = 16  # keys per tile of the dk, dv kernel (at most 63: a query's choice in it is an int64 bit mask)


def check_supported(q: Tensor) -> None:
    refuse("gather-attention", q, triton_problem(q.shape[2], q.shape[3]))


@triton.jit
def _gathered(K, V, INDICES, batch_head, row, query_pos, seq_q, seq_k, top_k, first_slot, SLOT_TILE: tl.constexpr,
              DIM: tl.constexpr):
    """Slots first_slot + arange(SLOT_TILE) of query `row`: their keys and values [SLOT_TILE, DIM]
    (zeros where masked), and which of them the query may see (slot in use, key at or before
    query_pos)."""
    slot = first_slot + tl.arange(0, SLOT_TILE)
    key = tl.load(INDICES + (batch_head * seq_q + row) * top_k + slot, mask=slot < top_k, other=-1)
    visible = (key >= 0) & (key <= query_pos) & (key < seq_k)
    k, v, _ = load_keys(K, V, batch_head, key, visible, seq_k, DIM)
    return k, v, visible


@triton.jit
def _forward(Q, K, V, INDICES, OUT, LSE, start, seq_k, top_k, scale, GROUP: tl.constexpr, DIM: tl.constexpr,
             SLOT_TILE: tl.constexpr, GROUP_PAD: tl.constexpr, USE_DOT: tl.constexpr):
    row, batch_head, seq_q, rows, head_ok = query_program(GROUP, GROUP_PAD)
    q = tl.load(Q + with_dim(rows, DIM), mask=head_ok[:, None], other=0.0)  # [GROUP_PAD, DIM]
    row_max, row_sum, acc = softmax_start(GROUP_PAD, DIM)
    for first_slot in range(0, top_k, SLOT_TILE):
        k, v, visible = _gathered(K, V, INDICES, batch_head, row, start + row, seq_q, seq_k, top_k, first_slot,
                                  SLOT_TILE, DIM)
        row_max, row_sum, acc = softmax_step(q, k, v, visible, scale, 1.0, row_max, row_sum, acc, False, USE_DOT)
    store_softmax(OUT, LSE, rows, head_ok, acc, row_max, row_sum, DIM)


@triton.jit
def _backward_q(Q, K, V, INDICES, DOUT, LSE, DELTA, DQ, start, seq_k, top_k, scale, GROUP: tl.constexpr,
                DIM: tl.constexpr, SLOT_TILE: tl.constexpr, GROUP_PAD: tl.constexpr, USE_DOT: tl.constexpr):
    row, batch_head, seq_q, rows, head_ok = query_program(GROUP, GROUP_PAD)
    q, do, lse, delta = load_backward_rows(Q, DOUT, LSE, DELTA, rows, head_ok, DIM)
    dq = tl.zeros([GROUP_PAD, DIM], tl.float32)
    for first_slot in range(0, top_k, SLOT_TILE):
        k, v, visible = _gathered(K, V, INDICES, batch_head, row, start + row, seq_q, seq_k, top_k, first_slot,
                                  SLOT_TILE, DIM)
        p, dp = probabilities(q, do, lse, k, v, visible[None, :] & head_ok[:, None], scale, USE_DOT)
        dq += pv(p * (dp - delta[:, None]), k, USE_DOT)
    tl.store(DQ + with_dim(rows, DIM), (dq * scale).to(DQ.dtype.element_ty), mask=head_ok[:, None])


@triton.jit
def _backward_kv(Q, K, V, DOUT, LSE, DELTA, DK, DV, FIRST, RUN_ROW, RUN_BITS, start, seq_q, seq_k, num_tiles, scale,
                 GROUP: tl.constexpr, DIM: tl.constexpr, KEY_TILE: tl.constexpr, GROUP_PAD: tl.constexpr,
                 READERS: tl.constexpr, USE_DOT: tl.constexpr):
    """dk, dv [KEY_TILE, DIM] of one tile of keys from the queries that chose any of them:
    RUN_ROW/RUN_BITS[FIRST[b] : FIRST[b + 1]] for b = batch_head * num_tiles + key tile, each a
    query position and the bit mask of the tile's keys it chose; READERS queries at a time."""
    tile = tl.program_id(0)
    batch_head = tl.program_id(1)
    key_pos, in_seq, k, v, kv_offsets, dk, dv = key_tile_start(K, V, batch_head, tile, seq_k, KEY_TILE, KEY_TILE, DIM)
    lane = tl.arange(0, KEY_TILE).to(tl.int64)
    runs_end = tl.load(FIRST + batch_head * num_tiles + tile + 1)
    for first_run in range(tl.load(FIRST + batch_head * num_tiles + tile), runs_end, READERS):
        run, run_ok, row, head_ok, q, do, lse, delta = load_readers(Q, DOUT, LSE, DELTA, RUN_ROW, first_run, runs_end,
                                                                    batch_head, seq_q, GROUP, DIM, GROUP_PAD, READERS)
        bits = tl.load(RUN_BITS + run, mask=run_ok, other=0)  # [READERS] int64
        chosen = ((bits[:, None] >> lane[None, :]) & 1) != 0  # [READERS, KEY_TILE]
        visible = visible_to_readers(head_ok, row, chosen, key_pos, in_seq, start, READERS * GROUP_PAD, KEY_TILE)
        dk, dv = key_grads_step(q, do, lse, delta, k, v, visible, lse, dk, dv, scale, False, USE_DOT)
    store_key_grads(DK, DV, kv_offsets, in_seq, dk, dv, scale)


def _visible_slots(indices: Tensor, start: int) -> Tensor:
    """[bh, m, top_k]: the slots that name a key at or before their query."""
    positions = start + torch.arange(indices.shape[1], device=indices.device)
    return (indices >= 0) & (indices <= positions[:, None])


def key_runs(indices: Tensor, start: int, seq_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The reverse index of the dk, dv kernel, on the device, no host sync: indices [bh, m, top_k]
    (distinct per query) -> first [bh * tiles + 1] (tile b's runs are first[b]:first[b + 1]), and
    per run its query position [runs] and the bit mask of the tile's keys it chose [runs] (int64);
    arrays sized for the most runs possible, those past first[-1] unused."""
    bh, m, _ = indices.shape
    tiles = triton.cdiv(seq_k, KEY_TILE)
    rows = torch.arange(m, device=indices.device)[None, :, None]
    tile = torch.arange(bh, device=indices.device)[:, None, None] * tiles + indices.clamp(min=0) // KEY_TILE
    unused = bh * tiles * m  # sorts after every run
    visible = _visible_slots(indices, start)
    code = torch.where(visible, tile * m + rows, unused).flatten()
    bits = torch.where(visible, torch.ones_like(indices) << (indices.clamp(min=0) % KEY_TILE), 0).flatten()
    code, order = code.sort()
    new_run = torch.ones_like(code, dtype=torch.bool)
    new_run[1:] = code[1:] != code[:-1]
    run = new_run.cumsum(0) - 1
    run_code = torch.full_like(code, unused).scatter_(0, run, code)
    run_bits = torch.zeros_like(code).scatter_add_(0, run, bits[order])  # distinct keys: the sum is the union
    first = torch.searchsorted(run_code // m, torch.arange(bh * tiles + 1, device=code.device))
    return first.to(torch.int32), (run_code % m).to(torch.int32), run_bits


def _tile_shapes(q: Tensor, top_k: int) -> dict:
    """The query-centric kernels' tiles: SLOT_TILE slots a step, the group padded to GROUP_PAD rows."""
    group, dim = q.shape[2], q.shape[3]
    slot_tile = min(64, max(16, triton.next_power_of_2(top_k)))
    use_dot = tiles_usable(q.dtype, slot_tile, dim)
    return dict(GROUP=group, DIM=dim, SLOT_TILE=slot_tile, GROUP_PAD=padded_group(group, use_dot), USE_DOT=use_dot)


def _record_query_kernel(name: str, q: Tensor, indices: Tensor, start: int, meta: dict) -> None:
    """A query-centric launch: every program walks all of its query's slots, a tile at a time."""
    if not counters.counting():
        return
    bh, m, g, _ = q.shape
    tiles = triton.cdiv(indices.shape[-1], meta["SLOT_TILE"])
    counters.record(counters.Launch(name, (m, bh), meta["GROUP_PAD"], meta["SLOT_TILE"],
                                    visited=bh * m * tiles * meta["SLOT_TILE"] * meta["GROUP_PAD"],
                                    needed=int(_visible_slots(indices, start).sum()) * g))


class TritonGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, start):
        check_supported(q)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        # a key named in several slots counts once (and its bit in key_runs' masks is set once)
        indices = torch.where(distinct_slots(indices, indices >= 0), indices, -1).contiguous()
        bh, m, group, dim = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        meta = _tile_shapes(q, indices.shape[-1])
        if m:
            _forward[(m, bh)](q, k, v, indices, out, lse, start, k.shape[1], indices.shape[-1], dim**-0.5, **meta)
        _record_query_kernel("gather_attention_forward", q, indices, start, meta)
        ctx.save_for_backward(q, k, v, indices, out, lse)
        ctx.start = start
        ctx.pairs = lambda: int(_visible_slots(indices, start).sum())
        flops.attention(ctx.pairs, group, dim)
        return out, lse.to(q.dtype) if q.dtype == torch.float64 else lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, indices, out, lse = ctx.saved_tensors
        bh, m, group, dim = q.shape
        dout = dout.contiguous()
        delta = backward_delta(dout, out, dlse)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # every key tile has a program
        meta = _tile_shapes(q, indices.shape[-1])
        scale = dim**-0.5
        if m:
            _backward_q[(m, bh)](q, k, v, indices, dout, lse, delta, dq, ctx.start, k.shape[1], indices.shape[-1],
                                 scale, **meta)
            _record_query_kernel("gather_attention_backward_q", q, indices, ctx.start, meta)
            tiles = triton.cdiv(k.shape[1], KEY_TILE)
            first, run_row, run_bits = key_runs(indices, ctx.start, k.shape[1])
            use_dot = tiles_usable(q.dtype, KEY_TILE, dim)
            rows, readers = readers_per_tile(group, use_dot)
            _backward_kv[(tiles, bh)](q, k, v, dout, lse, delta, dk, dv, first, run_row, run_bits, ctx.start, m,
                                      k.shape[1], tiles, scale, GROUP=group, DIM=dim, KEY_TILE=KEY_TILE,
                                      GROUP_PAD=rows, READERS=readers, USE_DOT=use_dot)
            if counters.counting():
                runs = first[1:] - first[:-1]
                walked = int((-(-runs // readers)).sum()) * readers
                counters.record(counters.Launch("gather_attention_backward_kv", (tiles, bh), readers * rows, KEY_TILE,
                                                visited=walked * rows * KEY_TILE, needed=ctx.pairs() * group))
        else:
            dk.zero_(), dv.zero_()
        flops.attention(ctx.pairs, group, dim, backward=True)
        return dq, dk, dv, None, None
