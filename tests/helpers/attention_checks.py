"""Checks every attention variant must pass on the backbone: causality (by perturbation and by
gradient, in train and eval mode) and cached decoding equal to the parallel forward."""

import torch

from kernels import recompute


def logits_with_embedding(model, tokens):
    """logits [b, n, vocab] and the embedding output they were computed from (grad-enabled)."""
    captured = {}

    def keep(module, args, output):
        captured["emb"] = output
        return output

    handle = model.token_emb.register_forward_hook(keep)
    try:
        logits = model(tokens)
    finally:
        handle.remove()
    return logits, captured["emb"]


def assert_causal_by_perturbation(model, tokens, t, *, seed=0):
    """Changing every token after t leaves the logits at <= t unchanged (same random state for
    dropout and noise in both passes), and does change some later logit.

    Unchanged to 1e-12, not to the bit: Routing sorts tokens by cluster, so a later token that moves
    to another cluster regroups the products an earlier query's scores come from, and on some CPUs'
    BLAS (an AMD EPYC here) that moves the float64 logits by 1e-16. A leak moves them by far more."""
    changed = tokens.clone()
    vocab = model.num_tokens
    tail = changed[:, t + 1 :]
    changed[:, t + 1 :] = (tail + 1 + torch.randint(0, vocab - 1, tail.shape)) % vocab
    torch.manual_seed(seed)
    base = model(tokens)
    torch.manual_seed(seed)
    out = model(changed)
    before, after = base[:, : t + 1], out[:, : t + 1]
    moved = torch.where(after == before, 0.0, (after - before).abs()).max().item()  # masked logits: -inf in both
    assert moved <= 1e-12, f"logits at <= {t} moved by {moved:.3g} when later tokens changed"
    if t + 1 < tokens.shape[1]:
        assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :]), "the perturbation changed nothing"


def assert_causal_by_gradient(model, tokens, t):
    """The logits at t have zero gradient with respect to every later input embedding, and a
    nonzero one with respect to some earlier one."""
    logits, emb = logits_with_embedding(model, tokens)
    (grad,) = torch.autograd.grad(logits[:, t].sum(), emb)
    assert grad[:, t + 1 :].abs().max() == 0, f"position {t} depends on a later position"
    assert grad[:, : t + 1].abs().max() > 0


def assert_cached_decoding_equals_parallel(model, tokens, pieces, atol=1e-10):
    """Feeding `tokens` to the cache in pieces of the given lengths gives the parallel logits."""
    full = model(tokens)
    cache = model.new_cache()
    outs, start = [], 0
    for size in pieces:
        outs.append(model(tokens[:, start : start + size], cache=cache))
        start += size
    assert start == tokens.shape[1]
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=0, atol=atol)


def assert_truncated_cache_forgets(model, tokens, keep):
    """Decoding, rolling the cache back to `keep` positions and decoding other tokens gives the
    parallel logits of the new sequence (speculative decoding's rollback)."""
    other = tokens.clone()
    other[:, keep:] = (other[:, keep:] + 1) % model.num_tokens
    cache = model.new_cache()
    model(tokens, cache=cache)
    model.truncate_cache(cache, keep)
    tail = torch.cat([model(other[:, i : i + 1], cache=cache) for i in range(keep, tokens.shape[1])], 1)
    torch.testing.assert_close(tail, model(other)[:, keep:], rtol=0, atol=1e-10)


def saved_bytes(layer, x):
    """Bytes a training forward of `layer` keeps for its backward pass: each storage once, the
    layer's own parameters left out."""
    parameters = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in parameters:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x).sum().backward()
    return sum(storages.values())


def assert_recomputation_changes_nothing(layer, x, monkeypatch):
    """The training forward, whose attention is recomputed in the backward (kernels.recompute.s
    `recomputed`), gives the output and gradients, to the bit, of the same forward keeping
    everything (random draws included: dropout, Gumbel noise; a layer's aux_loss included)."""
    results = []
    for recomputing in (True, False):
        if not recomputing:
            monkeypatch.setattr(recompute, "checkpoint", lambda f, *args, use_reentrant: f(*args))
        layer.zero_grad(set_to_none=True)
        x_in = x.clone().requires_grad_()
        torch.manual_seed(0)
        out = layer(x_in)
        loss = out.square().sum()
        if getattr(layer, "aux_loss", None) is not None:
            loss = loss + layer.aux_loss
        loss.backward()
        results.append([out.detach(), x_in.grad, *(p.grad for p in layer.parameters() if p.grad is not None)])
    assert len(results[0]) == len(results[1]) > 2
    for got, expected in zip(*results):
        assert torch.equal(got, expected)


def assert_attention_dropout_only_in_training(build, tokens):
    """`build(**knobs)` -> a model in eval mode, the same weights for any knobs: with attn_dropout=0.5
    its eval output is the model's without dropout (the knob reached the layers and is off in eval),
    and in training two calls differ."""
    model = build(attn_dropout=0.5)
    assert torch.equal(model(tokens), build()(tokens))
    model.train()
    assert not torch.equal(model(tokens), model(tokens))
