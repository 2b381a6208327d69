"""Activations recomputed in the backward pass instead of kept for it.

`recomputed(fn, *args)` is a checkpoint of fn where it pays: only when a backward will run, and not
while a reversible stack recomputes the block (models/reversible.py), whose backward frees the
block's activations at once, so a checkpoint inside it would compute fn a third time for nothing.

`RecomputedProjections` is checkpointing for one matmul. An attention's query and key/value projections are saved for the backward by whatever reads them
(kernels keep their inputs), and at long context they are a large part of what a layer keeps.
Their input is kept anyway (the projection's own weight gradient needs it), so recomputing them
costs one matmul each in the backward and frees them between forward and backward.
"""

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from models.reversible import recomputing


def recomputed(fn: Callable, *args):
    """fn(*args); while autograd records for a backward (outside a reversible block's
    recomputation), what fn would keep for it is recomputed from args in the backward instead."""
    if torch.is_grad_enabled() and not recomputing():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


class RecomputedProjections:
    """While open, any tensor autograd saves that is a view of a projection made by `linear` is
    saved as (projection, the view's size, stride and offset). The backward recomputes each
    projection once, from its input and weight, for all of its views, and drops it when the last
    of them has been read back. Other tensors go to the hooks that were open before (an outer
    checkpoint's, a memory count's), or are saved as usual. Closed (or `enabled=False`), nothing
    changes.

    The recomputation uses the weight as it is in the backward, so the weight must not change in
    place between forward and backward (an optimizer step never falls between them); parameters a
    sharded backend gathers on demand (ZeRO-3's) are left to be saved as usual."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._sources: dict[int, _Projection] = {}  # storage address -> its projection
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self._outer = None

    def linear(self, x: Tensor, layer: nn.Linear) -> Tensor:
        """layer(x), whose saved views are recomputed in the backward while this is open."""
        y = layer(x)
        if self.enabled and y.requires_grad and not hasattr(layer.weight, "ds_id"):
            self._sources[y.untyped_storage().data_ptr()] = _Projection(x, layer, y.dtype)
        return y

    def __enter__(self) -> "RecomputedProjections":
        if self.enabled:
            self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)  # (pack, unpack) or None
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
        self._sources.clear()  # the packed views hold their projections; nothing else should

    def _pack(self, t: Tensor):
        source = self._sources.get(t.untyped_storage().data_ptr()) if t.layout == torch.strided else None
        if source is None or t.dtype != source.dtype:
            return t if self._outer is None else _Outer(self._outer, t)
        source.pending += 1
        return source, t.size(), t.stride(), t.storage_offset()


class _Outer:
    """A tensor packed by the hooks that were open around RecomputedProjections."""

    def __init__(self, hooks, t: Tensor):
        self.unpack, self.packed = hooks[1], hooks[0](t)


def _unpack(packed):
    if isinstance(packed, Tensor):
        return packed
    if isinstance(packed, _Outer):
        return packed.unpack(packed.packed)
    source, size, stride, offset = packed
    return source.read().as_strided(size, stride, offset)


class _Projection:
    """One projection's recipe, and its value while views of it are still to be read back."""

    def __init__(self, x: Tensor, layer: nn.Linear, dtype: torch.dtype):
        self.x, self.layer, self.dtype = x, layer, dtype
        self.pending = 0  # packed views not yet read back
        self.value: Optional[Tensor] = None

    def read(self) -> Tensor:
        value = self.value
        if value is None:
            with torch.no_grad():  # in the forward's dtype (autocast does not apply in the backward)
                weight, bias = self.layer.weight, self.layer.bias
                value = F.linear(self.x.to(self.dtype), weight.to(self.dtype),
                                 None if bias is None else bias.to(self.dtype))
        self.pending -= 1
        self.value = value if self.pending > 0 else None  # the last view read: nothing kept
        return value
