"""The shared backbone with dense attention, and the sampling helpers; on CUDA (the gpu tier): cached
decoding, the first step against the CPU's, training in each precision."""

import pytest
import torch

from experiments.bench.agreement import lm_loss
from models.lm import transformer_lm
from models.sampling import filter_top_k, generate, sample
from tests.helpers.attention_checks import assert_attention_dropout_only_in_training
from tests.helpers.gpu import (PRECISIONS, assert_cached_decoding_on_cuda, assert_devices_agree, assert_loss_falls,
                               train_on_cuda)


def tiny_dense(**kw):
    torch.manual_seed(0)
    return transformer_lm(num_tokens=64, dim=32, depth=2, heads=2, dim_head=16, **kw).eval()


def test_logits_shape():
    model = tiny_dense()
    assert model(torch.randint(0, 64, (3, 20))).shape == (3, 20, 64)


def test_dense_model_is_causal():
    model = tiny_dense()
    x = torch.randint(0, 64, (2, 40))
    base = model(x)
    for t in (0, 7, 20, 38):
        changed = x.clone()
        changed[:, t + 1 :] = torch.randint(0, 64, changed[:, t + 1 :].shape)
        out = model(changed)
        assert torch.equal(out[:, : t + 1], base[:, : t + 1]), f"logits at <= {t} moved"
        assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :]), "the perturbation changed nothing"


def test_cached_decoding_equals_parallel_forward():
    model = tiny_dense()
    x = torch.randint(0, 64, (2, 30))
    full = model(x)
    cache = model.new_cache()
    pieces = [model(x[:, :11], cache=cache)] + [model(x[:, t : t + 1], cache=cache) for t in range(11, 30)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reversible", [False, True])
def test_the_logits_read_the_final_norms_output(reversible):
    model = tiny_dense(reversible=reversible)
    x = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        before = model(x)
        model.norm.weight.mul_(torch.linspace(0.5, 2.0, len(model.norm.weight)))
        assert not torch.allclose(model(x), before)


def test_filter_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0]])
    kept = filter_top_k(logits, 2)
    assert torch.isfinite(kept).tolist() == [[False, True, False, True]]
    assert torch.equal(filter_top_k(logits, None), logits)


def test_greedy_sampling_is_argmax_and_top1_is_greedy():
    logits = torch.randn(5, 16)
    assert torch.equal(sample(logits, temperature=0), logits.argmax(-1))
    assert torch.equal(sample(logits, temperature=1.0, top_k=1), logits.argmax(-1))


def test_greedy_generation_matches_uncached_greedy_decoding():
    model = tiny_dense()
    prompt = torch.randint(0, 64, (2, 5))
    out = generate(model, prompt, 12, temperature=0)
    seq = prompt
    for _ in range(12):
        seq = torch.cat((seq, model(seq)[:, -1].argmax(-1, keepdim=True)), 1)
    assert torch.equal(out, seq[:, 5:])


def test_chunked_feed_forward_equals_the_whole():
    whole, chunked = tiny_dense(), tiny_dense(ff_chunks=3)
    x = torch.randint(0, 64, (2, 20))
    torch.testing.assert_close(chunked(x), whole(x))


def test_factorised_embedding_shapes_and_parameters():
    model = tiny_dense(emb_dim=8)
    assert model.token_emb.weight.shape == (64, 8) and model.to_logits.weight.shape == (64, 8)
    assert model(torch.randint(0, 64, (2, 5))).shape == (2, 5, 64)
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in tiny_dense().parameters())


def _block_step(recompute_norms: bool, monkeypatch):
    """One pre-norm block's training step -> its gradients and the bytes it kept for the backward."""
    from models import transformer
    from models.recompute import RecomputedLayers

    if not recompute_norms:
        monkeypatch.setattr(transformer, "RecomputedLayers", lambda enabled: RecomputedLayers(enabled=False))
    torch.manual_seed(0)
    block = tiny_dense().blocks[0].train()
    x = torch.randn(2, 12, 32, requires_grad=True)
    storages = {}
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x).square().sum().backward()
    return [x.grad, *(p.grad for p in block.parameters())], sum(storages.values())


def test_a_block_recomputes_its_norms_outputs_instead_of_keeping_them(monkeypatch):
    """Each LayerNorm's input is kept for its own backward; its output, which the attention's and
    the feed-forward's first projections read, is recomputed from it: two [batch, seq, dim] fewer."""
    grads, kept = _block_step(True, monkeypatch)
    plain_grads, plain_kept = _block_step(False, monkeypatch)
    assert plain_kept - kept == 2 * 2 * 12 * 32 * 4
    for got, expected in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.gpu
def test_cached_decoding_equals_parallel_forward_on_cuda():
    assert_cached_decoding_on_cuda(tiny_dense(), torch.randint(0, 64, (2, 30)), [11] + [1] * 19)


@pytest.mark.gpu
def test_first_step_agrees_between_the_cpu_and_cuda():
    assert_devices_agree(lambda device: tiny_dense(), lm_loss(64, 30))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_trains_on_cuda(tmp_path, precision):
    assert_loss_falls(train_on_cuda(tmp_path, precision))


def test_attention_dropout_drops_in_training_and_not_in_eval():
    assert_attention_dropout_only_in_training(tiny_dense, torch.randint(0, 64, (2, 16)))
