"""The definition of gather attention, as dense attention masked to each query's chosen keys: slow,
O(seq_q * seq_k) memory, and the reference every other path is tested against."""

import torch
from torch import Tensor

from kernels import at_least_fp32


def gather_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, start: int) -> tuple[Tensor, Tensor]:
    """Shapes and meaning as kernels.gather_attention.gather_attention: each query over the keys its
    indices name (-1: an unused slot) at or before its position. -> out [bh, seq_q, g, d],
    lse [bh, seq_q, g] (a query with no key: zeros and -inf)"""
    bh, m, g, d = q.shape
    n = k.shape[1]
    # unused slots (-1) land in an extra column, dropped after
    chosen = torch.zeros(bh, m, n + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(2, torch.where(indices < 0, n, indices), True)
    positions = start + torch.arange(m, device=q.device)
    allowed = chosen[..., :n] & (torch.arange(n, device=q.device) <= positions[:, None])
    scores = at_least_fp32(torch.einsum("bmgd,bkd->bmgk", q, k)) * d**-0.5
    scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))
    lse = scores.logsumexp(-1)
    probs = (scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None]).exp()
    return torch.einsum("bmgk,bkd->bmgd", probs.to(q.dtype), v), lse


def random_indices(bh: int, m: int, start: int, top_k: int, generator: torch.Generator | None = None) -> Tensor:
    """Inputs for checking a kernel: each query's own position first, then distinct random earlier
    keys, -1 where a query has fewer earlier keys than slots, and some slots left unused.
    -> indices [bh, m, top_k]"""
    positions = start + torch.arange(m)
    draws = torch.rand(bh, m, start + m, generator=generator)
    draws = draws.masked_fill(torch.arange(start + m) >= positions[:, None], -1.0)  # earlier keys only
    earlier = draws.topk(min(top_k - 1, start + m), dim=-1)
    picks = torch.where(earlier.values >= 0, earlier.indices, -1)
    picks = torch.nn.functional.pad(picks, (0, top_k - 1 - picks.shape[-1]), value=-1)
    picks = picks.masked_fill(torch.rand(picks.shape, generator=generator) < 0.2, -1)  # unused slots
    return torch.cat((positions[None, :, None].expand(bh, m, 1), picks), dim=-1)
