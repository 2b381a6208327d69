"""Reversible residual layers: the recomputing backward equals autograd through the same
coupling, memory stays flat in depth, and side effects run once."""

import pytest
import torch

from kernels import span_attention
from kernels import recompute as kernel_recompute
from models import recompute
from models.lm import dsa_lm, moba_lm, nsa_lm, routing_lm, sinkhorn_lm, transformer_lm

KNOBS = dict(num_tokens=32, dim=32, heads=2, dim_head=16)
MODELS = {
    "dense": lambda depth, **kw: transformer_lm(**KNOBS, depth=depth, **kw),
    "sinkhorn": lambda depth, **kw: sinkhorn_lm(**KNOBS, depth=depth, bucket_size=4, n_local_attn_heads=1, **kw),
    "routing": lambda depth, **kw: routing_lm(**KNOBS, depth=depth, window_size=4, num_clusters=3, ema_decay=0.999,
                                              commitment_weight=0.1, **{"n_local_attn_heads": 0, **kw}),
    # no attention dropout in their kernels; DSA sparse from the start, its indexer learning by its KL loss
    "moba": lambda depth, **kw: moba_lm(**KNOBS, depth=depth, kv_heads=1, block_size=4, top_k=2, kernel="torch",
                                        **{**kw, "attn_dropout": 0.0}),
    "dsa": lambda depth, **kw: dsa_lm(**KNOBS, depth=depth, kv_heads=1, index_heads=2, index_dim_head=8, top_k=4,
                                      warmup_steps=0, kl_weight=1.0, kernel="torch", **{**kw, "attn_dropout": 0.0}),
}


def coupled_forward(model, tokens):
    """The reversible model's function, through plain autograd (every activation kept)."""
    x = model.project_in(model.token_emb(tokens))
    x1 = x2 = x
    aux = 0
    for block in model.blocks:
        x1, x2 = block.forward_reversible(x1, x2)
        aux = aux + (block.attn.aux_loss if getattr(block.attn, "aux_loss", None) is not None else 0)
    return model.to_logits(model.project_out(model.norm((x1 + x2) / 2))), aux


def gradients(model, loss_fn):
    model.zero_grad()
    torch.manual_seed(1)  # dropout and Gumbel noise draw the same numbers in both passes
    loss_fn().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", MODELS)
def test_recomputing_backward_equals_autograd_through_the_coupling(name):
    torch.manual_seed(0)
    model = MODELS[name](3, reversible=True, attn_dropout=0.1, ff_dropout=0.1, emb_dim=16, ff_chunks=3).double().train()
    tokens = torch.randint(0, 32, (2, 13))
    weights = torch.randn(2, 13, 32, dtype=torch.double)

    def reversible_loss():
        return (model(tokens) * weights).sum() + model.aux_loss()

    def plain_loss():
        logits, aux = coupled_forward(model, tokens)
        return (logits * weights).sum() + aux

    recomputed, plain = gradients(model, reversible_loss), gradients(model, plain_loss)
    assert recomputed.keys() == plain.keys() and len(plain) == len(list(model.parameters()))
    for key in plain:
        torch.testing.assert_close(recomputed[key], plain[key], rtol=1e-9, atol=1e-12, msg=key)


def saved_bytes(model, tokens) -> int:
    """Bytes of tensors autograd keeps, at the end of a training forward, for the backward pass
    (a reversible backward recomputes one block at a time, so its peak adds one block's worth)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens)
    logits.sum().backward()
    return total


def test_saved_activations_do_not_grow_with_depth():
    tokens = torch.randint(0, 32, (2, 64))
    shallow, deep = (saved_bytes(MODELS["sinkhorn"](depth, reversible=True).train(), tokens) for depth in (2, 8))
    plain_shallow, plain_deep = (saved_bytes(MODELS["sinkhorn"](depth).train(), tokens) for depth in (2, 8))
    assert deep == shallow  # only the last block's outputs, whatever the depth
    assert plain_deep > 3 * plain_shallow / 2 and deep < plain_deep / 4


def test_routing_statistics_are_gathered_once_despite_recomputation():
    torch.manual_seed(0)
    model = MODELS["routing"](2, reversible=True, n_local_attn_heads=0).train()
    model(torch.randint(0, 32, (2, 10))).sum().backward()
    assert all(block.attn._counts.sum() == 2 * 10 * 2 for block in model.blocks)  # batch * seq * heads


@pytest.mark.parametrize("name", ["sinkhorn", "routing"])
def test_bucketed_attention_is_not_checkpointed_inside_a_reversible_block(name, monkeypatch):
    """A reversible block is recomputed whole in the backward and its activations freed at once:
    a checkpoint of its attention would compute that attention a third time for nothing."""
    calls = []
    monkeypatch.setattr(kernel_recompute, "checkpoint", lambda f, *args, use_reentrant: calls.append(f) or f(*args))
    tokens = torch.randint(0, 32, (2, 12))
    MODELS[name](2, reversible=True).train()(tokens).sum().backward()
    assert not calls
    MODELS[name](2).train()(tokens).sum().backward()
    # where the layers are not reversible, per layer: the attention (and routing's commitment loss)
    assert len(calls) == 2 * {"sinkhorn": 1, "routing": 2}[name]


@pytest.mark.parametrize("knobs", [
    pytest.param(dict(kernel="cpu"), id="cpu-kernels", marks=pytest.mark.skipif(
        not span_attention.available(), reason="no C compiler for the CPU kernel")),
    pytest.param(dict(diff_topk=True), id="diff-topk"),
])
def test_nsa_recomputes_nothing_of_its_own_inside_a_reversible_block(knobs, monkeypatch):
    """NSA's own recomputations (its compressors, or with diff_topk its whole attention; its
    projections; the blocks' norms) are skipped while a reversible block is recomputed, whose
    activations are freed at once: they would compute those a third time for nothing."""
    calls, reads = [], []
    monkeypatch.setattr(kernel_recompute, "checkpoint", lambda f, *args, use_reentrant: calls.append(f) or f(*args))
    read = recompute._Recipe.read
    monkeypatch.setattr(recompute._Recipe, "read", lambda recipe: reads.append(recipe) or read(recipe))
    tokens = torch.randint(0, 32, (2, 24))

    def nsa(**kw):
        return nsa_lm(**KNOBS, depth=2, kv_heads=1, sliding_window_size=8, compress_block_size=4, compress_stride=2,
                      fine_block_size=4, num_fine_selected=2, **knobs, **kw).train()

    nsa(reversible=True)(tokens).sum().backward()
    assert not calls and not reads
    nsa()(tokens).sum().backward()
    assert len(calls) == 2 and reads  # where the layers are not reversible: one checkpoint per layer


def test_inference_equals_the_training_forward():
    torch.manual_seed(0)
    model = MODELS["dense"](3, reversible=True).double().eval()
    tokens = torch.randint(0, 32, (2, 11))
    training_path = model(tokens)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), training_path)


def test_a_reversible_run_trains_and_counts_its_flops(tmp_path):
    from tests.helpers.runs import read_summary, train

    run = tmp_path / "run"
    train(run, "model=sinkhorn", "model.bucket_size=8", "model.n_local_attn_heads=1", "model.reversible=true",
          "model.ff_chunks=2", "model.emb_dim=16", "trainer.max_steps=3", "schedule=constant")
    summary = read_summary(run)
    assert summary["status"] == "completed" and summary["flops_per_token"] > 0
