"""The lightning indexer of DeepSeek Sparse Attention: the score of every earlier key for each
query, I(t, s) = sum_j w(t, j) * ReLU(q(t, j) . k(s)) over a few indexer heads j with one key per
token, and the top-k keys by it, in one pass over chunks of queries (no [seq, seq] tensor).

    naive.py           every score at once, then a stable sort: the definition
    reference.py       chunked PyTorch scoring and torch.topk; the chosen keys' scores (plain PyTorch)
    lightning_index.c  the CPU kernel: a chunk's scores and top-k in one pass after PyTorch's matrix
                       product; the chosen keys' scores and their gradients (DSA's sparse KL)
    cpu.py             its custom operators
    triton.py          a Triton scoring kernel per chunk, then torch.topk (the CUDA path)
"""

from typing import Optional

from torch import Tensor

from kernels import dispatch
from kernels.lightning_index.reference import index_topk as _chunked

__all__ = ["cpu_built", "gathered_scores", "index_topk", "triton_problem"]


@dispatch.constant_result  # torch.compile reads the answer, never the compiler's files
def cpu_built() -> bool:
    """Whether the CPU kernel is built, or can be built, here (a C compiler)."""
    from kernels.lightning_index import cpu

    return cpu.available()


def triton_problem(index_dim_head: int) -> Optional[str]:
    """What the Triton kernel needs that this shape lacks (one phrase), or None."""
    return dispatch.power_of_two("index_dim_head", index_dim_head, 256, low=16)


def index_topk(q: Tensor, k: Tensor, w: Tensor, start: int, top_k: int, kernel: str = "torch") -> Tensor:
    """The top_k keys of each query by the indexer's score, best first, never after the query.

    q        [batch, seq_q, index_heads, index_dim_head]  indexer queries at positions start..
    k        [batch, seq_k, index_dim_head]               indexer keys from position 0 (seq_k = start + seq_q)
    w        [batch, seq_q, index_heads]                  each head's weight per query
    returns  indices [batch, seq_q, top_k] (int64), -1 where a query has fewer than top_k keys

    Keys are ranked by their fp32 score, equal scores by position, the later key first (the same
    order on every path, so decoding keeps what the parallel pass keeps). No gradient.

    kernel: model.kernel, picked by kernels/dispatch.py's rule: "torch" (reference.py), "triton"
    (triton.py), "cpu" (lightning_index.c after PyTorch's matrix products), or "auto" (Triton on
    CUDA where index_dim_head suits it, the C kernel on CPU tensors where it builds, the reference
    elsewhere).
    """
    runs = dispatch.choose(q, kernel, triton_problem(q.shape[-1]), cpu_built, "the lightning indexer")
    if runs == "triton":
        from kernels.lightning_index.triton import index_topk as scored

        return scored(q, k, w, start, top_k)
    if runs == "cpu":
        from kernels.lightning_index import cpu

        return cpu.index_topk(q, k, w, start, top_k)
    return _chunked(q, k, w, start, top_k)


def gathered_scores(q: Tensor, k: Tensor, w: Tensor, indices: Tensor, kernel: str = "torch") -> Tensor:
    """The indexer's score of each query's chosen keys, with gradient (DSA's sparse KL):

    q        [batch, c, index_heads, index_dim_head]  indexer queries
    k        [batch, seq_k, index_dim_head]           indexer keys
    w        [batch, c, index_heads]                  each head's weight per query
    indices  [batch, c, slots]                        chosen key positions (int64); -1: unused
    returns  I(t, indices[t, s]) [batch, c, slots], at least fp32, 0 in unused slots

    kernel: model.kernel: "cpu" or "auto" take the C kernel (lightning_index.c) on CPU tensors
    where it builds; elsewhere the chosen keys are gathered and scored in torch (reference.py).
    """
    if dispatch.choose(q, kernel, None, cpu_built, "the lightning indexer") == "cpu":
        from kernels.lightning_index import cpu

        return cpu.gathered_scores(q, k, w, indices)
    from kernels.lightning_index.reference import gathered_scores as reference

    return reference(q, k, w, indices)
