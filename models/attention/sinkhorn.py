"""Sparse Sinkhorn attention (Tay et al. 2020), causal.

The sequence is cut into buckets of `bucket_size`. Each query bucket attends to its own bucket
(causally, token by token) and to one more bucket of keys and values:

- Sinkhorn heads: a *sorted* bucket, the mixture sum_j P[i, j] * bucket_j given by a soft
  permutation P. A learned sorting network scores bucket pairs (a bilinear form of learned
  projections of the buckets' mean inputs); Sinkhorn balancing (`sinkhorn_iter` rounds, in log
  space, at `temperature`, with Gumbel noise while training) turns the scores into P.
- Local heads (the first `n_local_attn_heads`): the previous bucket, so each token sees a window
  of between `bucket_size` and 2 * `bucket_size` - 1 past tokens.

Causality (the paper's causal Sinkhorn balancing, made token-exact). Bucket i may only be sorted
against buckets j < i, whose tokens all precede every token of bucket i, and the scores of row i
are computed from bucket i - 1's summary, not bucket i's own (a summary of bucket i would carry
tokens later than its first ones). Balancing keeps the mask j < i, and normalises each column
cumulatively, over the rows i' <= i only: a plain column sum would let row i depend on later
rows. Each round is a cumulative column normalisation then a row normalisation, so every row of
P is a convex combination of earlier buckets. Bucket 0 has no earlier bucket and sees only its
own past.

Decoding keeps the inputs, keys and values of every past position (models.attention.cache); a
new token's sorted bucket is recomputed from the complete buckets before its own, which is what
the parallel pass computes.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from kernels import at_least_fp32
from models.attention import cache as kv_cache
from models.attention.masked import bucket_pair_attention
from models.recompute import recomputed
from models.rotary import Rotary

_MASKED = -1e9  # finite, so fully masked rows keep finite gradients


class SinkhornAttention(nn.Module):
    def __init__(
        self,
        *,
        dim: int,
        heads: int,
        dim_head: int,
        bucket_size: int,
        n_local_attn_heads: int = 0,
        sinkhorn_iter: int = 5,
        temperature: float = 0.75,
        dropout: float = 0.0,
    ):
        super().__init__()
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
        if not 0 <= n_local_attn_heads <= heads:
            raise ValueError(f"n_local_attn_heads must lie in [0, heads={heads}], got {n_local_attn_heads}")
        if sinkhorn_iter < 1:
            raise ValueError(f"sinkhorn_iter must be >= 1, got {sinkhorn_iter}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.heads, self.dim_head, self.bucket = heads, dim_head, bucket_size
        self.local_heads, self.sort_heads = n_local_attn_heads, heads - n_local_attn_heads
        self.sinkhorn_iter, self.temperature, self.dropout = sinkhorn_iter, temperature, dropout
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)
        self.rotary = Rotary(dim_head)
        if self.sort_heads:  # the sorting network: query-side and key-side bucket projections
            self.to_sort = nn.Linear(dim, 2 * self.sort_heads * dim_head, bias=False)

    def forward(self, x: Tensor, cache: Optional[dict] = None) -> Tensor:
        """x [batch, seq, dim] -> [batch, seq, dim]; `cache` holds past inputs, keys, values."""
        if kv_cache.is_static(cache):
            out = self._static_step(x, cache)
        elif cache is None:
            # recomputed in the backward from x (the block's norm output, recomputed too): q, k, v
            # and the bucketed layout, which holds each bucket's keys and values twice (next to its
            # own and as another's extra bucket), would be kept, more than dense attention keeps
            out = recomputed(self._project_and_attend, x)
        else:
            out = self._project_and_attend(x, cache)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))

    truncate_cache = staticmethod(kv_cache.truncate)

    def static_cache(self, batch: int, capacity: int, dtype: torch.dtype, device) -> dict:
        """Zeroed inputs [batch, slots, dim], keys and values [batch, heads, slots, dim_head] for
        static decoding, slots: the capacity rounded up to whole buckets."""
        slots = -(-capacity // self.bucket) * self.bucket
        keys = {name: torch.zeros(batch, self.heads, slots, self.dim_head, dtype=dtype, device=device)
                for name in ("k", "v")}
        return {"x": torch.zeros(batch, slots, self.to_qkv.in_features, dtype=dtype, device=device), **keys}

    def _static_step(self, x: Tensor, cache: dict) -> Tensor:
        """x [b, t, dim] at positions cache["positions"] [t] -> the heads' outputs [b, h, t, d]: each
        query against its bucket's keys and its earlier block (the previous bucket, or the sorted
        one, mixed over every bucket of the capacity: the mixing weights of later buckets are 0, and
        causal balancing keeps each row independent of later rows, so the rows read are the parallel
        pass's), gathered by position (static shapes)."""
        B, positions = self.bucket, cache[kv_cache.POSITIONS]
        qkv = rearrange(self.to_qkv(x), "b n (s h d) -> s b h n d", s=3, h=self.heads)
        (q, k), v = self.rotary.at(qkv[:2], positions), qkv[2]
        xs, k, v = kv_cache.write(cache, x=x, k=k, v=v)
        bucket = positions // B  # [t]
        offsets = torch.arange(B, device=x.device)
        own = bucket[:, None] * B + offsets  # [t, B] key positions
        previous = (bucket[:, None] - 1).clamp(min=0) * B + offsets
        keys, values = (torch.cat((t[:, :, previous], t[:, :, own]), dim=3).to(q.dtype) for t in (k, v))  # [b, h, t, 2B, d]
        if self.sort_heads:  # the sorted bucket replaces the previous one in the Sinkhorn heads
            buckets = k.shape[2] // B
            rows = self._sort_matrix(xs, buckets)[:, :, (bucket - 1).clamp(min=0)]  # [b, hs, t, buckets]
            sorted_k, sorted_v = (torch.einsum("bhij,bhjnd->bhind", rows.to(q.dtype),
                                               t[:, self.local_heads :].to(q.dtype).unflatten(2, (buckets, B)))
                                  for t in (k, v))
            keys = torch.cat((keys[:, : self.local_heads], torch.cat((sorted_k, keys[:, self.local_heads :, :, B:]), 3)), 1)
            values = torch.cat((values[:, : self.local_heads],
                                torch.cat((sorted_v, values[:, self.local_heads :, :, B:]), 3)), 1)
        visible = torch.cat(((bucket > 0)[:, None].expand(-1, B), own <= positions[:, None]), dim=1)  # [t, 2B]
        scores = at_least_fp32(torch.einsum("bhtd,bhtkd->bhtk", q * self.dim_head**-0.5, keys))
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        return torch.einsum("bhtk,bhtkd->bhtd", weights.to(values.dtype), values)

    def _project_and_attend(self, x: Tensor, cache: Optional[dict] = None) -> Tensor:
        """x [b, n, dim] -> the heads' outputs [b, h, n, d]."""
        start = 0 if cache is None else cache.get("pos", 0)
        qkv = rearrange(self.to_qkv(x), "b n (s h d) -> s b h n d", s=3, h=self.heads)
        (q, k), v = self.rotary(qkv[:2], start), qkv[2]
        if cache is not None:
            x, k, v = kv_cache.append(cache, start, x=x, k=k, v=v)
        return self._attend(x, q, k, v, start)

    def _attend(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        """Queries q [b, h, n, d] at positions [start, start + n); x [b, end, dim] and
        k, v [b, h, end, d] hold every position up to the last query."""
        B, n, end = self.bucket, q.shape[2], k.shape[2]
        first, last = start // B, (end - 1) // B  # the query buckets touched
        count = last - first + 1
        offset = start - first * B
        # queries on the bucket grid, with the key and value buckets they own (views, unless the
        # ends need padding) and the bucket before the first, if there is one (zero padding is
        # masked or dropped)
        queries = _grid(q, offset, count * B - offset - n).unflatten(2, (count, B))
        own_k, own_v = (_grid(t[:, :, first * B :] if first else t, 0, (last + 1) * B - end).unflatten(2, (count, B))
                        for t in (k, v))
        first_k, first_v = (t[:, :, (first - 1) * B : first * B] if first else None for t in (k, v))
        has_earlier = torch.arange(first, last + 1, device=q.device) > 0  # bucket 0 has no extra bucket
        own = torch.ones(B, B, dtype=torch.bool, device=q.device).tril()
        mask = torch.cat((has_earlier[:, None, None].expand(count, B, B), own.expand(count, B, B)), dim=2)
        keep = None
        if self.training and self.dropout:  # drawn on the bucket grid: indexed by position alone
            keep = torch.rand(*queries.shape[:-1], 2 * B, device=q.device) >= self.dropout
        # each query bucket's extra bucket: the previous one for local heads, the sorted one for
        # Sinkhorn heads
        sorted_k = sorted_v = None
        if self.sort_heads:
            sorted_k, sorted_v = self._sorted_buckets(x, k, v, first, last)
        out = bucket_pair_attention(queries, own_k, own_v, mask, keep, self.dropout, earlier_k=sorted_k,
                                    earlier_v=sorted_v, first_k=first_k, first_v=first_v)
        return out.flatten(2, 3)[:, :, offset : offset + n]

    def _sorted_buckets(self, x: Tensor, k: Tensor, v: Tensor, first: int, last: int) -> tuple[Tensor, Tensor]:
        """The sorted bucket of keys and values for query buckets first..last, Sinkhorn heads:
        [b, sort heads, count, bucket, d] each (zeros for bucket 0, which is masked)."""
        B, count = self.bucket, last - first + 1
        complete = last  # buckets 0..last-1 are complete: all any query bucket here may use
        if complete == 0:  # only bucket 0 queries: nothing to sort
            zeros = k.new_zeros(k.shape[0], self.sort_heads, count, B, k.shape[3])
            return zeros, zeros
        mix = self._sort_matrix(x, complete)  # [b, hs, rows i = 1..complete, complete]
        rows = mix[:, :, max(first, 1) - 1 :]  # rows of query buckets first..last
        if first == 0:
            rows = F.pad(rows, (0, 0, 1, 0))
        return tuple(
            torch.einsum("bhij,bhjnd->bhind", rows.to(t.dtype), t[:, self.local_heads :, : complete * B].unflatten(2, (complete, B)))
            for t in (k, v)
        )

    def _sort_matrix(self, x: Tensor, complete: int) -> Tensor:
        """Soft permutation [b, hs, complete, complete]: row r belongs to query bucket r + 1 and
        mixes buckets j <= r. Computed in fp32 at least (fp64 stays fp64: a static cache's step
        balances more rows than the parallel pass, and the rows they share must agree to round-off)."""
        B = self.bucket
        means = x[:, : complete * B].unflatten(1, (complete, B)).mean(dim=2)  # [b, buckets, dim]
        sort_q, sort_k = rearrange(self.to_sort(means), "b m (s h d) -> s b h m d", s=2, h=self.sort_heads)
        scores = at_least_fp32(sort_q @ sort_k.transpose(-1, -2)) / math.sqrt(self.dim_head)
        return sinkhorn(scores, self.sinkhorn_iter, self.temperature, noise=self.training)


def sinkhorn(scores: Tensor, iterations: int, temperature: float, noise: bool = False) -> Tensor:
    """Causal Sinkhorn balancing of scores [..., rows, cols] under the mask col <= row, in log
    space. Columns are normalised cumulatively (over rows <= the current one), so row r depends on
    rows <= r only; every round ends with a row normalisation, so rows sum to 1."""
    rows, cols = scores.shape[-2:]
    allowed = torch.ones(rows, cols, dtype=torch.bool, device=scores.device).tril()
    logits = scores / temperature
    if noise:  # Gumbel-Sinkhorn (Mena et al. 2018): a relaxed sample, not only the mode
        uniform = torch.rand_like(logits).clamp(1e-9, 1 - 1e-9)
        logits = logits - torch.log(-torch.log(uniform)) / temperature
    logits = logits.masked_fill(~allowed, _MASKED)
    for _ in range(iterations):
        logits = (logits - logits.logcumsumexp(dim=-2)).masked_fill(~allowed, _MASKED)
        logits = (logits - logits.logsumexp(dim=-1, keepdim=True)).masked_fill(~allowed, _MASKED)
    return logits.exp().masked_fill(~allowed, 0.0)


def _grid(t: Tensor, before: int, after: int) -> Tensor:
    """t [b, h, n, d] with `before` and `after` zero positions added (no copy when none are)."""
    return F.pad(t, (0, 0, before, after)) if before or after else t
