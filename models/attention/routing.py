"""Routing attention (Roy et al. 2020), causal at the token level.

Each routing head shares one projection between queries and keys (as the paper does for
language models, so a token's query and key fall in the same cluster) and routes every token to
the nearest of `num_clusters` centroids (spherical k-means on the unit-normalised vectors). A
token attends to the `window_size` most recent tokens of its own cluster, itself included. The
first `n_local_attn_heads` heads attend to the `window_size` most recent tokens instead, with keys
of their own: nothing is routed there, and a shared query-key space cannot express "find the
token after the one like me" (a query scores its own token's earlier copies above it), which
associative recall needs: with shared keys, two local heads covering all 64 tokens of MQAR stayed
at 0.26 accuracy where dense attention reached 1.0.

Why this is causal: a token's cluster depends on its own vector and the centroids only, and "the
w most recent same-cluster tokens" is decided by the past alone. (Cutting the cluster-sorted
sequence into fixed windows, or taking each cluster's top-k tokens over the whole sequence, lets
later tokens move the window boundaries of earlier ones.) In the parallel pass the tokens are
sorted by (cluster, position); within a cluster that keeps positions in order, so the key set is
a sliding window of width w in sorted order restricted to the same cluster, computed chunk by
chunk against the chunk before. Decoding masks the cached keys by the same rule.

Centroids are a buffer (saved with the model), initialised to random unit vectors and moved by
an exponential moving average of their members once per optimizer step (`after_optimizer_step`,
called by the task) from statistics gathered over that step's micro-batches. The commitment
loss, weight * mean ||x - centroid(x)||^2, is exposed as `aux_loss` while training.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from models.attention import cache as kv_cache
from models.attention.masked import bucket_pair_attention
from models.recompute import recomputed
from models.reversible import recomputing
from models.rotary import Rotary


class RoutingAttention(nn.Module):
    def __init__(
        self,
        *,
        dim: int,
        heads: int,
        dim_head: int,
        window_size: int,
        num_clusters: int,
        n_local_attn_heads: int = 0,
        ema_decay: float = 0.999,
        commitment_weight: float = 1e-4,
        dropout: float = 0.0,
    ):
        super().__init__()
        if window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {window_size}")
        if num_clusters < 1:
            raise ValueError(f"num_clusters must be >= 1, got {num_clusters}")
        if not 0 <= n_local_attn_heads <= heads:
            raise ValueError(f"n_local_attn_heads must lie in [0, heads={heads}], got {n_local_attn_heads}")
        if not 0 <= ema_decay < 1:
            raise ValueError(f"ema_decay must lie in [0, 1), got {ema_decay}")
        self.heads, self.window, self.local_heads = heads, window_size, n_local_attn_heads
        self.route_heads = heads - n_local_attn_heads
        self.ema_decay, self.commitment_weight, self.dropout = ema_decay, commitment_weight, dropout
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)  # the routing heads' keys too
        self.to_local_k = nn.Linear(dim, n_local_attn_heads * dim_head, bias=False) if n_local_attn_heads else None
        self.to_v = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)
        self.rotary = Rotary(dim_head)
        centroids = F.normalize(torch.randn(self.route_heads, num_clusters, dim_head), dim=-1)
        self.register_buffer("centroids", centroids)  # [route heads, clusters, dim_head]
        # this optimizer step's k-means statistics (sums of members, member counts)
        self.register_buffer("_sums", torch.zeros_like(centroids), persistent=False)
        self.register_buffer("_counts", torch.zeros(self.route_heads, num_clusters), persistent=False)
        self.aux_loss: Optional[Tensor] = None

    def forward(self, x: Tensor, cache: Optional[dict] = None) -> Tensor:
        """x [batch, seq, dim] -> [batch, seq, dim]; `cache` holds past keys, values, clusters."""
        start = 0 if cache is None else cache.get("pos", 0)
        q = rearrange(self.to_q(x), "b n (h d) -> b h n d", h=self.heads)
        v = rearrange(self.to_v(x), "b n (h d) -> b h n d", h=self.heads)
        local_k = None if self.to_local_k is None else rearrange(self.to_local_k(x), "b n (h d) -> b h n d",
                                                                    h=self.local_heads)
        clusters = self._route(q[:, self.local_heads :])
        if kv_cache.is_static(cache):  # a static cache: every query against the whole capacity
            positions = cache[kv_cache.POSITIONS]
            q, k = self.rotary.at(q, positions), self.rotary.at(self._keys(q, local_k), positions)
            k, v, key_clusters = kv_cache.write(cache, k=k, v=v, clusters=clusters[..., None])
            out = self._attend_cached(q, k.to(q.dtype), v.to(q.dtype), clusters, key_clusters[..., 0], positions)
        elif cache is None:
            # recomputed in the backward from the projections: the rotated queries and keys, and
            # the sorted layout that keeps each chunk's keys and values twice (next to its own and
            # its successor's queries), would be kept beside them, more than dense attention keeps
            out = recomputed(self._attend_projections, q, local_k, v, clusters)
        else:
            q, k = self.rotary(q, start), self.rotary(self._keys(q, local_k), start)
            k, v, key_clusters = kv_cache.append(cache, start, k=k, v=v, clusters=clusters[..., None])
            if start == 0:
                out = self._attend_sorted(q, k, v, clusters)
            else:
                query_pos = torch.arange(start, start + q.shape[2], device=q.device)
                out = self._attend_cached(q, k, v, clusters, key_clusters[..., 0], query_pos)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))

    truncate_cache = staticmethod(kv_cache.truncate)

    def static_cache(self, batch: int, capacity: int, dtype: torch.dtype, device) -> dict:
        """Zeroed keys, values [batch, heads, capacity, dim_head] and clusters [batch, heads,
        capacity, 1] for static decoding."""
        d = self.to_v.out_features // self.heads
        keys = {name: torch.zeros(batch, self.heads, capacity, d, dtype=dtype, device=device) for name in ("k", "v")}
        return {**keys, "clusters": torch.zeros(batch, self.heads, capacity, 1, dtype=torch.long, device=device)}

    def _keys(self, q: Tensor, local_k: Optional[Tensor]) -> Tensor:
        """Keys [b, h, n, d]: the local heads' own, then the routing heads' queries."""
        routed = q[:, self.local_heads :]
        return routed if local_k is None else torch.cat((local_k, routed), dim=1)

    def _attend_projections(self, q: Tensor, local_k: Optional[Tensor], v: Tensor, clusters: Tensor) -> Tensor:
        """All positions from 0, from the unrotated projections q, v [b, h, n, d] and local_k
        [b, local heads, n, d] (None without local heads)."""
        return self._attend_sorted(self.rotary(q, 0), self.rotary(self._keys(q, local_k), 0), v, clusters)

    def _route(self, vectors: Tensor) -> Tensor:
        """Cluster of every token [b, heads, n] (local heads: all 0). While training, also gather
        the k-means statistics and set the commitment loss."""
        b, _, n, _ = vectors.shape
        local = torch.zeros(b, self.local_heads, n, dtype=torch.long, device=vectors.device)
        if not self.route_heads:
            self.aux_loss = None
            return local
        with torch.no_grad():
            unit = F.normalize(vectors.float(), dim=-1)
            nearest = torch.einsum("bhnd,hcd->bhnc", unit, self.centroids.float()).argmax(dim=-1)
        if self.training:
            # recomputed in the backward from the vectors (kept for the attention anyway): its unit
            # vectors and differences would be kept beside them
            self.aux_loss = recomputed(self._commitment_loss, vectors, nearest)
            if not recomputing():  # a reversible backward pass runs this forward a second time
                self._gather(unit, nearest)
        else:
            self.aux_loss = None
        return torch.cat((local, nearest), dim=1)

    def _commitment_loss(self, vectors: Tensor, nearest: Tensor) -> Tensor:
        """weight * mean ||unit(vector) - its centroid||^2; vectors [b, h, n, d], nearest [b, h, n]."""
        unit = F.normalize(vectors.float(), dim=-1)
        centroids = self.centroids.float()
        chosen = centroids[torch.arange(self.route_heads, device=unit.device)[:, None], nearest]  # [b, h, n, d]
        return self.commitment_weight * (unit - chosen).square().sum(-1).mean()

    @torch.no_grad()
    def _gather(self, unit: Tensor, nearest: Tensor) -> None:
        if self._counts.dtype != torch.float32:  # a half-precision engine cast the buffers: counts need fp32
            self._sums, self._counts = self._sums.float(), self._counts.float()
        flat = nearest + torch.arange(self.route_heads, device=unit.device)[:, None] * self.centroids.shape[1]
        flat = flat.flatten()  # [b * h * n] indices into [heads * clusters]
        members = rearrange(unit, "b h n d -> (b h n) d")
        self._sums.view(-1, unit.shape[-1]).index_add_(0, flat, members)
        self._counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Move each centroid that had members toward their mean, then clear the statistics."""
        if not self.route_heads:
            return
        had = self._counts > 0
        means = F.normalize(self._sums / self._counts.clamp(min=1)[..., None], dim=-1)
        centroids = self.centroids.float()
        moved = F.normalize(self.ema_decay * centroids + (1 - self.ema_decay) * means, dim=-1)
        self.centroids.copy_(torch.where(had[..., None], moved, centroids))
        self._sums.zero_()
        self._counts.zero_()

    def _attend_sorted(self, q: Tensor, k: Tensor, v: Tensor, clusters: Tensor) -> Tensor:
        """All positions at once. q, k, v [b, h, n, d]; clusters [b, h, n]."""
        b, h, n, d = q.shape
        w = self.window
        positions = torch.arange(n, device=q.device)
        order = (clusters * n + positions).argsort(dim=-1)  # by cluster, then position
        chunks = -(-n // w)
        # each token's slot in the sorted sequence, before the padding to whole chunks (cluster -1,
        # its own)
        slots = order.argsort(dim=-1)
        qs, ks, vs = (t.new_zeros(b, h, chunks * w, d).scatter(2, slots[..., None].expand(-1, -1, -1, d), t)
                      for t in (q, k, v))
        ids = clusters.new_full((b, h, chunks * w), -1).scatter_(2, slots, clusters)
        # chunk c's queries against chunks c - 1 and c (chunk -1: zeros in cluster -2, never matched)
        q_grid, k_grid, v_grid, query_ids = (t.unflatten(2, (chunks, w)) for t in (qs, ks, vs, ids))
        key_ids = torch.cat((F.pad(query_ids[:, :, :-1], (0, 0, 1, 0), value=-2), query_ids), dim=3)
        distance = torch.arange(w, device=q.device)[:, None] + w - torch.arange(2 * w, device=q.device)
        in_window = (distance >= 0) & (distance < w)  # query index - key index, in sorted order
        mask = (query_ids[..., :, None] == key_ids[..., None, :]) & in_window
        keep = self._dropout_keep(order, distance.clamp(0, w - 1), chunks) if self.training and self.dropout else None
        out = bucket_pair_attention(q_grid, k_grid, v_grid, mask, keep, self.dropout).flatten(2, 3)[:, :, :n]
        return torch.empty_like(out).scatter_(2, order[..., None].expand(-1, -1, -1, d), out)  # back in order

    def _dropout_keep(self, order: Tensor, distance: Tensor, chunks: int) -> Tensor:
        """Which attention weights survive dropout, [b, h, chunks, w, 2w]. The random draws are
        indexed by (query position, how many same-cluster tokens back the key lies), not by the
        sorted layout: the layout depends on later tokens, and draws made in it would let them
        change earlier outputs. distance [w, 2w]: query index - key index, clamped to [0, w)."""
        b, h, n = order.shape
        w = self.window
        draws = torch.rand(b, h, n, w, device=order.device)  # [b, h, query position, distance]
        draws = F.pad(draws.gather(2, order[..., None].expand(-1, -1, -1, w)), (0, 0, 0, chunks * w - n))
        draws = draws.unflatten(2, (chunks, w)).gather(-1, distance.expand(b, h, chunks, w, 2 * w))
        return draws >= self.dropout

    def _attend_cached(self, q: Tensor, k: Tensor, v: Tensor, clusters: Tensor, key_clusters: Tensor,
                       query_pos: Tensor) -> Tensor:
        """New queries q [b, h, n, d] at positions query_pos [n] against every cached key k, v
        [b, h, end, d] with clusters key_clusters [b, h, end] (keys after a query are masked): the
        same key sets as the parallel pass."""
        end = k.shape[2]
        causal = torch.arange(end, device=q.device)[None, :] <= query_pos[:, None]
        same = (clusters[..., :, None] == key_clusters[..., None, :]) & causal  # [b, h, n, end]
        # same-cluster keys from this key up to the query, the key included
        newer = same.flip(-1).cumsum(-1).flip(-1)
        mask = same & (newer <= self.window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # decoding: no dropout
