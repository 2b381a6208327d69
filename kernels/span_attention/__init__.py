"""Span attention: each query attends, with every query head of its GQA group, to a few spans of
keys [start, end) of its own (NSA's sliding window and its selected blocks in training).

    naive.py          dense attention masked to the spans: the definition the kernel must match
    span_attention.c  the CPU kernel: one pass per query over its spans, keys read where they lie

The C kernel is compiled for this CPU on first use (kernels/native.py). Where no compiler works,
`available()` is False and callers keep their PyTorch path.
"""

import ctypes
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

from kernels import flops
from kernels.native import load, pointer, transposed_tiles

_SOURCE = Path(__file__).with_name("span_attention.c")
_SIGNATURES = (("span_attention_forward", 8, 8), ("span_attention_backward", 15, 8))
Rotate = Callable[[Tensor, bool], Tensor]  # rotate(x [..., seq, dim_head], inverse) -> x rotated by position
# element types the kernel runs in fp32 without losing what the caller asked for
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available() -> bool:
    """Whether the CPU kernel is built (or can be built) here."""
    return _library() is not None


def span_attention(q: Tensor, k: Tensor, v: Tensor, spans: Tensor, weights: Optional[Tensor] = None,
                   gate: Optional[Tensor] = None, rotate: Optional[Rotate] = None) -> tuple[Tensor, Tensor]:
    """Attention of each query over the keys of its spans, on the CPU kernel.

    q        [batch_kv, group, seq_q, dim_head]  queries of one GQA group (batch * kv_heads first)
    k, v     [batch_kv, seq_k, dim_head]
    spans    [batch_kv, seq_q, slots, 2] or [seq_q, slots, 2] (the same for every batch_kv): int32
             (start, end) key ranges per query; end <= start leaves a slot unused. Spans must not
             overlap, and causality is the caller's: a span holds only keys the query may see.
    weights  [batch_kv, seq_q, slots] or None: slot s's share of the output is multiplied by
             weights[..., s] (the probabilities stay those of one softmax over all slots)
    gate     [batch_kv, group, seq_q] or None: each head's output is multiplied by it, inside the
             kernel (a gated branch keeps no copy of its output for the gate's gradient)
    rotate   rotate(x, inverse) or None: x [..., seq, dim_head] rotated by position (rotary
             embeddings; query i and key j at positions i and j), or rotated back with inverse.
             Applied to q and k inside, and again in the backward, so no rotated copy is kept.
    returns  out [batch_kv, group, seq_q, dim_head] in q's dtype, and the log-sum-exp
             [batch_kv, group, seq_q] in fp32, so that attentions over disjoint keys merge exactly.
             A query with no key gets zeros and a log-sum-exp of -inf.

    Computed in fp32 whatever the inputs' dtype (one of KERNEL_DTYPES).
    """
    if _library() is None:
        raise RuntimeError("the span-attention CPU kernel could not be built here (no working C compiler)")
    out, lse = _SpanAttention.apply(q.float(), k.float(), v.float(), spans.to(torch.int32).contiguous(),
                                    None if weights is None else weights.float(), None if gate is None else gate.float(),
                                    rotate)
    return out.to(q.dtype), lse


class _SpanAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spans, weights, gate, rotate):
        ctx.rotate = rotate
        q_in, k_in = q, k  # saved as given: the caller keeps them anyway
        q, k = _rotated(q, k, rotate)
        v_rows = v.contiguous()
        weights, gate = (None if t is None else t.contiguous() for t in (weights, gate))
        bh, g, m, d = q.shape
        out, lse = torch.empty_like(q), q.new_empty(bh, g, m)
        ctx.shape = _shape(q, k, spans)
        ctx.pairs = lambda: _pairs(spans, bh)
        flops.attention(ctx.pairs, g, d)
        k_t = transposed_tiles(k)  # held here: a pointer does not keep its tensor alive
        status = _library().span_attention_forward(
            pointer(q), pointer(k_t), pointer(v_rows), pointer(spans), pointer(weights), pointer(gate), pointer(out),
            pointer(lse), *ctx.shape, ctypes.c_float(d**-0.5), torch.get_num_threads())
        if status:
            raise MemoryError("span attention: a thread could not allocate its scores")
        # v as given (a view of the caller's projection, say): the backward reads it in tiles only
        ctx.save_for_backward(q_in, k_in, v, spans, weights, gate, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, spans, weights, gate, lse = ctx.saved_tensors
        q, k = _rotated(q, k, ctx.rotate)
        d = q.shape[-1]
        threads = torch.get_num_threads()
        dout = dout.float().contiguous()
        dlse = None if dlse is None else dlse.float().contiguous()
        dq = torch.empty_like(q)
        dk, dv = (k.new_zeros(threads, *k.shape) for _ in range(2))  # one buffer per thread: no races
        dweights = None if weights is None else torch.zeros_like(weights)
        dgate = None if gate is None else torch.empty_like(gate)
        k_t, v_t = transposed_tiles(k), transposed_tiles(v)
        status = _library().span_attention_backward(
            pointer(q), pointer(k), pointer(k_t), pointer(v_t), pointer(spans), pointer(weights), pointer(gate),
            pointer(lse), pointer(dout), pointer(dlse), pointer(dq), pointer(dk), pointer(dv), pointer(dweights),
            pointer(dgate),
            *ctx.shape, ctypes.c_float(d**-0.5), threads)
        if status:
            raise MemoryError("span attention: a thread could not allocate its probabilities")
        flops.attention(ctx.pairs, q.shape[1], d, backward=True)
        dk = dk.sum(0)
        if ctx.rotate is not None:  # the gradients of the rotated q and k, rotated back
            dq, dk = ctx.rotate(dq, True), ctx.rotate(dk, True)
        return dq, dk, dv.sum(0), None, dweights, dgate, None


def _rotated(q: Tensor, k: Tensor, rotate: Optional[Rotate]) -> tuple[Tensor, Tensor]:
    if rotate is not None:
        q, k = rotate(q, False), rotate(k, False)
    return q.contiguous(), k.contiguous()


def _shape(q: Tensor, k: Tensor, spans: Tensor) -> tuple:
    """The kernel's size arguments: bh, g, m, d, n, slots, the most keys one query sees, shared."""
    bh, g, m, d = q.shape
    lengths = (spans[..., 1] - spans[..., 0]).clamp(min=0).sum(-1)
    max_keys = int(lengths.max()) if lengths.numel() else 0
    return (bh, g, m, d, k.shape[1], spans.shape[-2], max_keys, int(spans.dim() == 3))


def _pairs(spans: Tensor, bh: int) -> int:
    """(query, key) pairs of one head over all batch * kv heads."""
    pairs = int((spans[..., 1] - spans[..., 0]).clamp(min=0).sum())
    return pairs * bh if spans.dim() == 3 else pairs


def _library() -> Optional[ctypes.CDLL]:
    return load(_SOURCE, _SIGNATURES)
