"""Routing attention: token-exact causality, the window-of-my-cluster rule, caching, k-means; on CUDA (the
gpu tier): cached decoding, the first step against the CPU's, training in each precision."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.attention_checks import (assert_cached_decoding_equals_parallel, assert_causal_by_gradient,
                                            assert_causal_by_perturbation, assert_recomputation_changes_nothing,
                                            assert_truncated_cache_forgets, saved_bytes)
from tests.helpers.gpu import (PRECISIONS, assert_cached_decoding_on_cuda, assert_devices_agree, assert_loss_falls,
                               train_on_cuda)
from experiments.bench.agreement import lm_loss
from models.attention.dense import DenseAttention
from models.attention.routing import RoutingAttention
from models.lm import routing_lm

WINDOW = 4
# a tiny routing run of train.py
ROUTING_RUN = ["model=routing", "model.n_local_attn_heads=1", "model.window_size=8", "model.num_clusters=2",
               "schedule=constant", "trainer.validate_every=0", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=3"]


def tiny_routing(local_heads=1, **kw):
    torch.manual_seed(0)
    knobs = dict(num_tokens=32, dim=32, depth=2, heads=2, dim_head=16, window_size=WINDOW, num_clusters=3,
                 n_local_attn_heads=local_heads, ema_decay=0.999)
    return routing_lm(**{**knobs, **kw}).double()


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("t", [0, 3, 4, 5, 7, 8, 13, 22])  # window ends, starts, middles
def test_causal_by_perturbation(t, mode):
    model = tiny_routing(attn_dropout=0.1).train(mode == "train")
    assert_causal_by_perturbation(model, torch.randint(0, 32, (2, 23)), t)


@pytest.mark.parametrize("local_heads", [0, 1])
@pytest.mark.parametrize("t", [2, 4, 11, 16])
def test_causal_by_gradient(t, local_heads):
    assert_causal_by_gradient(tiny_routing(local_heads).train(), torch.randint(0, 32, (2, 21)), t)


def reference_routing(q, k, v, clusters, window):
    """Dense masked attention under the rule: the `window` most recent same-cluster keys."""
    n = q.shape[2]
    pos = torch.arange(n)
    same = (clusters[..., :, None] == clusters[..., None, :]) & (pos[None] <= pos[:, None])
    # number of same-cluster keys between key j and query i, both included
    between = torch.stack([same[..., i, :].flip(-1).cumsum(-1).flip(-1) for i in range(n)], dim=-2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=same & (between <= window))


@pytest.mark.parametrize("n", [1, 4, 9, 30])
@pytest.mark.parametrize("clusters", [1, 3, 7])
def test_sorted_chunks_give_exactly_the_window_of_my_cluster(n, clusters):
    torch.manual_seed(n)
    attn = RoutingAttention(dim=16, heads=3, dim_head=8, window_size=WINDOW, num_clusters=clusters).double()
    q, k, v = torch.randn(3, 2, 3, n, 8, dtype=torch.double)
    ids = torch.randint(0, clusters, (2, 3, n))
    torch.testing.assert_close(attn._attend_sorted(q, k, v, ids), reference_routing(q, k, v, ids, WINDOW))


def test_local_heads_are_a_sliding_window():
    torch.manual_seed(0)
    attn = RoutingAttention(dim=16, heads=2, dim_head=8, window_size=WINDOW, num_clusters=3,
                            n_local_attn_heads=2).double()
    n = 13
    q, k, v = torch.randn(3, 1, 2, n, 8, dtype=torch.double)
    pos = torch.arange(n)
    window = (pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - WINDOW)
    ids = attn._route(q)
    assert torch.equal(ids, torch.zeros_like(ids))
    torch.testing.assert_close(attn._attend_sorted(q, k, v, ids),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=window))


def test_routing_heads_key_with_their_queries_and_local_heads_with_their_own_keys():
    """Head 0 is local, head 1 routes: only head 0's output moves with the local key projection,
    and head 1 gives what attention with keys equal to its queries gives."""
    torch.manual_seed(0)
    attn = RoutingAttention(dim=16, heads=2, dim_head=8, window_size=WINDOW, num_clusters=3,
                            n_local_attn_heads=1).double().eval()
    attn.to_out.weight.data = torch.eye(16, dtype=torch.double)  # the heads' outputs side by side
    x = torch.randn(2, 11, 16, dtype=torch.double)
    before = attn(x)
    attn.to_local_k.weight.data.normal_()
    after = attn(x)
    assert not torch.allclose(before[..., :8], after[..., :8])
    torch.testing.assert_close(before[..., 8:], after[..., 8:])
    q = attn.to_q(x).unflatten(-1, (2, 8)).transpose(1, 2)[:, 1:]  # [b, 1, n, d]
    v = attn.to_v(x).unflatten(-1, (2, 8)).transpose(1, 2)[:, 1:]
    clusters = attn._route(q)[:, 1:]  # routed before the rotary positions, as in the layer
    q = attn.rotary(q, 0)
    torch.testing.assert_close(after[..., 8:], reference_routing(q, q, v, clusters, WINDOW).squeeze(1))


@pytest.mark.parametrize("pieces", [[23], [1] * 23, [5, 3, 8, 7], [8, 1, 1, 13]], ids=str)
def test_cached_decoding_equals_parallel_forward(pieces):
    assert_cached_decoding_equals_parallel(tiny_routing().eval(), torch.randint(0, 32, (2, 23)), pieces)


@pytest.mark.gpu
@pytest.mark.parametrize("pieces", [[1] * 23, [5, 3, 8, 7]], ids=["one-at-a-time", "5-3-8-7"])
def test_cached_decoding_equals_parallel_forward_on_cuda(pieces):
    assert_cached_decoding_on_cuda(tiny_routing(), torch.randint(0, 32, (2, 23)), pieces)


@pytest.mark.gpu
def test_first_step_agrees_between_the_cpu_and_cuda():
    assert_devices_agree(lambda device: tiny_routing().float(), lm_loss(32, 24))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_trains_on_cuda(tmp_path, precision):
    assert_loss_falls(train_on_cuda(tmp_path, precision, *ROUTING_RUN))


def test_truncated_cache_forgets_the_rolled_back_tokens():
    assert_truncated_cache_forgets(tiny_routing().eval(), torch.randint(0, 32, (2, 17)), keep=9)


def routing_layers(model):
    return [block.attn for block in model.blocks]


def test_centroids_move_once_per_optimizer_step_from_all_micro_batches():
    model = tiny_routing(local_heads=0).train()
    before = [a.centroids.clone() for a in routing_layers(model)]
    for micro in range(3):  # gradient accumulation: statistics add up, centroids stay put
        model(torch.randint(0, 32, (2, 10)))
        assert all(torch.equal(a.centroids, c) for a, c in zip(routing_layers(model), before))
    assert all(a._counts.sum() == 3 * 2 * 10 * 2 for a in routing_layers(model))  # micro * b * n * heads
    model.after_optimizer_step()
    for a, c in zip(routing_layers(model), before):
        assert not torch.allclose(a.centroids, c)
        torch.testing.assert_close(a.centroids.norm(dim=-1), torch.ones(2, 3, dtype=torch.double))
        assert a._counts.sum() == 0


def test_eval_forward_gathers_nothing_and_sets_no_loss():
    model = tiny_routing(local_heads=0).eval()
    model(torch.randint(0, 32, (2, 10)))
    assert all(a._counts.sum() == 0 and a.aux_loss is None for a in routing_layers(model))
    assert model.aux_loss() == 0


def test_commitment_loss_pulls_the_routed_vectors():
    model = tiny_routing(local_heads=0, commitment_weight=1.0).train()
    model(torch.randint(0, 32, (2, 10)))
    aux = model.aux_loss()
    assert aux > 0
    aux.backward()
    assert model.blocks[0].attn.to_q.weight.grad.abs().max() > 0


def test_the_commitment_loss_scales_with_commitment_weight():
    x = torch.randint(0, 32, (2, 10))
    one, two = (tiny_routing(local_heads=0, commitment_weight=weight).train() for weight in (1.0, 2.0))
    for model in (one, two):
        model(x)
    torch.testing.assert_close(two.aux_loss(), 2 * one.aux_loss())


def test_a_list_of_local_heads_gives_each_layer_its_own_in_order():
    assert [attn.local_heads for attn in routing_layers(tiny_routing(local_heads=[0, 2]))] == [0, 2]


def test_centroids_are_saved_with_the_model():
    model = tiny_routing(local_heads=0).train()
    model(torch.randint(0, 32, (2, 10)))
    model.after_optimizer_step()
    state = model.state_dict()
    assert "blocks.0.attn.centroids" in state and not any("_sums" in key for key in state)
    fresh = tiny_routing(local_heads=0, num_tokens=32)
    fresh.blocks[0].attn.centroids.zero_()
    fresh.load_state_dict(state)
    assert torch.equal(fresh.blocks[0].attn.centroids, model.blocks[0].attn.centroids)


def test_generation_works_before_any_training():
    """Centroids start as random unit vectors, so an untrained model routes and decodes."""
    from models.sampling import generate

    model = tiny_routing().eval()
    out = generate(model, torch.randint(0, 32, (1, 5)), 12, temperature=0)
    assert out.shape == (1, 12)


@pytest.mark.parametrize("bad, message", [
    (dict(window_size=0), "window_size"), (dict(num_clusters=0), "num_clusters"),
    (dict(n_local_attn_heads=3), "n_local_attn_heads"), (dict(ema_decay=1.0), "ema_decay"),
    (dict(n_local_attn_heads=[1]), "depth is 2"),
])
def test_bad_knobs_are_refused_with_the_key(bad, message):
    with pytest.raises(ValueError, match=message):
        tiny_routing(**bad)


def test_centroids_move_in_training_and_a_resumed_run_continues_with_them(tmp_path):
    from tests.helpers.runs import losses, train

    train(tmp_path / "whole", *ROUTING_RUN, "trainer.max_steps=6")
    train(tmp_path / "split", *ROUTING_RUN, "trainer.max_steps=3")
    train(tmp_path / "split", *ROUTING_RUN, "trainer.max_steps=6")  # resumes at step 3
    assert losses(tmp_path / "split") == pytest.approx(losses(tmp_path / "whole"), rel=1e-6)
    saved = [torch.load(p, weights_only=True)["model"]["blocks.0.attn.centroids"]
             for p in sorted((tmp_path / "whole" / "checkpoints").glob("step_*.pt"))]
    assert len(saved) == 3 and not torch.allclose(saved[0], saved[-1])


def test_statistics_stay_fp32_when_an_engine_casts_the_model_to_half_precision():
    model = tiny_routing(local_heads=0).float().train().to(torch.bfloat16)
    for _ in range(2):
        model(torch.randint(0, 32, (2, 300)))
    layer = model.blocks[0].attn
    assert layer._counts.dtype == torch.float32 and layer._counts.sum() == 2 * 2 * 300 * 2  # exact past 256
    before = layer.centroids.clone()
    model.after_optimizer_step()
    assert layer.centroids.dtype == torch.bfloat16 and not torch.equal(layer.centroids, before)



def layer_with_both_kinds_of_head():
    torch.manual_seed(0)
    return RoutingAttention(dim=32, heads=2, dim_head=16, window_size=16, num_clusters=4, n_local_attn_heads=1,
                            dropout=0.1)


def test_training_keeps_no_more_than_dense_attention():
    """The rotated queries and keys, the sorted layout (each key and value held twice) and the
    commitment loss's unit vectors are recomputed in the backward from the projections, so a
    training forward keeps no more than dense attention's (its input, q, k, v and the output)."""
    x = torch.randn(1, 512, 32)
    assert saved_bytes(layer_with_both_kinds_of_head(), x) <= saved_bytes(DenseAttention(dim=32, heads=2, dim_head=16), x)


def test_recomputing_the_attention_changes_nothing(monkeypatch):
    layer = layer_with_both_kinds_of_head().train()
    assert_recomputation_changes_nothing(layer, torch.randn(2, 70, 32), monkeypatch)


def test_a_centroid_moves_by_ema_decay_toward_its_members_mean_and_an_empty_one_stays():
    torch.manual_seed(0)
    attn = RoutingAttention(dim=8, heads=1, dim_head=4, window_size=2, num_clusters=2, ema_decay=0.9)
    before = attn.centroids.clone()
    attn._sums[0, 0] = torch.tensor([2.0, 0.0, 0.0, 0.0])  # two members, mean direction e0
    attn._counts[0, 0] = 2
    attn.after_optimizer_step()
    expected = F.normalize(0.9 * before[0, 0] + 0.1 * torch.tensor([1.0, 0.0, 0.0, 0.0]), dim=-1)
    torch.testing.assert_close(attn.centroids[0, 0], expected)
    torch.testing.assert_close(attn.centroids[0, 1], before[0, 1])


def test_commitment_loss_is_weight_times_mean_squared_distance_to_the_nearest_centroid():
    torch.manual_seed(0)
    attn = RoutingAttention(dim=8, heads=2, dim_head=4, window_size=2, num_clusters=3, commitment_weight=0.5).train()
    x = torch.randn(2, 5, 8)
    attn(x)
    unit = F.normalize(attn.to_q(x).view(2, 5, 2, 4).transpose(1, 2), dim=-1)  # [b, h, n, d]
    distances = (unit[..., None, :] - attn.centroids[None, :, None]).square().sum(-1)  # [b, h, n, clusters]
    torch.testing.assert_close(attn.aux_loss, 0.5 * distances.min(-1).values.mean())
