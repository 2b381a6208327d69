"""Caches for incremental decoding, shared by the attentions.

Growing buffers (`append`, `reserve`, `truncate`): tensors are stored along their second-to-last dimension
(the sequence: keys [b, h, n, d], inputs [b, n, dim]) in buffers that grow by doubling, so
decoding copies each position once instead of the whole cache per token; rolling back is O(1)
(later writes overwrite). The position reached is a Python int, cache["pos"].

Static caches (`is_static`, `write`): buffers of a fixed capacity allocated before decoding by the
attention's `static_cache(batch, capacity, dtype, device)`, and cache["positions"], the positions
of this step's tokens as a tensor on the device. Nothing in a step depends on how far decoding has
gone, so its shapes are the same every time and it can be compiled once and replayed as a CUDA
graph (models/decoding.py). Entries past the current position (never written, or left by a
rollback) are masked by position, never read.
"""

from torch import Tensor

POSITIONS = "positions"


def append(cache: dict, start: int, **tensors: Tensor) -> list[Tensor]:
    """Write each tensor at positions [start, start + n) of the buffer of its name and set
    cache["pos"]; returns, per tensor, the view of its buffer up to the new end."""
    views = []
    for name, t in tensors.items():
        end = start + t.shape[-2]
        buf = _holding(cache, name, start, end, t)
        buf[..., start:end, :] = t
        views.append(buf[..., :end, :])
    cache["pos"] = start + next(iter(tensors.values())).shape[-2]
    return views


def reserve(cache: dict, end: int, template: Tensor, *names: str) -> list[Tensor]:
    """The buffers `names` of the cache, grown as `append` grows them to hold positions [0, end)
    (what lies before cache["pos"] kept), for a kernel that writes them itself; `template` [..., 0,
    d] gives a missing buffer's other dimensions, dtype and device. cache["pos"] is left as it is."""
    return [_holding(cache, name, cache.get("pos", 0), end, template) for name in names]


def _holding(cache: dict, name: str, start: int, end: int, like: Tensor) -> Tensor:
    """The buffer `name`, replaced by one of twice the size (at least `end` and 64 positions, like's
    other dimensions and dtype) where it is missing, too short or of another dtype; its first
    `start` positions are kept."""
    buf = cache.get(name)
    if buf is None or buf.shape[-2] < end or buf.dtype != like.dtype:
        capacity = max(end, 2 * (buf.shape[-2] if buf is not None else 0), 64)
        grown = like.new_empty(*like.shape[:-2], capacity, like.shape[-1])
        if start:
            grown[..., :start, :] = buf[..., :start, :]
        cache[name] = buf = grown
    return buf


def truncate(cache: dict, length: int) -> None:
    """Forget every position from `length` on."""
    cache["pos"] = min(cache.get("pos", 0), length)


def is_static(cache) -> bool:
    """Whether `cache` is a static cache (fixed-capacity buffers and the step's positions)."""
    return cache is not None and POSITIONS in cache


def write(cache: dict, **tensors: Tensor) -> list[Tensor]:
    """Static cache: write each tensor [..., t, d] at cache["positions"] [t] of the buffer of its
    name [..., capacity, d], in place (in the buffer's dtype); returns the whole buffers."""
    positions = cache[POSITIONS]
    buffers = []
    for name, t in tensors.items():
        buf = cache[name]
        buf.index_copy_(buf.dim() - 2, positions, t.to(buf.dtype))
        buffers.append(buf)
    return buffers
