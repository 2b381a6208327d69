"""The gather-attention reference against the naive dense-masked definition: values and every
gradient, in float64 so the tolerance can be tight; half precision against fp32."""

import pytest
import torch

from kernels.gather_attention import gather_attention, gathered_probabilities
from kernels.gather_attention.naive import gather_attention as naive
from tests.helpers.chosen_keys import random_indices, repeat_some_slots
from tests.helpers.kernel_checks import assert_all_close, values_and_grads

CASES = [  # (batch_kv, seq_q, seq_k, group, dim_head, top_k)
    (1, 16, 16, 1, 8, 4),
    (2, 37, 37, 2, 16, 5),  # group of 2
    (3, 50, 50, 8, 8, 16),  # a larger group; top_k above the early queries' keys
    (2, 5, 41, 2, 8, 7),  # decoding: queries at the end of a longer key sequence
    (1, 1, 1, 1, 8, 3),  # a single token
]


def inputs(bh, m, n, g, d, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bh, m, g, d, dtype=dtype, generator=gen, requires_grad=True)
    k = torch.randn(bh, n, d, dtype=dtype, generator=gen, requires_grad=True)
    v = torch.randn(bh, n, d, dtype=dtype, generator=gen, requires_grad=True)
    return q, k, v, gen


@pytest.mark.parametrize("bh,m,n,g,d,top_k", CASES,
                         ids=[f"BH{c[0]}-Q{c[1]}-K{c[2]}-G{c[3]}-D{c[4]}-top{c[5]}" for c in CASES])
def test_matches_naive_reference(bh, m, n, g, d, top_k):
    q, k, v, gen = inputs(bh, m, n, g, d)
    indices = random_indices(bh, m, n - m, top_k, gen)
    # the lse output has a gradient too
    ours = values_and_grads(*gather_attention(q, k, v, indices, n - m), (q, k, v))
    assert_all_close(ours, values_and_grads(*naive(q, k, v, indices, n - m), (q, k, v)), 1e-10)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 4e-3), (torch.bfloat16, 3e-2)], ids=["fp16", "bf16"])
def test_half_precision_follows_fp32(dtype, tol):
    q, k, v, gen = inputs(2, 29, 29, 2, 16, torch.float32)
    indices = random_indices(2, 29, 0, 6, gen)
    results = []
    for leaves in ((q, k, v), tuple(t.detach().to(dtype).requires_grad_() for t in (q, k, v))):
        out, lse = gather_attention(*leaves, indices, 0)
        results.append([out, lse, *torch.autograd.grad(out.float().square().sum() + lse.float().sum(), leaves)])
    for name, ref, ours in zip(("out", "lse", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(ours.float(), ref.float(), rtol=tol, atol=tol, msg=f"{name} differs")


def test_keys_after_the_query_are_masked_even_when_named():
    q, k, v, _ = inputs(1, 6, 6, 2, 8)
    future = torch.tensor([[[0, 5]] * 6])  # every query names key 5, which only the last may see
    out, _ = gather_attention(q, k, v, future, 0)
    only_first, _ = gather_attention(q, k, v, torch.tensor([[[0, -1]] * 5 + [[0, 5]]]), 0)
    torch.testing.assert_close(out, only_first, rtol=0, atol=0)


def test_query_with_no_visible_key_gets_zeros_and_finite_gradients():
    q, k, v, _ = inputs(1, 6, 6, 2, 8)
    indices = torch.tensor([[[-1, -1]] * 3 + [[0, 1]] * 3])
    out, lse = gather_attention(q, k, v, indices, 0)
    assert (out[0, :3] == 0).all() and (lse[0, :3] == float("-inf")).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_gathered_probabilities_are_the_attention_weights_summed_over_the_group():
    q, k, v, gen = inputs(2, 23, 23, 3, 8)
    indices = random_indices(2, 23, 0, 5, gen)
    _, lse = gather_attention(q, k, v, indices, 0)
    probs = gathered_probabilities(q, k, indices, lse, 0)
    scores = torch.einsum("bmgd,bmkd->bmgk", q, k[torch.arange(2)[:, None, None], indices.clamp(min=0)]) * 8**-0.5
    expected = scores.masked_fill((indices < 0)[:, :, None], float("-inf")).softmax(-1).sum(2)
    torch.testing.assert_close(probs, expected.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(probs.sum(-1), torch.full((2, 23), 3.0, dtype=torch.float64))


def test_a_key_named_in_several_slots_counts_once():
    """The chosen keys are a set: the reference, the naive definition and the probabilities given
    to the indexer all equal what the same indices give with the repeats unused (-1), the
    probabilities of a repeated slot 0."""
    q, k, v, gen = inputs(2, 21, 21, 2, 8)
    chosen = random_indices(2, 21, 0, 6, gen)
    indices, _, counts = repeat_some_slots(chosen, chosen >= 0, gen)
    assert ((indices >= 0) & ~counts).any(), "the case must repeat some keys"
    once = indices.masked_fill(~counts, -1)
    as_set = values_and_grads(*naive(q, k, v, once, 0), (q, k, v))
    for attend in (gather_attention, naive):
        ours = values_and_grads(*attend(q, k, v, indices, 0), (q, k, v))
        assert_all_close(ours, as_set, 1e-10, f" from the repeats unused ({attend.__module__})")
    _, lse = gather_attention(q, k, v, indices, 0)
    probs = gathered_probabilities(q, k, indices, lse, 0)
    torch.testing.assert_close(probs, gathered_probabilities(q, k, once, lse, 0), rtol=0, atol=0)
    torch.testing.assert_close(probs.sum(-1), torch.full((2, 21), 2.0, dtype=torch.float64))
