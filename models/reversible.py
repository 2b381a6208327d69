"""Reversible residual layers (Gomez et al. 2017, as used by the Reformer): activation memory
that does not grow with depth.

The residual stream is carried as two halves, and each block maps

    y1 = x1 + f(x2)        f: the block's attention branch
    y2 = x2 + g(y1)        g: the block's feed-forward branch

which can be inverted exactly: x2 = y2 - g(y1), x1 = y1 - f(x2). `reversible_stack` runs the
forward pass without keeping any block's activations and, in the backward pass, rebuilds each
block's inputs from its outputs, recomputes the block with gradients on and backpropagates through
it. Only the last block's outputs are stored, whatever the depth.

Recomputation must see what the forward pass saw: the random state (dropout, Gumbel noise) is
saved before each branch and restored when it is recomputed, and `recomputing()` lets a layer with
side effects (routing attention's k-means statistics) skip them the second time.
"""

import contextlib
from typing import Sequence

import torch
from torch import Tensor, nn

from kernels.recompute import recomputation as _recomputation
from kernels.recompute import recomputing  # noqa: F401 (where the attentions ask whether a block is recomputed)


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _replayed_rng(state: tuple, device: torch.device):
    """Run with the random state `state`, leaving the caller's own state untouched."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def block_aux_loss(block: nn.Module) -> Tensor | None:
    return getattr(block.attn, "aux_loss", None)


class _ReversibleStack(torch.autograd.Function):
    """(x1, x2) [batch, seq, dim] each -> (y1, y2, summed auxiliary loss of the attentions)."""

    @staticmethod
    def forward(ctx, x1: Tensor, x2: Tensor, blocks: Sequence[nn.Module], *params: Tensor):
        ctx.blocks, ctx.params = blocks, params
        ctx.rng = []
        aux = x1.new_zeros((), dtype=torch.float32)
        with torch.no_grad():
            for block in blocks:
                f_rng = _rng_state(x1.device)
                x1 = x1 + block.attend(x2)
                g_rng = _rng_state(x1.device)
                x2 = x2 + block.feed(x1)
                ctx.rng.append((f_rng, g_rng))
                if (extra := block_aux_loss(block)) is not None:
                    aux = aux + extra.float()
        ctx.save_for_backward(x1, x2)
        return x1, x2, aux

    @staticmethod
    def backward(ctx, dy1: Tensor, dy2: Tensor, daux: Tensor):
        y1, y2 = ctx.saved_tensors
        device = y1.device
        param_grads = []
        with _recomputation():
            for block, (f_rng, g_rng) in zip(reversed(ctx.blocks), reversed(ctx.rng)):
                f_params = [p for p in block.attn_params() if p.requires_grad]
                g_params = [p for p in block.ff_params() if p.requires_grad]
                # feed-forward branch: y2 = x2 + g(y1)
                with torch.enable_grad(), _replayed_rng(g_rng, device):
                    y1 = y1.detach().requires_grad_()
                    g_out = block.feed(y1)
                dy1_g, *dg = torch.autograd.grad(g_out, [y1, *g_params], dy2, allow_unused=True)
                dy1 = dy1 + dy1_g
                with torch.no_grad():
                    x2 = y2 - g_out
                # attention branch: y1 = x1 + f(x2)
                with torch.enable_grad(), _replayed_rng(f_rng, device):
                    x2 = x2.detach().requires_grad_()
                    f_out = block.attend(x2)
                    outputs, grads = [f_out], [dy1]
                    if (extra := block_aux_loss(block)) is not None and extra.requires_grad:
                        outputs.append(extra.float())
                        grads.append(daux)
                dx2_f, *df = torch.autograd.grad(outputs, [x2, *f_params], grads, allow_unused=True)
                with torch.no_grad():
                    x1 = y1 - f_out
                dy2 = dy2 + dx2_f
                y1, y2 = x1.detach(), x2.detach()
                param_grads.append(dict(zip(f_params + g_params, df + dg)))
        grads = {}
        for block_grads in param_grads:  # a layer shared by several blocks sums their gradients
            for p, g in block_grads.items():
                if g is not None:
                    grads[p] = g if grads.get(p) is None else grads[p] + g
        return (dy1, dy2, None, *(grads.get(p) for p in ctx.params))


def reversible_stack(x1: Tensor, x2: Tensor, blocks: Sequence[nn.Module]) -> tuple[Tensor, Tensor, Tensor]:
    """Run `blocks` reversibly on the two halves [batch, seq, dim]; returns (y1, y2, aux_loss).

    Each block provides `attend(x)` and `feed(x)` (its two residual branches) and
    `attn_params()` / `ff_params()` (the parameters of each)."""
    # each parameter once, though a shared layer lists it in several blocks
    params = list(dict.fromkeys(p for block in blocks for p in (*block.attn_params(), *block.ff_params())
                                if p.requires_grad))
    return _ReversibleStack.apply(x1, x2, tuple(blocks), *params)
