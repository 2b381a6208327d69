"""Growing buffers for incremental decoding, shared by the attentions.

Tensors are stored along their second-to-last dimension (the sequence: keys [b, h, n, d],
inputs [b, n, dim]) in buffers that grow by doubling, so decoding copies each position once
instead of the whole cache per token; rolling back is O(1) (later writes overwrite).
"""

from torch import Tensor


def append(cache: dict, start: int, **tensors: Tensor) -> list[Tensor]:
    """Write each tensor at positions [start, start + n) of the buffer of its name and set
    cache["pos"]; returns, per tensor, the view of its buffer up to the new end."""
    views = []
    for name, t in tensors.items():
        end = start + t.shape[-2]
        buf = cache.get(name)
        if buf is None or buf.shape[-2] < end or buf.dtype != t.dtype:
            capacity = max(end, 2 * (buf.shape[-2] if buf is not None else 0), 64)
            grown = t.new_empty(*t.shape[:-2], capacity, t.shape[-1])
            if start:
                grown[..., :start, :] = buf[..., :start, :]
            cache[name] = buf = grown
        buf[..., start:end, :] = t
        views.append(buf[..., :end, :])
    cache["pos"] = start + next(iter(tensors.values())).shape[-2]
    return views


def truncate(cache: dict, length: int) -> None:
    """Forget every position from `length` on."""
    cache["pos"] = min(cache.get("pos", 0), length)
