"""Mixture of Block Attention (Lu et al. 2025, MoBA): each query attends to a few whole blocks of
keys, chosen by a gate without parameters.

The keys are cut into blocks of `block_size` tokens. Query t scores every earlier block i by its
dot product with the block's mean key, <q_t, mean(K_i)>, and attends to the `top_k` best,
always counting its own block among them (`include_own_block`, as the paper: its own block holds
keys after t, so its mean is not scored; the block is attended up to t). Only complete blocks
before the query's own are scored, so nothing after t decides what t sees. With
`include_own_block=false` (an ablation) the own block is left out and all `top_k` blocks are
chosen among the earlier ones: a query in the first block then sees no key and gets zeros.

As in the paper, the gate uses the rotated queries and keys (rotary positions before the mean)
and passes no gradient: the keys learn from the attention alone. With GQA (`kv_heads` < heads)
the heads of a group share their blocks, chosen by the sum of their scores (the group's queries
summed, as NSA sums its importance over a group); at kv_heads = heads each head chooses alone, as
in the paper.

The block attention over the chosen blocks is one operator, kernels/moba_attention/, which picks
its path: NSA's selected-block attention with other indices (torch, or Triton on CUDA) or, on the
CPU, the span-attention C kernel NSA's selected branch runs on there, which applies the rotary
positions itself in training and keeps only the log-sum-exp for the backward. Block choice is chunked over
the queries, so no [seq, seq / block_size] score tensor is kept at long context. Decoding keeps
the keys, values and the means of the complete blocks in the cache.
"""

from typing import Optional

import torch
from einops import rearrange
from torch import Tensor, nn

from kernels import at_least_fp32
from kernels.moba_attention import cpu_built, moba_attention, triton_problem
from models.attention import cache as kv_cache
from models.attention.knobs import check_at_least_1, check_gqa, check_kernel, check_no_dropout
from models.rotary import Rotary

_GATE_CHUNK = 1 << 22  # gate scores (query, block) per chunk of queries


class MixtureOfBlockAttention(nn.Module):
    def __init__(
        self,
        *,
        dim: int,
        heads: int,
        dim_head: int,
        kv_heads: int,
        block_size: int,
        top_k: int,
        include_own_block: bool = True,
        dropout: float = 0.0,
        kernel: str = "auto",
    ):
        super().__init__()
        _check(heads, kv_heads, dim_head, block_size, top_k, dropout, kernel)
        self.heads, self.kv_heads, self.dim_head = heads, kv_heads, dim_head
        self.group = heads // kv_heads
        self.block = block_size
        self.top_k = top_k
        self.include_own_block = include_own_block
        self.kernel = kernel
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, 2 * kv_heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)
        self.rotary = Rotary(dim_head)

    def forward(self, x: Tensor, cache: Optional[dict] = None) -> Tensor:
        """x [batch, seq, dim] -> [batch, seq, dim]; with `cache`, x continues the cached tokens."""
        start = 0 if cache is None else cache.get("pos", 0)
        q = rearrange(self.to_q(x), "b n (h g d) -> b h g n d", h=self.kv_heads, g=self.group)
        k, v = rearrange(self.to_kv(x), "b n (s h d) -> s b h n d", s=2, h=self.kv_heads)
        q_gate, k_gate = self._rotate(q.detach(), k.detach(), start)  # the gate's view: rotated, no gradient
        if cache is not None:
            k_gate, v, means = self._extend_cache(cache, start, k_gate, v)
        else:
            means = block_means(k_gate, self.block)
        blocks, valid = self._choose(q_gate, means, start)
        if cache is not None:  # the cache holds rotated keys
            out = moba_attention(self.rotary(q.flatten(1, 2), start).view_as(q), k_gate, v, blocks, valid, start,
                                 self.block, self.kernel)
        else:  # rotated by the path (the C kernel: inside it, no rotated copy kept for the backward)
            out = moba_attention(q, k, v, blocks, valid, start, self.block, self.kernel, rotary=self.rotary)
        return self.to_out(rearrange(out, "b h g n d -> b n (h g d)"))

    def _rotate(self, q: Tensor, k: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Rotary positions from `start`: q [b, h, g, n, d], k [b, h, n, d] -> the same, rotated."""
        return self.rotary(q.flatten(1, 2), start).view_as(q), self.rotary(k, start)

    @torch.no_grad()
    def _choose(self, q: Tensor, means: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """The blocks of queries q [b, h, g, m, d] at positions start.., from the mean keys of the
        complete blocks [b, h, complete, d]: -> blocks, valid [b, h, m, top_k] (the own block first
        where it is included; a slot no block is left for is invalid)."""
        b, h, _, m, _ = q.shape
        own = torch.arange(start, start + m, device=q.device) // self.block
        free = self.top_k - 1 if self.include_own_block else self.top_k
        blocks = own.new_zeros(b, h, m, free)
        valid = torch.zeros(b, h, m, free, dtype=torch.bool, device=q.device)
        q_group = at_least_fp32(q.sum(2))  # the group's summed scores: one choice per kv head
        scored = min(free, means.shape[2])
        step = max(1, _GATE_CHUNK // max(1, b * h * means.shape[2]))
        for c0 in range(0, m if scored else 0, step):
            c = slice(c0, c0 + step)
            scores = torch.einsum("bhmd,bhcd->bhmc", q_group[:, :, c], at_least_fp32(means))
            earlier = torch.arange(means.shape[2], device=q.device) < own[c, None]  # complete, before the own block
            top = scores.masked_fill(~earlier, float("-inf")).topk(scored, dim=-1)
            blocks[:, :, c, :scored], valid[:, :, c, :scored] = top.indices, top.values > float("-inf")
        if self.include_own_block:
            blocks = torch.cat((own.expand(b, h, m)[..., None], blocks), dim=-1)
            valid = torch.cat((valid.new_ones(b, h, m, 1), valid), dim=-1)  # (valid may have no slot: top_k 1)
        return blocks, valid

    # ---- cache -----------------------------------------------------------------------------------

    def truncate_cache(self, cache: dict, length: int) -> None:
        """Roll back to the first `length` positions (block means completed after it go too)."""
        kv_cache.truncate(cache, length)
        if "blocks" in cache:
            kv_cache.truncate(cache["blocks"], length // self.block)

    def _extend_cache(self, cache: dict, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Append the new rotated keys and values; average the blocks they complete. -> every cached
        key and value [b, h, end, d] and the complete blocks' means [b, h, end // block, d]."""
        k, v = kv_cache.append(cache, start, k=k, v=v)
        blocks = cache.setdefault("blocks", {})
        done, complete = blocks.get("pos", 0), k.shape[2] // self.block
        if complete > done:
            (means,) = kv_cache.append(blocks, done, means=block_means(k[:, :, done * self.block :], self.block))
        else:
            means = blocks["means"][:, :, :done] if done else k.new_zeros(*k.shape[:2], 0, k.shape[3])
        return k, v, means


def block_means(k: Tensor, block: int) -> Tensor:
    """The mean key of every complete block: k [b, h, n, d] -> [b, h, n // block, d]."""
    complete = k.shape[2] // block
    return k[:, :, : complete * block].unflatten(2, (complete, block)).mean(3)


def _check(heads, kv_heads, dim_head, block_size, top_k, dropout, kernel) -> None:
    """Reject knob combinations MoBA cannot run, saying how to fix them."""
    check_gqa(heads, kv_heads)
    check_at_least_1(block_size=block_size, top_k=top_k)
    check_no_dropout(dropout, "MoBA's block kernels")
    check_kernel(kernel, "MoBA", cpu_built, triton_problem(heads // kv_heads, dim_head, block_size))
