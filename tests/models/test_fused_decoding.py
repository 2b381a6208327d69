"""Which models and which steps decode through the dense kernel: dense language models do, every
other model keeps its own forward, and so do prompts, batches, long inputs, training and
autocast; greedy generation (which installs it) gives the tokens of the blocks' own forward."""

import pytest
import torch

from kernels import dense_decoding
from models.fused_decoding import DenseStack, fits, fused_blocks
from models.lm import nsa_lm, transformer_lm
from models.sampling import generate

DENSE = dict(num_tokens=50, dim=64, depth=2, heads=4, dim_head=16)


def _dense(**changes):
    torch.manual_seed(0)
    return transformer_lm(**{**DENSE, **changes}).eval()


def test_a_dense_language_model_fits():
    assert fits(_dense()) is None
    assert fits(_dense(emb_dim=32)) is None  # the factorised embedding lies outside the blocks


@pytest.mark.parametrize("model, reason", [
    (lambda: _dense(reversible=True), "plain stack"),
    (lambda: _dense().to(torch.bfloat16), "fp32"),
    (lambda: nsa_lm(num_tokens=50, dim=64, depth=1, heads=4, dim_head=16, kv_heads=1, sliding_window_size=8,
                    compress_block_size=4, compress_stride=4, fine_block_size=4, num_fine_selected=2),
     "not dense attention"),
], ids=["reversible", "bf16", "nsa"])
def test_other_models_keep_their_forward(model, reason):
    model = model()
    assert reason in fits(model)
    with fused_blocks(model):
        assert "hidden" not in vars(model)
    with pytest.raises(ValueError, match="fused decoding cannot run this model"):
        DenseStack(model, 1)


def test_a_masked_dense_attention_keeps_its_forward():
    model = _dense()
    model.blocks[1].attn.mask = torch.ones(8, 8, dtype=torch.bool).tril()
    assert "with a mask" in fits(model)


@torch.no_grad()
def test_only_a_few_new_tokens_of_one_cached_sequence_take_the_kernel():
    model = _dense()
    stack = DenseStack(model, 1)
    cache = model.new_cache()
    assert not stack.takes(torch.zeros(1, 5, dtype=torch.long), cache)  # a prompt: nothing cached yet
    model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
    assert stack.takes(torch.zeros(1, 1, dtype=torch.long), cache)
    assert stack.takes(torch.zeros(1, 16, dtype=torch.long), cache)
    assert not stack.takes(torch.zeros(1, 17, dtype=torch.long), cache)
    assert not stack.takes(torch.zeros(2, 1, dtype=torch.long), cache)
    assert not stack.takes(torch.zeros(1, 1, dtype=torch.long), None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not stack.takes(torch.zeros(1, 1, dtype=torch.long), cache)
    with torch.enable_grad():
        assert not stack.takes(torch.zeros(1, 1, dtype=torch.long), cache)


@torch.no_grad()
def test_dropout_in_training_mode_keeps_the_blocks_forward():
    model = _dense(ff_dropout=0.1)
    cache = model.new_cache()
    model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
    stack = DenseStack(model, 1)
    assert stack.takes(torch.zeros(1, 1, dtype=torch.long), cache)
    model.train()
    assert not stack.takes(torch.zeros(1, 1, dtype=torch.long), cache)


@pytest.mark.skipif(not dense_decoding.available(), reason="no C compiler: the kernel is not built here")
def test_greedy_generation_gives_the_blocks_tokens(monkeypatch):
    model = _dense(depth=3)
    prompt = torch.randint(0, 50, (1, 12))
    step, steps = DenseStack.__call__, []
    monkeypatch.setattr(DenseStack, "__call__", lambda self, x, caches: steps.append(1) or step(self, x, caches))
    fused = generate(model, prompt, 40, temperature=0.0)
    assert len(steps) == 40  # every step after the prompt went through the kernel
    calls = []
    monkeypatch.setattr(DenseStack, "takes", lambda self, tokens, caches: calls.append(1) and False)
    assert torch.equal(generate(model, prompt, 40, temperature=0.0), fused)
    assert len(calls) == 41  # the prompt and every step asked, and this time took the blocks' forward
