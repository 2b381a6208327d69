"""The selected-block attention reference against the naive dense-masked definition: values and
every gradient, in float64 so the tolerance can be tight."""

import pytest
import torch

from kernels.selected_attention import selected_attention
from kernels.selected_attention.naive import selected_attention as naive
from tests.helpers.chosen_keys import random_selection


CASES = [  # (batch_kv, seq_q, seq_k, group, dim_head, block, selected)
    (1, 16, 16, 1, 8, 4, 2),
    (2, 37, 37, 2, 16, 4, 3),  # length not a multiple of the block
    (3, 50, 50, 4, 8, 16, 2),  # blocks at the start and the end
    (2, 5, 41, 2, 8, 8, 3),  # decoding: queries at the end of a longer key sequence
    (1, 1, 1, 1, 8, 4, 1),  # a single token
]


@pytest.mark.parametrize("bh,m,n,g,d,block,selected", CASES,
                         ids=[f"BH{c[0]}-Q{c[1]}-K{c[2]}-G{c[3]}-D{c[4]}-blk{c[5]}-S{c[6]}" for c in CASES])
def test_matches_naive_reference(bh, m, n, g, d, block, selected):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(bh, m, g, d, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(bh, n, d, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(bh, n, d, dtype=torch.float64, generator=gen, requires_grad=True)
    start = n - m
    indices, valid = random_selection(bh, m, start, block, selected, gen)
    out, lse = selected_attention(q, k, v, indices, valid, start, block)
    ref, ref_lse = naive(q, k, v, indices, valid, start, block)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    grad, grad_lse = torch.randn_like(out), torch.randn_like(lse)  # the lse output has a gradient too
    ours_all = torch.autograd.grad((out * grad).sum() + (lse * grad_lse).sum(), (q, k, v))
    theirs_all = torch.autograd.grad((ref * grad).sum() + (ref_lse * grad_lse).sum(), (q, k, v))
    for ours, theirs, name in zip(ours_all, theirs_all, "qkv"):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10, msg=f"d{name} differs")


def test_chunking_does_not_change_the_result(monkeypatch):
    """Many small chunks and one large chunk give the same values and gradients."""
    import kernels.selected_attention.reference as module

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 40, 2, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, 40, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, 40, 8, generator=gen, requires_grad=True)
    indices, valid = random_selection(2, 40, 0, 4, 3, gen)
    results = []
    for chunk in (1 << 20, 96):  # 96 elements: a single row per chunk
        monkeypatch.setattr(module, "_FORWARD_CHUNK", chunk)
        monkeypatch.setattr(module, "_BACKWARD_CHUNK", chunk)
        out, lse = selected_attention(q, k, v, indices, valid, 0, 4)
        results.append((out, lse, *torch.autograd.grad(out.square().sum() + lse.sum(), (q, k, v))))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_query_with_no_visible_key_gets_zeros_and_finite_gradients():
    """Free-block slots can all be unused early in a sequence: zeros, lse -inf, no NaN."""
    q = torch.randn(1, 6, 2, 8, requires_grad=True)
    k, v = torch.randn(1, 6, 8, requires_grad=True), torch.randn(1, 6, 8, requires_grad=True)
    indices = torch.zeros(1, 6, 1, dtype=torch.long)
    valid = torch.tensor([False, False, False, True, True, True])[None, :, None]
    out, lse = selected_attention(q, k, v, indices, valid, 0, 4)
    assert (out[0, :3] == 0).all() and (lse[0, :3] == float("-inf")).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[0, 3:]).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_slot_weights_scale_each_slots_share_and_get_their_gradient():
    """out = sum_s w_s P_s V_s with one softmax over all slots: values and every gradient, the
    weights' included (NSA's differentiable selection passes straight-through weights)."""
    gen = torch.Generator().manual_seed(2)
    bh, m, g, d, block, selected = 2, 23, 2, 8, 4, 3
    q = torch.randn(bh, m, g, d, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(bh, m, d, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(bh, m, d, dtype=torch.float64, generator=gen, requires_grad=True)
    weights = torch.rand(bh, m, selected, dtype=torch.float64, generator=gen).add(0.5).requires_grad_()
    indices, valid = random_selection(bh, m, 0, block, selected, gen)
    out, lse = selected_attention(q, k, v, indices, valid, 0, block, weights=weights)
    ref, ref_lse = naive(q, k, v, indices, valid, 0, block, weights)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    leaves = (q, k, v, weights)
    ours = torch.autograd.grad((out * grad).sum() + (lse * grad_lse).sum(), leaves)
    theirs = torch.autograd.grad((ref * grad).sum() + (ref_lse * grad_lse).sum(), leaves)
    for a, b, name in zip(ours, theirs, ("q", "k", "v", "weights")):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"d{name} differs")
