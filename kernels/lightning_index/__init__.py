"""The lightning indexer of DeepSeek Sparse Attention: the score of every earlier key for each
query, I(t, s) = sum_j w(t, j) * ReLU(q(t, j) . k(s)) over a few indexer heads j with one key per
token, and the top-k keys by it, in one pass over chunks of queries (no [seq, seq] tensor).

    naive.py      every score at once, then a stable sort: the definition
    reference.py  chunked PyTorch scoring and torch.topk (the CPU path)
    triton.py     a Triton scoring kernel per chunk, then torch.topk (the CUDA path)
"""

from typing import Optional

from torch import Tensor

from kernels import dispatch
from kernels.lightning_index.reference import index_topk as _chunked


def triton_problem(index_dim_head: int) -> Optional[str]:
    """What the Triton kernel needs that this shape lacks (one phrase), or None."""
    return dispatch.power_of_two("index_dim_head", index_dim_head, 256, low=16, verb="to be")


def index_topk(q: Tensor, k: Tensor, w: Tensor, start: int, top_k: int, kernel: str = "torch") -> Tensor:
    """The top_k keys of each query by the indexer's score, best first, never after the query.

    q        [batch, seq_q, index_heads, index_dim_head]  indexer queries at positions start..
    k        [batch, seq_k, index_dim_head]               indexer keys from position 0 (seq_k = start + seq_q)
    w        [batch, seq_q, index_heads]                  each head's weight per query
    returns  indices [batch, seq_q, top_k] (int64), -1 where a query has fewer than top_k keys

    Keys are ranked by their fp32 score, equal scores by position, the later key first (the same
    order on every path, so decoding keeps what the parallel pass keeps). No gradient.

    kernel: model.kernel, picked by kernels/dispatch.py's rule: "torch" (reference.py), "triton"
    (triton.py), or "auto" (Triton on CUDA where index_dim_head suits it, the reference elsewhere).
    """
    if dispatch.choose(q, kernel, triton_problem(q.shape[-1]), what="the lightning indexer") == "triton":
        from kernels.lightning_index.triton import index_topk as scored

        return scored(q, k, w, start, top_k)
    return _chunked(q, k, w, start, top_k)
