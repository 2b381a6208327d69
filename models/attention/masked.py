"""Masked attention over small key sets (buckets, windows) that keeps only its inputs for the
backward pass, not the attention weights: the weights are recomputed from q and k in the
backward pass, as flash attention does. Sinkhorn and routing attention call it on their bucketed
layouts, where scaled_dot_product_attention (with a mask, on the CPU) would keep the scores,
a float copy of the mask and the weights of every layer until the backward pass.
"""

from typing import Optional

import torch
from torch import Tensor

from kernels import at_least_fp32


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, keep: Optional[Tensor] = None,
                     dropout: float = 0.0) -> Tensor:
    """softmax(q k^T / sqrt(d), where mask) [* keep / (1 - dropout)] @ v.

    q [..., m, d]; k, v [..., n, d]; mask [..., m, n] bool (True: attend; every row needs one);
    keep [..., m, n] bool, the attention weights that survive dropout (None: no dropout).
    Softmax in fp32 (or fp64 for fp64 inputs); returns [..., m, d] in v's dtype."""
    return _MaskedAttention.apply(q, k, v, mask, keep, dropout)


class _MaskedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, keep, dropout):
        scale = q.shape[-1] ** -0.5  # applied to q: fewer elements than the scores
        weights = _probabilities(q * scale, k, mask)
        if keep is not None:
            weights.mul_(keep).div_(1 - dropout)
        out = weights.to(v.dtype) @ v
        ctx.save_for_backward(q, k, v, mask, keep)
        ctx.dropout = dropout
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, keep = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        q_scaled = q * scale
        probs = _probabilities(q_scaled, k, mask)
        grad_out = grad_out.to(v.dtype)
        dropped = probs if keep is None else probs * keep / (1 - ctx.dropout)
        grad_v = dropped.to(v.dtype).transpose(-1, -2) @ grad_out
        grad_weights = at_least_fp32(grad_out @ v.transpose(-1, -2))
        if keep is not None:
            grad_weights.mul_(keep).div_(1 - ctx.dropout)
        # softmax backward: dS = P * (dP - rowsum(dP * P))
        grad_scores = probs.mul_(grad_weights - (grad_weights * probs).sum(-1, keepdim=True)).to(q.dtype)
        grad_q = (grad_scores @ k).mul_(scale)
        grad_k = grad_scores.transpose(-1, -2) @ q_scaled
        return grad_q, grad_k, grad_v, None, None, None


def _probabilities(q_scaled: Tensor, k: Tensor, mask: Tensor) -> Tensor:
    """softmax over the allowed keys, [..., m, n] (one fused kernel; recomputed in the backward)."""
    scores = at_least_fp32(q_scaled @ k.transpose(-1, -2)).masked_fill_(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)
