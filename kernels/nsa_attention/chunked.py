"""NSA in plain PyTorch: the readable path (model.kernel=torch), and the one for what the fused
kernels do not take (differentiable selection, attention dropout in training). `runs` says which
kernels its branch functions may call: "cpu" the span-attention C kernel (reference.py), "triton"
the selected-attention Triton kernel (differentiable selection on CUDA), "torch" neither.

A training step selects blocks once, without gradient, and recomputes each gated branch on its own
in the backward (as flash attention recomputes its probabilities), so a layer keeps x, the
projections, the gates and the compressed branch's attention output (less than dense attention
keeps), and its backward holds one branch's activations at a time. Plain checkpoints, inside a
reversible stack's recomputation too: there they hold its backward to one branch at a time (2k,
kernel=torch: 111.5 against 117.1 MB). Otherwise (inference, decoding after a cache,
differentiable selection) the three branches run in one go."""

from typing import Optional

import torch
from einops import rearrange
from torch import Tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from kernels.nsa_attention import reference
from kernels.nsa_attention.blocks import BlockRules, split_compressed
from kernels.nsa_attention.compressed import block_selection, causal_block_attention, compressed_attention
from kernels.recompute import recomputed


def attend(q: Tensor, keys: tuple[Tensor, ...], gates: Tensor, to_compress: Optional[Tensor], compress, block: int,
           stride: int, rules: BlockRules, rotary, start: int, compressed: Optional[Tensor], runs: str, diff_topk: bool,
           dropout: float, record: bool) -> tuple[Tensor, Optional[tuple[Tensor, Tensor]]]:
    """kernels.nsa_attention.nsa_attention in plain PyTorch (shapes there)."""
    kv_heads = keys[0].shape[2]
    branches = Branches(block, stride, rules, rotary, runs, dropout)
    q = rearrange(q, "b n (h g) d -> b h g n d", h=kv_heads)
    keys = tuple(t.transpose(1, 2) for t in keys)  # [b, h, n, d]
    gates = rearrange(gates, "b n s (h g) -> s b h g n 1", h=kv_heads)
    chosen = None
    if compressed is not None or not torch.is_grad_enabled():
        out, chosen = branches.together(q, keys, gates, to_compress, compress, start, compressed, False)
    elif diff_topk:  # selection passes gradient: the branches recompute together
        out, _ = recomputed(branches.together, q, keys, gates, to_compress, compress, 0, None, True)
        if record:  # what the step chose, as the fused kernels record it
            with torch.no_grad():
                _, chosen = branches.together(q.detach(), tuple(t.detach() for t in keys), gates.detach(),
                                              to_compress.detach(), compress, 0, None, False)
    else:
        out = branches.train(q, keys, gates, to_compress, compress)
    return rearrange(out, "b h g n d -> b n (h g) d"), chosen if record else None


class Branches:
    """The branches on layout q [b, h, g, n, d] (a GQA group's heads together), keys and values
    [b, h, n, d], gate logits [3, b, h, g, n, 1] -> [b, h, g, n, d]."""

    def __init__(self, block: int, stride: int, rules: BlockRules, rotary, runs: str, dropout: float):
        self.block, self.stride, self.rules, self.rotary, self.runs, self.dropout = block, stride, rules, rotary, runs, dropout

    def train(self, q: Tensor, keys: tuple[Tensor, ...], gates: Tensor, to_compress: Tensor, compress) -> Tensor:
        """A training step from position 0: selection once without gradient, each branch checkpointed."""
        k_slc, v_slc, k_win, v_win = keys
        with torch.no_grad():
            kc, _ = split_compressed(compress(to_compress))
            scores, indices = block_selection(q.flatten(0, 1), kc.flatten(0, 1), 0, self.block, self.stride,
                                              self.rules.fine, self.rules.chooser(k_slc.shape[2]))
        out = checkpoint(self._compressed, q, to_compress, gates[0], compress, use_reentrant=False,
                         context_fn=_keep_causal_attention)
        out = out + checkpoint(self._selected, q, k_slc, v_slc, gates[1], scores, indices, use_reentrant=False)
        return out + checkpoint(self._window, q, k_win, v_win, gates[2], use_reentrant=False)

    def together(self, q: Tensor, keys: tuple[Tensor, ...], gates: Tensor, to_compress: Optional[Tensor], compress,
                 start: int, compressed: Optional[Tensor], importance_grad: bool
                 ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """The three branches in one go, for queries from `start` (keys from 0; `compressed` the
        cache's compressed keys, else compressed here) -> out, and the freely chosen blocks
        (indices, valid) [b, h, n, free]."""
        b, h, g, m, d = q.shape
        k_slc, v_slc, k_win, v_win = keys
        rotary = self.rotary if start else None  # after a cache, its keys are rotated where they are read
        if rotary is None:
            k_slc, k_win = self.rotary(torch.stack((k_slc, k_win)), 0)
        q_rot = self.rotary(q.flatten(1, 2), start).view_as(q)
        kc, vc = split_compressed(compressed if compressed is not None else compress(to_compress))
        out_cmp, scores, indices = compressed_attention(
            q.flatten(0, 1), kc.flatten(0, 1), vc.flatten(0, 1), start, self.block, self.stride, self.rules.fine,
            self.rules.chooser(k_slc.shape[2]), importance_grad=importance_grad)
        scores, indices = scores.view(b, h, m, -1), indices.view(b, h, m, -1)
        out_slc = reference.selected(q_rot, k_slc, v_slc, scores, indices, start, self.rules, self.runs, rotary)
        out_win = reference.window(q_rot, k_win, v_win, start, self.rules, self.runs, self.dropout, rotary)
        gates = torch.sigmoid(gates)
        out = gates[0] * out_cmp.view_as(q) + gates[1] * out_slc + gates[2] * out_win
        return out, (indices, scores > float("-inf"))

    def _compressed(self, q: Tensor, to_compress: Tensor, gate: Tensor, compress) -> Tensor:
        kc, vc = split_compressed(compress(to_compress))
        out = causal_block_attention(q.flatten(0, 1), kc.flatten(0, 1), vc.flatten(0, 1), self.block, self.stride)
        return torch.sigmoid(gate) * out.view_as(q)

    def _selected(self, q: Tensor, k: Tensor, v: Tensor, gate: Tensor, scores: Tensor, indices: Tensor) -> Tensor:
        b, h, _, m, _ = q.shape
        q_rot, k = self.rotary(q.flatten(1, 2)).view_as(q), self.rotary(k)
        out = reference.selected(q_rot, k, v, scores.view(b, h, m, -1), indices.view(b, h, m, -1), 0, self.rules,
                                 self.runs)
        return torch.sigmoid(gate) * out

    def _window(self, q: Tensor, k: Tensor, v: Tensor, gate: Tensor) -> Tensor:
        q_rot, k = self.rotary(q.flatten(1, 2)).view_as(q), self.rotary(k)
        return torch.sigmoid(gate) * reference.window(q_rot, k, v, 0, self.rules, self.runs, self.dropout)


def _keep_causal_attention():
    """Recompute everything but causal fused attention (the compressed branch, the costliest
    forward to repeat), whose outputs are kept: a selective-checkpoint context."""
    def policy(ctx, op, *args, **kwargs):
        names = [a.name for a in op._schema.arguments]
        causal = "is_causal" in names and (kwargs["is_causal"] if "is_causal" in kwargs
                                           else len(args) > names.index("is_causal") and args[names.index("is_causal")])
        keep = "scaled_dot_product" in op._schema.name and causal
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
