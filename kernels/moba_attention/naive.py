"""MoBA's block attention as its definition: dense attention masked to the chosen blocks' keys up
to each query. The paths of kernels/moba_attention/ are tested against it."""

import torch
from torch import Tensor


def naive_moba_attention(q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, valid: Tensor, start: int,
                         block: int) -> Tensor:
    """q [b, h, g, m, d] at positions start.., k, v [b, h, n, d] (rotated), blocks, valid [b, h, m,
    slots] -> [b, h, g, m, d]; a query with no key gets zeros."""
    n, m = k.shape[2], q.shape[3]
    key_block = torch.arange(n, device=q.device) // block
    chosen = ((key_block == blocks[..., None]) & valid[..., None]).any(-2)  # [b, h, m, n]
    chosen &= torch.arange(n, device=q.device) <= torch.arange(start, start + m, device=q.device)[:, None]
    scores = torch.einsum("bhgmd,bhnd->bhgmn", q, k) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~chosen[:, :, None], float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("bhgmn,bhnd->bhgmd", probs, v)
