"""The project's C kernels (a `.c` file in a kernel's package, sharing `native.h`), compiled with
the machine's C compiler the first time one is needed (about a second) for this CPU
(-march=native), into a cache keyed by the sources, the flags and the CPU's model and feature
flags, so a cache shared between different CPUs never serves the wrong build. Where no compiler
works, `load` returns None and callers keep their PyTorch path."""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Optional

from torch import Tensor

_HEADER = Path(__file__).with_name("native.h")
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC"]
_OPENMP = ["-fopenmp"]  # rows on PyTorch's OpenMP threads (native.h's run_rows)
_POSIX_THREADS = ["-fopenmp-simd", "-pthread"]
TILE = 16  # keys per transposed tile, as TILE in native.h


def pointer(t: Optional[Tensor]):
    """A tensor's data for a C argument; the caller keeps the tensor alive while C runs."""
    return None if t is None else ctypes.c_void_p(t.data_ptr())


@lru_cache(maxsize=None)
def load(source: Path, signatures: tuple[tuple[str, int, int], ...]) -> Optional[ctypes.CDLL]:
    """The compiled `source`, built into the cache on first use; None where it cannot be built.
    signatures: (function, number of pointer arguments, number of int64 arguments) for functions
    that take pointers, then int64 sizes, then (float scale, int threads), and return int status."""
    if platform.system() not in ("Linux", "Darwin"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    threading = [_OPENMP, _POSIX_THREADS] if _torch_libgomp_loaded() else [_POSIX_THREADS]
    library = next(filter(None, (_build(compiler, source, [*_FLAGS, *flags]) for flags in threading)), None)
    if library is None:
        return None
    for name, pointers, sizes in signatures:
        function = getattr(library, name)
        function.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * sizes + [ctypes.c_float, ctypes.c_int]
        function.restype = ctypes.c_int
    return library


@lru_cache(maxsize=None)
def load_torch_library(source: Path) -> Optional[ctypes.CDLL]:
    """The C++ `source`, built against this PyTorch's headers and linked to its c10 (cached by
    PyTorch's version too); None where no C++ compiler builds it."""
    import torch

    installed = Path(torch.__file__).parent  # its headers and libraries, as the wheel lays them out
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if platform.system() != "Linux" or compiler is None:
        return None
    flags = ["-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             f"-I{installed / 'include'}"]
    libraries = (f"-L{installed / 'lib'}", "-lc10", f"-Wl,-rpath,{installed / 'lib'}")
    return _build(compiler, source, flags, libraries, salt=torch.__version__)


def rows_as_they_lie(x: Tensor) -> Tensor:
    """x with its last dimension contiguous, as the kernels read rows: a view of a projection as it
    is, a copy only where the last dimension is strided."""
    return x if x.stride(-1) == 1 else x.contiguous()


def row_strides(x: Tensor, split: bool) -> tuple[int, ...]:
    """Where the kernels find each row of x: (heads, batch stride, head stride, then the strides of
    the dimensions between the heads and the last), for leading dimensions [batch, heads] (split)
    or [batch * heads]. Row (b, ...) of batch * head b is at (b / heads) batch stride + (b % heads)
    head stride + ..."""
    if split:
        return (x.shape[1], *x.stride()[:-1])
    return (1, x.stride(0), 0, *x.stride()[1:-1])


def transposed_tiles(x: Tensor) -> Tensor:
    """[..., n, d] -> [..., n / TILE, d, TILE] (n zero-padded to a multiple of TILE): keys in the
    layout native.h's tile_scores reads; x may be any strided view."""
    n, d = x.shape[-2:]
    whole = n - n % TILE
    tiles = x.new_empty(*x.shape[:-2], -(-n // TILE), d, TILE)  # one copy of x, written straight into its layout
    tiles[..., : whole // TILE, :, :] = x[..., :whole, :].unflatten(-2, (-1, TILE)).transpose(-1, -2)
    if whole < n:  # the last, partial tile: its keys, then zeros
        tiles[..., -1, :, :].zero_()
        tiles[..., -1, :, : n - whole] = x[..., whole:, :].transpose(-1, -2)
    return tiles


def _build(compiler: str, source: Path, flags: list[str], libraries: tuple[str, ...] = ("-lm",),
           salt: str = "") -> Optional[ctypes.CDLL]:
    """`source` built with `flags` and linked with `libraries` (cached) and loaded; None where that fails."""
    key = hashlib.sha256(b"\0".join([source.read_bytes(), _HEADER.read_bytes(),
                                     " ".join([compiler, *flags, *libraries, salt]).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    path = cache_root() / "kernels" / f"{source.stem}-{key}.so"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                built = Path(tmp) / path.name
                subprocess.run([compiler, *flags, f"-I{_HEADER.parent}", str(source), "-o", str(built), *libraries],
                               check=True, capture_output=True, timeout=120)
                os.replace(built, path)  # atomic: concurrent runs of a sweep never load half a file
        except (OSError, subprocess.SubprocessError):
            return None
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        return None


def _torch_libgomp_loaded() -> bool:
    """Whether this process holds a libgomp.so.1 (PyTorch's OpenMP runtime on Linux): a kernel
    built with -fopenmp then binds to that same runtime, by its soname, instead of loading a
    second one whose threads would compete with PyTorch's."""
    try:
        with open("/proc/self/maps") as maps:
            return any(line.rstrip().endswith("/libgomp.so.1") for line in maps)
    except OSError:
        return False


def cache_root() -> Path:
    """Where what this machine has built or measured is kept: $XDG_CACHE_HOME or ~/.cache."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sparse-attention-experiments"


def _cpu_flags() -> str:
    """The CPU's model and feature flags (the build is -march=native), from /proc/cpuinfo where it exists."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))
