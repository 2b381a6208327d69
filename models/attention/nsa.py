"""Native Sparse Attention (Yuan et al. 2025): compressed, selected and sliding-window branches
over each query's causal past, mixed by learned per-head sigmoid gates.

Notation of the paper -> knob: l = compress_block_size, d = compress_stride,
l' = fine_block_size, n = num_fine_selected, w = sliding_window_size.

- compressed: blocks of l keys every d tokens, each compressed to one key (and one value) by an
  MLP over the block plus a learned intra-block position embedding. A block is visible to query t
  only once it is complete (its last token <= t); a query that sees no block gets zeros, not NaN.
- selected: block importance is the compressed-attention probability summed over the query heads
  of a GQA group and spread onto the fine blocks by token overlap (from the compressed branch's
  probabilities, kernels/compressed_attention/); each position keeps its top n fine
  blocks, always including its own block, the initial block and the previous block (in that order
  of priority). Keys after t inside its own block are masked. As in the paper, the choice of
  blocks passes no gradient, unless `diff_topk`: then each freely chosen block's share of the
  output is weighted by its importance through a straight-through factor (1 in value), so the
  compressed keys and the queries learn from what selection does with them.
- sliding window: the last w keys, t included.

Cost per query: n / d compressed keys, n selected blocks and w window keys; nothing else grows
with the sequence. In training the compressed branch and the window are fused attention, the
forced blocks run as tiled attention over [initial | previous | own] tiles
(models/attention/tiled.py), the freely chosen blocks are gathered (kernels/selected_attention/),
and each branch is recomputed in the backward pass, so a layer keeps O(n) memory. On the Triton
kernels (kernel auto on CUDA, or triton) the compressed branch's attention and block selection come
from one scoring of the compressed keys, as on the CPU kernels below (kernels/compressed_attention/
triton.py): its output and log-sum-exp are kept, the selection recomputes the probabilities from
them; the window is the same flash kernel with a window mask (kernels/window_attention/). On the CPU
(kernel auto or cpu), C kernels take over: block selection is one pass per query from its
compressed scores to its chosen blocks (kernels/compressed_attention/selection.c), which
also gives the compressed branch's output from the same probabilities (the paper's reuse: each
query is scored against the compressed keys once; the backward is flash attention's), and the
selected blocks and the window are spans of keys for one kernel (kernels/span_attention/) that
reads each query's keys where they lie, applies the rotary positions and the gate itself, and
keeps only the log-sum-exp besides its inputs for the backward. Decoding (queries after a cache)
gathers each query's selected blocks directly: a step reads the compressed keys, n blocks and the
window, never the whole cache.

Each branch has its own keys and values (as the paper: no gradient shortcuts between branches;
`shared_kv`, an ablation, gives all three one projection); the query projection is shared. Rotary
positions apply to the selected and window branches; the compressed branch gets its positions from
the intra-block embedding and the causal block mask.
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from kernels import at_least_fp32, triton_runnable
from kernels import span_attention as spans
from kernels.compressed_attention import (block_selection, causal_block_attention, compressed_attention,
                                          cpu_compressed_selection, cpu_selection_available, fused_selection_kernel,
                                          triton_compressed_selection, triton_dim_supported)
from kernels.selected_attention import selected_attention
from kernels.window_attention import triton_window_attention
from kernels.nsa_attention import triton as nsa_kernels
from kernels.nsa_attention.ops import nsa_attention
from models.attention import cache as kv_cache
from models.attention.tiled import tiled_attention
from models.recompute import RecomputedLayers, recomputation_pays, recomputed
from models.rotary import Rotary

BRANCH_NAMES = ("compressed", "selected", "window")
BRANCHES = len(BRANCH_NAMES)
RAW = ("k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win")  # cached per-token keys and values


@dataclass
class Selection:
    """The fine blocks one layer's selected branch attended to in one forward: blocks
    [batch, kv_heads, seq, slots] (block index, -1 for an unused slot), the first `forced` slots
    the forced ones (own, initial, previous), the others chosen by importance."""

    blocks: Tensor
    forced: int
    fine_block: int

    def holds(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [batch, seq] (a key position per query, -1: none) -> (selected, forced)
        [batch, kv_heads, seq] bool: whether a selected block holds the query's position, and
        whether a forced block does."""
        block = (positions // self.fine_block)[:, None, :, None]
        match = (self.blocks == block) & (positions >= 0)[:, None, :, None]
        return match.any(-1), match[..., : self.forced].any(-1)


@contextmanager
def recording_selection(model: nn.Module) -> Iterator[list[Selection]]:
    """Within it, each NSA layer of `model` appends the blocks it selects in every forward without a
    cache through its one-go path (inference and validation; a diff_topk training step too, once for
    its forward and once for its recomputation) to the list it yields, layer by layer."""
    layers = _nsa_layers(model)
    records: list[Selection] = []
    for layer in layers:
        layer.selections = records
    try:
        yield records
    finally:
        for layer in layers:
            layer.selections = None


def _nsa_layers(model: nn.Module) -> list["NativeSparseAttention"]:
    return [m for m in model.modules() if isinstance(m, NativeSparseAttention)]


def open_branches(model: nn.Module) -> list[str]:
    """The branches open in every NSA layer of `model` (none without NSA layers), in BRANCH_NAMES order."""
    layers = _nsa_layers(model)
    return [name for i, name in enumerate(BRANCH_NAMES) if layers and all(i not in layer.closed for layer in layers)]


@contextmanager
def branch_closed(model: nn.Module, name: str) -> Iterator[None]:
    """Within it, every NSA layer of `model` holds branch `name`'s gate at 0, as `branches` without
    it would: a knock-out at evaluation, which says how much of what a trained model does rests on
    that branch. The layers' own branches come back on exit."""
    layers = _nsa_layers(model)
    kept = [layer.closed for layer in layers]
    for layer in layers:
        layer.closed = sorted(set(layer.closed) | {BRANCH_NAMES.index(name)})
    try:
        yield
    finally:
        for layer, closed in zip(layers, kept):
            layer.closed = closed


class BlockCompressor(nn.Module):
    """Per-KV-head MLP from a block [l, dim_head] (+ intra-block position) to one [dim_head]."""

    def __init__(self, kv_heads: int, block: int, stride: int, dim_head: int, hidden: int):
        super().__init__()
        self.block, self.stride = block, stride
        self.pos = nn.Parameter(torch.zeros(kv_heads, block, dim_head))
        self.w1 = nn.Parameter(torch.randn(kv_heads, block * dim_head, hidden) / math.sqrt(block * dim_head))
        self.b1 = nn.Parameter(torch.zeros(kv_heads, 1, hidden))
        self.w2 = nn.Parameter(torch.randn(kv_heads, hidden, dim_head) / math.sqrt(hidden))

    def num_blocks(self, seq: int) -> int:
        return max(0, (seq - self.block) // self.stride + 1)

    def forward(self, x: Tensor, first: int = 0) -> Tensor:
        """x [batch, kv_heads, seq, dim_head] -> [batch, kv_heads, blocks, dim_head] for the
        complete blocks from block index `first` on."""
        return self.compress(x, self.pos, self.w1, self.b1, self.w2, first)

    def compress(self, x: Tensor, pos: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, first: int = 0) -> Tensor:
        """forward with the weights given (heads along their first dimension, as x's second), so that
        two compressors' weights side by side run as one."""
        x = x[:, :, first * self.stride :]
        nc = self.num_blocks(x.shape[2])
        if nc == 0:
            return x.new_zeros(*x.shape[:2], 0, x.shape[3])
        # the intra-block positions enter the first layer linearly: as a bias of their own
        bias = b1 + torch.einsum("hx,hxy->hy", pos.flatten(1), w1)[:, None]  # [h, 1, hidden]
        hidden = F.gelu(self._first_layer(x, w1, nc) + bias)
        return torch.einsum("bhcy,hyd->bhcd", hidden, w2)

    def _first_layer(self, x: Tensor, w1: Tensor, nc: int) -> Tensor:
        """The first layer's product over each block's tokens, x [b, h, seq, d] -> [b, h, nc, hidden].
        Where the block is r strides long, block c is strides c .. c + r - 1: one product of the
        non-overlapping strides with the r slices of w1 gives every term, with no overlapping copy
        of the keys (an unfold copies each token r times, and its backward adds the copies back)."""
        l, s = self.block, self.stride
        if l % s:
            return torch.einsum("bhcx,hxy->bhcy", x.unfold(2, l, s).transpose(-1, -2).flatten(-2), w1)
        r, h, d = l // s, w1.shape[0], x.shape[-1]
        strides = x[:, :, : (nc + r - 1) * s].reshape(*x.shape[:2], nc + r - 1, s * d)  # [b, h, nc + r - 1, s * d]
        w = w1.view(h, r, s * d, -1).transpose(1, 2).flatten(2)  # [h, s * d, r * hidden]
        terms = torch.einsum("bhcx,hxy->bhcy", strides, w).unflatten(-1, (r, -1))  # [b, h, nc + r - 1, r, hidden]
        return sum(terms[:, :, i : i + nc, i] for i in range(r))


class NativeSparseAttention(nn.Module):
    def __init__(
        self,
        *,
        dim: int,
        heads: int,
        dim_head: int,
        kv_heads: int,
        sliding_window_size: int,
        compress_block_size: int,
        compress_stride: int,
        fine_block_size: int,
        num_fine_selected: int,
        compress_hidden_mult: float = 1.0,
        diff_topk: bool = False,
        branches: tuple[str, ...] = BRANCH_NAMES,
        gate_bias: tuple[float, ...] = (0.0,) * BRANCHES,
        shared_kv: bool = False,
        dropout: float = 0.0,
        kernel: str = "auto",
    ):
        super().__init__()
        _check(heads, kv_heads, dim_head, sliding_window_size, compress_block_size, compress_stride, fine_block_size,
               num_fine_selected, kernel, branches, gate_bias)
        # an ablation: the gates of the branches left out are held at 0 (sigmoid of -inf), so they add
        # nothing and pass no gradient
        self.closed = [i for i, name in enumerate(BRANCH_NAMES) if name not in branches]
        # ablations: a fixed offset of each branch's gate logit (the gates start at sigmoid of it, and
        # a gate's learnt bias moves from there), and one key/value projection that every branch reads
        self.gate_bias = tuple(float(b) for b in gate_bias) if any(gate_bias) else None
        self.shared_kv = shared_kv
        self.heads, self.kv_heads, self.dim_head = heads, kv_heads, dim_head
        self.group = heads // kv_heads
        self.window = sliding_window_size
        self.fine_block = fine_block_size
        self.num_selected = num_fine_selected
        self.diff_topk = diff_topk
        self.dropout = dropout
        self.kernel = kernel
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, (1 if shared_kv else BRANCHES) * 2 * kv_heads * dim_head, bias=False)
        self.to_gates = nn.Linear(dim, BRANCHES * heads)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)
        hidden = max(1, int(dim_head * compress_hidden_mult))
        self.compress_k = BlockCompressor(kv_heads, compress_block_size, compress_stride, dim_head, hidden)
        self.compress_v = BlockCompressor(kv_heads, compress_block_size, compress_stride, dim_head, hidden)
        self.rotary = Rotary(dim_head)
        self.selections: Optional[list[Selection]] = None  # set by recording_selection

    def forward(self, x: Tensor, cache: Optional[dict] = None) -> Tensor:
        """x [batch, seq, dim] -> [batch, seq, dim]; with `cache`, x continues the cached tokens."""
        training = cache is None and torch.is_grad_enabled()
        if torch.is_autocast_enabled(x.device.type):  # one cast for the three projections, not one each
            x = x.to(torch.get_autocast_dtype(x.device.type))
        # a training step on the CPU kernels keeps no layer's query and key/value projections for
        # the backward, it recomputes them from x (bench size at 8k: 616 -> 488 MB kept, dense 613);
        # not while a reversible stack recomputes this layer, whose backward follows at once
        recompute_projections = cache is None and recomputation_pays() and not self.diff_topk and self._cpu_kernels(x)
        with RecomputedLayers(enabled=recompute_projections) as projections:
            q = projections.apply(self.to_q, x).unflatten(-1, (self.heads, self.dim_head))  # [b, n, heads, d]
            # six [b, n, kv_heads, d] views of one projection: their gradients are stacked straight into its layout
            kv = projections.apply(self.to_kv, x).unflatten(-1, (-1, self.kv_heads, self.dim_head)).unbind(2)
            kv = kv * BRANCHES if self.shared_kv else kv
            gates = self.to_gates(x).unflatten(-1, (BRANCHES, self.heads))  # [b, n, 3, heads]
            if self.gate_bias is not None:
                gates = gates + torch.tensor(self.gate_bias, dtype=gates.dtype, device=x.device).view(-1, 1)
            if self.closed:
                gates = gates.index_fill(2, torch.tensor(self.closed, device=x.device), float("-inf"))
            if self._fused_kernels(q):
                return self.to_out(self._fused(q, kv, gates, cache).flatten(2))
            q = rearrange(q, "b n (h g) d -> b h g n d", h=self.kv_heads)
            kv = tuple(t.transpose(1, 2) for t in kv)  # [b, h, n, d]
            gates = rearrange(gates, "b n s (h g) -> s b h g n 1", h=self.kv_heads)
            if not training:
                out = self._attend(q, kv, gates, cache)
            elif self.diff_topk:  # selection passes gradient: the branches recompute together
                out = recomputed(self._attend, q, kv, gates)
            else:
                out = self._train(q, kv, gates)
        return self.to_out(rearrange(out, "b h g n d -> b n (h g d)"))

    def _fused(self, q: Tensor, kv: tuple[Tensor, ...], gates: Tensor, cache: Optional[dict]) -> Tensor:
        """The three gated branches in the fused kernels (kernels/nsa_attention/), in training, inference and
        decoding alike: q [b, n, heads, d], kv six [b, n, kv_heads, d], gate logits [b, n, 3, heads] ->
        [b, n, heads, d]."""
        start = 0 if cache is None else cache.get("pos", 0)
        if cache is None:
            kc, vc = self._compress(kv[0].transpose(1, 2), kv[1].transpose(1, 2))
            local = kv[2:]
        else:
            *raw, kc, vc = self._extend_cache(cache, start, *(t.transpose(1, 2) for t in kv))
            local = tuple(t.transpose(1, 2) for t in raw[2:])
        n, seq_k = q.shape[1], start + q.shape[1]
        knobs = nsa_kernels.Knobs(self.compress_k.block, self.compress_k.stride, self.fine_block, self._num_forced(),
                                  self._num_free(seq_k), self.window)
        out, blocks = nsa_attention(q, kc, vc, *local, gates, self.rotary.phases(seq_k, q.device), start, knobs)
        if self.selections is not None and cache is None:
            chosen = blocks < -(-seq_k // self.fine_block)  # unused slots hold the number of fine blocks
            self.selections.append(self._selection_record(torch.zeros_like(blocks, dtype=torch.float).masked_fill(
                ~chosen, float("-inf")), blocks.long().masked_fill(~chosen, 0)))
        return out

    def _fused_kernels(self, q: Tensor) -> bool:
        """Whether the fused kernels run this layer: kernel triton, or auto on CUDA, where they take the
        shape, without differentiable selection or attention dropout in training."""
        dropout = self.dropout if self.training else 0.0
        return (fused_selection_kernel(q, self.kernel) == "triton" and not self.diff_topk and dropout == 0.0
                and nsa_kernels.supported(self.group, self.dim_head, self.fine_block) is None)

    def _train(self, q: Tensor, kv: tuple[Tensor, ...], gates: Tensor) -> Tensor:
        """The training forward: each branch, gated, is recomputed on its own in the backward pass
        (as flash attention recomputes its probabilities), so a layer keeps x, the query and
        key/value projections, the gates and the compressed branch's attention output (less than
        dense attention keeps), and its backward holds one branch's activations at a time. On the
        CPU kernels the local branches need no recomputation: they keep nothing but their
        log-sum-exps, block selection comes with the compressed branch's forward, and the query
        and key/value projections are not kept either: `forward` recomputes them from x. Block
        selection needs no gradient: it runs once, outside the recomputation."""
        k_cmp, v_cmp, k_slc, v_slc, k_win, v_win = kv
        cpu, triton = self._cpu_kernels(q), fused_selection_kernel(q, self.kernel) == "triton"
        if cpu or triton:  # one pass scores the compressed keys for selection and attention
            kc, vc = recomputed(self._compress, k_cmp, v_cmp)
            compressed_selection = cpu_compressed_selection if cpu else triton_compressed_selection
            out_cmp, scores, indices = compressed_selection(
                q, kc.flatten(0, 1), vc.flatten(0, 1), self.compress_k.block, self.compress_k.stride,
                self.fine_block, self._num_forced(), self._num_free(k_cmp.shape[2]))
            out = torch.sigmoid(gates[0]) * out_cmp.view_as(q)
            if cpu:
                local = self._local_kernels(q, k_slc, v_slc, k_win, v_win, gates[1:], scores, indices)
                return out.add_(local)  # in place: the product's backward needs its inputs, not its output
            out = out + checkpoint(self._selected_part, q, k_slc, v_slc, gates[1], scores, indices, use_reentrant=False)
            return out + checkpoint(self._window_part, q, k_win, v_win, gates[2], use_reentrant=False)
        scores, indices = self._selection(q, k_cmp)
        # plain checkpoints, inside a reversible stack's recomputation too: there they hold its
        # backward to one branch's activations at a time (2k, kernel=torch: 111.5 against 117.1 MB)
        out = checkpoint(self._compressed_part, q, k_cmp, v_cmp, gates[0], use_reentrant=False,
                         context_fn=_keep_causal_attention)
        out = out + checkpoint(self._selected_part, q, k_slc, v_slc, gates[1], scores, indices, use_reentrant=False)
        return out + checkpoint(self._window_part, q, k_win, v_win, gates[2], use_reentrant=False)

    def _local_kernels(self, q: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor, v_win: Tensor, gates: Tensor,
                       scores: Tensor, indices: Tensor) -> Tensor:
        """A training step's selected and window branches on the span-attention CPU kernel, with
        rotary positions and gates applied inside it, so that the backward keeps neither rotated
        nor gated copies (only each branch's log-sum-exp), and the projections are read where they
        lie: q [b, h, g, n, d], keys and values [b, h, n, d], gate logits [2, b, h, g, n, 1], free
        blocks [b * h, n, free] -> [b, h, g, n, d]."""
        b, h, _, m, _ = q.shape
        gates = torch.sigmoid(gates).squeeze(-1).flatten(1, 2)  # [2, b * h, g, n]
        phases = self.rotary.phases(m, q.device)
        chosen = self._selected_spans(indices.view(b, h, m, -1), scores.view(b, h, m, -1) > float("-inf"))
        out_slc, _ = spans.span_attention(q, k_slc, v_slc, chosen, gate=gates[0], phases=phases)
        out_win, _ = spans.span_attention(q, k_win, v_win, self._window_spans(m, q.device), gate=gates[1],
                                          phases=phases)
        return out_slc.add_(out_win)  # in place: no backward reads out_slc

    def _compress(self, k_cmp: Tensor, v_cmp: Tensor) -> tuple[Tensor, Tensor]:
        """Both compressors in one pass, their weights side by side: keys and values [b, h, n, d] ->
        kc, vc [b, h, blocks, d] (half the launches of two passes)."""
        both = torch.stack((k_cmp, v_cmp), 1).flatten(1, 2)  # [b, 2 * h, n, d]
        weights = (torch.cat(pair) for pair in zip(*((c.pos, c.w1, c.b1, c.w2) for c in (self.compress_k,
                                                                                          self.compress_v))))
        return self.compress_k.compress(both, *weights).chunk(2, dim=1)

    def _compressed_part(self, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, gate: Tensor) -> Tensor:
        kc, vc = self._compress(k_cmp, v_cmp)
        out = causal_block_attention(q.flatten(0, 1), kc.flatten(0, 1), vc.flatten(0, 1), self.compress_k.block,
                                     self.compress_k.stride)
        return torch.sigmoid(gate) * out.view_as(q)

    def _selected_part(self, q: Tensor, k: Tensor, v: Tensor, gate: Tensor, scores: Tensor, indices: Tensor) -> Tensor:
        b, h, _, m, _ = q.shape
        q_rot, k = self.rotary(q.flatten(1, 2)).view_as(q), self.rotary(k)
        out = self._selected(q_rot, k, v, scores.view(b, h, m, -1), indices.view(b, h, m, -1), 0)
        return torch.sigmoid(gate) * out

    def _window_part(self, q: Tensor, k: Tensor, v: Tensor, gate: Tensor) -> Tensor:
        q_rot, k = self.rotary(q.flatten(1, 2)).view_as(q), self.rotary(k)
        return torch.sigmoid(gate) * self._window(q_rot, k, v, 0)

    def _attend(self, q: Tensor, kv: tuple[Tensor, ...], gates: Tensor, cache: Optional[dict] = None) -> Tensor:
        """The three branches mixed by their gates, in one go (inference, decoding after `cache`,
        differentiable selection): q [b, h, g, n, d], kv six [b, h, n, d] (compressed, selected,
        window keys and values), gate logits [3, b, h, g, n, 1] -> [b, h, g, n, d]."""
        b, h, g, m, d = q.shape
        start = 0 if cache is None else cache.get("pos", 0)
        k_cmp, v_cmp, k_slc, v_slc, k_win, v_win = kv
        q_rot, k_slc, k_win = self._rotate(q, k_slc, k_win, start)
        if cache is not None:
            k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, kc, vc = self._extend_cache(
                cache, start, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win)
        else:
            kc, vc = self.compress_k(k_cmp), self.compress_v(v_cmp)
        out_cmp, scores, indices = compressed_attention(
            q.flatten(0, 1), kc.flatten(0, 1), vc.flatten(0, 1), start, self.compress_k.block, self.compress_k.stride,
            self.fine_block, self._chooser(k_slc.shape[2]), importance_grad=self.diff_topk and torch.is_grad_enabled())
        if self.selections is not None and cache is None:
            self.selections.append(self._selection_record(scores.view(b, h, m, -1), indices.view(b, h, m, -1)))
        out_slc = self._selected(q_rot, k_slc, v_slc, scores.view(b, h, m, -1), indices.view(b, h, m, -1), start)
        out_win = self._window(q_rot, k_win, v_win, start)
        gates = torch.sigmoid(gates)
        return gates[0] * out_cmp.view_as(q) + gates[1] * out_slc + gates[2] * out_win

    def _rotate(self, q: Tensor, k_slc: Tensor, k_win: Tensor, start: int) -> tuple[Tensor, Tensor, Tensor]:
        """Rotary positions from `start` for the branches that use them (selected, window):
        q [b, h, g, n, d], keys [b, h, n, d] -> the same, rotated."""
        k_slc, k_win = self.rotary(torch.stack((k_slc, k_win)), start)
        return self.rotary(q.flatten(1, 2), start).view_as(q), k_slc, k_win

    @torch.no_grad()
    def _selection(self, q: Tensor, k_cmp: Tensor) -> tuple[Tensor, Tensor]:
        """The free blocks of a training forward off the CPU kernels, chosen from position 0:
        (scores, indices) [bh, n, free]."""
        kc = self.compress_k(k_cmp)
        return block_selection(q.flatten(0, 1), kc.flatten(0, 1), 0, self.compress_k.block, self.compress_k.stride,
                               self.fine_block, self._chooser(k_cmp.shape[2]))

    def _chooser(self, seq_k: int):
        """choose(importance, first) for compressed attention: as many free blocks as fit, at every position."""
        free = self._num_free(seq_k)
        return lambda importance, first: self._choose(importance, first, free)

    def _num_free(self, seq_k: int) -> int:
        """Freely chosen blocks per query besides the forced ones (no more than the keys hold)."""
        return max(0, min(self.num_selected - self._num_forced(), -(-seq_k // self.fine_block)))

    def _cpu_kernels(self, q: Tensor) -> bool:
        """Whether block selection, the selected and the window branches from position 0 run on the
        CPU kernels (kernels/compressed_attention/selection.c, kernels/span_attention/): kernel
        auto or cpu, a CPU tensor they compute in fp32 without loss, and kernels built for this CPU."""
        return fused_selection_kernel(q, self.kernel) == "cpu" and q.dtype in spans.KERNEL_DTYPES and spans.available()

    # ---- selected branch -------------------------------------------------------------------------

    def _selected(self, q: Tensor, k: Tensor, v: Tensor, scores: Tensor, indices: Tensor, start: int) -> Tensor:
        """Attention over the forced and the freely chosen fine blocks -> [b, h, g, n, d]; the free
        blocks' indices and scores [b, h, n, free] come from `_choose` (-inf: slot unused).

        In training the forced blocks (own, initial, previous) are the same for every query of a
        fine block, so they are attended tile by tile; only the freely chosen blocks are gathered
        per query. The two partial attentions cover disjoint blocks and are merged exactly through
        their log-sum-exps. After a cache, each query gathers all its blocks at once."""
        b, h, g, m, d = q.shape
        valid = scores > float("-inf")
        weights = None
        if scores.requires_grad:  # differentiable selection: 1 in value, the scores' gradient
            chosen = scores.masked_fill(~valid, 0.0)
            weights = 1.0 + (chosen - chosen.detach())
        if start:
            forced, forced_valid = self._forced_indices(start, m, q.device)
            indices = torch.cat((forced.expand(b, h, m, -1), indices), dim=-1)
            valid = torch.cat((forced_valid.expand(b, h, m, -1), valid), dim=-1)
            return _gathered_attention(q, k, v, indices, valid, start, self.fine_block)
        if self._cpu_kernels(q):
            if weights is not None:  # the forced blocks keep their whole share
                weights = torch.cat((weights.new_ones(b, h, m, self._num_forced()), weights), dim=-1).flatten(0, 1)
            out, _ = spans.span_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                          self._selected_spans(indices, valid), weights)
            return out.view_as(q)
        sink = self.fine_block if self._num_forced() >= 2 else 0
        out_forced, lse_forced = tiled_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                                 self.fine_block, self._forced_visible, sink)
        out_forced, lse_forced = out_forced.view_as(q), lse_forced.view(b, h, g, m)
        if indices.shape[-1] == 0:
            return out_forced
        out_free, lse_free = selected_attention(
            rearrange(q, "b h g n d -> (b h) n g d"), k.flatten(0, 1), v.flatten(0, 1),
            indices.flatten(0, 1), valid.flatten(0, 1), start, self.fine_block, self.kernel,
            None if weights is None else weights.flatten(0, 1),
        )
        out_free = rearrange(out_free, "(b h) n g d -> b h g n d", b=b)
        lse_free = rearrange(lse_free, "(b h) n g -> b h g n", b=b)
        lse = torch.logaddexp(lse_forced, lse_free)
        return (out_forced * (lse_forced - lse).exp()[..., None].to(q.dtype)
                + out_free * (lse_free - lse).exp()[..., None].to(q.dtype))

    def _selected_spans(self, indices: Tensor, valid: Tensor) -> Tensor:
        """The forced and the freely chosen blocks [b, h, m, free] of the queries from position 0 as
        key spans [b * h, m, forced + free, 2] for the span-attention kernel."""
        b, h, m, _ = indices.shape
        forced, forced_valid = self._forced_indices(0, m, indices.device)
        blocks = torch.cat((forced.expand(b * h, m, -1), indices.flatten(0, 1)), dim=-1)
        valid = torch.cat((forced_valid.expand(b * h, m, -1), valid.flatten(0, 1)), dim=-1)
        return self._block_spans(blocks, valid)

    def _selection_record(self, scores: Tensor, indices: Tensor) -> Selection:
        """The forced and freely chosen blocks [b, h, m, free] of queries from position 0, as recorded."""
        b, h, m, _ = indices.shape
        forced, forced_valid = self._forced_indices(0, m, indices.device)
        blocks = torch.cat((forced.expand(b, h, m, -1), indices), dim=-1)
        valid = torch.cat((forced_valid.expand(b, h, m, -1), scores > float("-inf")), dim=-1)
        return Selection(blocks.masked_fill(~valid, -1), forced.shape[-1], self.fine_block)

    def _block_spans(self, blocks: Tensor, valid: Tensor) -> Tensor:
        """Fine blocks [..., m, slots] of the queries from position 0 -> their key spans [..., m, slots, 2]
        (start, end), cut after the query; an invalid slot gets an empty span."""
        start = blocks * self.fine_block
        query_end = torch.arange(1, blocks.shape[-2] + 1, device=blocks.device)[:, None]
        end = torch.minimum(start + self.fine_block, query_end).masked_fill(~valid, 0)
        return torch.stack((start.masked_fill(~valid, 0), end), dim=-1)

    def _num_forced(self) -> int:
        return min(3, self.num_selected)

    def _forced_visible(self, query_pos: Tensor, key_pos: Tensor) -> Tensor:
        """Key in the query's own block (at or before it), the initial block, or the previous block,
        as many of these as num_fine_selected allows, in that priority; broadcasts its arguments."""
        own = query_pos // self.fine_block
        key_block = key_pos // self.fine_block
        forced = key_block == own
        if self._num_forced() >= 2:
            forced = forced | (key_block == 0)
        if self._num_forced() >= 3:
            forced = forced | (key_block == own - 1)
        return forced & (key_pos <= query_pos) & (key_pos >= 0)

    def _forced_indices(self, start: int, m: int, device) -> tuple[Tensor, Tensor]:
        """The forced blocks of the queries at start.. as block indices and validity [m, forced],
        each block once."""
        own = torch.arange(start, start + m, device=device) // self.fine_block
        blocks = torch.stack((own, torch.zeros_like(own), own - 1), dim=-1)[:, : self._num_forced()]
        valid = torch.ones_like(blocks, dtype=torch.bool)
        if self._num_forced() >= 2:
            valid[:, 1] = own != 0
        if self._num_forced() >= 3:
            valid[:, 2] = own - 1 > 0
        return blocks.clamp(min=0), valid

    def _choose(self, importance: Tensor, first: int, free: int) -> tuple[Tensor, Tensor]:
        """The `free` most important fine blocks per (batch * kv head, position) besides the forced
        blocks, never in the future: importance [bh, n, fine blocks] of positions first.. ->
        scores, indices [bh, n, free] (score -inf: no block left for that slot)."""
        m, num_fine = importance.shape[1], importance.shape[2]
        query_pos = torch.arange(first, first + m, device=importance.device)[:, None]
        fine_start = torch.arange(num_fine, device=importance.device) * self.fine_block
        taken = self._forced_visible(query_pos, fine_start) | (fine_start > query_pos)
        scores, indices = importance.masked_fill(taken, float("-inf")).topk(min(free, num_fine), dim=-1)
        short = free - scores.shape[-1]  # early chunks have fewer blocks than later ones
        return F.pad(scores, (0, short), value=float("-inf")), F.pad(indices, (0, short))

    # ---- sliding window --------------------------------------------------------------------------

    def _window_visible(self, query_pos: Tensor, key_pos: Tensor) -> Tensor:
        return (key_pos <= query_pos) & (key_pos > query_pos - self.window)

    def _window_spans(self, m: int, device) -> Tensor:
        """The window of each query from position 0 as one key span [m, 1, 2]."""
        i = torch.arange(m, device=device)
        return torch.stack(((i - self.window + 1).clamp(min=0), i + 1), dim=-1)[:, None]

    def _window(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        """Sliding-window attention: query t sees keys (t - w, t]. -> [b, h, g, n, d]"""
        b, h, g, m, d = q.shape
        w = self.window
        dropout = self.dropout if self.training else 0.0
        if start == 0 and dropout == 0.0 and self._cpu_kernels(q):
            out, _ = spans.span_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                          self._window_spans(m, q.device))
            return out.view_as(q)
        if start == 0 and dropout == 0.0 and fused_selection_kernel(q, self.kernel) == "triton":
            out, _ = triton_window_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), w)
            return out.view_as(q)
        if start == 0:  # training: tiles of w queries see their tile and the previous one, fused
            pad = (-m) % w
            tiles = (m + pad) // w
            qt = rearrange(F.pad(q, (0, 0, 0, pad)), "b h g (c w) d -> c (b h g) w d", w=w)
            kt, vt = (rearrange(F.pad(t, (0, 0, 0, pad)), "b h (c w) d -> c (b h) w d", w=w) for t in (k, v))
            kt, vt = (torch.cat((F.pad(t, (0, 0, 0, 0, 0, 0, 1, 0))[:-1], t), dim=2) for t in (kt, vt))
            tile_start = torch.arange(tiles, device=q.device)[:, None, None] * w
            query_pos = tile_start + torch.arange(w, device=q.device)[:, None]  # [c, w, 1]
            key_pos = tile_start - w + torch.arange(2 * w, device=q.device)  # [c, 1, 2w]
            mask = (self._window_visible(query_pos, key_pos) & (key_pos >= 0))[:, None]  # [c, 1, w, 2w]
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, dropout_p=dropout, enable_gqa=True)
            return rearrange(out, "c (b h g) w d -> b h g (c w) d", b=b, h=h)[:, :, :, :m]
        lo = max(0, start - w + 1)  # decoding: the last w keys before the first query suffice
        k, v = k[:, :, lo:], v[:, :, lo:]
        qpos = torch.arange(start, start + m, device=q.device)[:, None]
        mask = self._window_visible(qpos, torch.arange(lo, lo + k.shape[2], device=q.device))
        out = F.scaled_dot_product_attention(q.flatten(2, 3), k, v, attn_mask=mask.repeat(g, 1), dropout_p=dropout)
        return out.view(b, h, g, m, d)

    # ---- cache -----------------------------------------------------------------------------------

    def truncate_cache(self, cache: dict, length: int) -> None:
        """Roll back to the first `length` positions (compressed blocks completed after it go too)."""
        kv_cache.truncate(cache, length)
        if "compressed" in cache:
            kv_cache.truncate(cache["compressed"], self.compress_k.num_blocks(length))

    def _extend_cache(self, cache: dict, start: int, *new: Tensor):
        """Append the new raw keys and values of every branch (growing buffers, each position
        copied once); compress the blocks they complete."""
        raw = kv_cache.append(cache, start, **dict(zip(RAW, new)))
        blocks = cache.setdefault("compressed", {})
        done = blocks.get("pos", 0)
        todo = self.compress_k.num_blocks(cache["pos"]) - done
        kc, vc = (compress(raw[i], first=done)[:, :, :todo] for i, compress in ((0, self.compress_k),
                                                                                (1, self.compress_v)))
        kc, vc = kv_cache.append(blocks, done, kc=kc, vc=vc)
        return (*raw, kc, vc)


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


def _gathered_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, valid: Tensor, start: int,
                        block: int) -> Tensor:
    """Each query over the keys of its own selected blocks, causal, gathered by index (decoding).

    q [b, h, g, m, d]; k, v [b, h, seq, d]; indices, valid [b, h, m, blocks] -> [b, h, g, m, d]"""
    b, h, g, m, d = q.shape
    key_pos = (indices[..., None] * block + torch.arange(block, device=q.device)).flatten(-2)  # [b, h, m, keys]
    allowed = (valid.repeat_interleave(block, dim=-1) & (key_pos < start + torch.arange(m, device=q.device)[:, None] + 1))
    safe = key_pos.clamp(max=k.shape[2] - 1)
    heads = (torch.arange(b, device=q.device)[:, None, None, None], torch.arange(h, device=q.device)[None, :, None, None])
    keys, values = k[heads + (safe,)], v[heads + (safe,)]  # [b, h, m, keys, d]
    scores = torch.einsum("bhgmd,bhmkd->bhgmk", q, keys)
    scores = at_least_fp32(scores) * d**-0.5
    probs = scores.masked_fill(~allowed[:, :, None], float("-inf")).softmax(-1)
    return torch.einsum("bhgmk,bhmkd->bhgmd", probs.to(q.dtype), values)


def _check(heads, kv_heads, dim_head, window, block, stride, fine_block, num_selected, kernel, branches,
           gate_bias) -> None:
    """Reject knob combinations NSA cannot run, saying how to fix them."""
    if len(gate_bias) != BRANCHES:
        raise ValueError(f"gate_bias={list(gate_bias)} must give one logit offset per branch "
                         f"({', '.join(BRANCH_NAMES)}): set model.gate_bias, e.g. [0,0,0]")
    if not branches or set(branches) - set(BRANCH_NAMES):
        raise ValueError(f"branches={list(branches)} must name at least one of {', '.join(BRANCH_NAMES)}: "
                         "set model.branches")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads} (GQA groups): change model.kv_heads")
    for name, value in (("sliding_window_size", window), ("compress_block_size", block),
                        ("compress_stride", stride), ("fine_block_size", fine_block), ("num_fine_selected", num_selected)):
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1: set model.{name}")
    if stride > block:
        raise ValueError(f"compress_stride={stride} exceeds compress_block_size={block}, so tokens between "
                         "blocks would never be compressed: lower model.compress_stride")
    if kernel == "cpu" and not (spans.available() and cpu_selection_available()):
        raise ValueError("kernel=cpu needs a working C compiler (cc or $CC) to build the CPU kernels: "
                         "install gcc, or use model.kernel=auto or torch")
    if kernel == "triton" and not triton_dim_supported(dim_head):
        raise ValueError(f"kernel=triton needs dim_head a power of two from 16 to 256, not {dim_head}: "
                         "change model.dim_head, or use model.kernel=auto or torch")
    if kernel == "triton" and not triton_runnable():
        raise ValueError("kernel=triton needs a CUDA device (or TRITON_INTERPRET=1 to run the kernel slowly "
                         "on the CPU): use model.kernel=auto or torch")
