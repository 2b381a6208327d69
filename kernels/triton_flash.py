"""Flash attention whose mask is a run of keys given by positions, as Triton kernels: NSA's
compressed branch (the compressed blocks complete by the query) and its sliding window (the last
`window` keys) are this one algorithm with two masks.

    PositionalFlashAttention.apply(q, k, v, start, mask, a, b) -> out, lse
    q [batch_kv, group, seq_q, dim_head] (queries from position `start`; a GQA group's heads share
    the keys), k, v [batch_kv, keys, dim_head]
    mask COMPRESSED: key c (block c of a = block tokens every b = stride) is visible to position t
         once complete, c * b + a - 1 <= t
    mask WINDOW:     key j is visible to position t when t - a < j <= t (a = window; b unused)
    -> out [batch_kv, group, seq_q, dim_head] (zeros where no key is visible) and its log-sum-exp
       [batch_kv, group, seq_q] in fp32 (-inf there)

A program takes a tile of queries of one head and walks only the key tiles its mask can reach
(online softmax, the log-sum-exp saved). The backward recomputes the probabilities from it in two
kernels that add nothing atomically: one program per key tile walks the queries (of every head
of the group) that can see it for dk and dv, one per query tile walks its keys for dq. Constraints,
checked before launch: dim_head a power of two from 16 to 256. Runs on CUDA tensors, or on CPU
tensors under TRITON_INTERPRET=1 (slow: the tests use tiny shapes).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import flops, triton_interpreting
from kernels.triton_tiles import pv, qk, tiles_usable

COMPRESSED, WINDOW = 0, 1
_TILE = 16  # queries and keys per tile: tensor-core tiles need 16


def check_supported(q: Tensor, what: str) -> None:
    dim = q.shape[-1]
    problems = []
    if dim < 16 or dim > 256 or dim & (dim - 1):
        problems.append(f"dim_head={dim} must be a power of two from 16 to 256")
    if not (q.is_cuda or triton_interpreting()):
        problems.append("the tensors must be on a CUDA device (or set TRITON_INTERPRET=1 to run on the CPU)")
    if problems:
        raise ValueError(f"the Triton {what} kernels cannot run this: " + "; ".join(problems)
                         + ". Use model.kernel=torch")


@triton.jit
def complete(t, BLOCK_C: tl.constexpr, STRIDE: tl.constexpr, num_blocks):
    """How many compressed blocks are complete at position(s) t."""
    return tl.minimum(tl.where(t + 1 >= BLOCK_C, (t + 1 - BLOCK_C) // STRIDE + 1, 0), num_blocks)


@triton.jit
def _visible(t, cols, MASK: tl.constexpr, A: tl.constexpr, B: tl.constexpr, num_keys):
    """[M, N]: whether key cols [N] is visible to positions t [M]."""
    if MASK == 0:
        return cols[None, :] < complete(t, A, B, num_keys)[:, None]
    return (cols[None, :] <= t[:, None]) & (cols[None, :] > t[:, None] - A) & (cols[None, :] < num_keys)


@triton.jit
def _keys_of(t_first, t_last, MASK: tl.constexpr, A: tl.constexpr, B: tl.constexpr, num_keys):
    """The keys [lo, hi) that positions t_first..t_last can see."""
    if MASK == 0:
        return 0, complete(t_last, A, B, num_keys)
    return tl.maximum(t_first - A + 1, 0), tl.minimum(t_last + 1, num_keys)


@triton.jit
def _queries_of(c_first, c_last, start, seq_q, MASK: tl.constexpr, A: tl.constexpr, B: tl.constexpr):
    """The query rows [lo, hi) that can see keys c_first..c_last."""
    if MASK == 0:
        return tl.maximum(c_first * B + A - 1 - start, 0), seq_q
    return tl.maximum(c_first - start, 0), tl.minimum(tl.maximum(c_last + A - start, 0), seq_q)


@triton.jit
def _key_tile(K, V, bh, cols, num_keys, d, D: tl.constexpr):
    """Keys and values [N, D] at key indices cols [N] (zeros past the end), and their offsets."""
    kv_off = (bh * num_keys + cols[:, None]) * D + d[None, :]
    k = tl.load(K + kv_off, mask=cols[:, None] < num_keys, other=0.0)
    v = tl.load(V + kv_off, mask=cols[:, None] < num_keys, other=0.0)
    return k, v, kv_off


@triton.jit
def _probabilities(q, k, lse, visible, scale, USE_DOT: tl.constexpr):
    """Recomputed probabilities [M, N] of queries q [M, D] over keys k [N, D]; 0 where a key is not
    visible or the query sees none (lse -inf)."""
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    return tl.where(visible, tl.exp(qk(q, k, USE_DOT) * scale - lse[:, None]), 0.0)


@triton.jit
def _forward(Q, K, V, OUT, LSE, start, seq_q, num_keys, scale, MASK: tl.constexpr, A: tl.constexpr,
             B: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, USE_DOT: tl.constexpr):
    tile, head, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    group = tl.num_programs(1)
    rows = tile * BM + tl.arange(0, BM)
    row_ok = rows < seq_q
    t = start + rows
    d = tl.arange(0, D)
    q_off = ((bh * group + head) * seq_q + rows[:, None]) * D + d[None, :]
    q = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0)
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    lo, hi = _keys_of(start + tile * BM, start + tl.minimum(tile * BM + BM, seq_q) - 1, MASK, A, B, num_keys)
    for n0 in range(lo, hi, BN):
        cols = n0 + tl.arange(0, BN)
        k, v, _ = _key_tile(K, V, bh, cols, num_keys, d, D)
        scores = tl.where(_visible(t, cols, MASK, A, B, num_keys), qk(q, k, USE_DOT) * scale, float("-inf"))
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
    tl.store(OUT + q_off, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + (bh * group + head) * seq_q + rows, lse, mask=row_ok)


@triton.jit
def _backward_kv(Q, K, V, DOUT, LSE, DELTA, DK, DV, start, seq_q, num_keys, scale, group, MASK: tl.constexpr,
                 A: tl.constexpr, B: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 USE_DOT: tl.constexpr):
    tile, bh = tl.program_id(0), tl.program_id(1)
    cols = tile * BN + tl.arange(0, BN)
    d = tl.arange(0, D)
    k, v, kv_off = _key_tile(K, V, bh, cols, num_keys, d, D)
    col_ok = cols[:, None] < num_keys
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    lo, hi = _queries_of(tile * BN, tl.minimum(tile * BN + BN, num_keys) - 1, start, seq_q, MASK, A, B)
    for head in range(group):
        for m0 in range(lo, hi, BM):
            rows = m0 + tl.arange(0, BM)
            row_ok = rows < seq_q
            row = (bh * group + head) * seq_q + rows
            q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
            do = tl.load(DOUT + row[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
            lse = tl.load(LSE + row, mask=row_ok, other=float("-inf"))
            delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
            visible = _visible(start + rows, cols, MASK, A, B, num_keys) & row_ok[:, None]
            p = _probabilities(q, k, lse, visible, scale, USE_DOT)  # [BM, BN]
            dv += pv(tl.trans(p), do, USE_DOT)
            ds = p * (qk(do, v, USE_DOT) - delta[:, None])
            dk += pv(tl.trans(ds), q, USE_DOT)
    tl.store(DK + kv_off, (dk * scale).to(DK.dtype.element_ty), mask=col_ok)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=col_ok)


@triton.jit
def _backward_q(Q, K, V, DOUT, LSE, DELTA, DQ, start, seq_q, num_keys, scale, MASK: tl.constexpr, A: tl.constexpr,
                B: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, USE_DOT: tl.constexpr):
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
    dq = tl.zeros([BM, D], tl.float32)
    lo, hi = _keys_of(start + tile * BM, start + tl.minimum(tile * BM + BM, seq_q) - 1, MASK, A, B, num_keys)
    for n0 in range(lo, hi, BN):
        cols = n0 + tl.arange(0, BN)
        k, v, _ = _key_tile(K, V, bh, cols, num_keys, d, D)
        p = _probabilities(q, k, lse, _visible(start + rows, cols, MASK, A, B, num_keys), scale, USE_DOT)
        ds = p * (qk(do, v, USE_DOT) - delta[:, None])
        dq += pv(ds, k, USE_DOT)
    tl.store(DQ + row[:, None] * D + d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


def visible_pairs(m: int, start: int, num_keys: int, mask: int, a: int, b: int) -> int:
    """(query, key) pairs the mask lets through, summed over queries start..start + m - 1."""
    t = torch.arange(start, start + m)
    if mask == COMPRESSED:
        return int(((t + 1 - a).div(b, rounding_mode="floor") + 1).clamp(0, num_keys).sum())
    return int((torch.minimum(t + 1, torch.tensor(num_keys)) - (t - a + 1).clamp(min=0)).clamp(min=0).sum())


class PositionalFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, start, mask, a, b):
        check_supported(q, "compressed-attention" if mask == COMPRESSED else "window-attention")
        q, k, v = q.contiguous(), k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous()
        bh, g, m, d = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(bh, g, m, device=q.device, dtype=torch.float32)
        meta = _meta(q, mask, a, b)
        if m:
            _forward[(triton.cdiv(m, _TILE), g, bh)](q, k, v, out, lse, start, m, k.shape[1], d**-0.5, **meta)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.knobs = start, meta
        ctx.pairs = lambda: bh * visible_pairs(m, start, k.shape[1], mask, a, b)
        flops.attention(ctx.pairs, g, d)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        start, meta = ctx.knobs
        bh, g, m, d = q.shape
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1).contiguous()  # rowsum(dO * O)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        keys = k.shape[1]
        if keys:
            _backward_kv[(triton.cdiv(keys, _TILE), bh)](q, k, v, dout, lse, delta, dk, dv, start, m, keys, d**-0.5, g,
                                                        **meta)
        if m:
            _backward_q[(triton.cdiv(m, _TILE), g, bh)](q, k, v, dout, lse, delta, dq, start, m, keys, d**-0.5, **meta)
        flops.attention(ctx.pairs, g, d, backward=True)
        return dq, dk, dv, None, None, None, None


def _meta(q: Tensor, mask: int, a: int, b: int) -> dict:
    return dict(MASK=mask, A=a, B=b, D=q.shape[-1], BM=_TILE, BN=_TILE, USE_DOT=tiles_usable(q.dtype, _TILE, q.shape[-1]))
