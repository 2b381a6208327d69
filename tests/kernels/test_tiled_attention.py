"""Tiled attention (own tile, previous tile, optional sink) against dense masked attention:
output, log-sum-exp and every gradient, the log-sum-exp's own included, in float64."""

import pytest
import torch

from kernels.nsa_attention.tiled import tiled_attention


def naive(q, k, v, allowed):
    """Dense attention over every key, masked by allowed [queries, keys]."""
    scores = torch.einsum("bgmd,bkd->bgmk", q, k) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bgmk,bkd->bgmd", scores.softmax(-1), v), scores.logsumexp(-1)


def forced(tile):
    """NSA's forced blocks: own block (causal), previous block, initial block."""
    def visible(query_pos, key_pos):
        own, key_block = query_pos // tile, key_pos // tile
        return ((key_block == own) | (key_block == own - 1) | (key_block == 0)) & (key_pos <= query_pos)
    return visible


def window(w):
    return lambda query_pos, key_pos: (key_pos <= query_pos) & (key_pos > query_pos - w)


CASES = [  # (batch_kv, group, seq, dim_head, tile, rule, sink)
    (1, 1, 16, 8, 4, "forced", 4),
    (2, 2, 37, 8, 4, "forced", 4),  # a length that is not a multiple of the tile
    (1, 3, 50, 16, 16, "forced", 16),
    (2, 2, 3, 8, 4, "forced", 4),  # shorter than one tile
    (1, 2, 29, 8, 8, "window", 0),  # a sliding window as long as the tile
    (1, 2, 29, 8, 8, "window-5", 0),  # a shorter window
]


@pytest.mark.parametrize("bh,g,n,d,tile,rule,sink", CASES,
                         ids=[f"BH{c[0]}-G{c[1]}-T{c[2]}-D{c[3]}-tile{c[4]}-{c[5]}-sink{c[6]}" for c in CASES])
def test_matches_dense_masked_attention(bh, g, n, d, tile, rule, sink):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(bh, g, n, d, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(bh, n, d, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(bh, n, d, dtype=torch.float64, generator=gen, requires_grad=True)
    visible = forced(tile) if rule == "forced" else window(int(rule.split("-")[1]) if "-" in rule else tile)
    positions = torch.arange(n)
    out, lse = tiled_attention(q, k, v, tile, visible, sink)
    ref, ref_lse = naive(q, k, v, visible(positions[:, None], positions[None]))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-10, atol=1e-10)
    grad, grad_lse = torch.randn_like(out), torch.randn_like(ref_lse)
    ours = torch.autograd.grad((out * grad).sum() + (lse * grad_lse).sum(), (q, k, v))
    theirs = torch.autograd.grad((ref * grad).sum() + (ref_lse * grad_lse).sum(), (q, k, v))
    for a, b, name in zip(ours, theirs, "qkv"):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"d{name} differs")
