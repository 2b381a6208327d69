"""Attention kernels, one package each: `naive.py` (the simplest readable reference), `reference.py`
(the chunked plain-PyTorch path), `triton.py` where there is a Triton kernel, a `.c` file where
there is a CPU kernel (compiled on first use by native.py, sharing native.h), and the operator in
the package's `__init__.py`, which picks among them by the one rule of dispatch.py. Shared: native.py
(building the C kernels), triton_tiles.py (tile products of the Triton kernels), counters.py (what
each launch walks, so a CPU can check a GPU's costs), flops.py. Nothing here imports models/ or
experiments/, and nothing imports Triton until a Triton kernel runs."""

import torch

from kernels.dispatch import triton_interpreting, triton_runnable  # noqa: F401 (the package's public checks)


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """Softmax scores and statistics in fp32 at least: half-precision sums lose the small terms
    (fp64 stays fp64, so the float64 tests check the algorithm exactly)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))
