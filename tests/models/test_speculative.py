"""Speculative decoding: exactly the target's greedy tokens, exactly the target's distribution."""

import pytest
import torch

from models.lm import nsa_lm, transformer_lm
from models.sampling import generate, probabilities
from models.speculative import speculative_generate, verify, verify_greedy
from tests.helpers.speculation import greedy_acceptances

NSA_KNOBS = dict(kv_heads=1, sliding_window_size=6, compress_block_size=4, compress_stride=2, fine_block_size=4,
                 num_fine_selected=3)


def dense(depth, seed, vocab=32, dim=32):
    torch.manual_seed(seed)
    return transformer_lm(num_tokens=vocab, dim=dim, depth=depth, heads=2, dim_head=16).double().eval()


def sparse(depth, seed, vocab=32):
    torch.manual_seed(seed)
    return nsa_lm(num_tokens=vocab, dim=32, depth=depth, heads=2, dim_head=16, **NSA_KNOBS).double().eval()


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("pair", ["dense-dense", "dense-nsa", "nsa-nsa"])
def test_greedy_speculative_equals_greedy_plain(gamma, batch, pair):
    target = sparse(2, 0) if pair == "nsa-nsa" else dense(2, 0)
    draft = dense(1, 1) if pair == "dense-dense" else sparse(1, 1)
    prompt = torch.randint(0, 32, (batch, 7), generator=torch.Generator().manual_seed(gamma))
    length = 16 if "nsa" in pair else 30
    plain = generate(target, prompt, length, temperature=0)
    spec, stats = speculative_generate(target, draft, prompt, length, gamma=gamma, temperature=0)
    assert torch.equal(spec, plain)
    if batch == 1:  # the draft proposed from what was committed, each round: its cache truncated to it
        assert stats.accepted == greedy_acceptances(draft, prompt, plain, length, gamma, shorten_last=True)
    assert len(stats.accepted) > 0  # it verified drafts, not only plain steps


def test_rows_accept_different_numbers_and_still_match():
    """A draft equal to the target for some contexts and not others: rows diverge in acceptance."""
    target = dense(2, 0)
    prompt = torch.randint(0, 32, (3, 5), generator=torch.Generator().manual_seed(0))
    spec, stats = speculative_generate(target, target, prompt, 20, gamma=4, temperature=0)
    assert torch.equal(spec, generate(target, prompt, 20, temperature=0))
    assert stats.accepted == [4] * (3 * 4)  # a draft that is the target is always accepted: 4 rounds of 4 a row
    draft = dense(1, 4)  # a random draft that agrees with the target for 0 to 3 tokens in a row
    spec, stats = speculative_generate(target, draft, prompt, 20, gamma=4, temperature=0)
    assert torch.equal(spec, generate(target, prompt, 20, temperature=0))
    assert len(set(stats.accepted)) > 1  # verification steps accepted different numbers


@pytest.mark.parametrize("model", [dense, sparse])
def test_truncated_cache_continues_like_a_fresh_one(model):
    lm = model(2, 0)
    x = torch.randint(0, 32, (1, 20))
    cache = lm.new_cache()
    lm(x[:, :15], cache=cache)
    lm.truncate_cache(cache, 9)  # roll back six positions, then take another path
    other = torch.randint(0, 32, (1, 6))
    rolled = lm(other, cache=cache)
    torch.testing.assert_close(rolled, lm(torch.cat((x[:, :9], other), 1))[:, 9:])


@pytest.mark.parametrize("seed", range(4))
def test_greedy_verification_is_the_rule_on_one_hot_distributions(seed):
    """verify_greedy (argmaxes compared) gives what verify gives on the temperature-0 distributions,
    for drafts that agree with the target for 0 to gamma tokens."""
    gen = torch.Generator().manual_seed(seed)
    for gamma in (1, 3, 5):
        logits = torch.randn(gamma + 1, 8, generator=gen, dtype=torch.float64)
        predicted = logits.argmax(-1)
        for agree in range(gamma + 1):
            drafted = [int(t) for t in predicted[:agree]] + [int(predicted[i] + 1) % 8 for i in range(agree, gamma)]
            q_probs = [torch.nn.functional.one_hot(torch.tensor(t), 8).double() for t in drafted]
            expected = verify(probabilities(logits, 0, None), q_probs, drafted, gen)
            accepted, token = verify_greedy(predicted, torch.tensor(drafted))
            assert (accepted, int(token)) == expected == (agree, int(predicted[agree]))


def committed_distribution(p, q, samples, seed=0):
    """How often each token comes first out of one verification step of one drafted token."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros_like(p)
    for _ in range(samples):
        token = int(torch.multinomial(q, 1, generator=gen))
        accepted, new = verify(torch.stack((p, p)), [q], [token], gen)
        counts[token if accepted else new] += 1
    return counts / samples


def tv(a, b):
    return 0.5 * float((a - b).abs().sum())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_accept_reject_yields_the_target_distribution(seed):
    """20,000 verification steps (fixed seed, vocabulary 8) against the exact target distribution:
    total variation below 0.02 (its expected value here is about 0.008)."""
    gen = torch.Generator().manual_seed(100 + seed)
    p = torch.softmax(2 * torch.randn(8, generator=gen, dtype=torch.float64), 0)
    q = torch.softmax(2 * torch.randn(8, generator=gen, dtype=torch.float64), 0)
    assert tv(committed_distribution(p, q, 20_000, seed), p) < 0.02


def test_a_draft_that_always_disagrees_still_yields_the_target_distribution():
    p = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    q = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0], dtype=torch.float64)  # never right
    assert tv(committed_distribution(p, q, 20_000), p) < 0.02


def test_speculative_sampling_from_models_matches_the_target():
    """End to end with models, temperature and top-k: 1,500 first tokens against the target's
    exact distribution, total variation below 0.07 (expected about 0.03)."""
    target, draft = dense(1, 0, vocab=8, dim=16), dense(1, 1, vocab=8, dim=16)
    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        p = probabilities(target(prompt)[0, -1], 0.7, 5)
    out, stats = speculative_generate(target, draft, prompt.expand(1500, -1), 2, gamma=1, temperature=0.7, top_k=5,
                                      generator=torch.Generator().manual_seed(0))
    assert tv(torch.bincount(out[:, 0], minlength=8).double() / 1500, p) < 0.07
    assert 0 < stats.mean_accepted < 1  # of gamma=1 draft token
