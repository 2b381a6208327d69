"""The bucket-pair attention: values and gradients equal plain autograd attention over the
concatenated key blocks, for every way of chunking the buckets."""

import pytest
import torch

from models.attention.masked import bucket_pair_attention


def reference(q, k, v, mask, keep, dropout, earlier_k, earlier_v, first_k, first_v):
    """Plain autograd: each bucket's keys built whole by slicing and concatenation."""

    def pairs(t, earlier, first):
        head = torch.zeros_like(t[:, :, :1]) if first is None else first[:, :, None]
        before = torch.cat((head, t[:, :, :-1]), dim=2)
        if earlier is not None:
            before = torch.cat((before[:, : t.shape[1] - earlier.shape[1]], earlier), dim=1)
        return torch.cat((before, t), dim=3)

    keys, values = pairs(k, earlier_k, first_k), pairs(v, earlier_v, first_v)
    scores = (q @ keys.transpose(-1, -2)) * q.shape[-1] ** -0.5
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    if keep is not None:
        weights = weights * keep / (1 - dropout)
    return weights @ values


@pytest.mark.parametrize("per_chunk", [1, 2, 5, None], ids=["chunk1", "chunk2", "chunk5", "chunk-default"])
@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no-dropout", "dropout0.3"])
@pytest.mark.parametrize("earlier_heads", [0, 1, 3], ids=["previous", "mixed", "all-earlier"])
@pytest.mark.parametrize("with_first", [False, True], ids=["zeros-first", "given-first"])
def test_values_and_gradients_match_autograd(per_chunk, dropout, earlier_heads, with_first):
    torch.manual_seed(0)
    b, h, c, B, d = 2, 3, 5, 4, 8

    def leaf(*shape):
        return torch.randn(*shape, dtype=torch.double, requires_grad=True)

    q, k, v = leaf(b, h, c, B, d), leaf(b, h, c, B, d), leaf(b, h, c, B, d)
    earlier_k, earlier_v = (leaf(b, earlier_heads, c, B, d) if earlier_heads else None for _ in range(2))
    first_k, first_v = (leaf(b, h, B, d) if with_first else None for _ in range(2))
    mask = torch.rand(b, h, c, B, 2 * B) > 0.5
    mask[..., torch.arange(B), B + torch.arange(B)] = True  # every row attends somewhere
    if not with_first:  # bucket 0's zero earlier block is masked, except where it is replaced
        mask[:, : h - earlier_heads, 0, :, :B] = False
    keep = torch.rand(b, h, c, B, 2 * B) >= dropout if dropout else None
    args = (earlier_k, earlier_v, first_k, first_v)
    ours = bucket_pair_attention(q, k, v, mask, keep, dropout, earlier_k=earlier_k, earlier_v=earlier_v,
                                 first_k=first_k, first_v=first_v, buckets_per_chunk=per_chunk)
    expected = reference(q, k, v, mask, keep, dropout, *args)
    torch.testing.assert_close(ours, expected)
    inputs = [t for t in (q, k, v, *args) if t is not None]
    grad = torch.randn_like(ours)
    for a, e in zip(torch.autograd.grad(ours, inputs, grad), torch.autograd.grad(expected, inputs, grad)):
        torch.testing.assert_close(a, e)


def test_a_broadcast_mask_serves_every_head():
    """Sinkhorn's mask is one [c, B, 2B] for all batches and heads."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 4, 5, 8, dtype=torch.double, requires_grad=True) for _ in range(3))
    mask = torch.rand(4, 5, 10) > 0.5
    mask[:, torch.arange(5), 5 + torch.arange(5)] = True
    mask[0, :, :5] = False
    ours = bucket_pair_attention(q, k, v, mask, buckets_per_chunk=3)
    expected = reference(q, k, v, mask.expand(2, 3, -1, -1, -1), None, 0.0, None, None, None, None)
    torch.testing.assert_close(ours, expected)
    grad = torch.randn_like(ours)
    for a, e in zip(torch.autograd.grad(ours, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        torch.testing.assert_close(a, e)
