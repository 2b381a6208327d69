"""NSA's training step on the CPU kernels: one pass of selection.c gives the block selection and the
compressed branch's output (the compressor recomputed in the backward); the selected and window
branches are span attention (kernels/span_attention/) with the rotary positions and gates applied
inside, keeping only their log-sum-exps, the projections read where they lie."""

import torch
from einops import rearrange
from torch import Tensor

from kernels import span_attention as spans
from kernels.nsa_attention.blocks import BlockRules, split_compressed
from kernels.nsa_attention.compressed import cpu_compressed_selection
from kernels.recompute import recomputed


def train(q: Tensor, keys: tuple[Tensor, ...], gates: Tensor, to_compress: Tensor, compress, block: int, stride: int,
          rules: BlockRules, rotary) -> Tensor:
    """A training step from position 0 (shapes as kernels.nsa_attention.nsa_attention) -> [b, n, heads, d]."""
    b, m, heads, d = q.shape
    kv_heads = keys[0].shape[2]
    q = rearrange(q, "b n (h g) d -> b h g n d", h=kv_heads)
    k_slc, v_slc, k_win, v_win = (t.transpose(1, 2) for t in keys)  # [b, h, n, d] views
    kc, vc = split_compressed(recomputed(compress, to_compress))
    out_cmp, scores, indices = cpu_compressed_selection(q, kc.flatten(0, 1), vc.flatten(0, 1), block, stride,
                                                        rules.fine, rules.forced, rules.free(m))
    gates = rearrange(torch.sigmoid(gates), "b n s (h g) -> s (b h) g n", h=kv_heads)  # [3, b * h, g, n]
    out = gates[0, ..., None] * out_cmp.view(b * kv_heads, -1, m, d)
    phases = rotary.phases(m, q.device)
    chosen = rules.block_spans(*rules.with_forced(indices, scores > float("-inf")))
    out_slc, _ = spans.span_attention(q, k_slc, v_slc, chosen, gate=gates[1], phases=phases)
    out_win, _ = spans.span_attention(q, k_win, v_win, rules.window_spans(m, q.device), gate=gates[2], phases=phases)
    out = out.view_as(q).add_(out_slc.add_(out_win))  # in place: no backward reads these sums
    return rearrange(out, "b h g n d -> b n (h g) d")
