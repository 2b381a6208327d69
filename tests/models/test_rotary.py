"""Rotary embeddings: the pairwise rotation by position, its inverse, and the same result in the
complex (fp32, fp64) and the real (bf16) formulations."""

import torch

from models.rotary import Rotary


def pairwise(x: torch.Tensor, start: int, dim_head: int) -> torch.Tensor:
    """The definition: channels (2i, 2i+1) of position p rotated by p * 10000^(-2i / dim_head)
    (the frequencies in fp32, as the module keeps them)."""
    inv_freq = (10_000.0 ** (-torch.arange(0, dim_head, 2, dtype=torch.float32) / dim_head)).double()
    angles = torch.arange(start, start + x.shape[-2], dtype=torch.float64)[:, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)


def test_rotation_matches_the_pairwise_definition():
    x = torch.randn(2, 3, 40, 16, dtype=torch.float64)
    torch.testing.assert_close(Rotary(16)(x, start=7), pairwise(x, 7, 16), rtol=1e-12, atol=1e-12)


def test_inverse_undoes_the_rotation_and_is_its_gradient():
    rotary = Rotary(16)
    x = torch.randn(3, 30, 16, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(rotary(rotary(x, 5), 5, inverse=True), x, rtol=1e-12, atol=1e-12)
    grad = torch.randn(3, 30, 16, dtype=torch.float64)
    (expected,) = torch.autograd.grad(rotary(x, 5), x, grad)
    torch.testing.assert_close(rotary(grad, 5, inverse=True), expected, rtol=1e-12, atol=1e-12)


def test_strided_views_and_bf16_rotate_as_contiguous_fp32():
    rotary = Rotary(8)
    kv = torch.randn(1, 20, 3 * 8)
    view = kv.view(1, 20, 3, 8)[:, :, 1].transpose(0, 1)  # odd storage offset, non-contiguous
    torch.testing.assert_close(rotary(view), rotary(view.contiguous()))
    x = torch.randn(2, 20, 8)
    torch.testing.assert_close(rotary(x.bfloat16()).float(), rotary(x), rtol=2e-2, atol=2e-2)


def test_a_rotation_outside_autograd_is_contiguous_and_the_same():
    rotary = Rotary(16)
    q = torch.randn(2, 30, 3, 16).transpose(1, 2)  # [b, heads, seq, d] of a [b, seq, heads, d] projection
    with torch.no_grad():
        rotated = rotary(q, 4)
    assert rotated.is_contiguous()
    torch.testing.assert_close(rotated, pairwise(q.double(), 4, 16).float(), rtol=1e-5, atol=1e-5)


def test_the_compiled_rotation_is_the_eager_one_with_its_gradient():
    """Under torch.compile the rotation takes the real form, its table computed in the graph (a
    compiled training step read garbage sizes back from complex views, torch 2.13 on the CPU: the
    compiled-run test in tests/experiments/runtime/test_backends.py catches that); an attention
    layer compiled must compute what it computes eagerly, forward and backward."""
    from models.attention.dense import DenseAttention

    torch.manual_seed(0)
    layer = DenseAttention(dim=32, heads=2, dim_head=16)
    compiled = torch.compile(layer, dynamic=False)
    x = torch.randn(2, 24, 32, requires_grad=True)
    grad = torch.randn(2, 24, 32)
    expected, ours = layer(x), compiled(x)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(ours, x, grad)[0], torch.autograd.grad(expected, x, grad)[0],
                               rtol=1e-5, atol=1e-6)


def test_the_bf16_inverse_undoes_the_rotation():
    rotary = Rotary(16)
    x = torch.randn(3, 30, 16).bfloat16()
    torch.testing.assert_close(rotary(rotary(x, 5), 5, inverse=True), x, rtol=3e-2, atol=3e-2)


def test_a_float32_call_after_a_float64_one_rotates_in_float32():
    rotary = Rotary(16)
    x = torch.randn(2, 30, 16, requires_grad=True)
    rotary(x.double(), 3)
    torch.testing.assert_close(rotary(x, 3), Rotary(16)(x, 3), rtol=0, atol=0)  # dtype included
