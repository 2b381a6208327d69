"""The definition of the lightning indexer's scores and of the keys it keeps: every score at once,
O(seq_q * seq_k) memory, the reference the chunked and Triton paths are tested against."""

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import at_least_fp32


def index_scores(q: Tensor, k: Tensor, w: Tensor, start: int) -> Tensor:
    """I(t, s) = sum_j w(t, j) * ReLU(q(t, j) . k(s)) for keys s <= t, -inf after t: q [b, m, heads, d],
    k [b, n, d], w [b, m, heads], queries at positions start.. -> [b, m, n], at least fp32."""
    products = at_least_fp32(torch.einsum("bmjd,bnd->bmjn", q, k)).relu()
    scores = (at_least_fp32(w)[..., None] * products).sum(2)
    positions = start + torch.arange(q.shape[1], device=q.device)
    return scores.masked_fill(torch.arange(k.shape[1], device=q.device) > positions[:, None], float("-inf"))


def index_topk(q: Tensor, k: Tensor, w: Tensor, start: int, top_k: int) -> Tensor:
    """The top_k keys of each query by its fp32 score, ties to the later key, best first:
    -> indices [b, m, top_k], -1 in the slots a query has no key for (fewer than top_k before it)."""
    scores = index_scores(q, k, w, start).float()
    n = scores.shape[-1]
    # a stable sort of the keys in reverse order: equal scores keep the later key first
    order = scores.flip(-1).sort(dim=-1, descending=True, stable=True).indices[..., :top_k]
    indices = n - 1 - order
    indices = indices.masked_fill(scores.gather(-1, indices) == float("-inf"), -1)
    return F.pad(indices, (0, top_k - indices.shape[-1]), value=-1)
