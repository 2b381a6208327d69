"""Native Sparse Attention (Yuan et al. 2025): compressed, selected and sliding-window branches
over each query's causal past, mixed by learned per-head sigmoid gates.

Notation of the paper -> knob: l = compress_block_size, d = compress_stride,
l' = fine_block_size, n = num_fine_selected, w = sliding_window_size.

- compressed: blocks of l keys every d tokens, each compressed to one key (and one value) by an
  MLP over the block plus a learned intra-block position embedding (`compressor=mlp`), or by the
  block's mean (`compressor=mean`, InfLLM-v2's: no parameters, so dense -> NSA adds none there).
  A block is visible to query t only once it is complete (its last token <= t); a query that
  sees no block gets zeros, not NaN.
- selected: block importance is the compressed-attention probability summed over the query heads
  of a GQA group and spread onto the fine blocks by token overlap; each position keeps its top n
  fine blocks, always including its own block, the initial block and the previous block (in that
  order of priority; kernels/nsa_attention/blocks.py). Keys after t inside its own block are
  masked. As in the paper, the choice of blocks passes no gradient, unless `diff_topk`: then each
  freely chosen block's share of the output is weighted by its importance through a straight-through
  factor (1 in value), so the compressed keys and the queries learn from what selection does.
- sliding window: the last w keys, t included.

Each branch has its own keys and values (as the paper: no gradient shortcuts between branches;
`shared_kv`, an ablation, gives all three one projection); the query projection is shared. Rotary
positions apply to the selected and window branches; the compressed branch gets its positions from
the intra-block embedding and the causal block mask.

This module states the algorithm: projections, compression, gates, the cache. The branches run in
one operator, kernels.nsa_attention.nsa_attention, which picks the fused Triton kernels, the C
kernels or plain PyTorch (model.kernel) by the one rule of kernels/dispatch.py.
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import dispatch
from kernels.nsa_attention import BRANCHES, compressed_blocks, cpu_built, nsa_attention, triton_problem
from kernels.nsa_attention.blocks import BlockRules
from kernels.nsa_attention.compressor import compress_blocks, compress_mean
from models.attention import cache as kv_cache
from models.attention.knobs import check_at_least_1, check_gqa
from models.recompute import RecomputedLayers, recomputation_pays
from models.rotary import Rotary

BRANCH_NAMES = ("compressed", "selected", "window")  # the gates' order, as kernels.nsa_attention's
RAW = ("to_compress", "k_slc", "v_slc", "k_win", "v_win")  # cached per-token keys and values, [b, heads, n, d]


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
    """The keys' and the values' compressors side by side, one MLP per head of 2 * kv_heads (keys
    [0, kv_heads), values after), from a block [l, dim_head] (+ intra-block position) to one
    [dim_head]; run by kernels/nsa_attention/compressor.py (model.kernel picks torch or Triton)."""

    def __init__(self, kv_heads: int, block: int, stride: int, dim_head: int, hidden: int):
        super().__init__()
        heads = 2 * kv_heads
        self.kv_heads, self.block, self.stride = kv_heads, block, stride
        self.pos = nn.Parameter(torch.zeros(heads, block, dim_head))
        self.w1 = nn.Parameter(torch.randn(heads, block * dim_head, hidden) / math.sqrt(block * dim_head))
        self.b1 = nn.Parameter(torch.zeros(heads, 1, hidden))
        self.w2 = nn.Parameter(torch.randn(heads, hidden, dim_head) / math.sqrt(hidden))

    def num_blocks(self, seq: int) -> int:
        return compressed_blocks(seq, self.block, self.stride)

    def forward(self, x: Tensor, first: int = 0, kernel: str = "auto") -> Tensor:
        """Keys and values x [batch, seq, 2 * kv_heads, dim_head] (any strides) -> compressed keys and
        values [batch, blocks, 2 * kv_heads, dim_head] for the complete blocks from block index `first` on."""
        return compress_blocks(x, self.pos, self.w1, self.b1, self.w2, self.block, self.stride, first, kernel)


class MeanCompressor(nn.Module):
    """InfLLM-v2's compressor: each block of keys (and of values) is its mean, with no parameters, so a
    dense model converted to NSA gains none there; the same interface as BlockCompressor."""

    def __init__(self, block: int, stride: int):
        super().__init__()
        self.block, self.stride = block, stride

    def num_blocks(self, seq: int) -> int:
        return compressed_blocks(seq, self.block, self.stride)

    def forward(self, x: Tensor, first: int = 0, kernel: str = "auto") -> Tensor:
        """x [batch, seq, 2 * kv_heads, dim_head] -> [batch, blocks, 2 * kv_heads, dim_head]."""
        return compress_mean(x, self.block, self.stride, first)


class InputProjection(nn.Module):
    """x [b, n, dim] -> the query, key/value and gate-logit projections side by side, as one product
    (their weights concatenated: the copy is weight-sized, not token-sized), without the gates' bias;
    split into [b, n, width] views, their gradients gathered by one concatenation. Its output is what
    a RecomputedLayers recipe recomputes, in the forward's dtype.

    The product's width is padded with zero rows of weight to a multiple of ALIGN columns: at bench
    size the widths sum to 1036 (the gates' 12 columns), and MKL's fp32 product x @ w^T took 1.2-2x
    as long at width 1036 as at 1040 (AMD EPYC Zen 4, 2 threads); every row of the output then also
    starts on a 64-byte line, which the C kernels read rows of and a GPU's TMA descriptors need (16 B).
    The zero rows are the owning layer's buffer (`padding`, set by it before each call): made once,
    moved and cast with the layer, never a launch a step."""

    ALIGN = 16

    def __init__(self, layers: tuple[nn.Linear, ...], widths: list[int]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.widths = widths
        self.padding: Optional[Tensor] = None  # [padding_rows(widths), dim] zeros, or None

    @classmethod
    def padding_rows(cls, widths: list[int]) -> int:
        return -sum(widths) % cls.ALIGN

    def forward(self, x: Tensor) -> Tensor:
        weights = [layer.weight for layer in self.layers]
        if self.padding is not None and len(self.padding):
            weights.append(self.padding)
        return F.linear(x, torch.cat(weights).to(x.dtype))

    def split(self, projected: Tensor) -> tuple[Tensor, ...]:
        """The projections' [b, n, width] views, the padding left out (split off, not sliced away: a
        slice's backward would copy the whole gradient once more)."""
        views = projected.split([*self.widths, projected.shape[-1] - sum(self.widths)], dim=-1)
        return views[:-1]


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
        compressor: str = "mlp",
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
        self.rules = BlockRules(fine_block_size, num_fine_selected, sliding_window_size)
        self.diff_topk = diff_topk
        self.dropout = dropout
        self.kernel = kernel
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, (1 if shared_kv else BRANCHES) * 2 * kv_heads * dim_head, bias=False)
        self.to_gates = nn.Linear(dim, BRANCHES * heads)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)
        # the three input projections run as one product (one launch, one product for x's gradient),
        # split into the query, the compressor's keys and values, the selected and window branches' four,
        # and the gate logits; held outside the module tree, so the parameters keep their names
        kv_width = kv_heads * dim_head
        kv_widths = [2 * kv_width] if shared_kv else [2 * kv_width] + [kv_width] * 4
        self._project = (InputProjection((self.to_q, self.to_kv, self.to_gates),
                                         [heads * dim_head, *kv_widths, BRANCHES * heads]),)
        self.register_buffer("projection_padding", torch.zeros(InputProjection.padding_rows(self._project[0].widths),
                                                               dim), persistent=False)
        hidden = max(1, int(dim_head * compress_hidden_mult))
        if compressor not in ("mlp", "mean"):
            raise ValueError(f"compressor={compressor} must be mlp or mean: set model.compressor")
        self.compressor = (BlockCompressor(kv_heads, compress_block_size, compress_stride, dim_head, hidden)
                           if compressor == "mlp" else MeanCompressor(compress_block_size, compress_stride))
        self.rotary = Rotary(dim_head)
        self.selections: Optional[list[Selection]] = None  # set by recording_selection

    def forward(self, x: Tensor, cache: Optional[dict] = None) -> Tensor:
        """x [batch, seq, dim] -> [batch, seq, dim]; with `cache`, x continues the cached tokens."""
        if torch.is_autocast_enabled(x.device.type):  # one cast for the three projections, not one each
            x = x.to(torch.get_autocast_dtype(x.device.type))
        start = 0 if cache is None else cache.get("pos", 0)
        self._project[0].padding = self.projection_padding  # as moved and cast with this layer
        # a kernel that saves the query and key/value projections for its backward may have them
        # recomputed from x instead (the CPU kernels: bench size at 8k, 616 -> 488 MB kept, dense 613);
        # not while a reversible stack recomputes this layer, whose backward follows at once
        with RecomputedLayers(enabled=cache is None and recomputation_pays(), armed=False) as projections:
            q, to_compress, *local, gates = self._project[0].split(projections.apply(self._project[0], x))
            q = q.unflatten(-1, (self.heads, self.dim_head))  # [b, n, heads, d]
            to_compress = to_compress.unflatten(-1, (2 * self.kv_heads, self.dim_head))  # [b, n, 2 * kv_heads, d]
            # the selected and window branches' keys and values, [b, n, kv_heads, d] views
            local = [t.unflatten(-1, (self.kv_heads, self.dim_head)) for t in local] or to_compress.chunk(2, 2) * 2
            gates = (gates + self.to_gates.bias.to(gates.dtype)).unflatten(-1, (BRANCHES, self.heads))  # [b, n, 3, heads]
            if self.gate_bias is not None:
                gates = gates + torch.tensor(self.gate_bias, dtype=gates.dtype, device=x.device).view(-1, 1)
            if self.closed:
                gates = gates.index_fill(2, torch.tensor(self.closed, device=x.device), float("-inf"))
            compressed = None
            if cache is not None:  # the cache keeps keys as projected ([b, h, n, d]), and the compressed blocks
                *local, compressed = self._extend_cache(cache, start, to_compress, *local)
            record = self.selections is not None and cache is None
            out, chosen = nsa_attention(
                q, tuple(local), gates, None if cache is not None else to_compress,
                partial(self.compressor, kernel=self.kernel), self.compressor.block,
                self.compressor.stride, self.rules, self.rotary, start, compressed, self.kernel, self.diff_topk,
                self.dropout if self.training else 0.0, record, projections.armed)
        if record and chosen is not None:
            self.selections.append(self._selection_record(*chosen))
        return self.to_out(out.flatten(2))

    def _selection_record(self, indices: Tensor, valid: Tensor) -> Selection:
        """The forced and freely chosen blocks [b, h, m, free] of queries from position 0, as recorded."""
        blocks, valid = self.rules.with_forced(indices, valid)
        return Selection(blocks.masked_fill(~valid, -1), self.rules.forced, self.rules.fine)

    # ---- cache -----------------------------------------------------------------------------------

    def truncate_cache(self, cache: dict, length: int) -> None:
        """Roll back to the first `length` positions (compressed blocks completed after it go too)."""
        kv_cache.truncate(cache, length)
        if "compressed" in cache:
            kv_cache.truncate(cache["compressed"], self.compressor.num_blocks(length))

    def _extend_cache(self, cache: dict, start: int, to_compress: Tensor, *local: Tensor) -> tuple[Tensor, ...]:
        """Append the new raw keys and values of every branch (growing buffers, each position copied
        once; token-first views in and out); compress the blocks they complete. -> the selected and
        window branches' four [b, n, kv_heads, d], and the compressed keys and values [b, blocks, 2 * kv_heads, d]."""
        raw = kv_cache.append(cache, start, **dict(zip(RAW, (t.transpose(1, 2) for t in (to_compress, *local)))))
        blocks = cache.setdefault("compressed", {})
        done = blocks.get("pos", 0)
        new = self.compressor(raw[0].transpose(1, 2), first=done, kernel=self.kernel)  # [b, new blocks, 2 * kv_heads, d]
        (compressed,) = kv_cache.append(blocks, done, kvc=new.transpose(1, 2))
        return (*(t.transpose(1, 2) for t in raw[1:]), compressed.transpose(1, 2))


def _check(heads, kv_heads, dim_head, window, block, stride, fine_block, num_selected, kernel, branches,
           gate_bias) -> None:
    """Reject knob combinations NSA cannot run, saying how to fix them."""
    if len(gate_bias) != BRANCHES:
        raise ValueError(f"gate_bias={list(gate_bias)} must give one logit offset per branch "
                         f"({', '.join(BRANCH_NAMES)}): set model.gate_bias, e.g. [0,0,0]")
    if not branches or set(branches) - set(BRANCH_NAMES):
        raise ValueError(f"branches={list(branches)} must name at least one of {', '.join(BRANCH_NAMES)}: "
                         "set model.branches")
    check_gqa(heads, kv_heads)
    check_at_least_1(sliding_window_size=window, compress_block_size=block, compress_stride=stride,
                     fine_block_size=fine_block, num_fine_selected=num_selected)
    if stride > block:
        raise ValueError(f"compress_stride={stride} exceeds compress_block_size={block}, so tokens between "
                         "blocks would never be compressed: lower model.compress_stride")
    dispatch.check(kernel, "NSA", triton_problem(heads // kv_heads, dim_head, fine_block), cpu_built)
