"""Decoding steps of a dense language model as one C call through all its blocks
(kernels/dense_decoding), on the growing cache: at one token PyTorch's ~30 operators a block cost
more in their own overhead than in arithmetic (AMD EPYC Zen 4, the speculative seed's target:
~2.6 ms of an 8.4 ms token outside the linears). models/sampling.py's decoding_linears installs it
for the models `fits` accepts; prompts, batches above one and training keep the blocks' forward.

    with fused_blocks(model):       # model.hidden takes the kernel for the steps it can
        logits = model(tokens[:, None], cache=cache)
"""

import contextlib
import ctypes
import functools
from typing import Optional

import torch
from torch import Tensor, nn

from kernels import dense_decoding
from models.attention import cache as kv_cache
from models.attention.dense import DenseAttention
from models.transformer import Block, FeedForward, TransformerLM

MAX_ROWS = 16  # new tokens a step takes: a decoding step or a verification pass, never a prompt


def fits(model: nn.Module) -> Optional[str]:
    """None where `model` decodes through the kernel: a TransformerLM, not reversible, whose blocks are
    all Block(DenseAttention with rotary positions, no mask, no biases; FeedForward Linear, exact
    GELU, Linear) with one LayerNorm eps and one rotary table, all fp32 on the CPU; otherwise why not."""
    if not isinstance(model, TransformerLM) or model.reversible:
        return "not a TransformerLM with a plain stack of blocks"
    first = model.blocks[0]
    for block in model.blocks:
        attn, ff = block.attn, block.ff
        if type(block) is not Block or type(attn) is not DenseAttention or type(ff) is not FeedForward:
            return "a block that is not dense attention with the plain feed-forward"
        if attn.rotary is None or attn.mask is not None or attn.to_qkv.bias is not None or attn.to_out.bias is not None:
            return "dense attention with a mask, without rotary positions, or with biases"
        up, act, down = ff.net[0], ff.net[1], ff.net[3]
        if ((attn.heads, attn.dim_head, up.out_features) != (first.attn.heads, first.attn.dim_head, first.ff.net[0].out_features)
                or not torch.equal(attn.rotary.inv_freq, first.attn.rotary.inv_freq)):
            return "blocks of different widths or rotary tables"
        if type(act) is not nn.GELU or act.approximate != "none" or up.bias is None or down.bias is None:
            return "a feed-forward other than Linear, exact GELU, Linear"
        if any(n.weight is None or n.bias is None or n.eps != first.attn_norm.eps for n in (block.attn_norm, block.ff_norm)):
            return "layer norms without affine parameters, or with different eps"
    if any(p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous() for p in model.blocks.parameters()):
        return "parameters that are not contiguous fp32 on the CPU"
    return None


class DenseStack:
    """The blocks of a model that `fits` accepts, run by the kernel over their growing caches
    (models/attention/cache.py: keys and values [1, heads, capacity, dim_head], cache["pos"]).
    Holds the weights' addresses: build it where decoding starts, after the model last moved."""

    def __init__(self, model: TransformerLM, threads: int):
        reason = fits(model)
        if reason is not None:
            raise ValueError(f"fused decoding cannot run this model: {reason}")
        first = model.blocks[0]
        self.rotary, self.threads = first.attn.rotary, threads
        self.heads, self.dim_head, self.eps = first.attn.heads, first.attn.dim_head, first.attn_norm.eps
        self.dim, self.hidden = first.attn_norm.normalized_shape[0], first.ff.net[0].out_features
        self.layers = len(model.blocks)
        self.model = model
        # dropout in training mode is the blocks' forward's to apply; the kernel has none
        self.dropout = any(b.attn.dropout > 0 or b.ff.net[2].p > 0 for b in model.blocks)
        fields = len(dense_decoding.FIELDS)
        self.table = (ctypes.c_int64 * (fields * self.layers))()
        for l, block in enumerate(model.blocks):
            up, down = block.ff.net[0], block.ff.net[3]
            weights = (block.attn_norm.weight, block.attn_norm.bias, block.attn.to_qkv.weight, block.attn.to_out.weight,
                       block.ff_norm.weight, block.ff_norm.bias, up.weight, up.bias, down.weight, down.bias)
            self.table[l * fields : l * fields + len(weights)] = [w.data_ptr() for w in weights]

    def takes(self, tokens: Tensor, caches: Optional[list]) -> bool:
        """Whether this step is the kernel's: a few new tokens of one sequence after a cached prompt,
        outside autograd and autocast, and without dropout to apply."""
        return (caches is not None and tokens.shape[0] == 1 and 0 < tokens.shape[1] <= MAX_ROWS
                and caches[0].get("pos", 0) > 0 and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
                and not (self.dropout and self.model.training))

    def __call__(self, x: Tensor, caches: list) -> Tensor:
        """x [1, rows, dim], the tokens after the caches' position -> [1, rows, dim] after every block;
        their keys and values are written to the caches, whose position moves past them."""
        start, rows = caches[0]["pos"], x.shape[1]
        fields = len(dense_decoding.FIELDS)
        x = x.reshape(rows, self.dim).clone(memory_format=torch.contiguous_format)  # C updates it in place
        template = x.new_empty(1, self.heads, 0, self.dim_head)
        buffers = [kv_cache.reserve(cache, start + rows, template, "k", "v") for cache in caches]
        capacity = buffers[0][0].shape[2]
        for l, (keys, values) in enumerate(buffers):
            if keys.shape[2] != capacity or not (keys.is_contiguous() and values.is_contiguous()):
                raise ValueError("fused decoding: the layers' caches differ in capacity or layout")
            self.table[l * fields + dense_decoding.KEYS] = keys.data_ptr()
            self.table[l * fields + dense_decoding.VALUES] = values.data_ptr()
        scratch = x.new_empty(dense_decoding.scratch_floats(rows, self.dim, self.heads, self.dim_head, self.hidden,
                                                            start + rows))
        dense_decoding.blocks_step(x, self.table, self.rotary.phases(start + rows, x.device), scratch,
                                   heads=self.heads, dim_head=self.dim_head, hidden=self.hidden, layers=self.layers,
                                   start=start, capacity=capacity, eps=self.eps, threads=self.threads)
        for cache in caches:
            cache["pos"] = start + rows
        return x[None]


@contextlib.contextmanager
def fused_blocks(*models: nn.Module):
    """Inside, each model that `fits` accepts (where the kernel builds) runs its decoding steps
    through the kernel: its `hidden` is patched for the context, every other call unchanged."""
    patched = []
    if dense_decoding.available():
        for model in models:
            if "hidden" in vars(model) or fits(model) is not None:
                continue  # patched by an enclosing context already, or not the kernel's
            model.hidden = functools.partial(_hidden, model, DenseStack(model, torch.get_num_threads()), model.hidden)
            patched.append(model)
    try:
        yield
    finally:
        for model in patched:
            del model.hidden


def _hidden(model: TransformerLM, stack: DenseStack, blocks_hidden, tokens: Tensor, cache: Optional[list] = None) -> Tensor:
    """model.hidden(tokens, cache) through the kernel where `stack` takes the step, else `blocks_hidden`."""
    if not stack.takes(tokens, cache):
        return blocks_hidden(tokens, cache)
    model._stack_aux = None  # as the blocks' forward leaves it: no auxiliary loss
    return model.project_out(model.norm(stack(model.embed(tokens, cache[0]["pos"]), cache)))
