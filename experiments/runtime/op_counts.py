"""What a piece of PyTorch code would launch on a GPU, counted while it runs on the CPU: so a CPU
can check the costs that decide a small kernel's speed on a GPU (launches, bytes moved between
kernels, the largest tensor held, the tiles each Triton kernel walks).

    with count_ops() as counts:
        layer(x).backward(grad)
    counts.launches        # aten ops that launch a device kernel + Triton launches
    counts.glue_bytes      # bytes read and written by the aten ops that are neither matrix products nor attention
    counts.largest         # the largest tensor any op created: bytes, shape, dtype, op
    counts.triton          # each Triton launch: kernel, grid, its integer keyword arguments (tiles)
    counts.reported        # the kernels.counters.Launch records the launch sites reported
    print(counts.format())

An aten op is seen as PyTorch's dispatcher hands it to a device backend (a TorchDispatchMode), so
what autograd does (each backward formula, a checkpoint's recomputation, gradient sums) is counted,
and so is every op inside a torch.autograd.Function's forward and backward. A custom op
(torch.library.custom_op, triton_op) is not a launch itself: its implementation runs with the
counter still on, so its aten ops and Triton kernels count as they would on a GPU. Each counted op
is one launch; some launch more on CUDA (a sort or top-k a few, logsumexp about four, a cuBLAS
product with split-K two), so the count is a floor.

What launches nothing: views and metadata changes (view, transpose, expand, select, slice, detach,
_unsafe_view, set_, ...), allocations (empty, empty_like, empty_strided: no kernel fills them),
and ops that return no tensor. A copy that a reshape or contiguous makes is a `clone` and counts;
so do factory ops that fill memory (zeros, full, arange), fill_ and zero_. Ops whose result the host
must wait for (item, nonzero, a bincount or masked_select sized by data) are counted as syncs too.

Bytes are the distinct elements an op reads and writes (an expanded dimension once), times their
size: each tensor argument read (not the destination of copy_, fill_ or an out= argument, which
are only written) and each tensor result written. Matrix products (mm, bmm, addmm, ...) and fused
attention (SDPA) are counted apart as `matmul_bytes` and `attention_bytes`, so that glue is the
elementwise, copy and reduction traffic between kernels. Triton kernels move their own bytes; they
are not glue.

Triton launches are seen where Triton starts them (JITFunction.run, or the interpreter's under
TRITON_INTERPRET=1), whether or not their launch site reports a Launch; the interpreter's own
copies of the arguments are not counted, nor are an autotuner's benchmark runs, nor what a launch
site does inside kernels.counters.bookkeeping() to report its launch.
"""

import math
import os
import sys
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kernels import counters

ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
# aliases of their input that the schema does not mark as views
VIEWS = {"_unsafe_view", "_reshape_alias", "lift_fresh"}
MATMULS = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "_addmm_activation", "_int_mm",
           "_scaled_mm", "convolution", "convolution_backward"}
ATTENTION_PREFIXES = ("_scaled_dot_product_", "_flash_attention", "_efficient_attention", "_cudnn_attention")
WRITE_ONLY = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_", "exponential_"}
# the host reads a value: a copy back and a wait, no kernel
HOST_READS = {"_local_scalar_dense", "item"}


def op_kind(func) -> str:
    """What an aten op costs on a GPU: "view" (metadata only), "allocation", "none" (neither returns
    nor writes a tensor), "host" (the host reads a value), or a launch: "matmul", "attention" or
    "glue" (an in-place foreach op returns nothing and launches)."""
    name = op_name(func)
    if name in HOST_READS:
        return "host"
    if func.is_view or name in VIEWS or torch.Tag.inplace_view in func.tags:
        return "view"
    if name in ALLOCATIONS:
        return "allocation"
    returns = any("Tensor" in str(r.type) for r in func._schema.returns)
    if not (returns or any(map(_writes, func._schema.arguments)) or torch.Tag.data_dependent_output in func.tags):
        return "none"
    if name in MATMULS:
        return "matmul"
    if name.startswith(ATTENTION_PREFIXES):
        return "attention"
    return "glue"


def op_name(func) -> str:
    """The op without its namespace and overload: "add" for aten.add.Tensor."""
    return func._schema.name.split("::")[-1]


def syncs(func) -> bool:
    """Whether the host must wait for the op's result on a GPU (a value it reads, or an output
    sized by the data)."""
    return bool({torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape} & set(func.tags))


def distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements a tensor addresses, each once (a dimension of stride 0 counts once)."""
    if t.numel() == 0:
        return 0
    return math.prod(size for size, stride in zip(t.shape, t.stride()) if stride != 0) * t.element_size()


@dataclass(frozen=True)
class Intermediate:
    bytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    op: str


@dataclass(frozen=True)
class TritonLaunch:
    kernel: str  # the jitted function's name
    grid: tuple[int, ...]  # programs along each axis
    meta: tuple[tuple[str, int], ...]  # its integer keyword arguments (tile sizes, flags), as passed


@dataclass
class OpCounts:
    """What one block of code launched: filled while count_ops() is open."""

    aten: Counter = field(default_factory=Counter)  # launches by aten op
    glue_by_op: Counter = field(default_factory=Counter)  # glue bytes by aten op
    syncs: Counter = field(default_factory=Counter)  # host waits by aten op
    matmul_bytes: int = 0
    attention_bytes: int = 0
    largest: Optional[Intermediate] = None
    triton: list[TritonLaunch] = field(default_factory=list)
    reported: list[counters.Launch] = field(default_factory=list)

    @property
    def aten_launches(self) -> int:
        return sum(self.aten.values())

    @property
    def launches(self) -> int:
        return self.aten_launches + len(self.triton)

    @property
    def glue_bytes(self) -> int:
        return sum(self.glue_by_op.values())

    def unreported(self) -> list[TritonLaunch]:
        """The Triton launches no Launch record accounts for (matched by grid)."""
        grids = Counter(tuple(launch.grid) for launch in self.reported)
        missing = []
        for launch in self.triton:
            if grids[launch.grid]:
                grids[launch.grid] -= 1
            else:
                missing.append(launch)
        return missing

    def format(self, io_bytes: Optional[int] = None, q_bytes: Optional[int] = None, top: int = 8) -> str:
        """A table: launches, syncs, bytes (glue against `io_bytes`, the layer's q, k, v and output),
        the largest intermediate (against `q_bytes`), the ops with most launches, one line per
        Triton launch."""
        mib = 2**20
        glue = f"{self.glue_bytes / mib:,.2f} MiB" + (f" ({self.glue_bytes / io_bytes:.2f}x q, k, v, out)"
                                                       if io_bytes else "")
        lines = [f"launches {self.launches:,} (aten {self.aten_launches:,}, Triton {len(self.triton):,}); "
                 f"host syncs {sum(self.syncs.values()):,}" + (f" ({_listed(self.syncs)})" if self.syncs else ""),
                 f"glue {glue}; matmul {self.matmul_bytes / mib:,.2f} MiB; attention (aten) "
                 f"{self.attention_bytes / mib:,.2f} MiB"]
        if self.largest is not None:
            ratio = f" ({self.largest.bytes / q_bytes:.2f}x q)" if q_bytes else ""
            lines.append(f"largest intermediate {self.largest.bytes / mib:,.2f} MiB{ratio}: {self.largest.op} "
                         f"{list(self.largest.shape)} {str(self.largest.dtype).removeprefix('torch.')}")
        if self.aten:
            lines.append(f"most launches: {_listed(Counter(dict(self.aten.most_common(top))))}")
        if self.glue_by_op:
            lines.append(f"most glue: {', '.join(f'{op} {b / mib:,.2f} MiB' for op, b in self.glue_by_op.most_common(top))}")
        for launch in self.reported:
            pairs = f"visited/needed {launch.visited / launch.needed:.2f}" if launch.needed else "not attention"
            lines.append(f"  triton {launch.kernel:<24} grid {str(tuple(launch.grid)):<16} "
                         f"{launch.rows:>4} rows x {launch.keys:<4} keys  {pairs}")
        for launch in self.unreported():
            meta = " ".join(f"{name}={value}" for name, value in launch.meta)
            lines.append(f"  triton {launch.kernel:<24} grid {str(launch.grid):<16} no Launch reported ({meta})")
        return "\n".join(lines)


def _listed(counts: Counter) -> str:
    return ", ".join(f"{op} {n}" for op, n in counts.most_common())


class _Counter(TorchDispatchMode):
    """Counts each aten op the dispatcher hands to a backend into `counts`."""

    def __init__(self, counts: OpCounts):
        super().__init__()
        self.counts = counts
        self.paused = 0  # inside a Triton launch: the interpreter's own copies are not the program's

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counted = not (self.paused or counters.in_bookkeeping())
        if func.namespace not in ("aten", "prims") and counted:
            return self._custom_op(func, args, kwargs)
        result = func(*args, **kwargs)
        if counted:
            self._count(func, args, kwargs, result)
        return result

    def _custom_op(self, func, args, kwargs):
        """Run a custom op's implementation with the counter on, so its inner ops count."""
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not tensors:
            return func(*args, **kwargs)
        keys = torch._C._dispatch_keys(tensors[0])
        for t in tensors[1:]:
            keys = keys | torch._C._dispatch_keys(t)
        below = keys & torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)
        with self:
            return func.redispatch(below, *args, **kwargs)

    def _count(self, func, args, kwargs, result) -> None:
        kind = op_kind(func)
        name = op_name(func)
        if syncs(func):
            self.counts.syncs[name] += 1
        if kind in ("view", "none", "host"):
            return
        outputs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        if not any(map(_writes, func._schema.arguments)):  # a new tensor (an in-place op's result is its argument)
            for t in outputs:
                size = t.numel() * t.element_size()
                if self.counts.largest is None or size > self.counts.largest.bytes:
                    self.counts.largest = Intermediate(size, tuple(t.shape), t.dtype, name)
        if kind == "allocation":
            return
        self.counts.aten[name] += 1
        moved = sum(map(distinct_bytes, [*_read(func, args, kwargs), *_written(func, args, kwargs, outputs)]))
        if kind == "matmul":
            self.counts.matmul_bytes += moved
        elif kind == "attention":
            self.counts.attention_bytes += moved
        else:
            self.counts.glue_by_op[name] += moved


def _read(func, args, kwargs) -> list[torch.Tensor]:
    """The tensor arguments an op reads: all but those it only writes (copy_'s and fill_'s
    destination, out= arguments)."""
    write_only = op_name(func) in WRITE_ONLY
    return [t for arg, value in _arguments(func, args, kwargs) if not (_writes(arg) and (write_only or arg.is_out))
            for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _written(func, args, kwargs, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors an op writes: its results, or, for an in-place op that returns nothing (the
    foreach ops), the arguments it writes."""
    return outputs or [t for arg, value in _arguments(func, args, kwargs) if _writes(arg)
                       for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _arguments(func, args, kwargs) -> list[tuple[Any, Any]]:
    """(schema argument, value) of each argument passed."""
    schema = func._schema.arguments
    return [*zip(schema, args), *((arg, kwargs[arg.name]) for arg in schema if arg.name in kwargs)]


def _writes(arg) -> bool:
    return arg.alias_info is not None and arg.alias_info.is_write


@contextmanager
def count_ops() -> Iterator[OpCounts]:
    """Count what the code in the block would launch on a GPU (see the module's docstring)."""
    counts = OpCounts()
    mode = _Counter(counts)
    with ExitStack() as stack:
        counts.reported = stack.enter_context(counters.recording())
        for cls in _triton_launchers():
            stack.enter_context(_watching_launches(cls, mode))
        stack.enter_context(_quiet_autotuning(mode))
        stack.enter_context(mode)
        yield counts


def _triton_launchers() -> list[type]:
    """The classes whose `run` starts a Triton kernel (compiled, and interpreted)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:  # no Triton here: nothing to watch
        return []
    return [JITFunction, InterpretedFunction]


@contextmanager
def _watching_launches(cls: type, mode: _Counter) -> Iterator[None]:
    """Record each launch of a `cls` kernel into mode.counts, and stop counting aten ops while it runs."""
    original = cls.run

    def run(kernel, *args, grid, warmup, **kwargs):
        if warmup or mode.paused:
            return original(kernel, *args, grid=grid, warmup=warmup, **kwargs)
        if callable(grid):  # a grid computed from the arguments, as Triton calls it
            grid = grid(dict(zip(kernel.arg_names, args), **kwargs))
        meta = tuple((name, value) for name, value in kwargs.items() if isinstance(value, int))
        mode.counts.triton.append(TritonLaunch(kernel.__name__, tuple(int(g) for g in grid), meta))
        mode.paused += 1
        try:
            return original(kernel, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            mode.paused -= 1

    cls.run = run
    try:
        yield
    finally:
        cls.run = original


@contextmanager
def _quiet_autotuning(mode: _Counter) -> Iterator[None]:
    """An autotuner's trial runs of its configs are not the program's launches."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        yield
        return
    original = Autotuner._bench

    def bench(*args: Any, **kwargs: Any):
        mode.paused += 1
        try:
            return original(*args, **kwargs)
        finally:
            mode.paused -= 1

    Autotuner._bench = bench
    try:
        yield
    finally:
        Autotuner._bench = original


def interpret_triton_here() -> Optional[str]:
    """On a machine without CUDA, have Triton kernels run in Triton's interpreter on CPU tensors:
    set TRITON_INTERPRET=1, which Triton reads as it defines each kernel, its own library's at its
    import (so call this before anything imports triton: torch.utils.flop_counter does). -> None,
    or one line saying why it cannot."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if "triton" in sys.modules:
        return "no CUDA here and Triton is already imported to compile for a GPU: set TRITON_INTERPRET=1"
    os.environ["TRITON_INTERPRET"] = "1"
    return None
