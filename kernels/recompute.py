"""Activations recomputed in the backward pass instead of kept for it, where that pays.

`recomputed(fn, *args)` is a checkpoint of fn only when a backward will run, and not while a
reversible stack recomputes its block (models/reversible.py enters `recomputation()`), whose
backward frees the block's activations at once, so a checkpoint inside it would compute fn a
third time for nothing; nor inside code torch.compile traces, whose partitioner chooses what to
recompute. The kernels' own paths use it (kernels/nsa_attention/), and so do the models.
"""

import contextlib
from typing import Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

_recomputing = False


def recomputing() -> bool:
    """True while a reversible stack recomputes a block for its backward pass."""
    return _recomputing


@contextlib.contextmanager
def recomputation() -> Iterator[None]:
    """Within it, recomputing() is true: a reversible stack's recomputation of a block."""
    global _recomputing
    previous, _recomputing = _recomputing, True
    try:
        yield
    finally:
        _recomputing = previous


def recomputation_pays() -> bool:
    """Whether autograd records for a backward, outside a reversible block's recomputation and
    outside code torch.compile traces (its partitioner chooses what to recompute, and its guards
    cannot follow recipes kept by storage address)."""
    return torch.is_grad_enabled() and not recomputing() and not torch.compiler.is_compiling()


def recomputed(fn: Callable, *args):
    """fn(*args); where recomputation pays, what fn would keep for the backward is recomputed from
    args in the backward instead."""
    if recomputation_pays():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)
