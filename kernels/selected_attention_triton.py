"""NSA's selected-block attention as Triton kernels, same signature and results as the reference
in kernels/selected_attention.py.

Group-centric, as the paper's kernel: one program per (batch * kv_head, query position) loads all
query heads of the GQA group at that position together and walks the position's selected blocks,
each key/value block fetched once for the whole group. Online softmax (running max and sum); the
log-sum-exp is saved for the backward pass. The backward program recomputes the probabilities
from it and writes dq directly, while dk and dv, which several positions share, are accumulated
in fp32 with atomic adds (no races; the order of additions, and so the last bits, may vary).

Constraints, checked before launch: dim_head <= 256 and a power of two (32, 64, 128 in practice),
group <= 64, block <= 128. Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (slow:
the tests use tiny shapes).
"""

import os

import torch
import triton
import triton.language as tl
from torch import Tensor


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_supported(q: Tensor, block: int) -> None:
    group, dim = q.shape[2], q.shape[3]
    problems = []
    if dim > 256 or dim & (dim - 1):
        problems.append(f"dim_head={dim} must be a power of two up to 256")
    if group > 64:
        problems.append(f"the GQA group (heads / kv_heads = {group}) must be at most 64")
    if block > 128:
        problems.append(f"fine_block_size={block} must be at most 128")
    if not (q.is_cuda or interpreting()):
        problems.append("the tensors must be on a CUDA device (or set TRITON_INTERPRET=1 to run on the CPU)")
    if problems:
        raise ValueError("the Triton selected-attention kernel cannot run this: " + "; ".join(problems)
                         + ". Use model.kernel=torch")


@triton.jit
def _forward(Q, K, V, IDX, VALID, OUT, LSE, start, seq_k, num_selected, scale,
             G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, GP: tl.constexpr):
    row = tl.program_id(0)  # query position within the sequence
    bh = tl.program_id(1)
    seq_q = tl.num_programs(0)
    t = start + row
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    j = tl.arange(0, BLOCK)
    q_ptr = Q + ((bh * seq_q + row) * G + g[:, None]) * D + d[None, :]
    q = tl.load(q_ptr, mask=g[:, None] < G, other=0.0).to(tl.float32)  # [GP, D]
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for s in range(num_selected):
        block_index = tl.load(IDX + (bh * seq_q + row) * num_selected + s)
        ok = tl.load(VALID + (bh * seq_q + row) * num_selected + s + j * 0) != 0  # [BLOCK], one value
        key_pos = block_index * BLOCK + j
        key_ok = (key_pos <= t) & (key_pos < seq_k) & ok
        kv_off = (bh * seq_k + key_pos[:, None]) * D + d[None, :]
        k = tl.load(K + kv_off, mask=key_ok[:, None], other=0.0).to(tl.float32)  # [BLOCK, D]
        v = tl.load(V + kv_off, mask=key_ok[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, BLOCK]
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep everything at 0
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    has_keys = l > 0
    out = acc / tl.where(has_keys, l, 1.0)[:, None]
    lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, l, 1.0)), float("-inf"))
    tl.store(OUT + ((bh * seq_q + row) * G + g[:, None]) * D + d[None, :], out.to(OUT.dtype.element_ty),
             mask=g[:, None] < G)
    tl.store(LSE + (bh * seq_q + row) * G + g, lse, mask=g < G)


@triton.jit
def _backward(Q, K, V, IDX, VALID, DOUT, LSE, DELTA, DQ, DK, DV, start, seq_k, num_selected, scale,
              G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, GP: tl.constexpr):
    row = tl.program_id(0)
    bh = tl.program_id(1)
    seq_q = tl.num_programs(0)
    t = start + row
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    j = tl.arange(0, BLOCK)
    rows = ((bh * seq_q + row) * G + g[:, None]) * D + d[None, :]
    g_ok = g < G
    q = tl.load(Q + rows, mask=g_ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DOUT + rows, mask=g_ok[:, None], other=0.0).to(tl.float32)
    lse = tl.load(LSE + (bh * seq_q + row) * G + g, mask=g_ok, other=float("-inf"))
    lse = tl.where(lse == float("-inf"), 0.0, lse)  # an empty row: its probabilities come out 0
    delta = tl.load(DELTA + (bh * seq_q + row) * G + g, mask=g_ok, other=0.0)
    dq = tl.zeros([GP, D], tl.float32)
    for s in range(num_selected):
        block_index = tl.load(IDX + (bh * seq_q + row) * num_selected + s)
        ok = tl.load(VALID + (bh * seq_q + row) * num_selected + s + j * 0) != 0  # [BLOCK], one value
        key_pos = block_index * BLOCK + j
        key_ok = (key_pos <= t) & (key_pos < seq_k) & ok
        kv_off = (bh * seq_k + key_pos[:, None]) * D + d[None, :]
        k = tl.load(K + kv_off, mask=key_ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(V + kv_off, mask=key_ok[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        p = tl.where(key_ok[None, :] & g_ok[:, None], tl.exp(scores - lse[:, None]), 0.0)  # [GP, BLOCK]
        dp = tl.sum(do[:, None, :] * v[None, :, :], axis=2)
        ds = p * (dp - delta[:, None]) * scale
        dq += tl.sum(ds[:, :, None] * k[None, :, :], axis=1)
        dk = tl.sum(ds[:, :, None] * q[:, None, :], axis=0)  # [BLOCK, D]
        dv = tl.sum(p[:, :, None] * do[:, None, :], axis=0)
        tl.atomic_add(DK + kv_off, dk, mask=key_ok[:, None])
        tl.atomic_add(DV + kv_off, dv, mask=key_ok[:, None])
    tl.store(DQ + rows, dq.to(DQ.dtype.element_ty), mask=g_ok[:, None])


def _launch_args(q: Tensor, k: Tensor, indices: Tensor, start: int, block: int):
    bh, m, group, dim = q.shape
    meta = dict(G=group, D=dim, BLOCK=block, GP=max(2, triton.next_power_of_2(group)))
    return (m, bh), (start, k.shape[1], indices.shape[-1], dim**-0.5), meta


class TritonSelectedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, valid, start, block):
        check_supported(q, block)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        indices, valid = indices.contiguous(), valid.to(torch.int8).contiguous()
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        grid, scalars, meta = _launch_args(q, k, indices, start, block)
        if q.shape[1]:
            _forward[grid](q, k, v, indices, valid, out, lse, *scalars, **meta)
        ctx.save_for_backward(q, k, v, indices, valid, out, lse)
        ctx.start, ctx.block = start, block
        return out, lse.to(q.dtype) if q.dtype == torch.float64 else lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, indices, valid, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)  # rowsum(dO * O), minus the lse's own gradient
        if dlse is not None:
            delta = delta - dlse.float()
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
        dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
        grid, scalars, meta = _launch_args(q, k, indices, ctx.start, ctx.block)
        if q.shape[1]:
            _backward[grid](q, k, v, indices, valid, dout, lse, delta.contiguous(), dq, dk, dv, *scalars, **meta)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
