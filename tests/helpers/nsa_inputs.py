"""Random inputs of NSA's fused kernels (kernels/nsa_attention/triton.py), shared by the tests that
run them: the tensors in the kernels' layouts, the rotary phases and the knobs."""

import torch

from kernels.nsa_attention import triton as kernels
from models.rotary import Rotary

GRADIENTS = ("dq", "dkc", "dvc", "dk_slc", "dv_slc", "dk_win", "dv_win", "dgates")  # the backward's, in order


def inputs(seq, heads, kv_heads, dim_head, block, stride, fine, selected, window, dtype, seed=0):
    """q [1, seq, heads, dim_head], kc, vc [1, kv_heads, blocks, dim_head], the selected and window
    branches' k, v [1, seq, kv_heads, dim_head] and the gate logits [1, seq, 3, heads]; the phases
    [seq, dim_head / 2, 2]; the knobs (the first min(3, selected) blocks forced)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = max(0, (seq - block) // stride + 1)
    shapes = [(1, seq, heads, dim_head), (1, kv_heads, blocks, dim_head), (1, kv_heads, blocks, dim_head),
              *[(1, seq, kv_heads, dim_head)] * 4, (1, seq, 3, heads)]
    tensors = [torch.randn(*shape, generator=gen).to(dtype) for shape in shapes]
    forced = min(3, selected)
    knobs = kernels.Knobs(block, stride, fine, forced, max(0, min(selected - forced, -(-seq // fine))), window)
    return tensors, Rotary(dim_head).phases(seq, "cpu"), knobs
