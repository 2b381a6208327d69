"""The static-cache decoding engine (models/decoding.py): its steps give the parallel pass's logits
for every LM attention it serves, through rollbacks; its greedy and speculative decoding give the
growing cache's greedy tokens, eagerly and compiled; what it cannot serve is refused in one line."""

import copy

import pytest
import torch

from models.decoding import ENGINES, StaticDecoder, choose_engine, greedy, speculative_greedy
from models.lm import nsa_lm, routing_lm, sinkhorn_lm, transformer_lm
from models.sampling import generate
from models.transformer import TransformerLM
from tests.helpers.speculation import greedy_acceptances

COMMON = dict(num_tokens=32, dim=32, heads=2, dim_head=16)
BUILDERS = {
    "dense": lambda depth: transformer_lm(**COMMON, depth=depth),
    "sinkhorn": lambda depth: sinkhorn_lm(**COMMON, depth=depth, bucket_size=4, n_local_attn_heads=1),
    "routing": lambda depth: routing_lm(**COMMON, depth=depth, window_size=4, num_clusters=3, n_local_attn_heads=1,
                                        ema_decay=0.99),
}


def tiny(kind: str, depth: int = 2, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    return BUILDERS[kind](depth).double().eval()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    yield
    torch._dynamo.reset()  # the compiled steps hold guards on these models: none outlive the test


@pytest.mark.parametrize("kind", BUILDERS)
def test_steps_and_rollbacks_give_the_parallel_logits(kind):
    """A prefill, steps of one and of four tokens across bucket and window edges, and rollbacks
    (the later positions' stale keys must stay unread until overwritten): each step's logits are
    the parallel pass's at its positions, to float64 round-off."""
    model = tiny(kind)
    tokens = torch.randint(0, 32, (2, 30), generator=torch.Generator().manual_seed(1))
    other = torch.randint(0, 32, (2, 30), generator=torch.Generator().manual_seed(2))
    engine = StaticDecoder(model, batch=2, capacity=32)
    with torch.no_grad():
        full = model(tokens)
        torch.testing.assert_close(engine.prefill(tokens[:, :5]), full[:, :5], rtol=0, atol=1e-10)
        start = 5
        for length in (1, 4, 1, 1, 4, 4, 1):
            engine.step(other[:, start : start + length])  # a rejected proposal: written, then rolled back
            engine.rollback(start)
            logits = engine.step(tokens[:, start : start + length])
            torch.testing.assert_close(logits, full[:, start : start + length], rtol=0, atol=1e-10)
            start += length


def drafts(target: TransformerLM, kind: str) -> dict[str, TransformerLM]:
    """Drafts that agree with the target always (itself), sometimes (perturbed), and rarely (another model)."""
    perturbed = copy.deepcopy(target)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.5 * p.std() * torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype))
    return {"same": target, "perturbed": perturbed, "other": tiny(kind, depth=1, seed=5)}


def assert_greedy_equal(target, draft, compile_mode, gamma=3, length=24):
    """The engine's greedy and speculative decoding give generate()'s greedy tokens."""
    prompt = torch.randint(0, 32, (1, 9), generator=torch.Generator().manual_seed(4))
    capacity = prompt.shape[1] + length + gamma + 1
    target_engine = StaticDecoder(target, 1, capacity, compile_mode)
    expected = generate(target, prompt, length + gamma, temperature=0)  # a last round may check drafts past length
    assert torch.equal(greedy(target_engine, prompt, length), expected[:, :length])
    tokens, stats = speculative_greedy(target_engine, StaticDecoder(draft, 1, capacity, compile_mode), prompt, length,
                                       gamma)
    assert torch.equal(tokens, expected[:, :length])
    # the draft proposed from what was committed, each round: its cache rolled back to it
    assert stats.accepted == greedy_acceptances(draft, prompt, expected, length, gamma, shorten_last=False)
    return stats


@pytest.mark.parametrize("kind", BUILDERS)
def test_greedy_and_speculative_decoding_equal_the_growing_caches(kind):
    target = tiny(kind)
    accepted = {}
    for name, draft in drafts(target, kind).items():
        accepted[name] = assert_greedy_equal(target, draft, None).accepted
    # every path of a round taken: all drafts kept (the draft then lags two tokens), some, none
    assert set(accepted["same"]) == {3}
    assert any(0 < a < 3 for a in accepted["perturbed"] + accepted["other"]) and 0 in accepted["other"]


def test_the_compiled_engine_decodes_as_the_eager_one():
    """Both step shapes compiled whole (fullgraph) for a model with a layer of each attention,
    target and draft: the greedy tokens of generate() again."""
    torch.manual_seed(0)
    kinds = iter(["dense", "sinkhorn", "routing"])
    target = TransformerLM(num_tokens=32, dim=32, depth=3, attention=lambda: BUILDERS[next(kinds)](1).blocks[0].attn)
    target = target.double().eval()
    stats = assert_greedy_equal(target, drafts(target, "dense")["perturbed"], "default")
    assert any(0 < a < 3 for a in stats.accepted)


def test_what_the_engine_cannot_serve_is_refused_in_one_line():
    nsa = nsa_lm(**COMMON, depth=1, kv_heads=1, sliding_window_size=8, compress_block_size=4, compress_stride=2,
                 fine_block_size=4, num_fine_selected=3)
    with pytest.raises(ValueError, match="NativeSparseAttention has no static cache: decode it with the growing cache"):
        StaticDecoder(nsa, 1, 16)
    dense = tiny("dense")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="replays CUDA graphs: it needs the model on CUDA"):
            StaticDecoder(dense, 1, 16, "reduce-overhead")
    engine = StaticDecoder(dense, 1, 8)
    engine.prefill(torch.zeros(1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="overflows the cache's capacity of 8 positions"):
        engine.step(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="one row at a time"):
        speculative_greedy(engine, engine, torch.zeros(2, 3, dtype=torch.long), 4, 2)


def test_an_engine_decodes_up_to_its_capacity_and_not_one_token_more():
    model = tiny("dense")
    tokens = torch.randint(0, 32, (1, 9), generator=torch.Generator().manual_seed(1))
    engine = StaticDecoder(model, 1, 8)
    with torch.no_grad():
        full = model(tokens[:, :8])
        engine.prefill(tokens[:, :6])
        torch.testing.assert_close(engine.step(tokens[:, 6:8]), full[:, 6:8], rtol=0, atol=1e-10)  # exactly full
        with pytest.raises(ValueError, match="overflows the cache's capacity of 8 positions"):
            engine.step(tokens[:, 8:9])
        engine.rollback(7)
        torch.testing.assert_close(engine.step(tokens[:, 7:8]), full[:, 7:8], rtol=0, atol=1e-10)


def test_auto_replays_graphs_only_for_greedy_decoding_on_cuda():
    """choose_engine reads only the device's type: no GPU is needed to ask it about one."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert choose_engine("auto", cuda, 0.0) == "graphs"
    assert choose_engine("auto", cuda, 0.8) == "cache"  # sampling: graphs decode greedily only
    assert choose_engine("auto", cpu, 0.0) == choose_engine("auto", cpu, 0.8) == "cache"


def test_the_configs_engines_are_the_engines():
    from experiments.config.schema import DecodingEngine

    assert {e.value for e in DecodingEngine} == {"auto", *ENGINES}
