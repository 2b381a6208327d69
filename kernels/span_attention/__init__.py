"""Span attention: each query attends, with every query head of its GQA group, to a few spans of
keys [start, end) of its own (NSA's sliding window and its selected blocks in training).

    naive.py          dense attention masked to the spans: the definition the kernel must match
    span_attention.c  the CPU kernel: one pass per query over its spans, keys read where they lie

The C kernel is compiled for this CPU on first use (kernels/native.py). Where no compiler works,
`available()` is False and callers keep their PyTorch path.
"""

import ctypes
import math
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from kernels import dispatch, flops
from kernels.native import load, pointer, row_strides, rows_as_they_lie, transposed_tiles

_SOURCE = Path(__file__).with_name("span_attention.c")
_SIGNATURES = (("span_attention_forward", 9, 16), ("span_attention_backward", 16, 18), ("span_extent", 2, 3))


@dispatch.constant_result  # torch.compile reads the answer, never the compiler's files
def available() -> bool:
    """Whether the CPU kernel is built (or can be built) here."""
    return _library() is not None


def span_attention(q: Tensor, k: Tensor, v: Tensor, spans: Tensor, weights: Optional[Tensor] = None,
                   gate: Optional[Tensor] = None, phases: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Attention of each query over the keys of its spans, on the CPU kernel.

    q        [batch_kv, group, seq_q, dim_head]  queries of one GQA group (batch * kv_heads first),
             or [batch, kv_heads, group, seq_q, dim_head]; any strides with dim_head contiguous
             (a view of a projection is read where it lies, not copied)
    k, v     [batch_kv, seq_k, dim_head], or [batch, kv_heads, seq_k, dim_head] alongside a 5-d q
    spans    [batch_kv, seq_q, slots, 2] or [seq_q, slots, 2] (the same for every batch_kv): int32
             (start, end) key ranges per query; end <= start leaves a slot unused. Spans must not
             overlap, and causality is the caller's: a span holds only keys the query may see.
    weights  [batch_kv, seq_q, slots] or None: slot s's share of the output is multiplied by
             weights[..., s] (the probabilities stay those of one softmax over all slots)
    gate     [batch_kv, group, seq_q] or None: each head's output is multiplied by it, inside the
             kernel (a gated branch keeps no copy of its output for the gate's gradient)
    phases   [positions, dim_head / 2, 2] or None (positions >= seq_q, seq_k): rotary embeddings
             as the (cos, sin) of each channel pair's angle at each position (Rotary.phases): query
             i and key j are rotated by the phases of positions i and j, the queries inside the
             kernel, the keys just before it, in the forward and again in the backward, so no
             rotated copy is kept
    returns  out, shaped as q, in q's dtype, and the log-sum-exp [batch_kv, group, seq_q] in fp32,
             so that attentions over disjoint keys merge exactly. A query with no key gets zeros
             and a log-sum-exp of -inf.

    Computed in fp32 whatever the inputs' dtype (one of kernels.dispatch.C_KERNEL_DTYPES). The kernel is the custom
    operator `sparse_attention::span_attention` (its backward `span_attention_backward`), so
    torch.compile traces through it: new outputs only, no input written.
    """
    if not available():
        raise RuntimeError("the span-attention CPU kernel could not be built here (no working C compiler)")
    _check(q, k, v, spans, weights, gate, phases)
    return _span_attention(q, k, v, spans.to(torch.int32).contiguous(), None if weights is None else weights.float(),
                           None if gate is None else gate.float(), None if phases is None else phases.float().contiguous())


def _check(q: Tensor, k: Tensor, v: Tensor, spans: Tensor, weights: Optional[Tensor], gate: Optional[Tensor],
           phases: Optional[Tensor]) -> None:
    """ValueError unless the arguments' shapes go together as span_attention's docstring says: the C
    kernel trusts every size, and would read or write past a tensor that does not fit (the spans'
    values are checked inside the operator, which torch.compile does not trace)."""
    if q.dim() not in (4, 5) or k.shape != v.shape or k.shape[:-2] != q.shape[:-3] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} do not go with queries {tuple(q.shape)}")
    bh, (g, m, _), n = q.shape[:-3].numel(), q.shape[-3:], k.shape[-2]
    if spans.dim() not in (3, 4) or spans.shape[-1] != 2 or spans.shape[-3] != m or \
            (spans.dim() == 4 and spans.shape[0] != bh):
        raise ValueError(f"spans {tuple(spans.shape)} do not go with queries {tuple(q.shape)}: [{bh}, {m}, slots, 2] "
                         f"or [{m}, slots, 2]")
    slots = spans.shape[-2]
    for name, t, shape in (("weights", weights, (bh, m, slots)), ("gate", gate, (bh, g, m))):
        if t is not None and (t.numel() != math.prod(shape) or t.shape[-2:] != shape[-2:]):
            raise ValueError(f"{name} {tuple(t.shape)} do not go with queries {tuple(q.shape)}: {list(shape)}")
    if phases is not None and (phases.shape[0] < max(m, n) or phases.shape[1:] != (q.shape[-1] // 2, 2)):
        raise ValueError(f"rotary phases {tuple(phases.shape)} for {max(m, n)} positions of dim_head {q.shape[-1]}")


@torch.library.custom_op("sparse_attention::span_attention", mutates_args=())
def _span_attention(q_in: Tensor, k_in: Tensor, v_in: Tensor, spans: Tensor, weights: Optional[Tensor],
                    gate: Optional[Tensor], phases: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """span_attention's kernel call: spans int32, weights, gate and phases fp32 (or None)."""
    weights, gate = (None if t is None else t.contiguous() for t in (weights, gate))
    q, k, v = q_in.float(), k_in.float(), v_in.float()
    q_rows, v_rows = rows_as_they_lie(q), rows_as_they_lie(v)
    g, m, d = q.shape[-3:]
    bh, split = q.shape[:-3].numel(), q.dim() == 5
    out, lse = q.new_empty(*q.shape[:-3], g, m, d), q.new_empty(bh, g, m)  # out laid out as [bh, g, m, d]
    shape = _shape(bh, g, m, d, k.shape[-2], spans)
    flops.attention(lambda: _pairs(spans, bh), g, d)
    k_t = transposed_tiles(_rotated_keys(k, phases))  # held here: a pointer does not keep its tensor alive
    status = _library().span_attention_forward(
        pointer(q_rows), pointer(k_t), pointer(v_rows), pointer(spans), pointer(weights), pointer(gate),
        pointer(phases), pointer(out), pointer(lse), *shape, *row_strides(q_rows, split),
        *row_strides(v_rows, split)[1:], ctypes.c_float(d**-0.5), torch.get_num_threads())
    if status:
        raise MemoryError("span attention: a thread could not allocate its scores")
    return out.to(q_in.dtype), lse


@_span_attention.register_fake
def _(q_in, k_in, v_in, spans, weights, gate, phases):
    *lead, g, m, d = q_in.shape
    return q_in.new_empty(q_in.shape), q_in.new_empty(math.prod(lead), g, m, dtype=torch.float32)


@torch.library.custom_op("sparse_attention::span_attention_backward", mutates_args=())
def _span_attention_backward(q_in: Tensor, k_in: Tensor, v_in: Tensor, spans: Tensor, weights: Optional[Tensor],
                             gate: Optional[Tensor], phases: Optional[Tensor], lse: Tensor, dout: Tensor,
                             dlse: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> dq, dk, dv (in q's, k's and v's dtypes and shapes), dweights and dgate (fp32; empty where
    weights or gate is None)."""
    weights, gate = (None if t is None else t.contiguous() for t in (weights, gate))
    q, k, v = q_in.float(), k_in.float(), v_in.float()
    q_rows = rows_as_they_lie(q)
    g, m, d = q.shape[-3:]
    bh, split = q.shape[:-3].numel(), q.dim() == 5
    threads = torch.get_num_threads()
    shared_grads = bh % threads == 0  # each thread's rows are whole batch * kv heads: no two add into one key
    dout = rows_as_they_lie(dout.float())  # the output's gradient as it comes (a transpose of to_out's, say)
    dlse = None if dlse is None else dlse.float().contiguous()
    dq = q.new_empty(q.shape)  # laid out as [bh, g, m, d]
    keys = _rotated_keys(k, phases)
    dk, dv = (keys.new_empty(1 if shared_grads else threads, *keys.shape) for _ in range(2))  # zeroed in C
    dweights = torch.zeros_like(weights) if weights is not None else q.new_empty(0)
    dgate = torch.empty_like(gate) if gate is not None else q.new_empty(0)
    k_t, v_t = transposed_tiles(keys), transposed_tiles(v).flatten(0, -4)
    status = _library().span_attention_backward(
        pointer(q_rows), pointer(keys), pointer(k_t), pointer(v_t), pointer(spans), pointer(weights), pointer(gate),
        pointer(phases), pointer(lse), pointer(dout), pointer(dlse), pointer(dq), pointer(dk), pointer(dv),
        pointer(None if weights is None else dweights), pointer(None if gate is None else dgate),
        *_shape(bh, g, m, d, k.shape[-2], spans), int(shared_grads), *row_strides(q_rows, split),
        *row_strides(dout, split)[1:], ctypes.c_float(d**-0.5), threads)
    if status:
        raise MemoryError("span attention: a thread could not allocate its probabilities")
    flops.attention(lambda: _pairs(spans, bh), g, d, backward=True)
    dk, dv = (t[0] if shared_grads else t.sum(0) for t in (dk, dv))
    if phases is not None:  # the keys' gradient, rotated back
        _rotate_(dk, phases, inverse=True)
    return dq.to(q_in.dtype), dk.view(k.shape).to(k_in.dtype), dv.view(v.shape).to(v_in.dtype), dweights, dgate


@_span_attention_backward.register_fake
def _(q_in, k_in, v_in, spans, weights, gate, phases, lse, dout, dlse):
    return (q_in.new_empty(q_in.shape), k_in.new_empty(k_in.shape), v_in.new_empty(v_in.shape),
            *(q_in.new_empty(0 if t is None else t.shape, dtype=torch.float32) for t in (weights, gate)))


def _setup_context(ctx, inputs, output):
    # q, k and v as given, not fp32 copies (views of the caller's projection, say, which the caller
    # keeps or recomputes anyway; in bf16, half the bytes)
    ctx.save_for_backward(*inputs, output[1])


def _backward(ctx, dout, dlse):
    q, k, v, spans, weights, gate, phases, lse = ctx.saved_tensors
    dq, dk, dv, dweights, dgate = _span_attention_backward(q, k, v, spans, weights, gate, phases, lse, dout, dlse)
    return dq, dk, dv, None, None if weights is None else dweights, None if gate is None else dgate, None


_span_attention.register_autograd(_backward, setup_context=_setup_context)


def _rotated_keys(k: Tensor, phases: Optional[Tensor]) -> Tensor:
    """k [..., seq_k, d] rotated by the phases of its positions (or as it is): contiguous [bh, seq_k, d],
    written in one pass."""
    if phases is None:
        return k.contiguous().view(-1, *k.shape[-2:])
    if k.storage_offset() % 2 or any(stride % 2 for stride in k.stride()[:-1]):
        k = k.contiguous()  # pairs of channels must lie where complex numbers can
    keys = torch.empty(k.shape, dtype=k.dtype)
    torch.mul(_pairs_of(k), _turns(phases, k.shape[-2]), out=_pairs_of(keys))
    return keys.view(-1, *k.shape[-2:])


def _rotate_(x: Tensor, phases: Tensor, inverse: bool = False) -> Tensor:
    """x [..., seq, d] (contiguous) rotated in place by the phases of positions 0..seq-1 (or back)."""
    turns = _turns(phases, x.shape[-2])
    _pairs_of(x).mul_(turns.conj_physical() if inverse else turns)  # a lazy conj() is lost when the op runs under AOTAutograd
    return x


def _pairs_of(x: Tensor) -> Tensor:
    """x [..., d] as d / 2 complex numbers (channels 2e, 2e + 1), a view."""
    return torch.view_as_complex(x.unflatten(-1, (-1, 2)))


def _turns(phases: Tensor, seq: int) -> Tensor:
    """e^(i angle) [seq, d / 2] of positions 0..seq-1, a complex view of the phases."""
    return torch.view_as_complex(phases[:seq])


def _shape(bh: int, g: int, m: int, d: int, n: int, spans: Tensor) -> tuple:
    """The kernel's size arguments: bh, g, m, d, n, slots, the most keys one query sees, shared;
    ValueError where a span in use (end > start) reaches outside the n keys, which the kernel would
    read (checked here, in the operator, where torch.compile does not trace)."""
    slots, max_keys = spans.shape[-2], ctypes.c_int64(0)
    rows = spans.numel() // (2 * slots) if slots else 0
    if _library().span_extent(pointer(spans), ctypes.addressof(max_keys), rows, slots, n, ctypes.c_float(0), 1):
        raise ValueError(f"a span reaches outside the {n} keys")
    return (bh, g, m, d, n, slots, max_keys.value, int(spans.dim() == 3))


def _pairs(spans: Tensor, bh: int) -> int:
    """(query, key) pairs of one head over all batch * kv heads."""
    pairs = int((spans[..., 1] - spans[..., 0]).clamp(min=0).sum())
    return pairs * bh if spans.dim() == 3 else pairs


def _library() -> Optional[ctypes.CDLL]:
    return load(_SOURCE, _SIGNATURES)
