"""NSA's three gated branches (compressed, selected, sliding window) as one operator: the model
(models/attention/nsa.py) states the algorithm and calls `nsa_attention`; this package picks how it
runs, once, by kernels/dispatch.py's rule:

    triton   fused.py: the three gated branches in one custom operator (triton.py launching
             triton_kernels.py), for training, inference and decoding alike, O(n) kept for the
             backward, which runs from the saved log-sum-exps
    cpu      cpu.py: a training step's C kernels, block selection with the compressed branch's
             output in one pass (selection.c), span attention for the chosen blocks and the window
             (kernels/span_attention/); off a training step the torch path with span attention
    torch    chunked.py: plain PyTorch, the readable path (compressed.py, compressed_chunked.py,
             reference.py, tiled.py), and the one for what the fused kernels do not take
             (differentiable selection, attention dropout in training)

    naive.py, compressed_naive.py   the dense definitions every path is tested against
    blocks.py                       which keys the selected branch and the window reach, and which
                                    compressed blocks a position sees
"""

from contextlib import nullcontext
from typing import Callable, ContextManager, Optional, Protocol

import torch
from torch import Tensor

from kernels import dispatch
from kernels import span_attention as spans
from kernels.nsa_attention.blocks import BlockRules, compressed_blocks

# compress(to_compress [b, n, 2 * kv_heads, d]) -> [b, blocks, 2 * kv_heads, d]: the learned compressor of
# the compressed branch's keys and values, the keys' heads first (its input passed as an argument, so
# that a path recomputing it in the backward saves that input as autograd saves any other)
Compress = Callable[[Tensor], Tensor]
BRANCHES = 3  # compressed, selected, window: the gates' order


class Rotary(Protocol):
    def __call__(self, x: Tensor, start: int = 0) -> Tensor: ...  # x [..., seq, d] rotated from position start

    def phases(self, end: int, device) -> Tensor: ...  # (cos, sin) [end, d / 2, 2] fp32, for the kernels


def triton_problem(group: int, dim_head: int, fine: int) -> Optional[str]:
    """What the fused kernels need that this shape lacks (one phrase, to follow "needs"), or None."""
    return (dispatch.power_of_two("dim_head", dim_head, 256, low=16)
            or dispatch.power_of_two("the GQA group (heads / kv_heads)", group, 64)
            or dispatch.power_of_two("fine_block_size", fine, 128))


@dispatch.constant_result  # torch.compile reads the answer, never the compiler's files
def cpu_built() -> bool:
    """Whether the CPU kernels are built, or can be built, here (a C compiler)."""
    from kernels.nsa_attention.compressed import cpu_selection_available

    return spans.available() and cpu_selection_available()


def nsa_attention(q: Tensor, keys: tuple[Tensor, ...], gates: Tensor, to_compress: Optional[Tensor], compress: Compress,
                  block: int, stride: int,
                  rules: BlockRules, rotary: Rotary, start: int = 0, compressed: Optional[Tensor] = None,
                  kernel: str = "auto", diff_topk: bool = False, dropout: float = 0.0, record: bool = False,
                  recompute_inputs: Callable[[], ContextManager] = nullcontext
                  ) -> tuple[Tensor, Optional[tuple[Tensor, Tensor]]]:
    """The three branches mixed by their sigmoid gates, for queries at positions start.. .

    q          [batch, seq_q, heads, dim_head]         queries, before rotary positions
    keys       four [batch, seq_k, kv_heads, dim_head] keys and values of the selected and window
                                                       branches (seq_k = start + seq_q), before rotary
    gates      [batch, seq_q, 3, heads]                gate logits, branches in that order (-inf: closed)
    to_compress [batch, seq_q, 2 * kv_heads, dim_head]  the compressed branch's keys and values (any
               strides; None after a cache, which holds them compressed)
    compress   the learned compressor (Compress)
    block, stride   compressed blocks of `block` tokens every `stride`
    rules      fine blocks, how many are selected, the window
    rotary     the rotary embedding (a Rotary: rotates tensors, and gives the kernels its phases)
    compressed [batch, blocks, 2 * kv_heads, dim_head] already compressed (a decoding cache), or None
    kernel     model.kernel: auto | torch | cpu | triton
    diff_topk  the selection passes gradient (straight-through factors on the chosen blocks)
    dropout    attention dropout of the window branch (training)
    record     also return the freely chosen blocks, where this forward chose them in one go
    recompute_inputs   a context within which the inputs a path saves for its backward may be
               recomputed instead (models/recompute.py's RecomputedLayers.armed: the projections),
               opened where that pays (around the C kernels, which save q and the keys as they lie)
    returns    out [batch, seq_q, heads, dim_head], and with `record` (indices, valid) [batch,
               kv_heads, seq_q, free] of the freely chosen blocks (or None where the path chose them
               in pieces: a CPU or chunked training step)
    """
    exact = diff_topk or (dropout > 0 and torch.is_grad_enabled())  # what only plain PyTorch computes
    runs = dispatch.choose(q, kernel, triton_problem(q.shape[2] // keys[0].shape[2], q.shape[3], rules.fine),
                           cpu_built, "NSA")
    training = compressed is None and torch.is_grad_enabled()
    if runs == "triton" and not exact:
        from kernels.nsa_attention import fused

        return fused.attend(q, keys, gates, to_compress, compress, block, stride, rules, rotary, start, compressed,
                            record)
    if runs == "cpu" and training and not exact:
        from kernels.nsa_attention import cpu

        with recompute_inputs():
            return cpu.train(q, keys, gates, to_compress, compress, block, stride, rules, rotary), None
    from kernels.nsa_attention import chunked

    return chunked.attend(q, keys, gates, to_compress, compress, block, stride, rules, rotary, start, compressed, runs,
                          diff_topk, dropout, record)


__all__ = ["BRANCHES", "BlockRules", "Compress", "compressed_blocks", "cpu_built", "nsa_attention", "triton_problem"]
