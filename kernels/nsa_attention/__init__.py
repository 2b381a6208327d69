"""NSA's branches given the layer's projections, and the one place that decides which implementation
runs them (models/attention/nsa.py states the algorithm; `path` picks how it runs):

    triton  the fused kernels (ops.py, triton.py): the three gated branches in one custom operator,
            for training, inference and decoding alike; on CUDA (kernel auto or triton), or
            anywhere Triton runs (kernel triton; its interpreter on a CPU)
    cpu     a training step's C kernels: block selection with the compressed branch's output in one
            pass (kernels/compressed_attention/selection.c), span attention for the selected blocks
            and the window (kernels/span_attention/); kernel auto or cpu on a CPU with a C compiler
    torch   plain PyTorch (reference.py, kernels/compressed_attention/): the readable path, and
            the one for what the fused kernels do not take (differentiable selection, attention
            dropout in training); its branch functions take the span kernel where it runs

    naive.py   the dense definition every path is tested against
    blocks.py  the rules of which keys the selected branch and the window reach
"""

from typing import Optional

from torch import Tensor

from kernels import span_attention as spans
from kernels.compressed_attention import cpu_selection_available
from kernels.nsa_attention.triton import supported as _triton_problem


def triton_supported(group: int, dim_head: int, fine: int) -> Optional[str]:
    """What keeps the fused kernels from this shape (one line), or None."""
    return _triton_problem(group, dim_head, fine)


def cpu_kernels_available() -> bool:
    """Whether the CPU kernels are built, or can be built, here (a C compiler)."""
    return spans.available() and cpu_selection_available()


def path(x: Tensor, kernel: str, group: int, dim_head: int, fine: int, exact: bool = False) -> str:
    """How an NSA layer runs on input x under model.kernel `kernel`: "triton", "cpu" or "torch".
    `exact`: the step needs what only plain PyTorch computes (differentiable selection, attention
    dropout in training)."""
    if exact:
        return "torch"
    if kernel == "triton" or (kernel == "auto" and x.is_cuda):
        return "triton" if triton_supported(group, dim_head, fine) is None else "torch"
    if kernel in ("auto", "cpu") and x.device.type == "cpu" and x.dtype in spans.KERNEL_DTYPES:
        return "cpu" if cpu_kernels_available() else "torch"
    return "torch"
