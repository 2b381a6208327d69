"""The lightning indexer's scoring and top-k in plain PyTorch, one chunk of queries at a time:
each chunk scores the keys up to its last query and keeps its top-k, so no [seq, seq] tensor
exists, only [chunk, seq] scores (the chunk sized to a fixed number of elements)."""

import torch
from torch import Tensor

from kernels import at_least_fp32
from kernels.ranking import ranking_keys

_CHUNK = 1 << 22  # scored (query, head, key) products per chunk


def top_keys(keys: Tensor, positions: Tensor, top_k: int) -> Tensor:
    """The top_k ranking keys [b, c, n] of queries at positions [c], best first -> indices
    [b, c, top_k], -1 where a slot holds a key after its query (a query with fewer keys)."""
    indices = keys.topk(min(top_k, keys.shape[-1]), dim=-1).indices
    indices = indices.masked_fill(indices > positions[:, None], -1)
    return torch.nn.functional.pad(indices, (0, top_k - indices.shape[-1]), value=-1)


def index_topk(q: Tensor, k: Tensor, w: Tensor, start: int, top_k: int) -> Tensor:
    """Shapes and meaning as kernels.lightning_index.index_topk."""
    b, m, heads, d = q.shape
    out = torch.empty(b, m, top_k, dtype=torch.long, device=q.device)
    step = max(1, _CHUNK // (k.shape[1] * heads))
    for c0 in range(0, m, step):
        c1 = min(m, c0 + step)
        visible = start + c1  # keys up to the chunk's last query
        products = at_least_fp32(torch.bmm(q[:, c0:c1].reshape(b, -1, d), k[:, :visible].transpose(1, 2))).relu_()
        scores = (at_least_fp32(w[:, c0:c1, :, None]) * products.view(b, c1 - c0, heads, visible)).sum(2)
        positions = start + torch.arange(c0, c1, device=q.device)
        scores = scores.masked_fill(torch.arange(visible, device=q.device) > positions[:, None], float("-inf"))
        out[:, c0:c1] = top_keys(ranking_keys(scores, later_first=True), positions, top_k)
    return out


def gathered_scores(q: Tensor, k: Tensor, w: Tensor, indices: Tensor) -> Tensor:
    """Shapes and meaning as kernels.lightning_index.gathered_scores: the chosen keys gathered, then
    scored (with gradient)."""
    keys = k[torch.arange(k.shape[0], device=k.device)[:, None, None], indices.clamp(min=0)]  # [b, c, slots, d]
    products = at_least_fp32(torch.einsum("bcjd,bckd->bcjk", q, keys)).relu()
    return (at_least_fp32(w)[..., None] * products).sum(2).masked_fill(indices < 0, 0.0)
