"""Span attention: each query attends, with every query head of its GQA group, to a few spans of
keys [start, end) of its own (NSA's sliding window and its selected blocks in training).

    naive.py          dense attention masked to the spans: the definition the kernel must match
    span_attention.c  the CPU kernel: one pass per query over its spans, keys read where they lie

The C kernel is compiled with the machine's C compiler the first time it is needed (about a
second), for this CPU (-march=native), into a cache keyed by the source, the flags and the CPU's
feature flags, so a cache shared between different CPUs never serves the wrong build. Where no
compiler works, `available()` is False and callers keep their PyTorch path.
"""

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

import torch
from torch import Tensor

_SOURCE = Path(__file__).with_name("span_attention.c")
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd", "-shared", "-fPIC", "-pthread"]
_TILE = 16  # keys per transposed tile, as TILE in span_attention.c
# element types the kernel runs in fp32 without losing what the caller asked for
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available() -> bool:
    """Whether the CPU kernel is built (or can be built) here."""
    return _library() is not None


def span_attention(q: Tensor, k: Tensor, v: Tensor, spans: Tensor, weights: Optional[Tensor] = None
                   ) -> tuple[Tensor, Tensor]:
    """Attention of each query over the keys of its spans, on the CPU kernel.

    q        [batch_kv, group, seq_q, dim_head]  queries of one GQA group (batch * kv_heads first)
    k, v     [batch_kv, seq_k, dim_head]
    spans    [batch_kv, seq_q, slots, 2] or [seq_q, slots, 2] (the same for every batch_kv): int32
             (start, end) key ranges per query; end <= start leaves a slot unused. Spans must not
             overlap, and causality is the caller's: a span holds only keys the query may see.
    weights  [batch_kv, seq_q, slots] or None: slot s's share of the output is multiplied by
             weights[..., s] (the probabilities stay those of one softmax over all slots)
    returns  out [batch_kv, group, seq_q, dim_head] in q's dtype, and the log-sum-exp
             [batch_kv, group, seq_q] in fp32, so that attentions over disjoint keys merge exactly.
             A query with no key gets zeros and a log-sum-exp of -inf.

    Computed in fp32 whatever the inputs' dtype (one of KERNEL_DTYPES).
    """
    if _library() is None:
        raise RuntimeError("the span-attention CPU kernel could not be built here (no working C compiler)")
    out, lse = _SpanAttention.apply(q.float(), k.float(), v.float(), spans.to(torch.int32).contiguous(),
                                    None if weights is None else weights.float())
    return out.to(q.dtype), lse


def _pointer(t: Optional[Tensor]):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


class _SpanAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spans, weights):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        weights = None if weights is None else weights.contiguous()
        bh, g, m, d = q.shape
        out, lse = torch.empty_like(q), q.new_empty(bh, g, m)
        ctx.shape = _shape(q, k, spans)
        k_t = _tiles(k)  # held here: a pointer does not keep its tensor alive
        status = _library().span_attention_forward(
            _pointer(q), _pointer(k_t), _pointer(v), _pointer(spans), _pointer(weights), _pointer(out),
            _pointer(lse), *ctx.shape, ctypes.c_float(d**-0.5), torch.get_num_threads())
        if status:
            raise MemoryError("span attention: a thread could not allocate its scores")
        ctx.save_for_backward(q, k, v, spans, weights, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, spans, weights, lse = ctx.saved_tensors
        d = q.shape[-1]
        threads = torch.get_num_threads()
        dout = dout.float().contiguous()
        dlse = None if dlse is None else dlse.float().contiguous()
        dq = torch.empty_like(q)
        dk, dv = (k.new_zeros(threads, *k.shape) for _ in range(2))  # one buffer per thread: no races
        dweights = None if weights is None else torch.zeros_like(weights)
        k_t, v_t = _tiles(k), _tiles(v)
        status = _library().span_attention_backward(
            _pointer(q), _pointer(k), _pointer(k_t), _pointer(v_t), _pointer(spans), _pointer(weights),
            _pointer(lse), _pointer(dout), _pointer(dlse), _pointer(dq), _pointer(dk), _pointer(dv), _pointer(dweights),
            *ctx.shape, ctypes.c_float(d**-0.5), threads)
        if status:
            raise MemoryError("span attention: a thread could not allocate its probabilities")
        return dq, dk.sum(0), dv.sum(0), None, dweights


def _tiles(x: Tensor) -> Tensor:
    """[bh, n, d] -> [bh, n / TILE, d, TILE] (n zero-padded to a multiple of TILE): the kernel's
    transposed tiles of keys."""
    bh, n, d = x.shape
    x = torch.nn.functional.pad(x, (0, 0, 0, (-n) % _TILE))
    return x.view(bh, -1, _TILE, d).transpose(-1, -2).contiguous()


def _shape(q: Tensor, k: Tensor, spans: Tensor) -> tuple:
    """The kernel's size arguments: bh, g, m, d, n, slots, the most keys one query sees, shared."""
    bh, g, m, d = q.shape
    lengths = (spans[..., 1] - spans[..., 0]).clamp(min=0).sum(-1)
    max_keys = int(lengths.max()) if lengths.numel() else 0
    return (bh, g, m, d, k.shape[1], spans.shape[-2], max_keys, int(spans.dim() == 3))


@lru_cache(maxsize=None)
def _library() -> Optional[ctypes.CDLL]:
    """The compiled kernel, built into the cache on first use; None where it cannot be built."""
    if platform.system() != "Linux" and platform.system() != "Darwin":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    key = hashlib.sha256(b"\0".join([_SOURCE.read_bytes(), " ".join([compiler, *_FLAGS]).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    path = _cache_dir() / f"span_attention-{key}.so"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                built = Path(tmp) / path.name
                subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"], check=True,
                               capture_output=True, timeout=120)
                os.replace(built, path)  # atomic: concurrent runs of a sweep never load half a file
        except (OSError, subprocess.SubprocessError):
            return None
    try:
        library = ctypes.CDLL(str(path))
    except OSError:
        return None
    int64, pointer = ctypes.c_int64, ctypes.c_void_p
    sizes = [int64] * 7 + [ctypes.c_int, ctypes.c_float, ctypes.c_int]
    library.span_attention_forward.argtypes = [pointer] * 7 + sizes
    library.span_attention_backward.argtypes = [pointer] * 13 + sizes
    library.span_attention_forward.restype = library.span_attention_backward.restype = ctypes.c_int
    return library


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "sparse-attention-experiments" / "kernels"


def _cpu_flags() -> str:
    """The CPU's model and feature flags (the build is -march=native), from /proc/cpuinfo where it exists."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))
