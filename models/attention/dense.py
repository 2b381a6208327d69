"""Dense causal multi-head attention through scaled_dot_product_attention: the baseline."""

from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from models.attention import cache as kv_cache
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
            k, v = kv_cache.append(cache, start, k=k, v=v)
        dropout = self.dropout if self.training else 0.0
        if start == 0:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        else:  # new queries sit at the end: query i sees every key up to start + i
            n, total = q.shape[2], k.shape[2]
            mask = torch.ones(n, total, dtype=torch.bool, device=x.device).tril(total - n)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))

    truncate_cache = staticmethod(kv_cache.truncate)

