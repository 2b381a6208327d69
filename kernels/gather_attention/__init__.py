"""Gather attention: each query attends, with all query heads of its GQA group, to keys chosen for
it one by one (DeepSeek Sparse Attention's top-k tokens), where NSA's selected attention takes
whole blocks.

    naive.py      dense attention masked to the chosen keys: the definition the others must match
    reference.py  gathers the chosen keys chunk by chunk, recomputing backward (the CPU path)
    triton.py     group-centric Triton kernels (the CUDA path)
"""

from torch import Tensor

from kernels.gather_attention.reference import gathered_probabilities

__all__ = ["gather_attention", "gathered_probabilities"]


def gather_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, start: int,
                     kernel: str = "torch") -> tuple[Tensor, Tensor]:
    """Attention of each query over the keys its indices name, causal.

    q        [batch_kv, seq_q, group, dim_head]  queries of one GQA group (batch * kv_heads first)
    k, v     [batch_kv, seq_k, dim_head]         keys and values from position 0
    indices  [batch_kv, seq_q, top_k]            key positions per query (int64); -1 leaves a slot
                                                 unused
    start    position of the first query (seq_k - seq_q when decoding, 0 in training)
    returns  out [batch_kv, seq_q, group, dim_head] and its log-sum-exp [batch_kv, seq_q, group]

    The chosen keys are a set: a key named in several slots of a query counts once. A key after the
    query's own position is masked even where an index names it. A query with no
    visible key gets zeros and a log-sum-exp of -inf (never NaN).

    kernel: "torch" (reference.py), "triton" (triton.py), or "auto" (Triton on CUDA where the shapes
    suit it, the reference elsewhere).
    """
    if kernel == "auto":
        group, dim = q.shape[2], q.shape[3]
        kernel = "triton" if q.is_cuda and dim <= 256 and not dim & (dim - 1) and group <= 64 else "torch"
    if kernel == "triton":
        from kernels.gather_attention.triton import TritonGatherAttention

        return TritonGatherAttention.apply(q, k, v, indices, start)
    from kernels.gather_attention.reference import gather_attention as chunked

    return chunked(q, k, v, indices, start)
