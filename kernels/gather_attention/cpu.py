"""Gather attention on the CPU kernel (gather_attention.c): one pass per query row, the heads of its
GQA group sharing each gathered key, the backward recomputing the probabilities from the saved
log-sum-exp. Registered as the custom operators `sparse_attention::gather_attention`,
`sparse_attention::gather_attention_backward` and `sparse_attention::gathered_probabilities`
(DSA's target for its indexer), so torch.compile traces through them.

The kernel resolves each query's slots itself (unused slots, keys after the query, a key named
again), so the caller passes the indices as they come. Computed in fp32 for fp32, bf16 and fp16
inputs; q, k, v are read where they lie (any strides with dim_head contiguous).
"""

import ctypes
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from kernels import dispatch, flops
from kernels.native import load, pointer, rows_as_they_lie
from kernels.selected_attention.reference import distinct_slots

_SOURCE = Path(__file__).with_name("gather_attention.c")
_SIGNATURES = (("gather_attention_forward", 6, 14), ("gather_attention_backward", 10, 18),
               ("gather_attention_probabilities", 5, 12))


@dispatch.constant_result  # torch.compile reads the answer, never the compiler's files
def available() -> bool:
    """Whether the CPU kernel is built (or can be built) here."""
    return _library() is not None


def gather_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, start: int) -> tuple[Tensor, Tensor]:
    """Shapes and meaning as kernels.gather_attention.gather_attention: q [bh, m, g, d], k, v
    [bh, n, d], indices [bh, m, top_k] -> out [bh, m, g, d] in q's dtype, lse [bh, m, g] fp32."""
    if not available():
        raise RuntimeError("the gather-attention CPU kernel could not be built here (no working C compiler)")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1] or indices.shape[:2] != q.shape[:2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} and indices "
                         f"{tuple(indices.shape)} do not go together")
    return _gather_attention(q, k, v, indices.to(torch.int64).contiguous(), start)


@torch.library.custom_op("sparse_attention::gather_attention", mutates_args=())
def _gather_attention(q_in: Tensor, k_in: Tensor, v_in: Tensor, indices: Tensor, start: int) -> tuple[Tensor, Tensor]:
    """The kernel call: indices int64, contiguous."""
    q, k, v = (rows_as_they_lie(t.float()) for t in (q_in, k_in, v_in))
    bh, m, g, d = q.shape
    out, lse = q.new_empty(bh, m, g, d), q.new_empty(bh, m, g)
    status = _library().gather_attention_forward(
        pointer(q), pointer(k), pointer(v), pointer(indices), pointer(out), pointer(lse), bh, m, g, d, k.shape[1],
        indices.shape[-1], start, *q.stride()[:3], *k.stride()[:2], *v.stride()[:2], ctypes.c_float(d**-0.5),
        torch.get_num_threads())
    if status:
        raise MemoryError("gather attention: a thread could not allocate its scratch")
    flops.attention(lambda: _pairs(indices, start, k.shape[1]), g, d)
    return out.to(q_in.dtype), lse


@_gather_attention.register_fake
def _(q_in, k_in, v_in, indices, start):
    return q_in.new_empty(q_in.shape), q_in.new_empty(q_in.shape[:3], dtype=torch.float32)


@torch.library.custom_op("sparse_attention::gather_attention_backward", mutates_args=())
def _gather_attention_backward(q_in: Tensor, k_in: Tensor, v_in: Tensor, indices: Tensor, start: int, lse: Tensor,
                               dout: Tensor, dlse: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """-> dq, dk, dv in q's, k's and v's dtypes and shapes."""
    q, k, v, dout = (rows_as_they_lie(t.float()) for t in (q_in, k_in, v_in, dout))
    dlse = None if dlse is None else dlse.float().contiguous()
    lse = lse.contiguous()  # held here: a pointer does not keep its tensor alive
    bh, m, g, d = q.shape
    n = k.shape[1]
    threads = torch.get_num_threads()
    shared_grads = bh % threads == 0  # each thread's rows are whole batch * kv heads: no two add into one key
    dq = q.new_empty(bh, m, g, d)
    dk, dv = (q.new_empty(1 if shared_grads else threads, bh, n, d) for _ in range(2))  # zeroed in C
    status = _library().gather_attention_backward(
        pointer(q), pointer(k), pointer(v), pointer(indices), pointer(lse), pointer(dout), pointer(dlse),
        pointer(dq), pointer(dk), pointer(dv), bh, m, g, d, n, indices.shape[-1], start, int(shared_grads),
        *q.stride()[:3], *k.stride()[:2], *v.stride()[:2], *dout.stride()[:3], ctypes.c_float(d**-0.5), threads)
    if status:
        raise MemoryError("gather attention: a thread could not allocate its scratch")
    flops.attention(lambda: _pairs(indices, start, n), g, d, backward=True)
    dk, dv = (t[0] if shared_grads else t.sum(0) for t in (dk, dv))
    return dq.to(q_in.dtype), dk.to(k_in.dtype), dv.to(v_in.dtype)


@_gather_attention_backward.register_fake
def _(q_in, k_in, v_in, indices, start, lse, dout, dlse):
    return q_in.new_empty(q_in.shape), k_in.new_empty(k_in.shape), v_in.new_empty(v_in.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, indices, start = inputs
    ctx.save_for_backward(q, k, v, indices, output[1])  # q, k, v as given: no fp32 copies kept
    ctx.start = start


def _backward(ctx, dout, dlse):
    q, k, v, indices, lse = ctx.saved_tensors
    dq, dk, dv = _gather_attention_backward(q, k, v, indices, ctx.start, lse, dout, dlse)
    return dq, dk, dv, None, None


_gather_attention.register_autograd(_backward, setup_context=_setup_context)


def gathered_probabilities(q: Tensor, k: Tensor, indices: Tensor, lse: Tensor, start: int) -> Tensor:
    """Shapes and meaning as kernels.gather_attention.gathered_probabilities -> [bh, m, top_k] fp32."""
    with torch.no_grad():
        return _gathered_probabilities(q, k, indices.to(torch.int64).contiguous(), lse, start)


@torch.library.custom_op("sparse_attention::gathered_probabilities", mutates_args=())
def _gathered_probabilities(q_in: Tensor, k_in: Tensor, indices: Tensor, lse: Tensor, start: int) -> Tensor:
    q, k = (rows_as_they_lie(t.float()) for t in (q_in, k_in))
    lse = lse.float().contiguous()  # held here: a pointer does not keep its tensor alive
    bh, m, g, d = q.shape
    probs = q.new_empty(indices.shape)
    status = _library().gather_attention_probabilities(
        pointer(q), pointer(k), pointer(indices), pointer(lse), pointer(probs), bh, m, g, d, k.shape[1],
        indices.shape[-1], start, *q.stride()[:3], *k.stride()[:2], ctypes.c_float(d**-0.5), torch.get_num_threads())
    if status:
        raise MemoryError("gather attention: a thread could not allocate its scratch")
    return probs


@_gathered_probabilities.register_fake
def _(q_in, k_in, indices, lse, start):
    return q_in.new_empty(indices.shape, dtype=torch.float32)


def _pairs(indices: Tensor, start: int, n: int) -> int:
    """(query, key) pairs of one head: the distinct keys each query sees."""
    positions = start + torch.arange(indices.shape[1])
    visible = (indices >= 0) & (indices <= positions[:, None]) & (indices < n)
    return int(distinct_slots(indices, visible).sum())


def _library() -> Optional[ctypes.CDLL]:
    return load(_SOURCE, _SIGNATURES)
