"""Gather attention as Triton kernels, same signature and results as reference.py.

Group-centric, as NSA's selected-attention kernel: one program per (batch * kv_head, query
position) holds every query head of its GQA group and walks the position's chosen keys a tile of
BLOCK_K indices at a time, each key and value row loaded once for the whole group, with an online
softmax; the log-sum-exp is saved. The backward recomputes the probabilities from it and adds
nothing atomically (its results are the same to the bit on every run): one program per query
position writes dq; one program per tile of BLOCK_T consecutive keys writes their dk and dv,
walking the queries that chose any key of the tile. Those come from a reverse index built on the
device without a host sync: each (query, key tile) once, with a bit mask of the keys it chose
there, sorted by tile; a program multiplies a tile of such queries with all its keys and masks the
products to the chosen ones. Selections with locality (DSA's indexer keeps neighbouring tokens
together) fill those tiles; scattered ones waste up to BLOCK_T - 1 of every BLOCK_T products, which
`kernels.counters` reports as visited against needed pairs.

Inner products are tensor-core tiles (tl.dot, fp32 accumulation, IEEE precision for fp32 inputs)
when dim_head is at least 16, the group padded to 16 rows; smaller shapes use a broadcast
multiply-and-sum. Constraints, checked before launch: dim_head a power of two up to 256, group
at most 64. Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (slow: the tests use
tiny shapes).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import counters, flops
from kernels.triton_tiles import power_of_two, pv, qk, refuse, tiles_usable

BLOCK_T = 16  # keys per tile of the dk, dv kernel (at most 63: a query's choice in it is an int64 bit mask)


def check_supported(q: Tensor) -> None:
    group, dim = q.shape[2], q.shape[3]
    refuse("gather-attention", q, power_of_two("dim_head", dim, 256),
           group > 64 and f"the GQA group (heads / kv_heads = {group}) must be at most 64")


@triton.jit
def _gathered(K, V, IDX, bh, row, t, seq_q, seq_k, top_k, s0, j, d, D: tl.constexpr):
    """Slots s0 + j of query `row`: their keys and values [BLOCK_K, D] (zeros where masked), and
    which of them the query may see (slot in use, key at or before t)."""
    slot = s0 + j
    key = tl.load(IDX + (bh * seq_q + row) * top_k + slot, mask=slot < top_k, other=-1)
    ok = (key >= 0) & (key <= t) & (key < seq_k)
    kv_off = (bh * seq_k + key[:, None]) * D + d[None, :]
    k = tl.load(K + kv_off, mask=ok[:, None], other=0.0)
    v = tl.load(V + kv_off, mask=ok[:, None], other=0.0)
    return k, v, ok


@triton.jit
def _forward(Q, K, V, IDX, OUT, LSE, start, seq_k, top_k, scale,
             G: tl.constexpr, D: tl.constexpr, BLOCK_K: tl.constexpr, GP: tl.constexpr, USE_DOT: tl.constexpr):
    row = tl.program_id(0)  # query position within the sequence
    bh = tl.program_id(1)
    seq_q = tl.num_programs(0)
    t = start + row
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    j = tl.arange(0, BLOCK_K)
    rows = ((bh * seq_q + row) * G + g[:, None]) * D + d[None, :]
    q = tl.load(Q + rows, mask=g[:, None] < G, other=0.0)  # [GP, D]
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for s0 in range(0, top_k, BLOCK_K):
        k, v, ok = _gathered(K, V, IDX, bh, row, t, seq_q, seq_k, top_k, s0, j, d, D)
        scores = tl.where(ok[None, :], qk(q, k, USE_DOT) * scale, float("-inf"))  # [GP, BLOCK_K]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep everything at 0
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + pv(p, v, USE_DOT)
        m = m_new
    has_keys = l > 0
    out = acc / tl.where(has_keys, l, 1.0)[:, None]
    lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, l, 1.0)), float("-inf"))
    tl.store(OUT + rows, out.to(OUT.dtype.element_ty), mask=g[:, None] < G)
    tl.store(LSE + (bh * seq_q + row) * G + g, lse, mask=g < G)


@triton.jit
def _backward_q(Q, K, V, IDX, DOUT, LSE, DELTA, DQ, start, seq_k, top_k, scale,
                G: tl.constexpr, D: tl.constexpr, BLOCK_K: tl.constexpr, GP: tl.constexpr, USE_DOT: tl.constexpr):
    row = tl.program_id(0)
    bh = tl.program_id(1)
    seq_q = tl.num_programs(0)
    t = start + row
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    j = tl.arange(0, BLOCK_K)
    g_ok = g < G
    rows = ((bh * seq_q + row) * G + g[:, None]) * D + d[None, :]
    q = tl.load(Q + rows, mask=g_ok[:, None], other=0.0)
    do = tl.load(DOUT + rows, mask=g_ok[:, None], other=0.0)
    lse = tl.load(LSE + (bh * seq_q + row) * G + g, mask=g_ok, other=float("-inf"))
    lse = tl.where(lse == float("-inf"), 0.0, lse)  # an empty row: its probabilities come out 0
    delta = tl.load(DELTA + (bh * seq_q + row) * G + g, mask=g_ok, other=0.0)
    dq = tl.zeros([GP, D], tl.float32)
    for s0 in range(0, top_k, BLOCK_K):
        k, v, ok = _gathered(K, V, IDX, bh, row, t, seq_q, seq_k, top_k, s0, j, d, D)
        p = tl.where(ok[None, :] & g_ok[:, None], tl.exp(qk(q, k, USE_DOT) * scale - lse[:, None]), 0.0)
        dp = qk(do, v, USE_DOT)
        dq += pv(p * (dp - delta[:, None]), k, USE_DOT)
    tl.store(DQ + rows, (dq * scale).to(DQ.dtype.element_ty), mask=g_ok[:, None])


@triton.jit
def _backward_kv(Q, K, V, DOUT, LSE, DELTA, DK, DV, FIRST, RUN_ROW, RUN_BITS, start, seq_q, seq_k, num_tiles, scale,
                 G: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, GP: tl.constexpr, BQ: tl.constexpr,
                 USE_DOT: tl.constexpr):
    """dk, dv [BLOCK_T, D] of one tile of keys from the queries that chose any of them:
    RUN_ROW/RUN_BITS[FIRST[b] : FIRST[b + 1]] for tile b = bh * num_tiles + key tile, each a query
    position and the bit mask of the tile's keys it chose."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh * num_tiles + tile
    j = tl.arange(0, BLOCK_T)
    d = tl.arange(0, D)
    g = tl.arange(0, GP)
    key_pos = tile * BLOCK_T + j
    in_seq = key_pos < seq_k
    kv_off = (bh * seq_k + key_pos[:, None]) * D + d[None, :]
    k = tl.load(K + kv_off, mask=in_seq[:, None], other=0.0)
    v = tl.load(V + kv_off, mask=in_seq[:, None], other=0.0)
    dk = tl.zeros([BLOCK_T, D], tl.float32)
    dv = tl.zeros([BLOCK_T, D], tl.float32)
    runs_end = tl.load(FIRST + b + 1)
    for r0 in range(tl.load(FIRST + b), runs_end, BQ):
        run = r0 + tl.arange(0, BQ)
        run_ok = run < runs_end
        row = tl.load(RUN_ROW + run, mask=run_ok, other=0)  # [BQ] query positions
        bits = tl.load(RUN_BITS + run, mask=run_ok, other=0)  # [BQ] int64
        head = (bh * seq_q + row[:, None]) * G + g[None, :]  # [BQ, GP] rows of q, lse, delta
        ok = run_ok[:, None] & (g[None, :] < G)
        q = tl.reshape(tl.load(Q + head[:, :, None] * D + d[None, None, :], mask=ok[:, :, None], other=0.0),
                       (BQ * GP, D))
        do = tl.reshape(tl.load(DOUT + head[:, :, None] * D + d[None, None, :], mask=ok[:, :, None], other=0.0),
                        (BQ * GP, D))
        lse = tl.load(LSE + head, mask=ok, other=0.0)
        lse = tl.reshape(tl.where(lse == float("-inf"), 0.0, lse), (BQ * GP,))
        delta = tl.reshape(tl.load(DELTA + head, mask=ok, other=0.0), (BQ * GP,))
        chosen = ((bits[:, None] >> j[None, :].to(tl.int64)) & 1) != 0  # [BQ, BLOCK_T]
        visible = (ok[:, :, None] & chosen[:, None, :] & in_seq[None, None, :]
                   & (key_pos[None, None, :] <= start + row[:, None, None]))
        visible = tl.reshape(visible, (BQ * GP, BLOCK_T))
        p = tl.where(visible, tl.exp(qk(q, k, USE_DOT) * scale - lse[:, None]), 0.0)  # [BQ * GP, BLOCK_T]
        dp = qk(do, v, USE_DOT)
        dv += pv(tl.trans(p), do, USE_DOT)
        dk += pv(tl.trans(p * (dp - delta[:, None])), q, USE_DOT)
    tl.store(DK + kv_off, (dk * scale).to(DK.dtype.element_ty), mask=in_seq[:, None])
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=in_seq[:, None])


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
    tiles = triton.cdiv(seq_k, BLOCK_T)
    rows = torch.arange(m, device=indices.device)[None, :, None]
    tile = torch.arange(bh, device=indices.device)[:, None, None] * tiles + indices.clamp(min=0) // BLOCK_T
    unused = bh * tiles * m  # sorts after every run
    code = torch.where(_visible_slots(indices, start), tile * m + rows, unused).flatten()
    bits = torch.where(_visible_slots(indices, start), torch.ones_like(indices) << (indices.clamp(min=0) % BLOCK_T),
                       0).flatten()
    code, order = code.sort()
    new_run = torch.ones_like(code, dtype=torch.bool)
    new_run[1:] = code[1:] != code[:-1]
    run = new_run.cumsum(0) - 1
    run_code = torch.full_like(code, unused).scatter_(0, run, code)
    run_bits = torch.zeros_like(code).scatter_add_(0, run, bits[order])  # distinct keys: the sum is the union
    first = torch.searchsorted(run_code // m, torch.arange(bh * tiles + 1, device=code.device))
    return first.to(torch.int32), (run_code % m).to(torch.int32), run_bits


def _meta(q: Tensor, top_k: int) -> dict:
    """Tile shapes: BLOCK_K slots a step, the group padded to GP rows (16 for tensor cores)."""
    group, dim = q.shape[2], q.shape[3]
    block_k = min(64, max(16, triton.next_power_of_2(top_k)))
    use_dot = tiles_usable(q.dtype, block_k, dim)
    return dict(G=group, D=dim, BLOCK_K=block_k, GP=max(16 if use_dot else 2, triton.next_power_of_2(group)),
                USE_DOT=use_dot)


def _record_query_kernel(name: str, q: Tensor, indices: Tensor, start: int, meta: dict) -> None:
    """A query-centric launch: every program walks all of its query's slots, a tile at a time."""
    if not counters.counting():
        return
    bh, m, g, _ = q.shape
    tiles = triton.cdiv(indices.shape[-1], meta["BLOCK_K"])
    counters.record(counters.Launch(name, (m, bh), meta["GP"], meta["BLOCK_K"],
                                    visited=bh * m * tiles * meta["BLOCK_K"] * meta["GP"],
                                    needed=int(_visible_slots(indices, start).sum()) * g))


class TritonGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, start):
        check_supported(q)
        q, k, v, indices = q.contiguous(), k.contiguous(), v.contiguous(), indices.contiguous()
        bh, m, group, dim = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        meta = _meta(q, indices.shape[-1])
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
        delta = (dout.float() * out.float()).sum(-1)  # rowsum(dO * O), minus the lse's own gradient
        if dlse is not None:
            delta = delta - dlse.float()
        delta = delta.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # every key tile has a program
        meta = _meta(q, indices.shape[-1])
        scale = dim**-0.5
        if m:
            _backward_q[(m, bh)](q, k, v, indices, dout, lse, delta, dq, ctx.start, k.shape[1], indices.shape[-1],
                                 scale, **meta)
            _record_query_kernel("gather_attention_backward_q", q, indices, ctx.start, meta)
            tiles = triton.cdiv(k.shape[1], BLOCK_T)
            first, run_row, run_bits = key_runs(indices, ctx.start, k.shape[1])
            # queries per tile: its rows (queries x padded group) at least 16 for tensor cores
            use_dot = tiles_usable(q.dtype, BLOCK_T, dim)
            rows = triton.next_power_of_2(group) if use_dot else meta["GP"]
            kv_meta = dict(G=group, D=dim, BLOCK_T=BLOCK_T, GP=rows, BQ=max(1, 64 // rows), USE_DOT=use_dot)
            _backward_kv[(tiles, bh)](q, k, v, dout, lse, delta, dk, dv, first, run_row, run_bits, ctx.start, m,
                                      k.shape[1], tiles, scale, **kv_meta)
            if counters.counting():
                runs = first[1:] - first[:-1]
                walked = int((-(-runs // kv_meta["BQ"])).sum()) * kv_meta["BQ"]
                counters.record(counters.Launch("gather_attention_backward_kv", (tiles, bh), kv_meta["BQ"] * rows,
                                                BLOCK_T, visited=walked * rows * BLOCK_T,
                                                needed=ctx.pairs() * group))
        else:
            dk.zero_(), dv.zero_()
        flops.attention(ctx.pairs, group, dim, backward=True)
        return dq, dk, dv, None, None
