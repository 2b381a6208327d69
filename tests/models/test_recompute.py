"""recomputed: a checkpoint only where a backward will use it. RecomputedLayers: the gradients
of saving, without keeping the projection, recomputed once."""

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from models import recompute
from models.recompute import RecomputedLayers, recomputed


class Square(torch.autograd.Function):
    """x^2, keeping x for the backward as the C kernels keep their inputs (its gradient reads x)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def layer_step(enabled: bool, saved: list | None = None):
    """A projection read through views by a custom Function, an op that saves its operands and a
    checkpoint -> the gradients of x and of the weight, and the storage addresses of the projection
    and of a tensor saved inside (`saved` collects what the outer hooks were given)."""
    torch.manual_seed(0)
    proj, other = nn.Linear(6, 12, bias=False), nn.Linear(6, 3)
    x = torch.randn(2, 5, 6, requires_grad=True)

    def count(t):
        if saved is not None:
            saved.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        with RecomputedLayers(enabled) as projections:
            y = projections.apply(proj, x)
            a, b, c = y.unflatten(-1, (3, 4)).unbind(-2)  # strided views, as NSA's keys and values
            gate = other(x)  # not made by `apply`: saved as usual
            mixed = checkpoint(lambda t: torch.tanh(t).transpose(0, 1), c.transpose(0, 1), use_reentrant=False)
            scale = gate.sigmoid().mean(-1, keepdim=True)
            out = (Square.apply(a) * b.sin() + mixed) * scale
        out.square().sum().backward()
    return x.grad, proj.weight.grad, y.untyped_storage().data_ptr(), scale.untyped_storage().data_ptr()


def test_gradients_are_those_of_saving_the_projection():
    with_recompute, without = layer_step(True), layer_step(False)
    torch.testing.assert_close(with_recompute[0], without[0], rtol=0, atol=0)
    torch.testing.assert_close(with_recompute[1], without[1], rtol=0, atol=0)


def test_the_projection_is_not_saved_and_other_tensors_reach_the_outer_hooks():
    kept, plain = [], []
    *_, projection, scale = layer_step(True, saved=kept)
    *_, projection_plain, _ = layer_step(False, saved=plain)
    assert projection_plain in plain  # saved as usual: the views a, b and the checkpoint's input
    assert projection not in kept
    assert scale in kept  # saved inside, by a product: it still reaches the outer hooks


def test_each_projection_is_recomputed_once_for_all_its_views(monkeypatch):
    torch.manual_seed(0)
    proj = nn.Linear(4, 8, bias=False)
    x = torch.randn(3, 4, requires_grad=True)
    with RecomputedLayers() as projections:
        y = projections.apply(proj, x)
        out = Square.apply(y[:, :4]) * y[:, 4:].sin() + y[:, 2:6].cos()  # three saved views of one projection
    calls = []
    real_linear = F.linear
    monkeypatch.setattr(recompute.F, "linear", lambda *args: calls.append(1) or real_linear(*args))
    out.sum().backward()
    assert len(calls) == 1


def test_disabled_or_sharded_parameters_are_saved_as_usual():
    proj = nn.Linear(4, 8, bias=False)
    x = torch.randn(3, 4, requires_grad=True)
    for enabled, sharded in ((False, False), (True, True)):
        if sharded:
            proj.weight.ds_id = 0  # how ZeRO-3 marks a parameter it gathers on demand
        with RecomputedLayers(enabled) as projections:
            y = projections.apply(proj, x)
            assert not projections._sources
            y.exp().sum().backward()


def test_the_recomputation_has_the_forwards_dtype_under_autocast():
    dtype = torch.bfloat16
    results = []
    for enabled in (True, False):
        torch.manual_seed(0)
        proj = nn.Linear(8, 8, bias=True)
        x = torch.randn(4, 8, requires_grad=True)
        with torch.autocast("cpu", dtype=dtype), RecomputedLayers(enabled) as projections:
            y = projections.apply(proj, x)
            assert y.dtype == dtype
            out = Square.apply(y) * y
        out.float().sum().backward()
        results.append((x.grad, proj.weight.grad))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)




def nested_step(enabled: bool):
    """A LayerNorm recomputed by an outer RecomputedLayers, read by a projection an inner one
    recomputes and by a product, as a block's norm and NSA's projections -> the gradients, and
    whether the norm's and the projection's outputs were still alive between forward and backward."""
    torch.manual_seed(0)
    norm, proj = nn.LayerNorm(6), nn.Linear(6, 8, bias=False)
    x = torch.randn(2, 5, 6, requires_grad=True)
    with RecomputedLayers(enabled) as outer:
        normed = outer.apply(norm, x)
        with RecomputedLayers(enabled) as inner:
            y = inner.apply(proj, normed)
            loss = (Square.apply(y) * normed.sum(-1, keepdim=True).sin()).sum()
    alive = [weakref.ref(normed), weakref.ref(y)]
    del normed, y, outer, inner
    alive = [ref() is not None for ref in alive]
    loss.backward()
    return (x.grad, norm.weight.grad, norm.bias.grad, proj.weight.grad), alive


def test_a_recomputed_layers_input_is_recomputed_by_the_layers_around_it():
    grads, alive = nested_step(True)
    plain_grads, alive_plain = nested_step(False)
    assert alive_plain == [True, True]  # kept for the backward as usual
    assert alive == [False, False]  # the inner recipe holds its input as the outer's recipe
    for got, expected in zip(grads, plain_grads):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)

def _tanh_chain(x):
    return torch.tanh(torch.tanh(x) * 2)


def _saved_storages(run):
    storages = set()

    def pack(t):
        storages.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return storages


def test_recomputed_keeps_only_its_inputs_and_gives_the_same_gradients():
    x = torch.randn(4, 8, requires_grad=True)
    kept = _saved_storages(lambda: recomputed(_tanh_chain, x).sum().backward())
    grad, x.grad = x.grad, None
    plain = _saved_storages(lambda: _tanh_chain(x).sum().backward())
    assert kept == {x.untyped_storage().data_ptr()} and len(plain) > 1
    torch.testing.assert_close(grad, x.grad, rtol=0, atol=0)
