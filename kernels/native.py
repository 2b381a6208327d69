"""The project's C kernels (a `.c` file in a kernel's package, sharing `native.h`), compiled with
the machine's C compiler the first time one is needed (about a second) for this CPU
(-march=native) or for the target named by $SPARSE_ATTENTION_MARCH (x86-64-v3: AVX2, x86-64-v4:
AVX-512, or any -march value the compiler knows), so that a developer on an AVX-512 machine can
test and time the AVX2 build. The cache is keyed by the sources, the flags (the target among them)
and the CPU's model and feature flags, so a cache shared between different CPUs never serves the
wrong build. A target this CPU cannot run is refused with a RuntimeError, not left to die on an
illegal instruction. Where no compiler works, `load` returns None and callers keep their PyTorch
path."""

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
MARCH_VARIABLE = "SPARSE_ATTENTION_MARCH"  # the build's target: -march=<value>, default native
_OPENMP = ["-fopenmp"]  # rows on PyTorch's OpenMP threads (native.h's run_rows)
_POSIX_THREADS = ["-fopenmp-simd", "-pthread"]
TILE = 16  # keys per transposed tile, as TILE in native.h


def pointer(t: Optional[Tensor]):
    """A tensor's data for a C argument; the caller keeps the tensor alive while C runs."""
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def march() -> str:
    """The target the kernels are built for: $SPARSE_ATTENTION_MARCH, or native."""
    return _checked_march(os.environ.get(MARCH_VARIABLE, ""))


@lru_cache(maxsize=None)  # read on every kernel call (decoding's products: ~25 a token), checked once per value
def _checked_march(setting: str) -> str:
    value = setting.strip() or "native"
    if not all(c.isalnum() or c in "-_.+" for c in value):
        raise ValueError(f"{MARCH_VARIABLE}={value!r} is not a -march value (e.g. native, x86-64-v3, x86-64-v4)")
    return value


def build_flags(target: Optional[str] = None) -> list[str]:
    """The C compiler's flags for the kernels, for `target` (default: march())."""
    # -fno-trapping-math: the kernels read no FP exception flags, and with them GCC 12 would not
    # if-convert exp_nonpositive's select, leaving every softmax loop scalar (values are unchanged)
    return ["-O3", f"-march={target or march()}", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]


def load(source: Path, signatures: tuple[tuple[str, int, int], ...]) -> Optional[ctypes.CDLL]:
    """The compiled `source`, built into the cache on first use for march(); None where it cannot be
    built; RuntimeError where this CPU cannot run that target.
    signatures: (function, number of pointer arguments, number of int64 arguments) for functions
    that take pointers, then int64 sizes, then (float scale, int threads), and return int status."""
    return _load(source, signatures, march())


@lru_cache(maxsize=None)
def _load(source: Path, signatures: tuple[tuple[str, int, int], ...], target: str) -> Optional[ctypes.CDLL]:
    if platform.system() not in ("Linux", "Darwin"):
        return None
    compiler = _compiler()
    if compiler is None:
        return None
    if missing := missing_features(target):
        raise RuntimeError(f"{MARCH_VARIABLE}={target} builds the C kernels for {', '.join(missing)}, which this CPU "
                           f"lacks: unset it, or name a target this CPU runs (x86-64-v3 for AVX2)")
    flags = build_flags(target)
    threading = [_OPENMP, _POSIX_THREADS] if _torch_libgomp_loaded() else [_POSIX_THREADS]
    library = next(filter(None, (_build(compiler, source, [*flags, *extra]) for extra in threading)), None)
    if library is None:
        return None
    for name, pointers, sizes in signatures:
        function = getattr(library, name)
        function.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * sizes + [ctypes.c_float, ctypes.c_int]
        function.restype = ctypes.c_int
    return library


def _compiler() -> Optional[str]:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


# the compiler's macro for each vector ISA the kernels' width follows (native.h's VEC), widest first,
# with the /proc/cpuinfo flag a CPU needs to run it
_ISAS = (("AMX", "__AMX_TILE__", "amx_tile"), ("AVX-512", "__AVX512F__", "avx512f"), ("AVX2", "__AVX2__", "avx2"),
         ("AVX", "__AVX__", "avx"), ("FMA", "__FMA__", "fma"), ("SSE4.2", "__SSE4_2__", "sse4_2"),
         ("NEON", "__ARM_NEON", None))


def isa(target: Optional[str] = None) -> str:
    """What the kernels are (or would be) built for, in words: e.g. "AVX2 (x86-64-v3)", "AVX-512
    (native)"; "no C compiler" where none works."""
    target = target or march()
    compiler = _compiler()
    macros = _macros(compiler, target) if compiler else None
    if macros is None:
        return f"no C compiler ({target})" if compiler is None else f"unknown ISA ({target})"
    widest = next((name for name, macro, _ in _ISAS if macro in macros and name not in ("FMA", "AVX")), None)
    if widest == "AMX":  # AMX tiles beside AVX-512 vectors: the kernels' vectors are AVX-512's
        widest = "AVX-512 + AMX"
    return f"{widest or 'scalar/SSE2'} ({target})"


@lru_cache(maxsize=None)
def _macros(compiler: str, target: str) -> Optional[frozenset[str]]:
    """The macros the compiler predefines for -march=target; None where it refuses the target."""
    try:
        done = subprocess.run([compiler, f"-march={target}", "-dM", "-E", "-x", "c", os.devnull],
                              capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return frozenset(line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define "))


def missing_features(target: str) -> list[str]:
    """The CPU features that a -march=target build uses and this CPU lacks (by /proc/cpuinfo's
    flags; [] for native, or where the flags or the compiler's macros cannot be read)."""
    compiler = _compiler()
    if target == "native" or compiler is None:
        return []
    macros = _macros(compiler, target)
    try:
        flags = set(" ".join(line.split(":", 1)[1] for line in Path("/proc/cpuinfo").read_text().splitlines()
                             if line.split(":")[0].strip() == "flags").split())
    except OSError:
        return []
    if macros is None or not flags:
        return []
    return [flag for _, macro, flag in _ISAS if flag and macro in macros and flag not in flags]


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
    layout native.h's tile_scores_heads reads; x may be any strided view."""
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
    path = cache_path(compiler, source, flags, libraries, salt)
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


def cache_path(compiler: str, source: Path, flags: list[str], libraries: tuple[str, ...] = ("-lm",),
               salt: str = "") -> Path:
    """Where the build of `source` with these flags is cached: keyed by the sources, the whole command
    (the target among the flags) and the CPU."""
    key = hashlib.sha256(b"\0".join([source.read_bytes(), _HEADER.read_bytes(),
                                     " ".join([compiler, *flags, *libraries, salt]).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    return cache_root() / "kernels" / f"{source.stem}-{key}.so"


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
    """The CPU's model and feature flags (a native build depends on them), from /proc/cpuinfo where it exists."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))
