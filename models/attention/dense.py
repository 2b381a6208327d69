"""Dense causal multi-head attention through scaled_dot_product_attention: the baseline."""

from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from models.rotary import Rotary


class DenseAttention(nn.Module):
    def __init__(self, *, dim: int, heads: int, dim_head: int, dropout: float = 0.0):
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)
        self.rotary = Rotary(dim_head)

    def forward(self, x: Tensor, cache: Optional[dict] = None) -> Tensor:
        """x [batch, seq, dim] -> [batch, seq, dim]; `cache` holds the past keys and values."""
        q, k, v = rearrange(self.to_qkv(x), "b n (s h d) -> s b h n d", s=3, h=self.heads)
        start = 0 if cache is None else cache.get("pos", 0)
        q, k = self.rotary(q, start), self.rotary(k, start)
        if cache is not None:
            k, v = _append(cache, start, k, v)
        dropout = self.dropout if self.training else 0.0
        if start == 0:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        else:  # new queries sit at the end: query i sees every key up to start + i
            n, total = q.shape[2], k.shape[2]
            mask = torch.ones(n, total, dtype=torch.bool, device=x.device).tril(total - n)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))

    @staticmethod
    def truncate_cache(cache: dict, length: int) -> None:
        cache["pos"] = min(cache.get("pos", 0), length)  # later writes overwrite what lies beyond


def _append(cache: dict, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Write the new keys and values [b, h, n, d] at `start` into buffers that grow by doubling
    (decoding then copies each key once, not the whole cache per token); return views up to the
    end."""
    end = start + k.shape[2]
    buf_k = cache.get("k")
    if buf_k is None or buf_k.shape[2] < end or buf_k.dtype != k.dtype:
        capacity = max(end, 2 * (buf_k.shape[2] if buf_k is not None else 0), 64)
        grown_k = k.new_empty(*k.shape[:2], capacity, k.shape[3])
        grown_v = v.new_empty(*v.shape[:2], capacity, v.shape[3])
        if start:
            grown_k[:, :, :start] = cache["k"][:, :, :start]
            grown_v[:, :, :start] = cache["v"][:, :, :start]
        cache["k"], cache["v"] = grown_k, grown_v
    cache["k"][:, :, start:end] = k
    cache["v"][:, :, start:end] = v
    cache["pos"] = end
    return cache["k"][:, :, :end], cache["v"][:, :, :end]
