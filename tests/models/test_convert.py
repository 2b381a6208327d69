"""models/convert.py: a dense model's attention weights under NSA's, MoBA's and DSA's names. The
converted projections equal the dense ones at step 0, and a converted layer that attends to every
key computes what the dense layer does."""

import pytest
import torch

from models.attention.nsa import NativeSparseAttention
from models.convert import OPEN_GATE_LOGIT, from_dense
from models.lm import dsa_lm, moba_lm, nsa_lm, transformer_lm

SIZE = dict(num_tokens=32, dim=32, depth=2, heads=4, dim_head=8)
NSA = dict(sliding_window_size=8, compress_block_size=4, compress_stride=2, fine_block_size=4, num_fine_selected=3)


def dense():
    torch.manual_seed(0)
    return transformer_lm(**SIZE).double().eval()


def build(kind, kv_heads, **knobs):
    torch.manual_seed(1)
    if kind == "nsa":
        return nsa_lm(**SIZE, kv_heads=kv_heads, kernel="torch", **{**NSA, **knobs}).double().eval()
    if kind == "moba":
        return moba_lm(**SIZE, kv_heads=kv_heads, kernel="torch", **{"block_size": 4, "top_k": 2, **knobs}).double().eval()
    return dsa_lm(**SIZE, kv_heads=kv_heads, index_heads=2, index_dim_head=8, warmup_steps=0, kl_weight=1.0,
                  kernel="torch", **{"top_k": 4, **knobs}).double().eval()


def converted(kind, kv_heads, **knobs):
    source, target = dense(), build(kind, kv_heads, **knobs)
    entries, origins = from_dense(source.state_dict(), target)
    shared = {k: v for k, v in source.state_dict().items() if k in target.state_dict() and k not in entries}
    target.load_state_dict({**shared, **entries}, strict=False)
    return source, target, origins


@pytest.mark.parametrize("kind", ["nsa", "moba", "dsa"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_converted_projections_equal_the_dense_ones(kind, kv_heads):
    """to_q is the dense queries; each kv head of to_kv (each of NSA's three copies) is the mean of its
    group's dense key (value) heads, the heads themselves at kv_heads = heads; to_out is the dense one."""
    source, target, origins = converted(kind, kv_heads)
    for i, (d_block, s_block) in enumerate(zip(source.blocks, target.blocks)):
        q, k, v = d_block.attn.to_qkv.weight.chunk(3)
        assert torch.equal(s_block.attn.to_q.weight, q)
        assert torch.equal(s_block.attn.to_out.weight, d_block.attn.to_out.weight)
        group = 4 // kv_heads
        expected = [w.view(kv_heads, group, 8, 32).mean(1).flatten(0, 1) for w in (k, v)]
        copies = s_block.attn.to_kv.weight.chunk(3 if kind == "nsa" else 1)
        for kv in copies:
            got_k, got_v = kv.chunk(2)
            torch.testing.assert_close(got_k, expected[0], rtol=0, atol=1e-15)
            torch.testing.assert_close(got_v, expected[1], rtol=0, atol=1e-15)
            if kv_heads == 4:
                assert torch.equal(got_k, k) and torch.equal(got_v, v)
        assert origins[f"blocks.{i}.attn.to_kv.weight"] == f"blocks.{i}.attn.to_qkv.weight"


def test_nsa_with_shared_kv_gets_one_copy():
    _, target, _ = converted("nsa", 4, shared_kv=True)
    assert target.blocks[0].attn.to_kv.weight.shape[0] == 2 * 4 * 8


def test_nsa_starts_with_the_window_gate_open():
    _, target, origins = converted("nsa", 2)
    bias = target.blocks[0].attn.to_gates.bias.view(3, 4)
    assert torch.equal(bias[2], torch.full((4,), OPEN_GATE_LOGIT, dtype=bias.dtype))
    assert torch.equal(bias[:2], torch.full((2, 4), -OPEN_GATE_LOGIT, dtype=bias.dtype))
    assert origins["blocks.0.attn.to_gates.bias"] == "(window gate open)"


@pytest.mark.parametrize("kind", ["moba", "dsa"])
def test_a_converted_layer_that_sees_every_key_computes_the_dense_model(kind):
    """MoBA choosing every block, DSA every token: the converted model's logits are the dense model's."""
    knobs = {"top_k": 8} if kind == "moba" else {"top_k": 32}
    source, target, _ = converted(kind, 4, **knobs)
    tokens = torch.randint(0, 32, (2, 29))
    torch.testing.assert_close(target(tokens), source(tokens), rtol=1e-9, atol=1e-9)


def test_converted_nsa_with_a_window_over_the_whole_sequence_is_nearly_the_dense_layer():
    """The window branch alone is the dense attention when it covers the sequence, so the converted
    layer is sigmoid(4) of it plus two gates' worth of the others: close, not equal (the gate weights
    are new)."""
    source, target, _ = converted("nsa", 4, sliding_window_size=64)
    x = torch.randn(2, 29, 32, dtype=torch.float64)
    dense_out = source.blocks[0].attn(x)
    nsa = target.blocks[0].attn
    assert isinstance(nsa, NativeSparseAttention)
    error = (nsa(x) - dense_out).norm() / dense_out.norm()
    assert error < 0.1, error
    with torch.no_grad():  # the gates at exactly (0, 0, 1): the dense layer itself
        nsa.to_gates.weight.zero_()
        nsa.to_gates.bias.copy_(torch.tensor([-1e4] * 8 + [1e4] * 4, dtype=torch.float64))
    torch.testing.assert_close(nsa(x), dense_out, rtol=1e-9, atol=1e-9)


def test_a_layer_without_a_dense_source_gets_nothing():
    target = build("moba", 4)
    assert from_dense(target.state_dict(), build("nsa", 4)) == ({}, {})
