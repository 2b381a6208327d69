"""Span attention as dense attention masked to each query's spans: the definition the kernel must
match (small shapes only: it builds the whole [seq_q, seq_k] mask)."""

from typing import Callable, Optional

import torch
from torch import Tensor


def naive_span_attention(q: Tensor, k: Tensor, v: Tensor, spans: Tensor, weights: Optional[Tensor] = None,
                         gate: Optional[Tensor] = None, rotate: Optional[Callable] = None) -> tuple[Tensor, Tensor]:
    """Same contract as span_attention (kernels/span_attention/__init__.py), in any dtype."""
    if rotate is not None:
        q, k = rotate(q, False), rotate(k, False)
    bh, g, m, d = q.shape
    spans = spans.expand(bh, *spans.shape[-3:]).long()
    key_pos = torch.arange(k.shape[1], device=q.device)
    inside = (key_pos >= spans[..., 0, None]) & (key_pos < spans[..., 1, None])  # [bh, m, slots, n]
    visible = inside.any(-2)
    scores = torch.einsum("bgmd,bnd->bgmn", q, k) * d**-0.5
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = scores.logsumexp(-1)
    probs = (scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None]).exp()
    if weights is not None:  # each key's probability scaled by the weight of the slot that holds it
        probs = probs * torch.einsum("bms,bmsn->bmn", weights.to(probs.dtype), inside.to(probs.dtype))[:, None]
    out = torch.einsum("bgmn,bnd->bgmd", probs, v)
    return (out if gate is None else out * gate[..., None]), lse
