"""What the process's C allocator does with freed memory: give it back to the system, or keep it
for the next step (`trainer.cpu_allocator`; the benchmark's children set it from the same key).

    system   glibc's defaults: a block above its threshold (which grows to at most 32 MB) is mapped
             on its own and unmapped when freed, so a tensor that large faults all its pages in
             afresh every time it is allocated again
    caching  every block comes from the heap and the heap is never trimmed, so a training step's
             tensors reuse the pages of the step before, as PyTorch's CUDA allocator reuses device
             memory. Resident memory keeps the heap's largest extent: more than the tensors need.

Why it matters: at 32k tokens the bench-size NSA step allocates about 6 GB of fresh pages, 1.4M page
faults and 4-5 s of system time in an 18 s step on an AMD EPYC VM. Caching removes them; dense
attention's step, whose time goes to its O(n^2) products, gains less.

Only glibc has these knobs (mallopt's M_MMAP_MAX and M_TRIM_THRESHOLD); elsewhere the C library
keeps its own policy and `use` says so by returning False.
"""

import ctypes
import ctypes.util
from functools import cache
from typing import Optional

MODES = ("system", "caching")
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt parameters (malloc.h)
# caching: no block mapped on its own, and a trim threshold of -1 (mallopt(3): never trim);
# system: glibc's documented defaults (128 KiB, 65536), which undo caching later in the same process
_SETTINGS = {"caching": ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)),
             "system": ((_M_MMAP_MAX, 65536), (_M_TRIM_THRESHOLD, 128 * 1024))}
_changed = False  # whether this process left glibc's defaults: "system" then has something to undo


def use(mode: str) -> bool:
    """Set this process's C allocator to `mode` (one of MODES) for the allocations that follow;
    False where caching was asked for and the C library is not glibc (nothing changed)."""
    global _changed
    if mode not in MODES:
        raise ValueError(f"cpu allocator {mode!r}: expected one of {', '.join(MODES)}")
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


def release_free_memory() -> None:
    """Return the free memory the C allocator keeps to the system (glibc's malloc_trim), whatever
    the mode: the next tensors fault their pages in afresh once."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


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
