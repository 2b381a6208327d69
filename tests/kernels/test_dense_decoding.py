"""The dense decoding kernel against its reference, the blocks' own forward over the growing cache:
the logits and the keys and values it writes, for a decoding step and verification passes of
every row count a call takes, across the caches' growth, with heads whose width is not a multiple
of the vector; the same results on any number of threads; no new token sees a later one; and
what it cannot hold is refused before C writes anything."""

import ctypes

import pytest
import torch

from kernels import dense_decoding
from models.fused_decoding import DenseStack, fused_blocks
from models.lm import transformer_lm

pytestmark = pytest.mark.skipif(not dense_decoding.available(), reason="no C compiler: the kernel is not built here")

SIZES = {"vector heads": dict(dim=64, heads=4, dim_head=16), "odd widths": dict(dim=40, heads=3, dim_head=10)}


def _model(size: str, seed: int = 0):
    torch.manual_seed(seed)
    return transformer_lm(num_tokens=50, depth=3, **SIZES[size]).eval()


def _prefilled(model, prompt):
    cache = model.new_cache()
    model(prompt, cache=cache)
    return cache


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 16])
@torch.no_grad()
def test_a_step_gives_the_blocks_logits_and_cache(size, rows):
    model = _model(size)
    prompt, new = torch.randint(0, 50, (1, 60)), torch.randint(0, 50, (1, rows))
    eager, fused = _prefilled(model, prompt), _prefilled(model, prompt)  # 60 + 16 outgrows a 64-position buffer
    expected = model(new, cache=eager)
    with fused_blocks(model):
        assert "hidden" in vars(model)
        out = model(new, cache=fused)
    assert "hidden" not in vars(model)  # the blocks' forward again after it
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for e, f in zip(eager, fused):
        assert f["pos"] == e["pos"] == 60 + rows
        for name in ("k", "v"):
            torch.testing.assert_close(f[name][..., : f["pos"], :], e[name][..., : e["pos"], :], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_steps_after_steps_follow_the_blocks():
    model = _model("vector heads")
    prompt = torch.randint(0, 50, (1, 9))
    eager, fused = _prefilled(model, prompt), _prefilled(model, prompt)
    for step in range(70):  # past the buffers' growth from 64 to 128 positions
        new = torch.randint(0, 50, (1, 1 if step % 4 else 6))
        expected = model(new, cache=eager)
        with fused_blocks(model):
            torch.testing.assert_close(model(new, cache=fused), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 3])
@torch.no_grad()
def test_any_number_of_threads_gives_the_same_logits(threads):
    model = _model("odd widths")
    prompt, new = torch.randint(0, 50, (1, 20)), torch.randint(0, 50, (1, 6))
    results = []
    for count in (2, threads):
        cache = _prefilled(model, prompt)
        stack = DenseStack(model, count)
        results.append(stack(model.embed(new, 20), cache))
    assert torch.equal(results[0], results[1])  # each output and each head's attention is one thread's sum


@torch.no_grad()
def test_no_new_token_sees_a_later_one():
    model = _model("vector heads")
    prompt, new = torch.randint(0, 50, (1, 30)), torch.randint(0, 50, (1, 6))
    changed = new.clone()
    changed[0, 4] = (new[0, 4] + 1) % 50
    with fused_blocks(model):
        a = model(new, cache=_prefilled(model, prompt))
        b = model(changed, cache=_prefilled(model, prompt))
    assert torch.equal(a[:, :4], b[:, :4])
    assert not torch.equal(a[:, 4:], b[:, 4:])


def test_a_step_the_scratch_or_caches_cannot_hold_is_refused_before_c_writes():
    x = torch.randn(2, 8)
    table = (ctypes.c_int64 * len(dense_decoding.FIELDS))()  # null addresses: C must never be reached
    phases = torch.zeros(64, 2, 2)
    args = dict(heads=2, dim_head=4, hidden=32, layers=1, eps=1e-5, threads=1)
    with pytest.raises(ValueError, match="too small for this step"):
        dense_decoding.blocks_step(x, table, phases, torch.empty(3), start=10, capacity=64, **args)
    with pytest.raises(ValueError, match="too small for this step"):
        dense_decoding.blocks_step(x, table, phases, torch.empty(10_000), start=63, capacity=64, **args)
    with pytest.raises(ValueError, match="phases cover every position"):
        dense_decoding.blocks_step(x, table, phases[:11], torch.empty(10_000), start=10, capacity=64, **args)
