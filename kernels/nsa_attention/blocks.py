"""Which keys NSA's selected branch and sliding window reach, as rules on positions: the forced
fine blocks (own, initial, previous: as many as num_fine_selected allows, in that priority), the
free choice by importance, the window, and these as key spans for the span-attention CPU kernel;
and which compressed blocks a position sees; and what the fused kernels keep for the backward.
Every path (naive, torch, C, Triton) states the same rules; these are the torch ones."""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.ranking import ranking_keys


def compressed_blocks(seq: int, block: int, stride: int) -> int:
    """How many compressed blocks (`block` tokens every `stride`) `seq` tokens complete."""
    return max(0, (seq - block) // stride + 1)


def keeps_branch_outputs(query_elements: int, input_elements: int) -> bool:
    """Whether the fused kernels keep the three branches' outputs before their gates (3x the
    queries' elements) for the backward: only where they weigh no more than the kernels' inputs (q
    and every branch's keys and values), so a layer never saves more than it was given. Else the dq
    kernels recompute rowsum(dO * O) in a first pass over the keys: at the paper's GQA group of 16
    the outputs would be 3x q against inputs of ~1.3x q, and the pass adds 2 products a pair (q.k
    and dP): 7 in the backward's kernels where 5 were."""
    return 3 * query_elements <= input_elements


def visible_compressed(positions: Tensor, block: int, stride: int, num_blocks: Optional[int] = None) -> Tensor:
    """How many compressed blocks are complete at each position (block i ends at i * stride + block - 1),
    at most num_blocks: the one count every path and counter of the compressed branch uses."""
    seen = (positions + 1 - block).div(stride, rounding_mode="floor") + 1
    return seen.clamp(0, num_blocks)


def split_compressed(kvc: Tensor) -> tuple[Tensor, Tensor]:
    """The compressor's output [b, blocks, 2 * kv_heads, d] (keys' heads, then values') -> compressed
    keys and values [b, kv_heads, blocks, d], views."""
    kc, vc = kvc.chunk(2, dim=2)
    return kc.transpose(1, 2), vc.transpose(1, 2)


@dataclass(frozen=True)
class BlockRules:
    fine: int  # fine_block_size
    selected: int  # num_fine_selected: forced and free
    window: int  # sliding_window_size

    @property
    def forced(self) -> int:
        return min(3, self.selected)

    def free(self, seq_k: int) -> int:
        """Freely chosen blocks per query besides the forced ones (no more than the keys hold)."""
        return max(0, min(self.selected - self.forced, -(-seq_k // self.fine)))

    def forced_visible(self, query_pos: Tensor, key_pos: Tensor) -> Tensor:
        """Key in the query's own block (at or before it), the initial block or the previous block;
        broadcasts its arguments."""
        own = query_pos // self.fine
        key_block = key_pos // self.fine
        forced = key_block == own
        if self.forced >= 2:
            forced = forced | (key_block == 0)
        if self.forced >= 3:
            forced = forced | (key_block == own - 1)
        return forced & (key_pos <= query_pos) & (key_pos >= 0)

    def forced_indices(self, start: int, m: int, device) -> tuple[Tensor, Tensor]:
        """The forced blocks of the queries at start.. as block indices and validity [m, forced],
        each block once."""
        own = torch.arange(start, start + m, device=device) // self.fine
        blocks = torch.stack((own, torch.zeros_like(own), own - 1), dim=-1)[:, : self.forced]
        valid = torch.ones_like(blocks, dtype=torch.bool)
        if self.forced >= 2:
            valid[:, 1] = own != 0
        if self.forced >= 3:
            valid[:, 2] = own - 1 > 0
        return blocks.clamp(min=0), valid

    def choose(self, importance: Tensor, first: int, free: int) -> tuple[Tensor, Tensor]:
        """The `free` most important fine blocks per (batch * kv head, position) besides the forced
        blocks, never in the future, ties to the earlier block (as the C pass and the definition
        choose): importance [bh, n, fine blocks] of positions first.. -> scores, indices [bh, n, free]
        (score -inf: no block left for that slot)."""
        m, num_fine = importance.shape[1], importance.shape[2]
        query_pos = torch.arange(first, first + m, device=importance.device)[:, None]
        fine_start = torch.arange(num_fine, device=importance.device) * self.fine
        taken = self.forced_visible(query_pos, fine_start) | (fine_start > query_pos)
        importance = importance.masked_fill(taken, float("-inf"))
        indices = ranking_keys(importance, later_first=False).topk(min(free, num_fine), dim=-1).indices
        scores = importance.gather(-1, indices)
        short = free - scores.shape[-1]  # early chunks have fewer blocks than later ones
        return F.pad(scores, (0, short), value=float("-inf")), F.pad(indices, (0, short))

    def chooser(self, seq_k: int):
        """choose(importance, first) for compressed attention: as many free blocks as fit, at every position."""
        free = self.free(seq_k)
        return lambda importance, first: self.choose(importance, first, free)

    def with_forced(self, indices: Tensor, valid: Tensor, start: int = 0) -> tuple[Tensor, Tensor]:
        """The forced blocks ahead of the chosen ones: indices, valid [..., m, free] of queries from
        `start` -> [..., m, forced + free]."""
        forced, forced_valid = self.forced_indices(start, indices.shape[-2], indices.device)
        lead = indices.shape[:-2]
        return (torch.cat((forced.expand(*lead, -1, -1), indices), dim=-1),
                torch.cat((forced_valid.expand(*lead, -1, -1), valid), dim=-1))

    def block_spans(self, blocks: Tensor, valid: Tensor) -> Tensor:
        """Fine blocks [..., m, slots] of the queries from position 0 -> their key spans [..., m, slots, 2]
        (start, end), cut after the query; an invalid slot gets an empty span."""
        start = blocks * self.fine
        query_end = torch.arange(1, blocks.shape[-2] + 1, device=blocks.device)[:, None]
        end = torch.minimum(start + self.fine, query_end).masked_fill(~valid, 0)
        return torch.stack((start.masked_fill(~valid, 0), end), dim=-1)

    def window_visible(self, query_pos: Tensor, key_pos: Tensor) -> Tensor:
        return (key_pos <= query_pos) & (key_pos > query_pos - self.window)

    def window_spans(self, m: int, device) -> Tensor:
        """The window of each query from position 0 as one key span [m, 1, 2]."""
        i = torch.arange(m, device=device)
        return torch.stack(((i - self.window + 1).clamp(min=0), i + 1), dim=-1)[:, None]
