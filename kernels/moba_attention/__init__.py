"""MoBA's block attention: each query attends, with every query head of its GQA group, to the keys
of the blocks chosen for it (models/attention/moba.py chooses them), cut after the query. The path,
by kernels/dispatch.py's rule:

    cpu     span attention's C kernel (kernels/span_attention/), each block a span of keys; given
            the rotary embedding, it rotates inside the kernel and keeps no rotated copy for the backward
    triton  selected attention's Triton kernels (kernels/selected_attention/), each block as its
            consecutive sub-blocks of the largest power of two up to 128 that divides it
    torch   selected attention's chunked PyTorch, over the same sub-blocks

    naive.py   dense attention masked to the chosen blocks: the definition every path is tested against
"""

from typing import Optional

import torch
from torch import Tensor

from kernels import dispatch
from kernels import span_attention as spans
from kernels.selected_attention import selected_attention
from kernels.selected_attention import triton_problem as selected_problem

_TRITON_MAX_BLOCK = 128  # the Triton selected-attention kernel's largest block


def cpu_built() -> bool:
    """Whether the C kernel is built, or can be built, here."""
    return spans.available()


def triton_problem(group: int, dim_head: int, block: int) -> Optional[str]:
    """What the Triton kernels need that this shape lacks (one phrase), or None."""
    return selected_problem(group, dim_head, sub_block(block))


def moba_attention(q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, valid: Tensor, start: int, block: int,
                   kernel: str = "auto", rotary=None) -> Tensor:
    """Attention of each query over the keys of its chosen blocks, causal within them.

    q       [batch, kv_heads, group, seq_q, dim_head]  queries at positions start..
    k, v    [batch, kv_heads, seq_k, dim_head]          keys and values from position 0
    blocks  [batch, kv_heads, seq_q, slots]             chosen block indices (int64); block i holds
                                                        keys [i * block, (i + 1) * block)
    valid   [batch, kv_heads, seq_q, slots]             False where a slot is unused
    kernel  model.kernel: auto | torch | cpu | triton
    rotary  None where q and k carry their rotary positions; else the Rotary embedding (models/rotary.py),
            which the path applies to both (a training step: start 0)
    returns [batch, kv_heads, group, seq_q, dim_head]; a query with no key gets zeros
    """
    runs = dispatch.choose(q, kernel, triton_problem(q.shape[2], q.shape[4], block), cpu_built, "MoBA")
    if rotary is not None:
        assert start == 0, "rotary positions are applied to a training step's queries, from position 0"
    if runs == "cpu":
        return _on_spans(q, k, v, blocks, valid, start, block,
                         None if rotary is None else rotary.phases(k.shape[2], q.device))
    if rotary is not None:
        q, k = rotary(q.flatten(1, 2)).view_as(q), rotary(k)
    return _on_sub_blocks(q, k, v, blocks, valid, start, block, runs)


def sub_block(block: int) -> int:
    """The largest power of two up to the Triton kernel's largest block that divides `block`."""
    return min(block & -block, _TRITON_MAX_BLOCK)


def _on_spans(q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, valid: Tensor, start: int, block: int,
              phases: Optional[Tensor]) -> Tensor:
    """The C kernel, each block a span of keys cut after the query (shapes as moba_attention)."""
    first = blocks * block
    query_end = torch.arange(start + 1, start + q.shape[3] + 1, device=q.device)[:, None]
    end = torch.minimum(first + block, query_end).masked_fill(~valid, 0)
    key_spans = torch.stack((first.masked_fill(~valid, 0), end), dim=-1).flatten(0, 1)
    out, _ = spans.span_attention(q, k, v, key_spans, phases=phases)
    return out


def _on_sub_blocks(q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, valid: Tensor, start: int, block: int,
                   runs: str) -> Tensor:
    """Selected attention, each block given as its sub-blocks: the same keys, one softmax over all
    of them (shapes as moba_attention)."""
    b = q.shape[0]
    sub = sub_block(block)
    parts = block // sub
    if parts > 1:  # sub-blocks that start after their query (past the sequence's end too) are left out
        blocks = (blocks[..., None] * parts + torch.arange(parts, device=q.device)).flatten(-2)
        positions = torch.arange(start, start + q.shape[3], device=q.device)[:, None]
        valid = valid.repeat_interleave(parts, dim=-1) & (blocks * sub <= positions)
        blocks = blocks.masked_fill(~valid, 0)  # an unused slot must still name a block of the sequence
    out, _ = selected_attention(q.flatten(0, 1).transpose(1, 2), k.flatten(0, 1), v.flatten(0, 1),
                                blocks.flatten(0, 1), valid.flatten(0, 1), start, sub, runs)
    return out.transpose(1, 2).unflatten(0, (b, -1))


__all__ = ["cpu_built", "moba_attention", "sub_block", "triton_problem"]
