"""NSA's selected-block attention as Triton kernels, same signature and results as reference.py.

Group-centric, as the paper's kernel: one program per (batch * kv_head, query position) loads all
query heads of the GQA group at that position together and walks the position's selected blocks,
each key/value block fetched once for the whole group. Online softmax (running max and sum); the
log-sum-exp is saved for the backward pass. The backward program recomputes the probabilities
from it and writes dq directly, while dk and dv, which several positions share, are accumulated
in fp32 with atomic adds (no races; the order of additions, and so the last bits, may vary).
Optional per-slot weights scale each slot's share of the output (NSA's differentiable selection);
their gradient is written per (position, slot).

Inner products are tensor-core tiles (tl.dot, fp32 accumulation, IEEE precision for fp32 inputs)
when the block and dim_head are at least 16, the group padded to 16 rows; smaller shapes use a
broadcast multiply-and-sum. Constraints, checked before launch: dim_head <= 256 and a power of two
(32, 64, 128 in practice), group <= 64, block <= 128 and a power of two. Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (slow:
the tests use tiny shapes).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import flops, triton_interpreting


def check_supported(q: Tensor, block: int) -> None:
    group, dim = q.shape[2], q.shape[3]
    problems = []
    if dim > 256 or dim & (dim - 1):
        problems.append(f"dim_head={dim} must be a power of two up to 256")
    if group > 64:
        problems.append(f"the GQA group (heads / kv_heads = {group}) must be at most 64")
    if block > 128 or block & (block - 1):
        problems.append(f"fine_block_size={block} must be a power of two up to 128")
    if not (q.is_cuda or triton_interpreting()):
        problems.append("the tensors must be on a CUDA device (or set TRITON_INTERPRET=1 to run on the CPU)")
    if problems:
        raise ValueError("the Triton selected-attention kernel cannot run this: " + "; ".join(problems)
                         + ". Use model.kernel=torch")


@triton.jit
def _qk(a, b, USE_DOT: tl.constexpr):
    """a [M, D] . b [N, D]^T -> [M, N] in fp32: a tensor-core tile when the shapes allow it."""
    if USE_DOT:
        return tl.dot(a, tl.trans(b), input_precision="ieee" if a.dtype == tl.float32 else None)
    return tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _pv(p, v, USE_DOT: tl.constexpr):
    """p [M, N] @ v [N, D] -> [M, D] in fp32."""
    if USE_DOT:
        return tl.dot(p.to(v.dtype), v, input_precision="ieee" if v.dtype == tl.float32 else None)
    return tl.sum(p.to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _selected_block(K, V, IDX, VALID, bh, row, s, t, seq_q, seq_k, num_selected, j, d, D: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Slot s of query `row`: its keys and values [BLOCK, D] (zeros where masked), which of them
    the query may see (in the block, at or before t, slot in use), and their offsets."""
    block_index = tl.load(IDX + (bh * seq_q + row) * num_selected + s)
    ok = tl.load(VALID + (bh * seq_q + row) * num_selected + s + j * 0) != 0  # [BLOCK], one value
    key_pos = block_index * BLOCK + j
    key_ok = (key_pos <= t) & (key_pos < seq_k) & ok
    kv_off = (bh * seq_k + key_pos[:, None]) * D + d[None, :]
    k = tl.load(K + kv_off, mask=key_ok[:, None], other=0.0)
    v = tl.load(V + kv_off, mask=key_ok[:, None], other=0.0)
    return k, v, key_ok, kv_off


@triton.jit
def _forward(Q, K, V, IDX, VALID, W, OUT, LSE, start, seq_k, num_selected, scale,
             G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, GP: tl.constexpr, USE_DOT: tl.constexpr,
             WEIGHTED: tl.constexpr):
    row = tl.program_id(0)  # query position within the sequence
    bh = tl.program_id(1)
    seq_q = tl.num_programs(0)
    t = start + row
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    j = tl.arange(0, BLOCK)
    q_ptr = Q + ((bh * seq_q + row) * G + g[:, None]) * D + d[None, :]
    q = tl.load(q_ptr, mask=g[:, None] < G, other=0.0)  # [GP, D]
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for s in range(num_selected):
        k, v, key_ok, kv_off = _selected_block(K, V, IDX, VALID, bh, row, s, t, seq_q, seq_k, num_selected, j, d, D,
                                               BLOCK)
        scores = _qk(q, k, USE_DOT) * scale  # [GP, BLOCK]
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep everything at 0
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        if WEIGHTED:  # the slot's share of the output, not of the normaliser
            p = p * tl.load(W + (bh * seq_q + row) * num_selected + s).to(tl.float32)
        acc = acc * alpha[:, None] + _pv(p, v, USE_DOT)
        m = m_new
    has_keys = l > 0
    out = acc / tl.where(has_keys, l, 1.0)[:, None]  # fp32 until the store
    lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, l, 1.0)), float("-inf"))
    tl.store(OUT + ((bh * seq_q + row) * G + g[:, None]) * D + d[None, :], out.to(OUT.dtype.element_ty),
             mask=g[:, None] < G)
    tl.store(LSE + (bh * seq_q + row) * G + g, lse, mask=g < G)


@triton.jit
def _backward(Q, K, V, IDX, VALID, W, DOUT, LSE, DELTA, DQ, DK, DV, DW, start, seq_k, num_selected, scale,
              G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, GP: tl.constexpr, USE_DOT: tl.constexpr,
              WEIGHTED: tl.constexpr):
    row = tl.program_id(0)
    bh = tl.program_id(1)
    seq_q = tl.num_programs(0)
    t = start + row
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    j = tl.arange(0, BLOCK)
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
        scores = _qk(q, k, USE_DOT) * scale
        p = tl.where(key_ok[None, :] & g_ok[:, None], tl.exp(scores - lse[:, None]), 0.0)  # [GP, BLOCK]
        dp = _qk(do, v, USE_DOT)
        pw = p
        if WEIGHTED:  # out = sum_s w_s P_s V_s: w_s gets sum(P_s * dP_s)
            slot = (bh * seq_q + row) * num_selected + s
            w = tl.load(W + slot).to(tl.float32)
            tl.store(DW + slot, tl.sum(tl.sum(p * dp, axis=1), axis=0))
            pw, dp = p * w, dp * w
        ds = p * (dp - delta[:, None]) * scale
        dq += _pv(ds, k, USE_DOT)
        dk = _pv(tl.trans(ds), q, USE_DOT)  # [BLOCK, D]
        dv = _pv(tl.trans(pw), do, USE_DOT)
        tl.atomic_add(DK + kv_off, dk, mask=key_ok[:, None])
        tl.atomic_add(DV + kv_off, dv, mask=key_ok[:, None])
    tl.store(DQ + rows, dq.to(DQ.dtype.element_ty), mask=g_ok[:, None])


def _launch_args(q: Tensor, k: Tensor, indices: Tensor, start: int, block: int, weights):
    bh, m, group, dim = q.shape
    # tensor-core tiles need every side >= 16: the group is padded up to 16 rows when they are used.
    # Triton's interpreter computes bf16 tl.dot wrongly (no bf16 in numpy): there bf16 uses the sums
    use_dot = block >= 16 and dim >= 16 and not (triton_interpreting() and q.dtype == torch.bfloat16)
    padded = triton.next_power_of_2(group)
    meta = dict(G=group, D=dim, BLOCK=block, GP=max(16 if use_dot else 2, padded), USE_DOT=use_dot)
    meta["WEIGHTED"] = weights is not None
    return (m, bh), (start, k.shape[1], indices.shape[-1], dim**-0.5), meta


class TritonSelectedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, valid, start, block, weights=None):
        check_supported(q, block)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        indices, valid = indices.contiguous(), valid.to(torch.int8).contiguous()
        w = valid if weights is None else weights.float().contiguous()  # a placeholder pointer when unweighted
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        grid, scalars, meta = _launch_args(q, k, indices, start, block, weights)
        if q.shape[1]:
            _forward[grid](q, k, v, indices, valid, w, out, lse, *scalars, **meta)
        ctx.save_for_backward(q, k, v, indices, valid, out, lse, weights)
        ctx.start, ctx.block = start, block
        ctx.pairs = lambda: int(valid.sum()) * block  # whole blocks: a query's own block is masked, not skipped
        flops.attention(ctx.pairs, q.shape[2], q.shape[-1])  # q [bh, m, group, d]
        return out, lse.to(q.dtype) if q.dtype == torch.float64 else lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, indices, valid, out, lse, weights = ctx.saved_tensors
        dout = dout.contiguous()
        w = valid if weights is None else weights.float().contiguous()
        dw = torch.zeros(indices.shape, device=q.device, dtype=torch.float32)
        delta = (dout.float() * out.float()).sum(-1)  # rowsum(dO * O), minus the lse's own gradient
        if dlse is not None:
            delta = delta - dlse.float()
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
        dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
        grid, scalars, meta = _launch_args(q, k, indices, ctx.start, ctx.block, weights)
        if q.shape[1]:
            _backward[grid](q, k, v, indices, valid, w, dout, lse, delta.contiguous(), dq, dk, dv, dw, *scalars,
                            **meta)
        flops.attention(ctx.pairs, q.shape[2], q.shape[-1], backward=True)
        dweights = None if weights is None else dw.to(weights.dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, dweights
