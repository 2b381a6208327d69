"""Attention kernels, one package each: `naive.py` (the simplest readable reference), `reference.py`
(the chunked plain-PyTorch path), `triton.py` where there is a Triton kernel, a `.c` file where
there is a CPU kernel (compiled on first use by native.py, sharing native.h), and the dispatcher
in the package's `__init__.py`. Shared by the Triton kernels: triton_tiles.py (tile products);
counters.py records what each launch walks, so a CPU can check a GPU's costs. Nothing here imports
models/ or experiments/."""

import os

import torch


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors) rather than compiling them."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_runnable() -> bool:
    """Whether the Triton kernel can run here: on CUDA, or in Triton's interpreter."""
    return torch.cuda.is_available() or triton_interpreting()


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """Softmax scores and statistics in fp32 at least: half-precision sums lose the small terms
    (fp64 stays fp64, so the float64 tests check the algorithm exactly)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))
