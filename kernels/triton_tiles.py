"""Tile products shared by the Triton kernels: tensor-core tiles (tl.dot, fp32 accumulation, IEEE
precision for fp32 inputs) where the shapes and the machine allow them, a broadcast
multiply-and-sum where they do not."""

import torch
import triton
import triton.language as tl

from kernels.dispatch import power_of_two, refuse, triton_interpreting  # noqa: F401 (the kernels' shape checks)


def tiles_usable(dtype: torch.dtype, *sides: int) -> bool:
    """Whether tl.dot can take tiles with these sides: each at least 16, and not bf16 in Triton's
    interpreter (numpy has no bf16 and computes its products wrongly; there the sums serve)."""
    return min(sides) >= 16 and not (triton_interpreting() and dtype == torch.bfloat16)


@triton.jit
def qk(a, b, USE_DOT: tl.constexpr):
    """a [M, D] . b [N, D]^T -> [M, N] in fp32."""
    if USE_DOT:
        return tl.dot(a, tl.trans(b), input_precision="ieee" if a.dtype == tl.float32 else None)
    return tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def pv(p, v, USE_DOT: tl.constexpr):
    """p [M, N] @ v [N, D] -> [M, D] in fp32, p cast to v's dtype for the tile."""
    if USE_DOT:
        return tl.dot(p.to(v.dtype), v, input_precision="ieee" if v.dtype == tl.float32 else None)
    return tl.sum(p.to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
