"""Launches of NSA's Triton kernels (triton_kernels.py): the three branches' forward into one gated
output, and their backward from the saved log-sum-exps; shapes in triton_kernels.py's docstring.

    forward(q, kc, vc, k_slc, v_slc, k_win, v_win, gates, phases, start, knobs, save)
        -> out, blocks, saved, lse
    backward(dout, q, kc, vc, k_slc, v_slc, k_win, v_win, gates, phases, saved, lse, blocks, knobs)
        -> dq, dkc, dvc, dk_slc, dv_slc, dk_win, dv_win, dgates

Tiles: BM = 64 query rows (64 / group positions x group heads), compressed keys 32 a tile (so a
short reach wastes little), window keys 64, forced and chosen blocks one fine block a tile.
Launches, each reported to kernels.counters with its grid, tile and the (row, key) pairs visited
against those its mask needs: forward 3 (compressed with selection, selected, window); backward 3
dq, 3 dk/dv, the reverse index of the chosen blocks (a sort and a search) and the sums of the
chunked partials.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton
from torch import Tensor

from kernels import counters
from kernels.nsa_attention.blocks import keeps_branch_outputs, split_compressed, visible_compressed
from kernels.nsa_attention.triton_kernels import (COMPRESSED, FORCED, WINDOW, backward_dkv_kernel, backward_dq_kernel,
                                                  forward_kernel, pairs_kernel)
from kernels.triton_tiles import tiles_usable

BM = 64  # query rows a program: Hopper's tensor cores want 64 or more
COMPRESSED_TILE, WINDOW_TILE, IMPORTANCE_TILE = 32, 64, 32
READERS_PER_CHUNK = 4096  # queries one dk/dv program takes of the long runs of readers (compressed keys, block 0)
NAMES = {COMPRESSED: "compressed", FORCED: "selected", WINDOW: "window"}


@dataclass(frozen=True)
class Knobs:
    """NSA's knobs as the kernels take them: compressed blocks of `block` every `stride`, fine
    blocks of `fine`, `forced` of (own, initial, previous) always attended, `free` chosen ones."""

    block: int
    stride: int
    fine: int
    forced: int
    free: int
    window: int


def _strides(t: Tensor) -> tuple[int, ...]:
    """The strides of a [batch, seq, heads, dim_head] tensor's first three dimensions."""
    if t.stride(-1) != 1:
        raise ValueError("the Triton NSA kernels need dim_head contiguous")
    return t.stride(0), t.stride(1), t.stride(2)


def _meta(mask: int, q: Tensor, kv_heads: int, knobs: Knobs) -> dict:
    """The constexprs of one branch's kernels."""
    group, dim = q.shape[2] // kv_heads, q.shape[3]
    use_dot = tiles_usable(q.dtype, 16)  # every tile side is 16 or more; not bf16 in the interpreter
    fine_tile = max(16 if use_dot else 2, knobs.fine)
    tile = {COMPRESSED: COMPRESSED_TILE, FORCED: fine_tile, WINDOW: WINDOW_TILE}[mask]
    meta = dict(KVH=kv_heads, G=group, D=dim, BM=BM, BN=tile, MASK=mask, L=knobs.block, S=knobs.stride,
                FINE=knobs.fine, FORCED_BLOCKS=knobs.forced, FREE=knobs.free if mask != WINDOW else 0,
                W=knobs.window, SCALE=dim**-0.5, ROTARY=mask != COMPRESSED, USE_DOT=use_dot,
                num_warps=4 if dim <= 64 else 8, num_stages=_stages(q.element_size() * dim))
    return meta


def _stages(row_bytes: int) -> int:
    """Software-pipelining depth: Triton's 3 on Hopper, but 2 where a row of a tile holds 512 bytes
    or more (fp32 at dim_head 128): at 3, four kernels ask 256 to 304 KB of shared memory a program,
    over an H100's 227 KB, and at 2 at most 208 KB (python -m experiments.bench.gpu_compile)."""
    return 2 if row_bytes >= 512 else 3


def _selection_meta(q: Tensor, kv_heads: int, knobs: Knobs) -> dict:
    """The selection pass's tiles: FINE_STEP fine blocks a step, COMPRESSED_STEP compressed blocks (_select)."""
    group = q.shape[2] // kv_heads
    per_fine = knobs.fine // knobs.stride
    exact = knobs.fine % knobs.stride == 0 and knobs.block <= knobs.fine and not per_fine & (per_fine - 1)
    if exact:  # the compressed blocks that start in a step, each read once (a tile of them fills exactly)
        compressed_step = max(IMPORTANCE_TILE, triton.next_power_of_2(per_fine))
        fine_step = compressed_step // per_fine
        fine_step_pad = triton.next_power_of_2(fine_step + 1)  # and a column for the next step's first fine block
    else:  # those that overlap a step: a block across a step's edge is read by both steps
        compressed_step = IMPORTANCE_TILE
        while (knobs.fine + knobs.block - 1) // knobs.stride + 2 > compressed_step:
            compressed_step *= 2
        fine_step = 1
        while ((fine_step + 1) * knobs.fine + knobs.block - 1) // knobs.stride + 2 <= compressed_step:
            fine_step += 1
        fine_step_pad = triton.next_power_of_2(fine_step)
    positions = BM // group
    smallest = 16 if tiles_usable(q.dtype, 16) else 2  # a tile side tl.dot takes
    return dict(GROUP_PAD=max(smallest, group), BLOCK_PAD=max(smallest, knobs.fine),
                FREE_PAD=max(2, triton.next_power_of_2(knobs.free)), FINE_STEP_PAD=fine_step_pad, FINE_STEP=fine_step,
                COMPRESSED_STEP=compressed_step, EXACT=exact, DOT_IMPORTANCE=positions >= 16 and fine_step_pad >= 16)


class _Count:
    """A launch's counter of visited pairs while kernels.counters records; else `unused` stands in
    for it (the kernel compiles without counting, and nothing is allocated)."""

    def __init__(self, unused: Tensor):
        self.on = counters.counting()
        with counters.bookkeeping():
            self.tensor = torch.zeros(1, dtype=torch.int64, device=unused.device) if self.on else unused

    def record(self, name: str, grid: tuple, rows: int, keys: int, needed: Callable[[], int]) -> None:
        """`needed` counts the pairs the mask lets through; it runs only while counting."""
        if self.on:
            with counters.bookkeeping():
                counters.record(counters.Launch(name, tuple(grid), rows, keys, int(self.tensor), needed()))


def flash_sparse_order(group: int, free: int) -> bool:
    """Whether the chosen blocks take Flash Sparse Attention's order (a program per block over the
    queries that chose it) rather than the paper's (a program per query over its blocks): for a
    group under 16, whose rows would fill a tensor-core tile only a group at a time. Its pairs add
    to each row's output and dq atomically, so deterministic runs keep the paper's order."""
    return free > 0 and group < 16 and not torch.are_deterministic_algorithms_enabled()


def keeps_outputs(q: Tensor, *keys: Tensor) -> bool:
    """blocks.keeps_branch_outputs for q and the kernels' other inputs `keys` (every branch's keys
    and values)."""
    return keeps_branch_outputs(q.numel(), q.numel() + sum(k.numel() for k in keys))


def forward(q: Tensor, kc: Tensor, vc: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor, v_win: Tensor,
            gates: Tensor, phases: Tensor, start: int, knobs: Knobs, save: bool, fsa: bool
            ) -> tuple[Tensor, ...]:
    """The gated sum of the three branches -> out [b, n, heads, d], the chosen fine blocks
    [b, kv_heads, n, free] (int32, num_fine where unused), and for the backward (`save`) the
    branches' outputs before their gates [3, b, n, heads, d] (where keeps_outputs, else [0, ...]),
    their log-sum-exps [3, b, kv_heads, n, group] and the chosen blocks' reverse index (order,
    ranked: _reverse_index; empty unless `save` or `fsa`, Flash Sparse Attention's order for the
    chosen blocks)."""
    b, n, heads, dim = q.shape
    kv_heads, num_blocks = kc.shape[1], kc.shape[2]
    group, num_keys = heads // kv_heads, k_slc.shape[1]
    num_fine = triton.cdiv(num_keys, knobs.fine)
    fsa = fsa and knobs.free > 0
    keep = save and keeps_outputs(q, kc, vc, k_slc, v_slc, k_win, v_win)
    out = torch.empty(b, n, heads, dim, device=q.device, dtype=q.dtype)
    saved = torch.empty(3 if keep else 0, b, n, heads, dim, device=q.device, dtype=q.dtype)
    # the selected branch's state between its tile and its positions (the paper's order), where not kept
    scratch = saved if keep else torch.empty(1, b, n, heads, dim, device=q.device, dtype=q.dtype)
    lse = torch.empty(3, b, kv_heads, n, group, device=q.device, dtype=torch.float32)
    blocks = torch.empty(b, kv_heads, n, knobs.free, device=q.device, dtype=torch.int32)
    order, ranked = (torch.empty(0, device=q.device, dtype=dtype) for dtype in (torch.int64, torch.int32))
    if n == 0:
        return out, blocks, saved, lse, order, ranked
    grid = (triton.cdiv(n, BM // group), b * kv_heads)
    selection = _selection_meta(q, kv_heads, knobs)
    # with Flash Sparse Attention's order the selected branch's output adds up in fp32, and the
    # chosen blocks' log-sum-exps wait in `stats` for the tile kernel
    acc = torch.empty(b, n, heads, dim, device=q.device, dtype=torch.float32) if fsa else out
    stats = torch.empty(b * kv_heads, n, knobs.free, group, device=q.device, dtype=torch.float32) if fsa else lse
    rows = _strides(out)
    for mask, k, v, keys in ((COMPRESSED, kc, vc, num_blocks), (FORCED, k_slc, v_slc, num_keys),
                             (WINDOW, k_win, v_win, num_keys)):  # mask: the branch's place in gates, saved and lse
        if mask == FORCED and (fsa or save) and knobs.free:
            order, ranked = _reverse_index(blocks)
            if fsa:
                _pairs(0, q, k, v, lse[FORCED], stats, acc, phases, blocks, ranked, order, start, num_fine, knobs)
        count = _Count(q)
        meta = _meta(mask, q, kv_heads, knobs)
        forward_kernel[grid](q, k, v, gates[:, :, mask], out, scratch[mask if keep else 0], lse[mask], phases, blocks,
                             stats, acc, gates[:, :, FORCED], scratch[FORCED if keep else 0], count.tensor,
                             *_strides(q), *_key_strides(mask, k), *_strides(gates[:, :, mask]), *rows, start, n,
                             keys, num_fine, ACCUMULATE=mask > 0, SAVE=keep or mask == FORCED, COUNT=count.on,
                             FSA=fsa, FREE_P=max(2, triton.next_power_of_2(knobs.free)), **selection, **meta)
        count.record(f"{NAMES[mask]}_forward", grid, BM, meta["BN"], lambda: group * needed_pairs(
            mask, start, n, keys, knobs, blocks, pass_count=2 if mask == COMPRESSED and knobs.free else 1,
            chosen=not fsa))
        if mask == FORCED and fsa:
            _pairs(1, q, k, v, lse[FORCED], stats, acc, phases, blocks, ranked, order, start, num_fine, knobs)
    return out, blocks, saved, lse, order, ranked


def _pairs(which: int, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, stats: Tensor, acc: Tensor, phases: Tensor,
           blocks: Tensor, ranked: Tensor, order: Tensor, start: int, num_fine: int, knobs: Knobs) -> None:
    """The pairs kernel's pass `which` (0: each pair's log-sum-exp; 1: its share of the output)."""
    b, n, heads, dim = q.shape
    kv_heads = k.shape[2]
    meta = _meta(FORCED, q, kv_heads, knobs)
    grid = (num_fine, b * kv_heads)
    count = _Count(q)
    pairs_kernel[grid](q, k, v, lse, stats, acc, phases, ranked, order, count.tensor, *_strides(q), *_strides(k),
                       *_strides(acc), start, n, k.shape[1], num_fine, KVH=kv_heads, G=meta["G"], D=dim, BM=BM,
                       BLOCK_PAD=meta["BN"], FINE=knobs.fine, FREE=knobs.free, SCALE=meta["SCALE"], USE_DOT=meta["USE_DOT"],
                       COUNT=count.on, PASS=which, num_warps=meta["num_warps"], num_stages=meta["num_stages"])
    count.record(f"selected_pairs_{('lse', 'output')[which]}", grid, BM, meta["BN"],
                 lambda: meta["G"] * chosen_pairs(start, knobs, blocks))


def backward(dout: Tensor, q: Tensor, kc: Tensor, vc: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor,
             v_win: Tensor, gates: Tensor, phases: Tensor, saved: Tensor, lse: Tensor, blocks: Tensor, order: Tensor,
             ranked: Tensor, knobs: Knobs, fsa: bool, dkvc: Optional[Tensor] = None) -> tuple[Tensor, ...]:
    """Gradients of forward's out (from position 0) -> dq, dkc, dvc, dk_slc, dv_slc, dk_win, dv_win, dgates;
    dkc and dvc written into dkvc [b, blocks, 2 * kv_heads, d] where given (as kc and vc are its views)."""
    b, n, heads, dim = q.shape
    kv_heads, num_blocks = kc.shape[1], kc.shape[2]
    group, num_keys = heads // kv_heads, k_slc.shape[1]
    num_fine = triton.cdiv(num_keys, knobs.fine)
    fsa = fsa and knobs.free > 0
    kept = saved.shape[0] == 3  # else the dq kernels recompute rowsum(dO * O) (keeps_outputs)
    dout = dout.contiguous()
    dq = torch.empty_like(dout)
    dq_acc = torch.empty(dout.shape, device=q.device, dtype=torch.float32) if fsa else dq
    dgates = torch.empty_like(gates)
    delta = torch.empty_like(lse)
    dkc, dvc = split_compressed(dkvc) if dkvc is not None else (torch.empty_like(kc), torch.empty_like(vc))
    dk_slc, dv_slc, dk_win, dv_win = (torch.empty(t.shape, device=t.device, dtype=t.dtype)
                                      for t in (k_slc, v_slc, k_win, v_win))
    selection = _selection_meta(q, kv_heads, knobs)
    grid = (triton.cdiv(n, BM // group), b * kv_heads)
    branches = {COMPRESSED: (kc, vc, num_blocks, dkc, dvc), FORCED: (k_slc, v_slc, num_keys, dk_slc, dv_slc),
                WINDOW: (k_win, v_win, num_keys, dk_win, dv_win)}
    # the paper's order: the selected branch's dq first (its chosen blocks use DQ as a scratch), the
    # others add to it; Flash Sparse Attention's: the compressed branch's first, the selected
    # branch's adds up in dq_acc (its pairs with its dk and dv) and the window's finishes it
    steps = ((COMPRESSED, "dq"), (FORCED, "dq"), (FORCED, "dkv"), (WINDOW, "dq"), (COMPRESSED, "dkv"),
             (WINDOW, "dkv")) if fsa else ((FORCED, "dq"), (COMPRESSED, "dq"), (WINDOW, "dq"), (COMPRESSED, "dkv"),
                                           (FORCED, "dkv"), (WINDOW, "dkv"))
    for mask, step in steps:
        k, v, keys, dk, dv = branches[mask]
        meta = _meta(mask, q, kv_heads, knobs)
        count = _Count(q)
        if step == "dq":
            backward_dq_kernel[grid](q, k, v, gates[:, :, mask], dout, saved[mask] if kept else dout, lse[mask],
                                     delta[mask], dgates[:, :, mask], dq, dq_acc, phases, blocks, count.tensor,
                                     *_strides(q), *_key_strides(mask, k), *_strides(gates[:, :, mask]),
                                     *_strides(dout), 0, n, keys, ACCUMULATE=mask != steps[0][0], COUNT=count.on,
                                     GROUP_PAD=selection["GROUP_PAD"], BLOCK_PAD=selection["BLOCK_PAD"], FSA=fsa,
                                     RECOMPUTE=not kept, **meta)
            # recomputing, the kernel walks its pairs twice; in Flash Sparse Attention's order the freely
            # chosen blocks' dq is not this kernel's, but its first pass still walks them (the selected
            # branch's rowsum(dO * O) covers every key the branch attends)
            chosen_first_pass = not kept and fsa and mask == FORCED
            count.record(f"{NAMES[mask]}_backward_dq", grid, BM, meta["BN"], lambda: group * (
                needed_pairs(mask, 0, n, keys, knobs, blocks, pass_count=1 if kept else 2, chosen=not fsa)
                + (chosen_pairs(0, knobs, blocks) if chosen_first_pass else 0)))
            continue
        if mask == COMPRESSED:
            chunks = _chunks(n, b * kv_heads * keys * dim * 8, q)
            grid_kv, rows = (triton.cdiv(keys, meta["BN"]), chunks, b * kv_heads), keys
        elif mask == FORCED:
            chunks = triton.cdiv(max(0, n - knobs.fine), READERS_PER_CHUNK) if knobs.forced >= 2 else 0
            grid_kv, rows = (num_fine + chunks, 1, b * kv_heads), min(knobs.fine, keys)
        else:
            chunks, grid_kv, rows = 0, (triton.cdiv(keys, meta["BN"]), 1, b * kv_heads), 0
        chunked = mask == COMPRESSED and chunks > 1
        used = chunked or (mask == FORCED and chunks)  # else a placeholder
        partial = torch.empty(2, chunks if used else 1, b * kv_heads, rows if used else 1, dim, device=q.device,
                              dtype=torch.float32)
        backward_dkv_kernel[grid_kv](q, k, v, gates[:, :, mask], dout, lse[mask], delta[mask], dk, dv, partial[0],
                                     partial[1], dq_acc, phases, ranked if knobs.free else blocks,
                                     order if knobs.free else blocks, count.tensor, *_strides(q),
                                     *_key_strides(mask, k), *_strides(gates[:, :, mask]), *_strides(dout),
                                     *_key_strides(mask, dk), 0, n, keys, num_fine,
                                     READERS_PER_CHUNK if mask == FORCED else triton.cdiv(n, max(chunks, 1)), rows,
                                     CHUNKED=chunked, COUNT=count.on, FSA=fsa, **meta)
        count.record(f"{NAMES[mask]}_backward_dkv", grid_kv, BM, meta["BN"],
                     lambda: group * needed_pairs(mask, 0, n, keys, knobs, blocks))
        if chunked:
            sums = partial.sum(1).view(2, b, kv_heads, keys, dim)
            if dkvc is not None:  # dk and dv side by side in one tensor: one copy
                dkvc.unflatten(2, (2, kv_heads)).permute(2, 0, 3, 1, 4).copy_(sums)
            else:
                dk.copy_(sums[0]), dv.copy_(sums[1])
        elif mask == FORCED and chunks:  # block 0 as the initial block: added to its other readers' sums
            sums = partial.sum(1).view(2, b, kv_heads, rows, dim).transpose(2, 3)
            dk[:, :rows].add_(sums[0])  # add_ on the view: `+=` on a slice would copy it back as well
            dv[:, :rows].add_(sums[1])
    return dq, dkc, dvc, dk_slc, dv_slc, dk_win, dv_win, dgates


def _key_strides(mask: int, k: Tensor) -> tuple[int, int, int]:
    """(batch, position, kv head) strides: k [b, seq, kv_heads, d], or kc [b, kv_heads, blocks, d]."""
    return (k.stride(0), k.stride(2), k.stride(1)) if mask == COMPRESSED else _strides(k)


def _chunks(n: int, chunk_bytes: int, q: Tensor) -> int:
    """How many chunks the compressed keys' readers are cut into: one per READERS_PER_CHUNK
    queries, no more than keeps the partial sums within q's size."""
    return max(1, min(triton.cdiv(n, READERS_PER_CHUNK), q.numel() * q.element_size() // max(chunk_bytes, 1)))


def _reverse_index(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """The (query, slot) pairs that chose each fine block, in one sort: blocks [b, kv_heads, n, free]
    -> order [b * kv_heads, n * free] (pair = query * free + slot, sorted by block, unused last) and
    the blocks so sorted (the kernels find a block's run in them by binary search)."""
    ranked, order = torch.sort(blocks.view(blocks.shape[0] * blocks.shape[1], -1), dim=-1, stable=True)
    return order, ranked


def needed_pairs(mask: int, start: int, n: int, keys: int, knobs: Knobs, blocks: Tensor, pass_count: int = 1,
                 chosen: bool = True) -> int:
    """(query, key) pairs a branch's mask lets through for one head, summed over batch * kv heads
    and queries start..start + n - 1, the chosen blocks' pairs included where `chosen`, times the
    passes a kernel needs over them (counted only while recording launches: it reads the blocks)."""
    t = torch.arange(start, start + n)
    bh = blocks.shape[0] * blocks.shape[1]
    if mask == COMPRESSED:
        pairs = bh * int(visible_compressed(t, knobs.block, knobs.stride, keys).sum())
    elif mask == WINDOW:
        reach = torch.minimum(t + 1, torch.tensor(keys)) - (t - knobs.window + 1).clamp(min=0)
        pairs = bh * int(reach.clamp(min=0).sum())
    else:
        own = t // knobs.fine
        own_keys = t - own * knobs.fine + 1
        initial = torch.where(own > 0, torch.full_like(t, knobs.fine), 0) if knobs.forced >= 2 else 0
        previous = torch.where(own > 1, torch.full_like(t, knobs.fine), 0) if knobs.forced >= 3 else 0
        pairs = bh * int((own_keys + initial + previous).sum()) + (chosen_pairs(start, knobs, blocks) if chosen else 0)
    return pass_count * pairs


def chosen_pairs(start: int, knobs: Knobs, blocks: Tensor) -> int:
    """(query, key) pairs in the chosen blocks [b, kv_heads, n, free], keys at or before the query."""
    t = torch.arange(start, start + blocks.shape[2])
    return int((t[None, None, :, None] - blocks.cpu().long() * knobs.fine + 1).clamp(0, knobs.fine).sum())
