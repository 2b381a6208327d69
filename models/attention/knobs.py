"""Checks of knobs that several attentions share, each refusal one line naming the knob and the fix."""

from typing import Callable, Optional

from kernels import dispatch


def check_gqa(heads: int, kv_heads: int) -> None:
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads} (GQA groups): change model.kv_heads")


def check_at_least_1(**knobs: int) -> None:
    for name, value in knobs.items():
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1: set model.{name}")


def check_no_dropout(dropout: float, kernels: str) -> None:
    if dropout:
        raise ValueError(f"attn_dropout={dropout}: {kernels} have no attention dropout; set model.attn_dropout=0")


def check_kernel(kernel: str, model: str, cpu_built: Optional[Callable[[], bool]],
                 triton_problem: Optional[str] = None) -> None:
    """model.kernel checked by kernels/dispatch.py's rule before any work: kernel=cpu needs the model's C
    kernel built here (cpu_built; None: the model has none); kernel=triton needs the shape its
    kernels take (triton_problem: what it lacks, or None) and CUDA or the interpreter."""
    dispatch.check(kernel, model, triton_problem, cpu_built)
