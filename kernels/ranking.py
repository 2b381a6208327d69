"""One exact order for a top-k choice: scores in fp32, equal scores by position, so that every path
(PyTorch, C, Triton; a training pass, a no-grad pass, decoding) keeps the same keys or blocks where
scores tie exactly. torch.topk has no rule for ties, and ties are common: ReLU's zeros in DSA's
indexer, fine blocks under the same compressed blocks in NSA (fine_block_size < compress_stride)."""

import sys

import torch
from torch import Tensor


def ranking_keys(scores: Tensor, later_first: bool) -> Tensor:
    """Scores [..., n] -> int64 keys [..., n] whose descending order is the scores' in fp32, ties
    broken by position (the later one first, or the earlier one): (the score's fp32 bits as an
    ordered integer) * 2^32 + a rank of the position."""
    bits = scores.float().view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: larger magnitude, smaller key
    ordered = ordered.masked_fill_(ordered == -1, 0)  # -0.0 ranks as +0.0
    n = scores.shape[-1]
    positions = torch.arange(n, dtype=torch.int32, device=scores.device)
    if not later_first:
        positions = n - 1 - positions
    positions = positions.expand_as(ordered)
    if sys.byteorder == "little":  # the two int32 halves written side by side: one pass, not three of int64
        return torch.stack((positions, ordered), dim=-1).view(torch.int64).squeeze(-1)
    return (ordered.long() << 32) | positions
