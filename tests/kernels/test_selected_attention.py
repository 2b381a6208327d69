"""The selected-block attention reference against the naive dense-masked definition: values and
every gradient, in float64 so the tolerance can be tight."""

import pytest
import torch

from kernels.selected_attention import selected_attention
from kernels.selected_attention.naive import selected_attention as naive
from tests.helpers.chosen_keys import random_selection, repeat_some_slots
from tests.helpers.kernel_checks import assert_all_close, random_qkv, values_and_grads


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
    q, k, v = random_qkv(bh, m, n, g, d, gen)
    start = n - m
    indices, valid = random_selection(bh, m, start, block, selected, gen)
    # the lse output has a gradient too
    ours = values_and_grads(*selected_attention(q, k, v, indices, valid, start, block), (q, k, v))
    assert_all_close(ours, values_and_grads(*naive(q, k, v, indices, valid, start, block), (q, k, v)), 1e-10)


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
    q, k, v = random_qkv(bh, m, m, g, d, gen)
    weights = torch.rand(bh, m, selected, dtype=torch.float64, generator=gen).add(0.5).requires_grad_()
    indices, valid = random_selection(bh, m, 0, block, selected, gen)
    leaves = (q, k, v, weights)
    ours = values_and_grads(*selected_attention(q, k, v, indices, valid, 0, block, weights=weights), leaves)
    assert_all_close(ours, values_and_grads(*naive(q, k, v, indices, valid, 0, block, weights), leaves), 1e-10)


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_a_block_named_in_several_valid_slots_counts_once(weighted):
    """The chosen blocks are a set: the reference and the naive definition both give what the same
    selection gives with the repeated slots marked unused; with weights the first slot's weight
    holds and a repeated slot's weight gets no gradient."""
    gen = torch.Generator().manual_seed(5)
    bh, m, g, d, block, selected = 2, 22, 2, 8, 4, 4
    q, k, v = random_qkv(bh, m, m, g, d, gen)
    weights = torch.rand(bh, m, selected, dtype=torch.float64, generator=gen).add(0.5).requires_grad_()
    indices, valid, counts = repeat_some_slots(*random_selection(bh, m, 0, block, selected, gen), gen)
    assert (valid & ~counts).any(), "the case must repeat some blocks in valid slots"
    leaves, w = ((q, k, v, weights), weights) if weighted else ((q, k, v), None)
    as_set = values_and_grads(*naive(q, k, v, indices, counts, 0, block, weights=w), leaves)
    for attend in (selected_attention, naive):
        ours = values_and_grads(*attend(q, k, v, indices, valid, 0, block, weights=w), leaves)
        assert_all_close(ours, as_set, 1e-10, f" from the repeats unused ({attend.__module__})")
    if weighted:
        assert (ours[-1][valid & ~counts] == 0).all()


def test_distinct_slots_keeps_the_first_valid_slot_of_each_block():
    """The de-duplication every path runs, against a plain loop, with as many slots as gather
    attention's rows hold and unused slots that name the same blocks as used ones."""
    from kernels.selected_attention.reference import distinct_slots

    gen = torch.Generator().manual_seed(8)
    indices = torch.randint(0, 12, (3, 5, 40), generator=gen)
    valid = torch.rand(3, 5, 40, generator=gen) < 0.7
    indices, valid, counts = repeat_some_slots(indices, valid, gen)
    assert (valid & ~counts).any() and (~valid).any()
    assert torch.equal(distinct_slots(indices, valid), counts)
