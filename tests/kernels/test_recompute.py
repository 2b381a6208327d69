"""kernels/recompute.py: a checkpoint only where a backward will use it."""

import torch

from kernels import recompute
from kernels.recompute import recomputation as _recomputation
from kernels.recompute import recomputed


def _tanh_chain(x):
    return torch.tanh(torch.tanh(x) * 2)


def test_recomputed_is_a_plain_call_without_a_backward_or_inside_a_reversible_recomputation(monkeypatch):
    calls = []
    monkeypatch.setattr(recompute, "checkpoint", lambda f, *args, use_reentrant: calls.append(f) or f(*args))
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        recomputed(_tanh_chain, x)
    with _recomputation():
        recomputed(_tanh_chain, x)
    assert not calls
    recomputed(_tanh_chain, x)
    assert calls == [_tanh_chain]
