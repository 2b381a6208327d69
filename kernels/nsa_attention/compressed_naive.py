"""The definition of NSA's compressed attention and block importance: dense softmax over the
complete blocks, and the importance as a [blocks, fine blocks] token-overlap product. Slow (the
product is cubic in the sequence) and the reference the chunked pass is tested against."""

import torch
from torch import Tensor


def compressed_attention(q: Tensor, kc: Tensor, vc: Tensor, start: int, block: int, stride: int, fine_block: int,
                         num_fine: int) -> tuple[Tensor, Tensor]:
    """q [bh, g, seq_q, d], kc, vc [bh, blocks, d] -> out [bh, g, seq_q, d] (zeros before the first
    complete block) and importance [bh, seq_q, num_fine]: the group's probability mass per fine block."""
    positions = start + torch.arange(q.shape[2], device=q.device)
    block_start = torch.arange(kc.shape[1], device=q.device) * stride
    visible = block_start[None] + block - 1 <= positions[:, None]  # [queries, blocks]
    scores = torch.einsum("bgmd,bcd->bgmc", q, kc) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
    out = torch.einsum("bgmc,bcd->bgmd", probs, vc)
    fine_start = torch.arange(num_fine, device=q.device) * fine_block
    overlap = (torch.minimum(block_start[:, None] + block, fine_start[None] + fine_block)
               - torch.maximum(block_start[:, None], fine_start[None])).clamp(min=0) / block
    return out, probs.sum(1) @ overlap.to(q.dtype)
