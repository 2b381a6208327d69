"""Gather attention: each query attends, with all query heads of its GQA group, to keys chosen for
it one by one (DeepSeek Sparse Attention's top-k tokens), where NSA's selected attention takes
whole blocks.

    naive.py            dense attention masked to the chosen keys: the definition the others must match
    reference.py        gathers the chosen keys chunk by chunk, recomputing backward (plain PyTorch)
    gather_attention.c  the CPU kernel: one pass per query, its group's heads sharing each gathered key
    cpu.py              its custom operators (sparse_attention::gather_attention and its backward)
    triton.py           group-centric Triton kernels (the CUDA path)

The C kernel is compiled for this CPU on first use (kernels/native.py); where no compiler works,
`cpu_built()` is False and the CPU runs the reference.
"""

from typing import Optional

from torch import Tensor

from kernels import dispatch

__all__ = ["cpu_built", "gather_attention", "gathered_probabilities", "triton_problem"]


@dispatch.constant_result  # torch.compile reads the answer, never the compiler's files
def cpu_built() -> bool:
    """Whether the CPU kernel is built, or can be built, here (a C compiler)."""
    from kernels.gather_attention import cpu

    return cpu.available()


def triton_problem(group: int, dim_head: int) -> Optional[str]:
    """What the Triton kernels need that this shape lacks (one phrase), or None."""
    return (dispatch.power_of_two("dim_head", dim_head, 256)
            or dispatch.group_at_most(group))


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

    kernel: model.kernel, picked by kernels/dispatch.py's rule: "torch" (reference.py), "triton"
    (triton.py), "cpu" (gather_attention.c), or "auto" (Triton on CUDA where the shapes suit it, the
    C kernel on CPU tensors of fp32, bf16 or fp16 where it builds, the reference elsewhere).
    """
    runs = dispatch.choose(q, kernel, triton_problem(q.shape[2], q.shape[3]), cpu_built, "gather attention")
    if runs == "triton":
        from kernels.gather_attention.triton import TritonGatherAttention

        return TritonGatherAttention.apply(q, k, v, indices, start)
    if runs == "cpu":
        from kernels.gather_attention import cpu

        return cpu.gather_attention(q, k, v, indices, start)
    from kernels.gather_attention.reference import gather_attention as chunked

    return chunked(q, k, v, indices, start)


def gathered_probabilities(q: Tensor, k: Tensor, indices: Tensor, lse: Tensor, start: int,
                           kernel: str = "torch") -> Tensor:
    """The attention probabilities of each query's gathered keys, summed over the heads of its
    group, recomputed from the log-sum-exp that gather_attention returned: q [bh, m, g, d],
    k [bh, n, d], indices [bh, m, top_k], lse [bh, m, g] -> [bh, m, top_k], at least fp32 (0 in
    unused slots, and in a slot that repeats an earlier slot's key: the key's probability goes to
    its first slot). No gradient: DSA's indexer learns to match them.

    kernel: as gather_attention's: the C kernel where it takes the tensors, reference.py elsewhere
    (under "triton" too: a small part of DSA's step on a GPU).
    """
    if dispatch.choose(q, kernel, None, cpu_built, "gather attention") == "cpu":
        from kernels.gather_attention import cpu

        return cpu.gathered_probabilities(q, k, indices, lse, start)
    from kernels.gather_attention.reference import gathered_probabilities as chunked

    return chunked(q, k, indices, lse, start)
