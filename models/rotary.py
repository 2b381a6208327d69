"""Rotary position embeddings (Su et al. 2021), applied to queries and keys by each attention."""

import torch
from torch import Tensor, nn


class Rotary(nn.Module):
    def __init__(self, dim_head: int, base: float = 10_000.0):
        super().__init__()
        if dim_head % 2:
            raise ValueError(f"rotary embeddings need an even dim_head, got {dim_head}")
        inv_freq = base ** (-torch.arange(0, dim_head, 2, dtype=torch.float32) / dim_head)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        """Rotate x [batch, heads, seq, dim_head] whose first position is `start`."""
        seq = x.shape[-2]
        pos = torch.arange(start, start + seq, device=x.device, dtype=torch.float32)
        angles = torch.outer(pos, self.inv_freq)  # [seq, dim_head / 2]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
