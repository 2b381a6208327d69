"""Every Triton kernel a workload launches, compiled here for a GPU that this machine need not have:
what each program asks of the chip (shared memory, registers, spilled bytes) against its limits,
so that a kernel a GPU would refuse (Triton's OutOfResources) or slow down (spills, one program a
multiprocessor) shows on a CPU.

    python -m experiments.bench.gpu_compile                          # NSA fwd+bwd at the paper and seed settings, bf16
    python -m experiments.bench.gpu_compile --setting count16 --dtype fp32
    python -m experiments.bench.gpu_compile --lm model=nsa model.dim=512 --save .gpu/launches.json
    python -m experiments.bench.gpu_compile --warm .gpu/launches.json      # on the GPU: fill Triton's cache, all cores

`--save` writes the launches recorded here; `--warm` compiles such a file on every core of a GPU
machine before anything is timed there, so that compiling (seconds a kernel, one at a time in the
process that first launches it) is not spent inside a timed stage.

How: the workload runs once at a short length (Triton's interpreter on a machine without CUDA) and
each launch's kernel, argument types, integer values and compile-time constants are recorded
(`capture`); a Python without the interpreter then compiles each distinct one for the target with
Triton's own compiler and reads the cubin's resource use with the cuobjdump Triton ships
(`compile_specs`). The integers are the short run's, so a length-dependent specialization (an
integer divisible by 16, or equal to 1) may differ from a long run's; the tiles, warps and stages,
which decide shared memory and registers, do not depend on the length.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

# Hopper (sm_90, the H100 and H200): what one multiprocessor holds
HOPPER = dict(arch=90, shared_per_program=232_448, shared_per_sm=233_472, registers_per_sm=65_536, warps_per_sm=64)
_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


@dataclass(frozen=True)
class Launch:
    """One kernel as launched: where it is defined, its arguments as (kind, value) pairs (a tensor
    by its dtype, a number by its value) and its keyword arguments (constexprs, warps, stages)."""

    module: str
    kernel: str
    args: tuple
    kwargs: tuple


@dataclass(frozen=True)
class Resources:
    """What one compiled program of a kernel uses: bytes of shared memory Triton allocates, registers
    a thread, local-memory (spilled) bytes a thread, warps, and seconds it took to compile."""

    kernel: str
    warps: int
    stages: int
    shared: int
    registers: int
    spilled: int
    compile_s: float

    def programs_per_sm(self, chip: dict = HOPPER) -> int:
        """Programs one multiprocessor holds at once, as registers, shared memory and warps allow."""
        by_registers = chip["registers_per_sm"] // max(1, self.registers * 32 * self.warps)
        by_shared = chip["shared_per_sm"] // self.shared if self.shared else by_registers
        return min(by_registers, by_shared, chip["warps_per_sm"] // self.warps)

    def refused(self, chip: dict = HOPPER) -> bool:
        """Whether the chip refuses to launch it (more shared memory than a program may have)."""
        return self.shared > chip["shared_per_program"]


def _describe(value: Any) -> tuple:
    import torch

    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype).removeprefix("torch."))
    if isinstance(value, bool) or value is None:
        return ("constant", value)
    if isinstance(value, (int, float)):
        return (type(value).__name__, value)
    raise TypeError(f"a kernel argument of type {type(value).__name__} cannot be recorded")


@contextmanager
def capture() -> Iterator[list[Launch]]:
    """Record the distinct Triton launches made inside (run by Triton's interpreter or on a GPU).
    In the interpreter, bf16 tiles take tl.dot as on a GPU (kernels/triton_tiles.py otherwise sums
    them there, numpy having no bf16): the launches are a GPU's, their values are not checked."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from kernels import triton_tiles

    launches: list[Launch] = []
    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def recording(cls):
        def run(kernel, *args, grid, warmup, **kwargs):
            if not warmup:
                fn = getattr(kernel, "fn", kernel)
                launch = Launch(fn.__module__, fn.__name__, tuple(_describe(a) for a in args),
                                tuple(sorted((k, _describe(v)) for k, v in kwargs.items())))
                if launch not in launches:
                    launches.append(launch)
            return originals[cls](kernel, *args, grid=grid, warmup=warmup, **kwargs)
        return run

    interpreting = triton_tiles.triton_interpreting
    triton_tiles.triton_interpreting = lambda: False
    for cls in originals:
        cls.run = recording(cls)
    try:
        yield launches
    finally:
        triton_tiles.triton_interpreting = interpreting
        for cls, run in originals.items():
            cls.run = run


def compile_specs(launches: Sequence[Launch], arch: int = HOPPER["arch"], jobs: int = 0) -> list[Resources]:
    """Each launch compiled for sm_<arch> in Pythons without Triton's interpreter, `jobs` at a time
    (0: one a core), in the order given."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(launches)))
    with tempfile.TemporaryDirectory() as folder:
        shares = [launches[i::jobs] for i in range(jobs)]
        paths = [Path(folder) / f"launches{i}.json" for i in range(jobs)]
        for path, share in zip(paths, shares):
            save(share, path)
        children = [subprocess.Popen([sys.executable, "-m", "experiments.bench.gpu_compile", "--compile", str(path),
                                      "--arch", str(arch)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True) for path in paths]
        for child in children:
            _, stderr = child.communicate()
            if child.returncode:
                raise RuntimeError(f"compiling for sm_{arch} failed:\n{stderr[-4000:]}")
        done = [[Resources(**r) for r in json.loads(path.with_suffix(".out").read_text())] for path in paths]
    return [done[i % jobs][i // jobs] for i in range(len(launches))]


def save(launches: Sequence[Launch], path: Path) -> None:
    path.write_text(json.dumps([asdict(launch) for launch in launches]))


def load(path: Path) -> list[Launch]:
    return [Launch(d["module"], d["kernel"], tuple(map(tuple, d["args"])), tuple((k, tuple(v)) for k, v in d["kwargs"]))
            for d in json.loads(path.read_text())]


class _Target:
    """Triton's driver interface, as far as compiling (not launching) for a chosen GPU needs it."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: Optional[int] = None) -> int:
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


def _compile_one(launch: Launch) -> Resources:
    import importlib

    import torch

    kernel = getattr(importlib.import_module(launch.module), launch.kernel)
    args = [torch.empty(16, dtype=getattr(torch, value)) if kind == "tensor" else value for kind, value in launch.args]
    kwargs = {name: value for name, (kind, value) in launch.kwargs}
    started = time.perf_counter()
    compiled = kernel.warmup(*args, grid=(1,), **kwargs)
    seconds = time.perf_counter() - started
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run([_cuobjdump(), "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                                check=True).stdout
    registers, stack, _, local = (int(x) for x in _RESOURCES.search(report).groups())
    return Resources(launch.kernel, compiled.metadata.num_warps, compiled.metadata.num_stages,
                     compiled.metadata.shared, registers, max(stack, local), round(seconds, 2))


def _cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def _compile_file(path: Path, arch: int) -> None:
    from triton.runtime import driver

    driver.set_active(_Target(arch))
    path.with_suffix(".out").write_text(json.dumps([asdict(_compile_one(launch)) for launch in load(path)]))


def nsa_workload(setting: dict, n: int, dtype) -> Callable[[], None]:
    """One NSA layer (kernel=triton) at `setting`: forward and backward, then a no-grad forward, of
    n random tokens."""
    import torch

    from experiments.bench.layers import nsa_layer

    def run() -> None:
        torch.manual_seed(0)
        layer = nsa_layer("triton", setting).to(dtype)
        x = torch.randn(1, n, setting["dim"], dtype=dtype, requires_grad=True)
        layer(x).sum().backward()
        with torch.no_grad():
            layer(x)

    return run


def lm_workload(overrides: Sequence[str], n: int, dtype) -> Callable[[], None]:
    """The LM that conf/ composes from `overrides` (kernel=triton): a training step's forward and
    backward of n random tokens under autocast to `dtype` (as train.py runs it), then a no-grad
    forward."""
    import torch
    import torch.nn.functional as F

    from experiments.bench.gpu_report import configured_lm

    def run() -> None:
        from hydra.utils import instantiate

        _, cfg = configured_lm(*overrides, "model.kernel=triton")
        torch.manual_seed(0)
        model = instantiate(cfg.model)  # configured_lm's build would take the torch path on a CPU
        x = torch.randint(0, cfg.model.num_tokens, (1, n + 1))
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            F.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten()).backward()
            with torch.no_grad():
                model(x[:, :-1])

    return run


def table(resources: Sequence[Resources], chip: dict = HOPPER) -> str:
    rows = [f"{'kernel':<28} {'warps':>5} {'stages':>6} {'shared KB':>9} {'regs':>5} {'spilled B':>9} "
            f"{'programs/SM':>11} {'compile s':>9}"]
    for r in resources:
        flag = "  REFUSED: over the chip's shared memory" if r.refused(chip) else ""
        rows.append(f"{r.kernel:<28} {r.warps:>5} {r.stages:>6} {r.shared / 1024:>9.1f} {r.registers:>5} "
                    f"{r.spilled:>9} {r.programs_per_sm(chip):>11} {r.compile_s:>9.2f}{flag}")
    return "\n".join(rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", nargs="*", default=["paper", "small"],
                        help="experiments/bench/layers.py SETTINGS (one NSA layer each)")
    parser.add_argument("--lm", nargs="+", metavar="OVERRIDE", help="also the LM these conf/ overrides compose")
    parser.add_argument("--dtype", nargs="+", default=["bf16"], choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--tokens", type=int, default=128, help="the short run's length (any that meets each branch)")
    parser.add_argument("--arch", type=int, default=HOPPER["arch"], help="compute capability x 10 (90: Hopper)")
    parser.add_argument("--jobs", type=int, default=0, help="compiles at a time (0: one a core)")
    parser.add_argument("--save", type=Path, help="also write the recorded launches to this file")
    parser.add_argument("--warm", type=Path, help="compile the launches a --save wrote, and nothing else")
    parser.add_argument("--compile", type=Path, help=argparse.SUPPRESS)  # the compiling child's input
    args = parser.parse_args(argv)
    if args.compile:
        _compile_file(args.compile, args.arch)
        return 0
    if args.warm:
        if not args.warm.is_file():
            print(f"gpu_compile: error: --warm {args.warm}: no such file (write one with --save)", file=sys.stderr)
            return 2
        started = time.perf_counter()
        resources = compile_specs(load(args.warm), args.arch, args.jobs)
        print(f"{len(resources)} kernels compiled for sm_{args.arch} in {time.perf_counter() - started:.0f} s")
        return 0

    from experiments.runtime.op_counts import interpret_triton_here

    problem = interpret_triton_here()
    if problem:
        print(f"gpu_compile: error: {problem}", file=sys.stderr)
        return 2
    import torch

    from experiments.bench.layers import SETTINGS, describe

    unknown = sorted(set(args.setting) - set(SETTINGS))
    if unknown:
        print(f"gpu_compile: error: --setting {' '.join(unknown)}: not one of {', '.join(SETTINGS)}", file=sys.stderr)
        return 2
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    workloads = [(describe(name, SETTINGS[name]), lambda dtype, name=name: nsa_workload(SETTINGS[name], args.tokens,
                                                                                         dtype)) for name in args.setting]
    if args.lm:
        workloads.append((f"LM {' '.join(args.lm)}", lambda dtype: lm_workload(args.lm, args.tokens, dtype)))
    refused, everything = False, []
    for title, workload in workloads:
        for dtype in args.dtype:
            with capture() as launches:
                workload(dtypes[dtype])()
            everything += [launch for launch in launches if launch not in everything]
            resources = compile_specs(launches, args.arch, args.jobs)
            refused |= any(r.refused() for r in resources)
            print(f"\n{title}; {dtype}, compiled for sm_{args.arch}")
            print(table(resources), flush=True)
    if args.save:
        save(everything, args.save)
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
