"""A linear layer for the few rows of a decoding step on the CPU (few_row_linear.c): x [rows, in]
@ w [out, in]^T (+ bias) in fp32, rows 1 to ~16, without the packing of w that a general matrix
product does on every call. Its reference is `torch.nn.functional.linear`. models/sampling.py's
decoding_linears times it beside PyTorch's products on each CPU and takes it where it is fastest."""

from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from kernels.native import load

_SOURCE = Path(__file__).with_name("few_row_linear.c")
_SIGNATURES = (("few_row_linear", 4, 3),)


def _library():
    return load(_SOURCE, _SIGNATURES)


def available() -> bool:
    """Whether the CPU kernel is built (or can be built) here."""
    return _library() is not None


def few_row_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], threads: int) -> Tensor:
    """x [rows, in] @ weight [out, in]^T + bias [out] -> [rows, out], all fp32 on the CPU, on
    `threads` threads; x is copied only where its rows are not contiguous. Called per linear per
    decoded token, so besides the checks that keep C inside its buffers it does no more than the
    call: the library is looked up once a call, and the pointers go to C as plain integers."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        # C reads and writes 4-byte floats: anything else would be misread, and its output overrun
        raise ValueError("few_row_linear takes fp32 CPU tensors, got " +
                         ", ".join(f"{t.dtype} on {t.device}" for t in tensors))
    if x.dim() != 2 or x.shape[1] != weight.shape[1] or (bias is not None and bias.shape != weight.shape[:1]):
        raise ValueError(f"few_row_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not go together")
    library = _library()
    if library is None:
        raise RuntimeError("the few-row linear CPU kernel could not be built here (no working C compiler)")
    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = x.new_empty(x.shape[0], weight.shape[0])
    library.few_row_linear(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                           x.shape[0], weight.shape[1], weight.shape[0], 0.0, threads)
    return out
