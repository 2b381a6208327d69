"""Tile products shared by the Triton kernels: tensor-core tiles (tl.dot, fp32 accumulation, IEEE
precision for fp32 inputs) where the shapes and the machine allow them, a broadcast
multiply-and-sum where they do not."""

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels import triton_interpreting


def dim_supported(dim_head: int) -> bool:
    """Whether the Triton kernels take this dim_head (a power of two from 16 to 256: a whole number of
    tensor-core tiles, and registers enough for a row)."""
    return power_of_two("dim_head", dim_head, 256, low=16) is None


def power_of_two(name: str, value: int, high: int, low: Optional[int] = None) -> Optional[str]:
    """What is wrong with `name`=value as a tile side (a power of two, from low, up to high), or None."""
    if (low is None or value >= low) and value <= high and value > 0 and not value & (value - 1):
        return None
    return f"{name}={value} must be a power of two " + (f"from {low} to {high}" if low else f"up to {high}")


def refuse(kernel: str, x: torch.Tensor, *problems: Optional[str]) -> None:
    """One ValueError naming every problem (None: none) that keeps the Triton `kernel` from running on
    x here, and what to do instead; nothing if there is none."""
    found = [problem for problem in problems if problem]
    if not (x.is_cuda or triton_interpreting()):
        found.append("the tensors must be on a CUDA device (or set TRITON_INTERPRET=1 to run on the CPU)")
    if found:
        raise ValueError(f"the Triton {kernel} kernel cannot run this: " + "; ".join(found) + ". Use model.kernel=torch")


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
