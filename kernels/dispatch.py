"""The one rule that picks how a kernel package runs, used by every package's operator:

    triton  compiled Triton kernels: on CUDA tensors (kernel auto or triton), or anywhere Triton
            runs when asked for (kernel triton: its interpreter on a CPU, TRITON_INTERPRET=1)
    cpu     the package's C kernel: CPU tensors of a dtype it computes in fp32 without loss, where
            a C compiler built it (kernel auto or cpu)
    torch   plain PyTorch, the readable path: kernel torch, and whatever the others do not take

`model.kernel` forces one (`torch` means torch everywhere); `auto` takes the fastest that runs.
Asked for a path that cannot run, `choose` refuses in one line saying why and what to set; `auto`
falls back to torch instead. Nothing here imports Triton: the project imports and runs (on its C
kernels and torch) where Triton is not installed.
"""

import importlib.util
import os
from typing import Callable, Optional

import torch

KERNELS = ("auto", "torch", "cpu", "triton")
C_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # computed in fp32 without loss


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a module set to None
        return False


TRITON_INSTALLED = _installed("triton")  # looked up once, without importing Triton


def constant_result(fn: Callable) -> Callable:
    """torch.compiler.assume_constant_result's mark (torch.compile calls fn once and uses its answer,
    never tracing into the compiler's files it reads), set without importing Dynamo: the decorator
    imports it, ~2 s at every process's start, and most processes never compile.
    tests/kernels/test_dispatch.py checks that the mark is torch's own."""
    fn._dynamo_marked_constant = True
    return fn


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors) rather than compiling them."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_runnable() -> bool:
    """Whether Triton kernels can run here: Triton installed, and CUDA or its interpreter."""
    return TRITON_INSTALLED and (torch.cuda.is_available() or triton_interpreting())


def power_of_two(name: str, value: int, high: int, low: Optional[int] = None) -> Optional[str]:
    """What a kernel needs of `name`=value as a tile side (a power of two, from low, up to high),
    phrased to follow "needs", or None where it has it."""
    if (low is None or value >= low) and value <= high and value > 0 and not value & (value - 1):
        return None
    return f"{name}={value} to be a power of two " + (f"from {low} to {high}" if low else f"up to {high}")


def group_at_most(group: int, high: int = 64) -> Optional[str]:
    """What the group-centric kernels (registers for `high` rows) need of the GQA group, phrased to
    follow "needs", or None."""
    return f"the GQA group (heads / kv_heads = {group}) to be at most {high}" if group > high else None


def check(kernel: str, what: str, triton_problem: Optional[str] = "no Triton kernel",
          cpu_built: Optional[Callable[[], bool]] = None) -> None:
    """Refuse, in one line before any work, a `kernel` that cannot run here: kernel=cpu where `what`
    has no C kernel or no compiler built it, kernel=triton where its kernels cannot take the shape
    (triton_problem) or Triton cannot run."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} must be one of {', '.join(KERNELS)}: set model.kernel")
    if kernel == "cpu" and cpu_built is None:
        raise ValueError(f"kernel=cpu: {what} has no C kernel; use model.kernel=auto, torch or triton")
    if kernel == "cpu" and not cpu_built():
        raise ValueError("kernel=cpu needs a working C compiler (cc or $CC) to build the CPU kernels: "
                         "install gcc, or use model.kernel=auto or torch")
    if kernel == "triton" and (problem := triton_problem or triton_missing()):
        raise ValueError(f"kernel=triton needs {problem}: use model.kernel=auto or torch")


def choose(x: torch.Tensor, kernel: str, triton_problem: Optional[str] = "no Triton kernel",
           cpu_built: Optional[Callable[[], bool]] = None, what: str = "this attention") -> str:
    """How to run on x under model.kernel `kernel`: "triton", "cpu" or "torch" (the module's rule).

    triton_problem: what the package's Triton kernels need that this shape lacks, phrased to follow
    "needs" (None: they take it);
    cpu_built: whether the package's C kernel is built here (None: the package has none)."""
    check(kernel, what, triton_problem if kernel == "triton" else None, cpu_built)
    if kernel == "torch":
        return "torch"
    if kernel == "triton" or (kernel == "auto" and x.is_cuda):
        problem = triton_problem or triton_missing(x)
        if problem is None:
            return "triton"
        if kernel == "triton":
            raise ValueError(f"kernel=triton needs {problem}: use model.kernel=auto or torch")
        return "torch"
    c_kernel_takes = x.device.type == "cpu" and x.dtype in C_KERNEL_DTYPES
    return "cpu" if cpu_built is not None and c_kernel_takes and cpu_built() else "torch"


def triton_missing(x: Optional[torch.Tensor] = None) -> Optional[str]:
    """What keeps Triton kernels from running on x here (one phrase), or None."""
    if not TRITON_INSTALLED:
        return "Triton installed (pip install triton, on Linux)"
    if x is not None and not (x.is_cuda or triton_interpreting()) or x is None and not triton_runnable():
        return "a CUDA device (or TRITON_INTERPRET=1 to run the kernels slowly on the CPU)"
    return None


def refuse(kernel: str, x: torch.Tensor, *problems: Optional[str]) -> None:
    """One ValueError naming every problem (None: none; each phrased to follow "needs") that keeps the
    Triton `kernel` from running on x here, and what to do instead; nothing if there is none."""
    found = [problem for problem in (*problems, triton_missing(x)) if problem]
    if found:
        raise ValueError(f"the Triton {kernel} kernel needs " + "; ".join(found) + ": use model.kernel=torch")
