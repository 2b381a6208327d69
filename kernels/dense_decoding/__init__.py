"""Decoding steps through every block of a dense pre-norm transformer in one C call
(dense_decoding.c): the few new tokens of one sequence, fp32 on the CPU. models/fused_decoding.py
says which models it serves and holds their weights' addresses; its reference is the blocks' own
forward over the growing cache."""

import ctypes
from pathlib import Path

from torch import Tensor

from kernels.native import load

_SOURCE = Path(__file__).with_name("dense_decoding.c")
_SIGNATURES = (("dense_decoding", 4, 8),)
# a block's row of int64 addresses in the table (dense_decoding.c's enum)
FIELDS = ("ln1_w", "ln1_b", "qkv_w", "out_w", "ln2_w", "ln2_b", "ff1_w", "ff1_b", "ff2_w", "ff2_b", "keys", "values")
KEYS, VALUES = FIELDS.index("keys"), FIELDS.index("values")


def _library():
    return load(_SOURCE, _SIGNATURES)


def available() -> bool:
    """Whether the CPU kernel is built (or can be built) here."""
    return _library() is not None


def scratch_floats(rows: int, dim: int, heads: int, dim_head: int, hidden: int, end: int) -> int:
    """The scratch a step of `rows` tokens ending at position `end` needs, in floats."""
    return rows * (2 * dim + 4 * heads * dim_head + hidden) + rows * heads * end


def blocks_step(x: Tensor, table, phases: Tensor, scratch: Tensor, *, heads: int, dim_head: int, hidden: int,
                layers: int, start: int, capacity: int, eps: float, threads: int) -> None:
    """x [rows, dim] (contiguous fp32, updated in place) through `layers` blocks whose addresses
    `table` (ctypes int64 [layers * len(FIELDS)]) holds, keys and values [heads, capacity, dim_head]
    written at positions start.. ; phases [>= start + rows, dim_head / 2, 2] fp32 (cos, sin);
    scratch of scratch_floats(...) floats. The caller keeps every tensor the table names alive and
    in place, and `capacity` >= start + rows."""
    rows, dim = x.shape
    if scratch.numel() < scratch_floats(rows, dim, heads, dim_head, hidden, start + rows) or start + rows > capacity:
        raise ValueError("dense_decoding: the scratch or the caches are too small for this step")
    if phases.shape[0] < start + rows or not (x.is_contiguous() and phases.is_contiguous()):
        raise ValueError("dense_decoding: rows and phases must be contiguous, phases cover every position")
    _library().dense_decoding(x.data_ptr(), ctypes.addressof(table), phases.data_ptr(), scratch.data_ptr(),
                              rows, dim, heads, dim_head, hidden, layers, start, capacity, eps, threads)
