"""Decoding's weight layout: the same values and results, and the training layout back after."""

import torch

from models.lm import transformer_lm
from models.sampling import decoding_layout, generate


def test_decoding_layout_changes_storage_not_values_and_restores_it():
    torch.manual_seed(0)
    model = transformer_lm(num_tokens=64, dim=32, depth=2, heads=2, dim_head=16).eval()
    tokens = torch.randint(0, 64, (2, 12))
    before = {name: (p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}
    expected = model(tokens)
    with decoding_layout(model):
        wide = model.blocks[0].ff.net[0].weight  # [128, 32]: read along its output side
        narrow = model.blocks[0].ff.net[3].weight  # [32, 128]: stays row-major
        assert wide.stride() == (1, 128) and narrow.is_contiguous()
        torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        assert p.data_ptr() == before[name][0] and torch.equal(p, before[name][1]), name
    greedy = generate(model, tokens[:1], 8, temperature=0.0)
    cache, out = model.new_cache(), []
    logits = model(tokens[:1], cache=cache)[:, -1]
    for _ in range(8):  # the same decoding in the training layout
        out.append(logits.argmax(-1))
        logits = model(out[-1][:, None], cache=cache)[:, -1]
    assert torch.equal(greedy, torch.stack(out, 1))
