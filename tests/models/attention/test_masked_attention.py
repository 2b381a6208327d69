"""The recomputing masked attention: values and gradients equal plain autograd attention."""

import pytest
import torch

from models.attention.masked import masked_attention


def reference(q, k, v, mask, keep, dropout):
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    if keep is not None:
        weights = weights * keep / (1 - dropout)
    return weights @ v


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no-dropout", "dropout0.3"])
@pytest.mark.parametrize("shape", [(2, 3, 4, 8, 16), (1, 2, 5, 9, 8)], ids=["B2-H3-C4-M8-D16", "B1-H2-C5-M9-D8"])
def test_values_and_gradients_match_autograd(shape, dropout):
    torch.manual_seed(0)
    b, h, c, m, d = shape
    q = torch.randn(b, h, c, m, d, dtype=torch.double, requires_grad=True)
    k, v = (torch.randn(b, h, c, 2 * m, d, dtype=torch.double, requires_grad=True) for _ in range(2))
    mask = torch.rand(b, h, c, m, 2 * m) > 0.5
    mask[..., torch.arange(m), torch.arange(m)] = True  # every row attends somewhere
    keep = torch.rand(b, h, c, m, 2 * m) >= dropout if dropout else None
    grad = torch.randn(b, h, c, m, d, dtype=torch.double)
    ours = masked_attention(q, k, v, mask, keep, dropout)
    expected = reference(q, k, v, mask, keep, dropout)
    torch.testing.assert_close(ours, expected)
    for a, e in zip(torch.autograd.grad(ours, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        torch.testing.assert_close(a, e)
