"""NSA's selected-block attention: each query attends, with all query heads of its GQA group, to
the keys of the fine blocks chosen for it.

    naive.py      dense attention masked to the chosen blocks: the definition the others must match
    reference.py  gathers the chosen blocks chunk by chunk, recomputing backward (the CPU path)
    triton.py     group-centric Triton kernels (the CUDA path)
"""

from typing import Optional

from torch import Tensor

from kernels import dispatch
from kernels.selected_attention.reference import SelectedAttention


def triton_problem(group: int, dim_head: int, block: int) -> Optional[str]:
    """What the Triton kernels need that this shape lacks (one phrase), or None."""
    return (dispatch.power_of_two("dim_head", dim_head, 256)
            or dispatch.group_at_most(group)
            or dispatch.power_of_two("fine_block_size", block, 128))


def selected_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, valid: Tensor, start: int,
                       block: int, kernel: str = "torch", weights: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Attention of each query over its selected blocks of keys, causal within the blocks.

    q        [batch_kv, seq_q, group, dim_head]  queries of one GQA group (batch * kv_heads first)
    k, v     [batch_kv, seq_k, dim_head]         keys and values from position 0
    indices  [batch_kv, seq_q, num_selected]     fine-block indices per query position (int64)
    valid    [batch_kv, seq_q, num_selected]     False where a selection slot is unused
    start    position of the first query (seq_k - seq_q when decoding, 0 in training)
    block    fine block size
    weights  [batch_kv, seq_q, num_selected] or None: slot s's share of the output is multiplied by
             weights[..., s] (the probabilities stay those of one softmax over all slots); NSA's
             differentiable selection passes straight-through factors, 1 in value
    returns  out [batch_kv, seq_q, group, dim_head] and its log-sum-exp [batch_kv, seq_q, group],
             so that partial attentions over disjoint key sets can be merged exactly

    The chosen blocks are a set: a query attends to the union of its valid slots' blocks, so a block
    named in several valid slots counts once (with weights, the first of those slots gives its
    factor, and the later ones get a zero gradient). Keys after a query's own position are masked
    (-inf) even inside a selected block. A query with no visible key gets zeros and a log-sum-exp
    of -inf (never NaN).

    kernel: model.kernel, picked by kernels/dispatch.py's rule: "torch" (reference.py), "triton"
    (triton.py), "auto" (Triton on CUDA where the shape suits it, the reference elsewhere); the
    package has no C kernel ("cpu" runs the reference).
    """
    kernel = "torch" if kernel == "cpu" else kernel  # the callers' C kernel is span attention, not this
    if dispatch.choose(q, kernel, triton_problem(q.shape[2], q.shape[3], block), what="selected attention") == "triton":
        from kernels.selected_attention.triton import selected_forward

        return selected_forward(q, k, v, indices, valid, start, block, weights)
    return SelectedAttention.apply(q, k, v, indices, valid, start, block, weights)
