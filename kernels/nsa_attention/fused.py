"""NSA on its fused Triton kernels: `attend` (the operator's Triton path) and `run`, over the kernels
as custom operators (torch.library.custom_op), so torch.compile traces through them and CUDA
graphs capture them: `sparse_attention::nsa_forward` and
`sparse_attention::nsa_backward`, each with a fake (meta) implementation giving its outputs'
shapes, and the autograd formula joining them. They return new tensors only (no output aliases an
input) and mutate nothing; every argument is a tensor or an int."""

from typing import Callable, Optional

import torch
from torch import Tensor

from kernels.nsa_attention import triton as kernels
from kernels.nsa_attention.blocks import BlockRules, split_compressed
from kernels.nsa_attention.triton import Knobs


@torch.library.custom_op("sparse_attention::nsa_forward", mutates_args=())
def nsa_forward(q: Tensor, kvc: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor, v_win: Tensor,
                gates: Tensor, phases: Tensor, start: int, block: int, stride: int, fine: int, forced: int, free: int,
                window: int, save: bool, fsa: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> out, blocks, saved, lse, order, ranked (kernels/nsa_attention/triton.py forward); kvc
    [b, blocks, 2 * kv_heads, d], the compressed keys' heads then the values'."""
    knobs = kernels.Knobs(block, stride, fine, forced, free, window)
    return kernels.forward(q, *split_compressed(kvc), k_slc, v_slc, k_win, v_win, gates, phases, start, knobs, save, fsa)


@nsa_forward.register_fake
def _(q, kvc, k_slc, v_slc, k_win, v_win, gates, phases, start, block, stride, fine, forced, free, window, save, fsa):
    b, n, heads, dim = q.shape
    kv_heads = kvc.shape[2] // 2
    indexed = n and free and (save or fsa)  # the chosen blocks' reverse index
    return (q.new_empty(b, n, heads, dim), q.new_empty(b, kv_heads, n, free, dtype=torch.int32),
            q.new_empty(3 if save and kernels.keeps_outputs(q, kvc, k_slc, v_slc, k_win, v_win) else 0, b, n, heads,
                        dim),
            q.new_empty(3, b, kv_heads, n, heads // kv_heads, dtype=torch.float32),
            q.new_empty((b * kv_heads, n * free) if indexed else (0,), dtype=torch.int64),
            q.new_empty((b * kv_heads, n * free) if indexed else (0,), dtype=torch.int32))


@torch.library.custom_op("sparse_attention::nsa_backward", mutates_args=())
def nsa_backward(dout: Tensor, q: Tensor, kvc: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor,
                 v_win: Tensor, gates: Tensor, phases: Tensor, saved: Tensor, lse: Tensor, blocks: Tensor,
                 order: Tensor, ranked: Tensor, block: int, stride: int, fine: int, forced: int, free: int, window: int,
                 fsa: bool) -> list[Tensor]:
    """-> dq, dkvc, dk_slc, dv_slc, dk_win, dv_win, dgates (kernels/nsa_attention/triton.py backward):
    the compressed keys' and values' gradients in one tensor, as kvc, so they need no concatenation."""
    knobs = kernels.Knobs(block, stride, fine, forced, free, window)
    dkvc = torch.empty_like(kvc)
    dq, _, _, *rest = kernels.backward(dout, q, *split_compressed(kvc), k_slc, v_slc, k_win, v_win, gates, phases, saved,
                                       lse, blocks, order, ranked, knobs, fsa, dkvc)
    return [dq, dkvc, *rest]


@nsa_backward.register_fake
def _(dout, q, kvc, k_slc, v_slc, k_win, v_win, gates, phases, saved, lse, blocks, order, ranked, block, stride,
      fine, forced, free, window, fsa):
    return [torch.empty_like(t) for t in (q, kvc, k_slc, v_slc, k_win, v_win, gates)]


def _setup_context(ctx, inputs, output):
    q, kvc, k_slc, v_slc, k_win, v_win, gates, phases, start, *knobs, save, fsa = inputs
    _, blocks, saved, lse, order, ranked = output
    ctx.save_for_backward(q, kvc, k_slc, v_slc, k_win, v_win, gates, phases, saved, lse, blocks, order, ranked)
    ctx.knobs, ctx.fsa, ctx.backward_possible = knobs, fsa, save and not start
    ctx.mark_non_differentiable(blocks, saved, lse, order, ranked)
    ctx.set_materialize_grads(False)  # else autograd fills a zero gradient for each of those five


def _backward(ctx, dout, *_):
    if dout is None:  # the output passed no gradient
        return (None,) * 17
    if not ctx.backward_possible:
        raise RuntimeError("the NSA kernels' backward needs a forward from position 0 with gradients enabled "
                           "(a training step), not decoding after a cache")
    grads = nsa_backward(dout, *ctx.saved_tensors, *ctx.knobs, ctx.fsa)
    return (*grads[:7], *[None] * 10)


nsa_forward.register_autograd(_backward, setup_context=_setup_context)


def run(q: Tensor, kvc: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor, v_win: Tensor, gates: Tensor,
        phases: Tensor, start: int, knobs: Knobs) -> tuple[Tensor, Tensor]:
    """The three gated branches on the Triton kernels -> out [b, n, heads, d] (passing gradient to every
    tensor but phases) and the chosen fine blocks [b, kv_heads, n, free] (int32, num_fine where unused);
    kvc [b, blocks, 2 * kv_heads, d] the compressed keys and values."""
    save = start == 0 and torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, kvc, k_slc, v_slc, k_win, v_win, gates))
    fsa = kernels.flash_sparse_order(2 * q.shape[2] // kvc.shape[2], knobs.free)
    out, blocks, *_ = nsa_forward(q, kvc, k_slc, v_slc, k_win, v_win, gates, phases, start, knobs.block,
                                  knobs.stride, knobs.fine, knobs.forced, knobs.free, knobs.window, save, fsa)
    return out, blocks


def attend(q: Tensor, keys: tuple[Tensor, ...], gates: Tensor, to_compress: Optional[Tensor], compress: Callable,
           block: int, stride: int,
           rules: BlockRules, rotary, start: int, compressed: Optional[tuple[Tensor, Tensor]], record: bool
           ) -> tuple[Tensor, Optional[tuple[Tensor, Tensor]]]:
    """kernels.nsa_attention.nsa_attention on the fused kernels (shapes there): token-first tensors
    straight into the kernels, the compressor run here (autograd through it)."""
    kvc = compressed if compressed is not None else compress(to_compress)
    seq_k = start + q.shape[1]
    knobs = Knobs(block, stride, rules.fine, rules.forced, rules.free(seq_k), rules.window)
    out, blocks = run(q, kvc, *keys, gates, rotary.phases(seq_k, q.device), start, knobs)
    if not record:
        return out, None
    chosen = blocks < -(-seq_k // rules.fine)  # unused slots hold the number of fine blocks
    return out, (blocks.long().masked_fill(~chosen, 0), chosen)
