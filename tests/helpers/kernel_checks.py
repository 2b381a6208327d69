"""Comparing an attention kernel's outputs and gradients with another path's: the same fixed
cotangents on every path, and one message per tensor that differs."""

from typing import Sequence

import torch
from torch import Tensor

from kernels import at_least_fp32

NAMES = ("out", "lse", "dq", "dk", "dv", "dweights")
# where the tests run a Triton kernel: on the GPU where there is one, else in Triton's interpreter
# on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 there)
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_for(kernel: str) -> torch.device:
    """Where a test runs a path: the Triton kernels' on TRITON_DEVICE, every other on the CPU."""
    return TRITON_DEVICE if kernel == "triton" else torch.device("cpu")


def values_and_grads(out: Tensor, lse: Tensor, leaves: Sequence[Tensor]) -> list[Tensor]:
    """[out, lse, each leaf's gradient] of sum(out * R) + sum(lse * S), with R [batch_kv, seq_q,
    group, dim_head] and S [batch_kv, seq_q, group] drawn from fixed seeds, so that every path on
    the same shapes gets the same ones (in its own dtype); summed in fp32 at least."""
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    grad_lse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(2)).to(lse.device, lse.dtype)
    loss = at_least_fp32(out * grad_out).sum() + at_least_fp32(lse * grad_lse).sum()
    return [out, lse, *torch.autograd.grad(loss, leaves)]


def assert_all_close(ours: Sequence[Tensor], theirs: Sequence[Tensor], tol: float, what: str = "") -> None:
    """Each pair equal to tol (0: to the bit), compared on the CPU in fp32 at least, named as NAMES."""
    for name, a, b in zip(NAMES, ours, theirs):
        torch.testing.assert_close(at_least_fp32(a).cpu(), at_least_fp32(b).cpu(), rtol=tol, atol=tol,
                                   msg=f"{name} differs{what}")


def random_qkv(bh: int, m: int, n: int, g: int, d: int, generator: torch.Generator,
               dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor, Tensor]:
    """Leaves that take gradients: q [bh, m, g, d], k and v [bh, n, d], standard normal."""
    q = torch.randn(bh, m, g, d, dtype=dtype, generator=generator, requires_grad=True)
    k = torch.randn(bh, n, d, dtype=dtype, generator=generator, requires_grad=True)
    v = torch.randn(bh, n, d, dtype=dtype, generator=generator, requires_grad=True)
    return q, k, v
