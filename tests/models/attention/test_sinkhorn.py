"""Sparse Sinkhorn attention: causal balancing, token-exact causality, buckets, caching; on CUDA (the gpu
tier): cached decoding, the first step against the CPU's, training in each precision."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.attention_checks import (assert_cached_decoding_equals_parallel, assert_causal_by_gradient,
                                            assert_causal_by_perturbation, assert_recomputation_changes_nothing,
                                            assert_truncated_cache_forgets, logits_with_embedding, saved_bytes)
from tests.helpers.gpu import (PRECISIONS, assert_cached_decoding_on_cuda, assert_devices_agree, assert_loss_falls,
                               train_on_cuda)
from tests.helpers.runs import TINY
from experiments.bench.agreement import lm_loss
from models.attention.dense import DenseAttention
from models.attention.sinkhorn import SinkhornAttention, sinkhorn
from models.lm import sinkhorn_lm

BUCKET = 4


def tiny_sinkhorn(local_heads=1, **kw):
    torch.manual_seed(0)
    knobs = dict(num_tokens=32, dim=32, depth=2, heads=2, dim_head=16, bucket_size=BUCKET,
                 n_local_attn_heads=local_heads)
    return sinkhorn_lm(**{**knobs, **kw}).double()


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("t", [0, 3, 4, 5, 7, 8, 13, 22])  # bucket ends, starts, middles
def test_causal_by_perturbation(t, mode):
    model = tiny_sinkhorn(attn_dropout=0.1, ff_dropout=0.1).train(mode == "train")
    assert_causal_by_perturbation(model, torch.randint(0, 32, (2, 23)), t)


@pytest.mark.parametrize("local_heads", [0, 1])
@pytest.mark.parametrize("t", [2, 4, 11, 16])
def test_causal_by_gradient(t, local_heads):
    model = tiny_sinkhorn(local_heads).train()  # Gumbel noise on
    assert_causal_by_gradient(model, torch.randint(0, 32, (2, 21)), t)


def test_sorted_buckets_reach_beyond_the_local_window():
    """With only Sinkhorn heads, a token two buckets on still depends on bucket 0: the sorted
    bucket carries it (local attention over own + previous bucket could not)."""
    model = tiny_sinkhorn(local_heads=0, depth=1).eval()
    logits, emb = logits_with_embedding(model, torch.randint(0, 32, (1, 3 * BUCKET)))
    (grad,) = torch.autograd.grad(logits[0, 2 * BUCKET].sum(), emb)
    assert grad[0, :BUCKET].abs().max() > 0


def test_local_heads_attend_to_their_bucket_and_the_previous_one():
    """All heads local: exactly masked attention over the own bucket's past and the bucket before."""
    torch.manual_seed(0)
    attn = SinkhornAttention(dim=16, heads=2, dim_head=8, bucket_size=BUCKET, n_local_attn_heads=2).double()
    n = 19
    q, k, v = torch.randn(3, 1, 2, n, 8, dtype=torch.double)
    pos = torch.arange(n)
    allowed = (pos[None] <= pos[:, None]) & (pos[None] // BUCKET >= pos[:, None] // BUCKET - 1)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    torch.testing.assert_close(attn._attend(torch.zeros(1, n, 16, dtype=torch.double), q, k, v, 0), expected)


def test_sinkhorn_rows_are_distributions_over_earlier_buckets_and_ignore_later_rows():
    scores = torch.randn(2, 6, 6, dtype=torch.double)
    p = sinkhorn(scores, iterations=8, temperature=0.5)
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 6, dtype=torch.double))
    assert torch.equal(p.triu(1), torch.zeros_like(p))
    changed = scores.clone()
    changed[:, 3:] = torch.randn(2, 3, 6, dtype=torch.double)
    torch.testing.assert_close(sinkhorn(changed, 8, 0.5)[:, :3], p[:, :3], rtol=0, atol=0)


def test_sinkhorn_rounds_follow_the_definition():
    """Each round: divide each entry by its column's mass over rows <= its own, then divide each
    row by its mass; entries above the diagonal are zero. Checked against explicit loops."""
    scores = torch.randn(5, 5, dtype=torch.double)
    temperature, rounds = 0.7, 3
    p = torch.exp(scores / temperature).tril()
    for _ in range(rounds):
        p = torch.stack([torch.stack([p[i, j] / p[: i + 1, j].sum() if j <= i else p[i, j] * 0
                                      for j in range(5)]) for i in range(5)])
        p = p / p.sum(-1, keepdim=True)
    torch.testing.assert_close(sinkhorn(scores, rounds, temperature), p)


@pytest.mark.parametrize("pieces", [[23], [1] * 23, [5, 3, 8, 7], [8, 1, 1, 13]], ids=str)
def test_cached_decoding_equals_parallel_forward(pieces):
    model = tiny_sinkhorn().eval()
    assert_cached_decoding_equals_parallel(model, torch.randint(0, 32, (2, 23)), pieces)


@pytest.mark.gpu
@pytest.mark.parametrize("pieces", [[1] * 23, [5, 3, 8, 7]], ids=["one-at-a-time", "5-3-8-7"])
def test_cached_decoding_equals_parallel_forward_on_cuda(pieces):
    assert_cached_decoding_on_cuda(tiny_sinkhorn(), torch.randint(0, 32, (2, 23)), pieces)


@pytest.mark.gpu
def test_first_step_agrees_between_the_cpu_and_cuda():
    """In eval mode: training draws Gumbel noise, each device from its own generator."""
    assert_devices_agree(lambda device: tiny_sinkhorn().float(), lm_loss(32, 24), train=False)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_trains_on_cuda(tmp_path, precision):
    assert_loss_falls(train_on_cuda(tmp_path, precision, "model=sinkhorn", "model.bucket_size=8",
                                    "model.n_local_attn_heads=1", base=TINY))


def test_truncated_cache_forgets_the_rolled_back_tokens():
    model = tiny_sinkhorn().eval()
    assert_truncated_cache_forgets(model, torch.randint(0, 32, (2, 17)), keep=9)


@pytest.mark.parametrize("bad, message", [
    (dict(bucket_size=0), "bucket_size"), (dict(n_local_attn_heads=3), "n_local_attn_heads"),
    (dict(sinkhorn_iter=0), "sinkhorn_iter"), (dict(temperature=0.0), "temperature"),
    (dict(n_local_attn_heads=[1, 1, 1]), "depth is 2"),
])
def test_bad_knobs_are_refused_with_the_key(bad, message):
    with pytest.raises(ValueError, match=message):
        tiny_sinkhorn(**bad)


def layer_with_both_kinds_of_head():
    torch.manual_seed(0)
    return SinkhornAttention(dim=32, heads=2, dim_head=16, bucket_size=16, n_local_attn_heads=1, dropout=0.1)


def test_training_keeps_its_input_and_output_alone():
    """The projections and the bucketed layout (each key and value held twice) are recomputed in
    the backward from the input, which the projection keeps anyway: a training forward keeps the
    input and the output, less than dense attention (its input, q, k, v and output)."""
    x = torch.randn(1, 512, 32)
    kept = saved_bytes(layer_with_both_kinds_of_head(), x)
    assert kept <= 2 * x.numel() * x.element_size()
    assert kept < saved_bytes(DenseAttention(dim=32, heads=2, dim_head=16), x)


def test_recomputing_the_attention_changes_nothing(monkeypatch):
    layer = layer_with_both_kinds_of_head().train()
    assert_recomputation_changes_nothing(layer, torch.randn(2, 70, 32), monkeypatch)


def test_gumbel_noise_is_added_to_the_scores_before_the_temperature():
    scores = torch.randn(2, 4, 4, dtype=torch.double)
    torch.manual_seed(3)
    noisy = sinkhorn(scores, 3, 0.5, noise=True)
    torch.manual_seed(3)
    gumbel = -torch.log(-torch.log(torch.rand_like(scores).clamp(1e-9, 1 - 1e-9)))
    torch.testing.assert_close(noisy, sinkhorn(scores + gumbel, 3, 0.5))


def test_training_draws_a_noisy_sort_and_evaluation_does_not():
    torch.manual_seed(0)
    attn = SinkhornAttention(dim=8, heads=2, dim_head=4, bucket_size=3, n_local_attn_heads=0)
    x = torch.randn(1, 12, 8)
    assert torch.equal(attn.eval()._sort_matrix(x, 3), attn._sort_matrix(x, 3))
    assert not torch.equal(attn.train()._sort_matrix(x, 3), attn._sort_matrix(x, 3))


def test_the_sort_scores_are_of_the_buckets_mean_inputs():
    torch.manual_seed(0)
    attn = SinkhornAttention(dim=8, heads=2, dim_head=4, bucket_size=3, n_local_attn_heads=0).eval()
    x = torch.randn(1, 9, 8)
    means = x.view(1, 3, 3, 8).mean(2)
    sort_q, sort_k = attn.to_sort(means).view(1, 3, 2, 2, 4).permute(2, 0, 3, 1, 4)
    expected = sinkhorn(sort_q @ sort_k.transpose(-1, -2) / 2, attn.sinkhorn_iter, attn.temperature)
    torch.testing.assert_close(attn._sort_matrix(x, 3), expected)
