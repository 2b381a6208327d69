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
        self._table: tuple[Tensor, Tensor] | None = None  # cos, sin [positions, dim_head / 2]

    def _cos_sin(self, end: int, device, dtype) -> tuple[Tensor, Tensor]:
        """cos and sin for positions [0, end), computed once and grown by doubling (decoding asks
        for one more position per token)."""
        table = self._table
        if table is None or table[0].shape[0] < end or table[0].device != device or table[0].dtype != dtype:
            size = max(end, 2 * table[0].shape[0] if table is not None else 0, 256)
            angles = torch.outer(torch.arange(size, device=device, dtype=torch.float32), self.inv_freq.to(device))
            self._table = table = (angles.cos().to(dtype), angles.sin().to(dtype))
        return table

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        """Rotate x [batch, heads, seq, dim_head] whose first position is `start`."""
        seq = x.shape[-2]
        cos, sin = self._cos_sin(start + seq, x.device, x.dtype)
        cos, sin = cos[start : start + seq], sin[start : start + seq]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
