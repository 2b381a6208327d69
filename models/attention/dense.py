"""Dense causal multi-head attention through scaled_dot_product_attention: the baseline, and,
with a fixed `mask`, every static sparsity pattern (DALL-E's axial and conv-like layers)."""

from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from models.attention import cache as kv_cache
from models.rotary import Rotary


class DenseAttention(nn.Module):
    """mask: [max_seq, max_seq] bool, True where query i may attend to key j (it must be causal:
    the model is checked for that by the tests); None: plain causal attention.
    rotary: rotary position embeddings on queries and keys (off: the model adds its own)."""

    def __init__(self, *, dim: int, heads: int, dim_head: int, dropout: float = 0.0,
                 mask: Optional[Tensor] = None, rotary: bool = True):
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        self.dropout = dropout
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)
        self.rotary = Rotary(dim_head) if rotary else None
        self.register_buffer("mask", mask, persistent=False)  # derived from the config, not learned

    def forward(self, x: Tensor, cache: Optional[dict] = None) -> Tensor:
        """x [batch, seq, dim] -> [batch, seq, dim]; `cache` holds the past keys and values (a growing
        or a static cache, models/attention/cache.py)."""
        if kv_cache.is_static(cache):
            return self._static_step(x, cache)
        qkv = rearrange(self.to_qkv(x), "b n (s h d) -> s b h n d", s=3, h=self.heads)
        start = 0 if cache is None else cache.get("pos", 0)
        if self.rotary is None:
            q, k, v = qkv
        else:  # v copied out: a view would keep the whole projection alive beside the rotated q, k
            (q, k), v = self.rotary(qkv[:2], start), qkv[2].contiguous()
        if cache is not None:
            k, v = kv_cache.append(cache, start, k=k, v=v)
        dropout = self.dropout if self.training else 0.0
        n, total = q.shape[2], k.shape[2]
        if self.mask is not None:
            if total > self.mask.shape[0]:
                raise ValueError(f"sequence of {total} is longer than this attention's mask ({self.mask.shape[0]})")
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[start:total, :total], dropout_p=dropout)
        elif start == 0:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        elif n == 1:  # one new query, at the end: it sees every key
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)
        else:  # new queries sit at the end: query i sees every key up to start + i
            mask = torch.ones(n, total, dtype=torch.bool, device=x.device).tril(total - n)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))

    truncate_cache = staticmethod(kv_cache.truncate)

    def static_cache(self, batch: int, capacity: int, dtype: torch.dtype, device) -> dict:
        """Zeroed keys and values [batch, heads, capacity, dim_head] for static decoding."""
        if self.mask is not None:
            raise ValueError("an attention with a fixed mask (DALL-E's layers) decodes with the growing cache only")
        return {name: torch.zeros(batch, self.heads, capacity, self.dim_head, dtype=dtype, device=device)
                for name in ("k", "v")}

    def _static_step(self, x: Tensor, cache: dict) -> Tensor:
        """x [batch, t, dim] at the positions cache["positions"] [t] -> [batch, t, dim]: every query
        against the whole capacity, keys after it masked (static shapes)."""
        positions = cache[kv_cache.POSITIONS]
        q, k, v = rearrange(self.to_qkv(x), "b n (s h d) -> s b h n d", s=3, h=self.heads)
        if self.rotary is not None:
            q, k = self.rotary.at(torch.stack((q, k)), positions)
        keys, values = kv_cache.write(cache, k=k, v=v)
        visible = torch.arange(keys.shape[2], device=x.device) <= positions[:, None]  # [t, capacity]
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=visible)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))
