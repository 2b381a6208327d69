"""DeepSeek Sparse Attention: causality in both stages, the attention and the indexer's KL losses
against their definitions, the stage schedule, caching, bad knobs, a run that resumes."""

import pytest
import torch
import torch.nn.functional as F

from kernels.gather_attention import cpu_built as gather_cpu_built
from kernels.lightning_index import cpu_built as index_cpu_built
from kernels.lightning_index.naive import index_scores, index_topk
from models.attention.dsa import DeepSeekSparseAttention
from models.lm import dsa_lm
from models.transformer import parameters_trained_alone
from tests.helpers.attention_checks import (assert_cached_decoding_equals_parallel, assert_causal_by_gradient,
                                            assert_causal_by_perturbation, assert_truncated_cache_forgets)
from tests.helpers.kernel_checks import device_for

STAGES = {"warm-up": 10, "sparse": 0}  # warmup_steps: a fresh model is in the warm-up, or sparse from the start


def tiny_dsa(stage="sparse", **overrides):
    torch.manual_seed(0)
    knobs = dict(num_tokens=32, dim=32, depth=2, heads=4, dim_head=16, kv_heads=2, index_heads=2, index_dim_head=8,
                 top_k=5, warmup_steps=STAGES[stage], kl_weight=1.0, kernel="torch")
    return dsa_lm(**{**knobs, **overrides}).double()


def layer(stage="sparse", **overrides):
    torch.manual_seed(1)
    knobs = dict(dim=16, heads=4, dim_head=8, kv_heads=2, index_heads=3, index_dim_head=8, top_k=4,
                 warmup_steps=STAGES[stage], kl_weight=1.0, kernel="torch")
    return DeepSeekSparseAttention(**{**knobs, **overrides}).double()


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("t", [0, 3, 4, 5, 11, 21])
def test_causal_by_perturbation(t, mode, stage):
    model = tiny_dsa(stage).train(mode == "train")
    assert_causal_by_perturbation(model, torch.randint(0, 32, (2, 23)), t)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("t", [2, 4, 11, 16])
def test_causal_by_gradient(t, stage):
    assert_causal_by_gradient(tiny_dsa(stage).train(), torch.randint(0, 32, (2, 21)), t)


def projections(attn, x):
    """The layer's rotated q [b, heads, n, d], k, v [b, kv_heads, n, d] and the indexer's outputs."""
    q = attn.rotary(attn.to_q(x).unflatten(-1, (attn.heads, -1)).transpose(1, 2))
    k, v = attn.to_kv(x).unflatten(-1, (2, attn.kv_heads, -1)).permute(2, 0, 3, 1, 4)
    return q, attn.rotary(k), v, attn.indexer(x, 0)


def chosen_mask(chosen, n):
    """indices [b, m, top_k] (-1: unused) -> [b, m, n] bool, True at the chosen keys."""
    unused_last = torch.where(chosen < 0, n, chosen)
    return torch.zeros(*chosen.shape[:2], n + 1, dtype=torch.bool).scatter_(2, unused_last, True)[..., :n]


def test_sparse_attention_attends_to_the_indexers_top_k_tokens_alone():
    """Every head over the top_k tokens of I(t, s) = sum_j w(t, j) ReLU(q(t, j) . k(s)), dense and
    masked, values and gradients."""
    attn = layer()
    x = torch.randn(2, 19, 16, dtype=torch.double, requires_grad=True)
    out = attn(x)
    q, k, v, (index_q, index_k, index_w) = projections(attn, x)
    chosen = index_topk(index_q, index_k, index_w, 0, 4)  # [b, n, top_k]
    mask = chosen_mask(chosen, 19)
    dense = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                           attn_mask=mask[:, None])
    expected = attn.to_out(dense.transpose(1, 2).flatten(2))
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    grads = [torch.autograd.grad(y.square().sum(), [x, attn.to_q.weight, attn.to_kv.weight]) for y in (out, expected)]
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_warm_up_attends_densely():
    attn = layer("warm-up")
    x = torch.randn(2, 19, 16, dtype=torch.double)
    q, k, v, _ = projections(attn, x)
    dense = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(attn(x), attn.to_out(dense.transpose(1, 2).flatten(2)), rtol=1e-10, atol=1e-10)


def kl(target, scores):
    """mean over rows of KL(target || softmax(scores)), both [rows, keys] (-inf: not a key)."""
    log_q = scores.log_softmax(-1)
    return torch.where(target > 0, target * (target.log() - log_q), 0.0).sum() / target.shape[0]


@pytest.mark.parametrize("stage", STAGES)
def test_the_indexers_kl_follows_the_report(stage, monkeypatch):
    """Warm-up: KL(dense attention averaged over the heads || softmax(I) over every key <= t);
    sparse: the same over the chosen tokens, the sparse attention's distribution as the target;
    mean over queries, times kl_weight; computed chunk by chunk (one query a chunk here)."""
    import models.attention.dsa as dsa

    monkeypatch.setattr(dsa, "_KL_CHUNK", 1)
    attn = layer(stage, kl_weight=0.5).train()
    x = torch.randn(2, 13, 16, dtype=torch.double)
    attn(x)
    q, k, v, (index_q, index_k, index_w) = projections(attn, x)
    scores = torch.einsum("bhnd,bhkd->bhnk", q, k.repeat_interleave(2, 1)) * 8**-0.5
    index = index_scores(index_q, index_k, index_w, 0)  # -inf after t
    keep = index > float("-inf")
    if stage == "sparse":
        chosen = index_topk(index_q, index_k, index_w, 0, 4)
        keep = chosen_mask(chosen, 13)
    target = scores.masked_fill(~keep[:, None], float("-inf")).softmax(-1).mean(1)
    expected = 0.5 * kl(target.flatten(0, 1), index.masked_fill(~keep, float("-inf")).flatten(0, 1))
    torch.testing.assert_close(attn.aux_loss, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("stage", STAGES)
def test_the_kl_trains_the_indexer_alone_and_the_language_loss_everything_else(stage):
    model = tiny_dsa(stage).train()
    x = torch.randint(0, 32, (2, 23))
    logits = model(x)
    indexer = {name for name, _ in model.named_parameters() if ".indexer." in name}
    rest = [name for name, _ in model.named_parameters() if name not in indexer]
    params = dict(model.named_parameters())
    from_kl = torch.autograd.grad(model.aux_loss(), list(params.values()), retain_graph=True, allow_unused=True)
    from_lm = torch.autograd.grad(logits.square().sum(), list(params.values()), allow_unused=True)
    for name, kl_grad, lm_grad in zip(params, from_kl, from_lm):
        if name in indexer:
            assert kl_grad is not None and kl_grad.abs().max() > 0 and lm_grad is None, name
        else:
            assert kl_grad is None, name
    assert rest and any(g is not None and g.abs().max() > 0 for n, g in zip(params, from_lm) if n in rest)


def test_the_stage_turns_sparse_after_warmup_steps_and_is_saved_with_the_model():
    model = tiny_dsa("warm-up", warmup_steps=2)
    layers = [block.attn for block in model.blocks]
    x = torch.randint(0, 32, (1, 23))
    assert all(a.warming_up for a in layers)
    dense = model(x)
    model.after_optimizer_step()
    torch.testing.assert_close(model(x), dense)
    model.after_optimizer_step()
    assert not any(a.warming_up for a in layers) and not torch.allclose(model(x), dense)
    fresh = tiny_dsa("warm-up", warmup_steps=2)
    fresh.load_state_dict(model.state_dict())
    assert not fresh.blocks[0].attn.warming_up and int(fresh.blocks[0].attn.steps) == 2


def test_evaluation_sets_no_loss():
    model = tiny_dsa().eval()
    model(torch.randint(0, 32, (2, 10)))
    assert all(block.attn.aux_loss is None for block in model.blocks) and model.aux_loss() == 0


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("pieces", [[23], [1] * 23, [5, 3, 8, 7]], ids=str)
def test_cached_decoding_equals_parallel_forward(pieces, stage):
    assert_cached_decoding_equals_parallel(tiny_dsa(stage).eval(), torch.randint(0, 32, (2, 23)), pieces)


def test_truncated_cache_forgets_the_rolled_back_tokens():
    assert_truncated_cache_forgets(tiny_dsa().eval(), torch.randint(0, 32, (2, 17)), keep=9)


@pytest.mark.triton
def test_triton_kernels_train_as_the_torch_path():
    """The indexer's scoring and the gather attention on Triton (interpreted on a CPU): the same
    output, KL and gradients as the torch path, fp32."""
    results = []
    for kernel in ("torch", "triton"):
        torch.manual_seed(0)
        attn = DeepSeekSparseAttention(dim=32, heads=4, dim_head=16, kv_heads=2, index_heads=2, index_dim_head=16,
                                       top_k=6, warmup_steps=0, kl_weight=1.0, kernel=kernel).train()
        attn.to(device_for(kernel))
        x = torch.randn(1, 21, 32, generator=torch.Generator().manual_seed(1)).to(device_for(kernel)).requires_grad_()
        out = attn(x)
        results.append([t.cpu() for t in (out, attn.aux_loss, *torch.autograd.grad(out.square().sum() + attn.aux_loss,
                                                                                   [x, *attn.parameters()]))])
    for expected, got in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not (gather_cpu_built() and index_cpu_built()), reason="no C compiler to build the CPU kernels")
def test_c_kernels_train_as_the_torch_path():
    """kernel=auto and kernel=cpu on CPU tensors: the indexer's top-k, the gather attention, the KL's
    target and the chosen keys' scores on the C kernels: the same output, KL and gradients as the
    torch path, fp32."""
    results = []
    for kernel in ("torch", "auto", "cpu"):
        torch.manual_seed(0)
        attn = DeepSeekSparseAttention(dim=32, heads=4, dim_head=16, kv_heads=2, index_heads=2, index_dim_head=16,
                                       top_k=6, warmup_steps=0, kl_weight=1.0, kernel=kernel).train()
        x = torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(1)).requires_grad_()
        out = attn(x)
        results.append([out, attn.aux_loss, *torch.autograd.grad(out.square().sum() + attn.aux_loss,
                                                                 [x, *attn.parameters()])])
    for c_kernels in results[1:]:
        for expected, got in zip(results[0], c_kernels):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not (gather_cpu_built() and index_cpu_built()), reason="no C compiler to build the CPU kernels")
@pytest.mark.parametrize("pieces", [[1] * 23, [5, 3, 8, 7]], ids=str)
def test_cached_decoding_equals_parallel_forward_on_the_c_kernels(pieces):
    model = tiny_dsa(kernel="auto").float().eval()
    assert_cached_decoding_equals_parallel(model, torch.randint(0, 32, (2, 23)), pieces, atol=1e-5)


@pytest.mark.parametrize("bad, message", [
    (dict(kv_heads=3), "heads=4 must be a multiple of kv_heads=3"), (dict(index_heads=0), "index_heads=0"),
    (dict(top_k=0), "top_k=0"), (dict(index_dim_head=7), "index_dim_head=7 must be even"),
    (dict(kl_weight=0.0), "set model.kl_weight > 0, or model.warmup_steps=0"),
    (dict(attn_dropout=0.1), "set model.attn_dropout=0"),
    (dict(kernel="triton", index_dim_head=24), "index_dim_head=24 to be a power of two"),
])
def test_bad_knobs_are_refused_with_the_key(bad, message):
    with pytest.raises(ValueError, match=message):
        tiny_dsa("warm-up", **bad)


DSA_RUN = ["model=dsa", "model.kv_heads=1", "model.top_k=8", "model.index_dim_head=8", "model.warmup_steps=3",
           "schedule=constant", "trainer.validate_every=0", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=3"]


def test_a_run_resumed_across_the_warm_up_continues_its_stage(tmp_path):
    from tests.helpers.runs import TINY, losses, train

    train(tmp_path / "whole", *DSA_RUN, "trainer.max_steps=5", base=TINY)
    train(tmp_path / "split", *DSA_RUN, "trainer.max_steps=2", base=TINY)
    train(tmp_path / "split", *DSA_RUN, "trainer.max_steps=5", base=TINY)  # resumes at step 2, sparse from 3
    assert losses(tmp_path / "split") == pytest.approx(losses(tmp_path / "whole"), rel=1e-6)
    saved = torch.load(sorted((tmp_path / "whole" / "checkpoints").glob("step_*.pt"))[-1], weights_only=True)
    assert int(saved["model"]["blocks.0.attn.steps"]) == 5


def test_deepspeed_trains_it(tmp_path):
    from tests.helpers.runs import TINY, read_summary, train

    train(tmp_path, *DSA_RUN, "trainer.max_steps=4", "backend=deepspeed", base=TINY, timeout=600)
    assert read_summary(tmp_path)["status"] == "completed"


# ---- on CUDA (the gpu tier; tests/conftest.py skips it where there is none) ------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_cached_decoding_equals_parallel_forward_on_cuda(kernel):
    from tests.helpers.gpu import assert_cached_decoding_on_cuda

    assert_cached_decoding_on_cuda(tiny_dsa(kernel=kernel), torch.randint(0, 32, (2, 23)), [5, 3, 8, 7])


@pytest.mark.gpu
@pytest.mark.parametrize("stage", STAGES)
def test_first_step_agrees_between_the_cpu_and_cuda(stage):
    from experiments.bench.agreement import lm_loss
    from tests.helpers.gpu import assert_devices_agree

    assert_devices_agree(lambda device: tiny_dsa(stage, kernel="auto").float(), lm_loss(32, 24))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_trains_on_cuda(tmp_path, precision):
    from tests.helpers.gpu import assert_loss_falls, train_on_cuda
    from tests.helpers.runs import TINY

    assert_loss_falls(train_on_cuda(tmp_path, precision, *DSA_RUN, base=TINY))


# ---- warm-up from a trained dense model: the indexer alone learns (model.warmup_trains) ------------


def train_steps(model, steps: int, seed: int = 0):
    """`steps` AdamW steps (weight decay on) of the LM loss plus the KL -> the parameter names that got a
    gradient at each step."""
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    touched = []
    for _ in range(steps):
        tokens = torch.randint(0, 32, (2, 17), generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + model.aux_loss()
        loss.backward()
        touched.append({n for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.after_optimizer_step()
    return touched


def test_indexer_warm_up_trains_the_indexer_alone_and_leaves_the_rest_unchanged_to_the_bit():
    model = tiny_dsa("warm-up", warmup_trains="indexer").train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    indexer = {n for n in before if ".attn.indexer." in n}
    assert indexer and len(indexer) < len(before)
    # what DeepSpeed's optimizer keeps out of the held-still group: exactly the parameters that learn
    named = dict(model.named_parameters())
    assert {id(p) for p in parameters_trained_alone(model)} == {id(named[n]) for n in indexer}
    assert train_steps(model, 3) == [indexer] * 3
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) != (name in indexer), name


def test_after_the_indexer_warm_up_everything_trains():
    model = tiny_dsa("warm-up", warmup_trains="indexer", warmup_steps=1).train()
    everything = {n for n, _ in model.named_parameters()}
    touched = train_steps(model, 2)
    assert touched[0] == {n for n in everything if ".attn.indexer." in n} and touched[1] == everything


def test_warm_up_of_everything_trains_every_parameter():
    model = tiny_dsa("warm-up", warmup_trains="all").train()
    assert parameters_trained_alone(model) == []
    assert train_steps(model, 1) == [{n for n, _ in model.named_parameters()}]


def test_the_indexer_warm_up_computes_what_warm_up_of_everything_does():
    """Freezing changes what learns, not the forward: the same logits and the same KL."""
    tokens = torch.randint(0, 32, (2, 19))
    results = []
    for trains in ("indexer", "all"):
        model = tiny_dsa("warm-up", warmup_trains=trains).train()
        results.append((model(tokens), model.aux_loss()))
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-12, atol=0)  # summed in another order


def test_warmup_trains_must_be_indexer_or_all():
    with pytest.raises(ValueError, match="warmup_trains=rest must be indexer or all"):
        layer("warm-up", warmup_trains="rest")
