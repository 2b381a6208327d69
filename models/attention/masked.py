"""Masked attention of query buckets over two blocks of keys each, an earlier block and their own
bucket: Sinkhorn attention (the previous or the sorted bucket) and routing attention (the previous
chunk of the cluster-sorted sequence).

Only the inputs are kept for the backward pass, which recomputes the probabilities from q and k,
as flash attention does. Both passes go through the buckets a chunk at a time, so the pairs of key
blocks (each bucket's keys held twice), the bucket-sized probabilities and their gradients exist
for one chunk at once, and the gradients of the keys and values are written straight into the
buckets they came from: the backward holds about what dense attention's does.
"""

from typing import Optional

import torch
from torch import Tensor

from kernels import at_least_fp32

# the scores of one chunk of buckets (1 MB in fp32): a chunk's temporaries stay small beside the
# layer's q, k, v (at 1k tokens a larger chunk's lifted the backward's peak above dense attention's),
# while each matrix product still covers many buckets (8 of 64 at the bench size)
_CHUNK_SCORES = 1 << 18


def bucket_pair_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, keep: Optional[Tensor] = None,
                          dropout: float = 0.0, *, earlier_k: Optional[Tensor] = None,
                          earlier_v: Optional[Tensor] = None, first_k: Optional[Tensor] = None,
                          first_v: Optional[Tensor] = None, buckets_per_chunk: Optional[int] = None) -> Tensor:
    """softmax(q keys^T / sqrt(d), where mask) [* keep / (1 - dropout)] @ values, per bucket, where a
    bucket's keys (values) are its earlier block followed by its own bucket.

    q, k, v [b, h, c, B, d]: the query buckets and their own key and value buckets.
    The earlier block of bucket i is bucket i - 1 of k, v; for bucket 0 it is first_k, first_v
    [b, h, B, d] (None: zeros, which the mask must leave out). earlier_k, earlier_v [b, h_e, c, B, d]:
    the earlier blocks of the last h_e heads instead (Sinkhorn's sorted buckets).
    mask [..., c, B, 2B] bool, broadcast to [b, h, c, B, 2B]: columns [:B] the earlier block, [B:]
    the own bucket; True: attend, and every row needs one. keep, like mask: the attention weights
    that survive dropout (None: no dropout).
    Softmax in fp32 (fp64 for fp64 inputs); returns [b, h, c, B, d] in v's dtype."""
    if buckets_per_chunk is None:
        b, h, _, B, _ = q.shape
        buckets_per_chunk = max(1, _CHUNK_SCORES // (b * h * B * 2 * B))
    return _BucketPairAttention.apply(q, k, v, mask, keep, dropout, earlier_k, earlier_v, first_k, first_v,
                                      buckets_per_chunk)


class _BucketPairAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, keep, dropout, earlier_k, earlier_v, first_k, first_v, per_chunk):
        scale = q.shape[-1] ** -0.5  # applied to q: fewer elements than the scores
        out = v.new_empty(*q.shape[:-1], v.shape[-1])
        for c0, c1 in _chunks(q.shape[2], per_chunk):
            weights = _probabilities(q[:, :, c0:c1] * scale, _pairs(k, earlier_k, first_k, c0, c1), mask[..., c0:c1, :, :])
            if keep is not None:
                weights.mul_(keep[..., c0:c1, :, :]).div_(1 - dropout)
            out[:, :, c0:c1] = weights.to(v.dtype) @ _pairs(v, earlier_v, first_v, c0, c1)
        ctx.save_for_backward(q, k, v, mask, keep, earlier_k, earlier_v, first_k, first_v)
        ctx.dropout, ctx.per_chunk = dropout, per_chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, keep, earlier_k, earlier_v, first_k, first_v = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        grad_out = grad_out.to(v.dtype)
        grad_q = torch.empty_like(q)
        grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
        grad_earlier_k, grad_earlier_v = (None if t is None else torch.empty_like(t) for t in (earlier_k, earlier_v))
        grad_first_k, grad_first_v = (None if t is None else torch.zeros_like(t) for t in (first_k, first_v))
        for c0, c1 in _chunks(q.shape[2], ctx.per_chunk):
            q_scaled = q[:, :, c0:c1] * scale
            keys, values = _pairs(k, earlier_k, first_k, c0, c1), _pairs(v, earlier_v, first_v, c0, c1)
            probs = _probabilities(q_scaled, keys, mask[..., c0:c1, :, :])
            chunk_keep = None if keep is None else keep[..., c0:c1, :, :]
            dropped = probs if chunk_keep is None else probs * chunk_keep / (1 - ctx.dropout)
            grad_chunk = grad_out[:, :, c0:c1]
            _fold(dropped.to(v.dtype).transpose(-1, -2) @ grad_chunk, grad_v, grad_earlier_v, grad_first_v, c0, c1)
            grad_weights = at_least_fp32(grad_chunk @ values.transpose(-1, -2))
            if chunk_keep is not None:
                grad_weights.mul_(chunk_keep).div_(1 - ctx.dropout)
            # softmax backward: dS = P * (dP - rowsum(dP * P))
            grad_scores = probs.mul_(grad_weights - (grad_weights * probs).sum(-1, keepdim=True)).to(q.dtype)
            grad_q[:, :, c0:c1] = (grad_scores @ keys).mul_(scale)
            _fold(grad_scores.transpose(-1, -2) @ q_scaled, grad_k, grad_earlier_k, grad_first_k, c0, c1)
        return (grad_q, grad_k, grad_v, None, None, None, grad_earlier_k, grad_earlier_v, grad_first_k, grad_first_v,
                None)


def _chunks(count: int, per_chunk: int):
    """(first, end) bucket ranges that cover 0..count."""
    return ((c0, min(c0 + per_chunk, count)) for c0 in range(0, count, per_chunk))


def _pairs(t: Tensor, earlier: Optional[Tensor], first: Optional[Tensor], c0: int, c1: int) -> Tensor:
    """[b, h, c1 - c0, 2B, d]: buckets c0..c1 of t [b, h, c, B, d], each after its earlier block."""
    if c0:
        before = t[:, :, c0 - 1 : c1 - 1]
    else:
        head = t.new_zeros(*t.shape[:2], 1, *t.shape[3:]) if first is None else first[:, :, None].to(t.dtype)
        before = torch.cat((head, t[:, :, : c1 - 1]), dim=2)
    if earlier is not None:
        local = t.shape[1] - earlier.shape[1]
        before = torch.cat((before[:, :local], earlier[:, :, c0:c1].to(t.dtype)), dim=1)
    return torch.cat((before, t[:, :, c0:c1]), dim=3)


def _fold(grad_pairs: Tensor, grad: Tensor, grad_earlier: Optional[Tensor], grad_first: Optional[Tensor],
          c0: int, c1: int) -> None:
    """The backward of _pairs: adds grad_pairs [b, h, c1 - c0, 2B, d] into the gradients of the
    buckets, the earlier blocks and the first earlier block it was built from."""
    B = grad.shape[3]
    before, own = grad_pairs[..., :B, :], grad_pairs[..., B:, :]
    grad[:, :, c0:c1] += own
    local = grad.shape[1]
    if grad_earlier is not None:
        local -= grad_earlier.shape[1]
        grad_earlier[:, :, c0:c1] = before[:, local:]
    before = before[:, :local]
    if c0 == 0:  # bucket 0's earlier block is first (or zeros)
        if grad_first is not None:
            grad_first[:, :local] += before[:, :, 0]
        before, c0 = before[:, :, 1:], 1
    grad[:, :local, c0 - 1 : c1 - 1] += before


def _probabilities(q_scaled: Tensor, k: Tensor, mask: Tensor) -> Tensor:
    """softmax over the allowed keys, [..., m, n] (one fused kernel; recomputed in the backward)."""
    scores = at_least_fp32(q_scaled @ k.transpose(-1, -2)).masked_fill_(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)
