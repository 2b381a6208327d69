"""Checks of knobs that several attentions share, each refusal one line naming the knob and the fix."""

from typing import Optional

from kernels import triton_runnable
from kernels.triton_tiles import dim_supported


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


def check_kernel(kernel: str, model: str, cpu_built: Optional[bool], **triton_dims: int) -> None:
    """kernel=cpu needs the model's C kernel built here (cpu_built; None: the model has none);
    kernel=triton needs each of triton_dims a power of two from 16 to 256, and CUDA or the interpreter."""
    if kernel == "cpu" and cpu_built is None:
        raise ValueError(f"kernel=cpu: {model} has no C kernel; use model.kernel=auto, torch or triton")
    if kernel == "cpu" and not cpu_built:
        raise ValueError("kernel=cpu needs a working C compiler (cc or $CC) to build the CPU kernels: "
                         "install gcc, or use model.kernel=auto or torch")
    if kernel != "triton":
        return
    for name, value in triton_dims.items():
        if not dim_supported(value):
            raise ValueError(f"kernel=triton needs {name} a power of two from 16 to 256, not {value}: "
                             f"change model.{name}, or use model.kernel=auto or torch")
    if not triton_runnable():
        raise ValueError("kernel=triton needs a CUDA device (or TRITON_INTERPRET=1 to run the kernel slowly "
                         "on the CPU): use model.kernel=auto or torch")
