"""Activations recomputed in the backward pass instead of kept for it.

`recomputed(fn, *args)`, a checkpoint of fn where it pays, lives with the kernels that use it too
(kernels/recompute.py).

`RecomputedLayers` is checkpointing for one cheap layer of one input. Whatever reads a layer's
output may save it for the backward (a projection's weight gradient, a kernel, its input), while
the layer's own input is kept anyway (a LayerNorm's backward, a projection's weight gradient,
both need theirs). Recomputing the output from that input costs one pass of the layer in the
backward and frees the output between forward and backward:
- a block's LayerNorm outputs, saved by the attention's projections and the feed-forward's first
  layer: two [batch, seq, dim] per block (models/transformer.py);
- NSA's query and key/value projections, saved by its CPU kernels (models/attention/nsa.py).
They nest: an inner layer's input that an outer one recomputes is recomputed too, when needed.
"""

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.recompute import recomputation_pays, recomputed  # noqa: F401 (the models' recomputation, in one import)


class RecomputedLayers:
    """While open, any tensor autograd saves that is a view of an output made by `apply` is saved
    as (its layer and input, the view's size, stride and offset). The backward recomputes each
    output once, from its input and the layer's weights, for all of its views, and drops it when
    the last of them has been read back. Other tensors go to the hooks that were open before (an
    outer checkpoint's, a memory count's), or are saved as usual. Closed (or `enabled=False`), nothing
    changes.

    The recomputation uses the weights as they are in the backward, so they must not change in
    place between forward and backward (an optimizer step never falls between them); parameters a
    sharded backend gathers on demand (ZeRO-3's) are left to be saved as usual."""

    def __init__(self, enabled: bool = True, armed: bool = True):
        self.enabled = enabled
        self._armed = armed  # unarmed, saved views are kept as usual until `armed()` opens
        self._sources: dict[int, _Recipe] = {}  # storage address -> the recipe of its output
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self._outer = None

    def apply(self, layer: nn.Module, x: Tensor) -> Tensor:
        """layer(x) (a module of one input, deterministic), whose saved views are recomputed in the
        backward while this is open."""
        y = layer(x)
        if self.enabled and y.requires_grad and not any(hasattr(p, "ds_id") for p in layer.parameters()):
            # x goes through the hooks open around these: an outer recomputation may own it too
            x = x if self._outer is None else _Outer(self._outer, x)
            self._sources[y.untyped_storage().data_ptr()] = _Recipe(x, layer, y.dtype)
        return y

    def __enter__(self) -> "RecomputedLayers":
        if self.enabled:
            self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)  # (pack, unpack) or None
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
        self._sources.clear()  # the packed views hold their recipes; nothing else should

    @contextmanager
    def armed(self) -> Iterator[None]:
        """Within it, saved views of the outputs are recomputed (for code that alone knows whether
        recomputing them pays: a kernel that saves them)."""
        previous, self._armed = self._armed, True
        try:
            yield
        finally:
            self._armed = previous

    def _pack(self, t: Tensor):
        source = self._sources.get(t.untyped_storage().data_ptr()) if self._armed and t.layout == torch.strided else None
        if source is None or t.dtype != source.dtype:
            return t if self._outer is None else _Outer(self._outer, t)
        source.pending += 1
        return source, t.size(), t.stride(), t.storage_offset()


class _Outer:
    """A tensor packed by the hooks that were open around RecomputedLayers."""

    def __init__(self, hooks, t: Tensor):
        self.unpack, self.packed = hooks[1], hooks[0](t)


def _unpack(packed):
    if isinstance(packed, Tensor):
        return packed
    if isinstance(packed, _Outer):
        return packed.unpack(packed.packed)
    source, size, stride, offset = packed
    return source.read().as_strided(size, stride, offset)


class _Recipe:
    """One layer's output as its layer and input, and its value while views of it are still to be
    read back."""

    def __init__(self, x, layer: nn.Module, dtype: torch.dtype):
        self.x, self.layer, self.dtype = x, layer, dtype
        self.pending = 0  # packed views not yet read back
        self.value: Optional[Tensor] = None

    def read(self) -> Tensor:
        value = self.value
        if value is None:
            x = _unpack(self.x)
            with torch.no_grad():  # in the forward's dtype (autocast does not apply in the backward)
                if isinstance(self.layer, nn.Linear):
                    weight, bias = self.layer.weight, self.layer.bias
                    value = F.linear(x.to(self.dtype), weight.to(self.dtype),
                                     None if bias is None else bias.to(self.dtype))
                else:
                    value = self.layer(x.to(self.dtype)).to(self.dtype)
        self.pending -= 1
        self.value = value if self.pending > 0 else None  # the last view read: nothing kept
        return value
