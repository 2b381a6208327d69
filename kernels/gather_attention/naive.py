"""The definition of gather attention, as dense attention masked to each query's chosen keys: slow,
O(seq_q * seq_k) memory, and the reference every other path is tested against."""

import torch
from torch import Tensor

from kernels import at_least_fp32


def gather_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, start: int) -> tuple[Tensor, Tensor]:
    """Shapes and meaning as kernels.gather_attention.gather_attention: each query over the keys its
    indices name (-1: an unused slot) at or before its position, the set of them: a key named in
    several slots counts once. -> out [bh, seq_q, g, d], lse [bh, seq_q, g] (a query with no key:
    zeros and -inf)"""
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

