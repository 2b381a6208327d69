"""What the process does with freed CPU memory: give it back to the system, or keep it for the next
step (`trainer.cpu_allocator`; the benchmark's children set it from the same key).

    system   glibc's defaults: a block above its threshold (which grows to at most 32 MB) is mapped
             on its own and unmapped when freed, so a tensor that large faults all its pages in
             afresh every time it is allocated again
    caching  every block comes from the heap and the heap is never trimmed, so a training step's
             tensors reuse the pages of the step before, as PyTorch's CUDA allocator reuses device
             memory. Resident memory keeps the heap's largest extent: more than the tensors need,
             as holes between long-lived tensors fit fewer of the next requests each step.
    pooled   blocks from 64 KiB are mappings of their own, kept when freed for the next request of
             their size (cpu_pool.cpp, built with the machine's C++ compiler against PyTorch);
             kept blocks are unmapped once the mapped bytes would pass the most the tensors ever
             held by 1/8. Pages are reused as with caching, and resident memory follows the tensors.
             Smaller blocks come from a caching heap. Where no C++ compiler builds the pool, the
             heap caches everything, as `caching`.

Why it matters: at 32k tokens the bench-size NSA step allocates about 6 GB of fresh pages, 1.4M page
faults and 4-5 s of system time in an 18 s step on an AMD EPYC VM. Caching and pooling remove them
(dense attention's step, whose time goes to its O(n^2) products, gains less); caching's heap then
holds 4.0 GB at its peak, the pool 2.8 GB, as much as glibc's defaults.

Only glibc has the heap's knobs (mallopt's M_MMAP_MAX and M_TRIM_THRESHOLD); elsewhere the C
library keeps its own policy and `use` says so by returning False.
"""

import ctypes
import ctypes.util
from functools import cache
from pathlib import Path
from typing import Optional

from kernels import native

MODES = ("system", "caching", "pooled")
FALLBACK = {"caching": "this C library is not glibc, it keeps its own policy",
            "pooled": "no C++ compiler built the pool (or the C library is not glibc): freed memory stays on the heap"}
POOLED_FROM = 64 << 10  # bytes: smaller blocks, many and short-lived, stay on the heap
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt parameters (malloc.h)
# caching: no block mapped on its own, and a trim threshold of -1 (mallopt(3): never trim);
# system: glibc's documented defaults (128 KiB, 65536), which undo caching later in the same process
_SETTINGS = {"caching": ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)),
             "system": ((_M_MMAP_MAX, 65536), (_M_TRIM_THRESHOLD, 128 * 1024))}
_changed = False  # whether this process left glibc's defaults: "system" then has something to undo
_active = "system"  # the mode in effect: what `use` asked for, or what it fell back to
_pool_installed = False  # whether PyTorch's CPU allocator is the pool (on or switched off)


def use(mode: str) -> bool:
    """Set what this process does with freed memory to `mode` (one of MODES) for the allocations
    that follow; False where it could not: caching or pooled without glibc (nothing changed), or
    pooled where the pool cannot be built (the heap caches, as `caching`)."""
    global _active, _pool_installed
    if mode not in MODES:
        raise ValueError(f"cpu allocator {mode!r}: expected one of {', '.join(MODES)}")
    if mode != "pooled" and _pool_installed:  # blocks come from the heap again
        _pool().pool_switch_off()
    if not _use_heap("system" if mode == "system" else "caching"):
        _active = "system"
    elif mode == "pooled" and _pool() is not None and _pool().pool_install(POOLED_FROM) == 0:
        _active, _pool_installed = "pooled", True
    else:
        _active = "caching" if mode == "pooled" else mode
    return _active == mode


def active() -> str:
    """The mode in effect in this process (one of MODES)."""
    return _active


def pool_stats() -> Optional[dict]:
    """What the pool holds, in bytes (live, kept, most_live) and counts (maps, reuses, unmaps);
    None where this process never installed it."""
    if not _pool_installed:
        return None
    values = (ctypes.c_int64 * 6)()
    _pool().pool_stats(values)
    return dict(zip(("live", "kept", "most_live", "maps", "reuses", "unmaps"), values))


def release_free_memory() -> None:
    """Return the free memory the allocators keep to the system (glibc's malloc_trim, the pool's
    kept blocks), whatever the mode: the next tensors fault their pages in afresh once."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
    if _pool_installed:
        _pool().pool_release()


def _use_heap(mode: str) -> bool:
    """The C heap's policy for the blocks it serves: glibc's defaults (system) or never unmapped nor trimmed."""
    global _changed
    if mode == "system" and not _changed:  # untouched: the C library's own defaults (glibc's growing threshold)
        return True
    libc = _glibc()
    if libc is None:
        return False
    for parameter, value in _SETTINGS[mode]:
        if libc.mallopt(parameter, value) != 1:
            return False
    _changed = True
    return True


@cache
def _pool() -> Optional[ctypes.CDLL]:
    """cpu_pool.cpp, built and loaded (not yet installed); None where it cannot be built."""
    library = native.load_torch_library(Path(__file__).with_name("cpu_pool.cpp"))
    if library is not None:
        library.pool_install.argtypes, library.pool_install.restype = (ctypes.c_int64,), ctypes.c_int
        library.pool_stats.argtypes, library.pool_stats.restype = (ctypes.POINTER(ctypes.c_int64),), None
        library.pool_switch_off.restype = library.pool_release.restype = None
    return library


@cache
def _glibc() -> Optional[ctypes.CDLL]:
    """The process's C library where it is glibc (it has gnu_get_libc_version, mallopt and malloc_trim)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not all(hasattr(libc, name) for name in ("gnu_get_libc_version", "mallopt", "malloc_trim")):
        return None
    libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return libc
