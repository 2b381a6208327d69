"""Gather attention in plain PyTorch, chunk by chunk (the CPU path).

A gathered key is a selected block of one key, so this is NSA's chunked selected attention
(kernels/selected_attention/reference.py) at block 1: one chunk of query rows at a time gathers
its keys by index, the backward recomputes them from the saved log-sum-exp and adds dk, dv into
place with `index_add_`. It keeps q, k, v, the indices and the log-sum-exp, O(seq * top_k) at most,
never a copy of the gathered keys for the whole sequence.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import at_least_fp32
from kernels.selected_attention.reference import SelectedAttention, distinct_slots

_CHUNK = 1 << 20  # gathered key elements per chunk of gathered_probabilities


def gather_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, start: int) -> tuple[Tensor, Tensor]:
    """Shapes and meaning as kernels.gather_attention.gather_attention (SelectedAttention counts a
    repeated key once)."""
    return SelectedAttention.apply(q, k, v, indices.clamp(min=0), indices >= 0, start, 1, None)


@torch.no_grad()
def gathered_probabilities(q: Tensor, k: Tensor, indices: Tensor, lse: Tensor, start: int) -> Tensor:
    """The attention probabilities of each query's gathered keys, summed over the heads of its
    group, recomputed from the log-sum-exp that gather_attention returned: q [bh, m, g, d],
    k [bh, n, d], indices [bh, m, top_k], lse [bh, m, g] -> [bh, m, top_k] (0 in unused slots, and
    in a slot that repeats an earlier slot's key: the key's probability goes to its first slot).
    No gradient: DSA's indexer learns to match them, the attention does not learn from that."""
    bh, m, g, d = q.shape
    rows_q, rows_lse = q.reshape(bh * m, g, d), lse.reshape(bh * m, g)
    flat = (indices.clamp(min=0) + (torch.arange(bh, device=q.device) * k.shape[1])[:, None, None]).reshape(bh * m, -1)
    positions = (start + torch.arange(m, device=q.device)).repeat(bh)
    allowed = (distinct_slots(indices, indices >= 0).reshape(bh * m, -1)
               & (indices.reshape(bh * m, -1) <= positions[:, None]))
    keys = k.reshape(-1, d)
    out = at_least_fp32(q.new_empty(bh * m, indices.shape[-1]))
    step = max(1, _CHUNK // (indices.shape[-1] * d))
    for r0 in range(0, bh * m, step):
        r = slice(r0, r0 + step)
        scores = at_least_fp32(torch.bmm(rows_q[r], F.embedding(flat[r], keys).transpose(1, 2))) * d**-0.5
        lse_r = rows_lse[r].masked_fill(rows_lse[r] == float("-inf"), 0.0)
        probs = (scores - lse_r[..., None]).exp().masked_fill(~allowed[r, None], 0.0)
        out[r] = probs.sum(1)
    return out.view(bh, m, -1)
