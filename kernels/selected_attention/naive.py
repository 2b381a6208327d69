"""The definition of selected attention, as dense attention masked to the chosen blocks: slow,
O(seq_q * seq_k) memory, and the reference every other path is tested against."""

import torch
from torch import Tensor


def selected_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, valid: Tensor, start: int, block: int,
                       weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Shapes and meaning as kernels.selected_attention.selected_attention: each query over the keys
    of its valid selected blocks at or before its position (the union: a block named in several
    valid slots counts once); with weights, each key's probability is scaled by the weight of the
    first slot that names its block. -> out [bh, seq_q, g, d], lse [bh, seq_q, g]"""
    n = k.shape[1]
    key_block = torch.arange(n, device=q.device) // block
    allowed = torch.zeros(q.shape[0], q.shape[1], n, dtype=torch.bool, device=q.device)
    scale = torch.zeros(q.shape[0], q.shape[1], n, dtype=q.dtype, device=q.device)
    for s in range(indices.shape[-1]):
        in_slot = (key_block == indices[..., s : s + 1]) & valid[..., s : s + 1] & ~allowed  # not an earlier slot's
        allowed |= in_slot
        if weights is not None:
            scale = scale + in_slot * weights[..., s : s + 1]
    positions = start + torch.arange(q.shape[1], device=q.device)
    allowed &= torch.arange(n, device=q.device)[None, None] <= positions[None, :, None]
    scores = torch.einsum("bmgd,bkd->bmgk", q, k) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))
    probs = scores.softmax(-1) if weights is None else scores.softmax(-1) * scale[:, :, None]
    return torch.einsum("bmgk,bkd->bmgd", probs, v), scores.logsumexp(-1)

