"""Attention kernels, one package each, and decoding's few-row product (few_row_linear: few_row_linear.c,
its reference torch's linear). Every package has `naive.py` (the simplest readable
reference) and its operator in `__init__.py`, which, where there are several paths, picks among them
by the one rule of dispatch.py; the paths differ by package:

    gather_attention, lightning_index                       reference.py (chunked PyTorch), <package>.c and cpu.py
                                                            (the CPU kernel), triton.py
    selected_attention                                      reference.py (chunked PyTorch), triton.py
    span_attention                                          span_attention.c (the CPU kernel) alone
    moba_attention                                          span_attention's C kernel, selected_attention's paths
    nsa_attention                                           the three branches over several files: chunked and
                                                            tiled torch, selection.c and cpu.py, fused Triton

C files are compiled on first use by native.py, sharing native.h. Shared: native.py, triton_tiles.py
(tile products of the Triton kernels), counters.py (what each launch walks, so a CPU can check a
GPU's costs), flops.py, recompute.py, ranking.py (one order for top-k choices, ties included).
Nothing here imports models/ or experiments/, and nothing imports Triton until a Triton kernel runs."""

import torch


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """Softmax scores and statistics in fp32 at least: half-precision sums lose the small terms
    (fp64 stays fp64, so the float64 tests check the algorithm exactly)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))
