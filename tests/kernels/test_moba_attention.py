"""MoBA's block attention on every path against its dense masked definition: values and gradients,
blocks of every kind of size (a power of two, not one, past the Triton kernel's largest), queries
from position 0 and after a cache, and the rotary positions applied by the path."""

import pytest
import torch

from kernels.moba_attention import cpu_built, moba_attention
from kernels.moba_attention.naive import naive_moba_attention
from models.rotary import Rotary
from tests.helpers.kernel_checks import device_for

CPU_KERNEL = pytest.mark.skipif(not cpu_built(), reason="no C compiler for the CPU kernel")
KERNEL_MARKS = {"torch": [], "cpu": [CPU_KERNEL], "triton": [pytest.mark.triton]}


def chosen_blocks(b: int, h: int, m: int, start: int, block: int, slots: int, gen: torch.Generator):
    """Each query's own block in slot 0 and distinct earlier blocks after it, some slots unused, as
    MoBA's gate leaves them -> blocks, valid [b, h, m, slots]."""
    blocks = torch.zeros(b, h, m, slots, dtype=torch.long)
    valid = torch.zeros(b, h, m, slots, dtype=torch.bool)
    for i in range(b):
        for j in range(h):
            for t in range(m):
                own = (start + t) // block
                earlier = torch.randperm(own, generator=gen)[: slots - 1]
                used = torch.rand(len(earlier), generator=gen) < 0.8
                blocks[i, j, t, : 1 + len(earlier)] = torch.cat((torch.tensor([own]), earlier))
                valid[i, j, t, : 1 + len(earlier)] = torch.cat((torch.tensor([True]), used))
    return blocks, valid


CASES = [  # (block, slots, seq_q, seq_k)
    (4, 3, 23, 23),  # length not a multiple of the block
    (12, 2, 29, 29),  # no power of two: sub-blocks of 4 on the selected-attention paths
    (160, 2, 340, 340),  # past 128: sub-blocks of 32
    (4, 3, 5, 26),  # queries after a cache of 21 keys
]


# the rotary positions applied by the path on the first case (a training step's queries, from position 0);
# Triton's interpreter on the sub-blocks' case
PARAMS = [pytest.param(*case, rotate, kernel, marks=marks,
                       id=f"blk{case[0]}-S{case[1]}-Q{case[2]}-K{case[3]}-{'rotary' if rotate else 'rotated'}-{kernel}")
          for case in CASES for rotate in (False, True) for kernel, marks in KERNEL_MARKS.items()
          if (not rotate or case == CASES[0]) and (kernel != "triton" or case == CASES[1])]


@pytest.mark.parametrize("block,slots,m,n,rotate,kernel", PARAMS)
def test_matches_the_definition(block, slots, m, n, rotate, kernel):
    dtype = torch.float64 if kernel == "torch" else torch.float32
    gen = torch.Generator().manual_seed(block + m)
    b, h, g, d = 2, 2, 2, 16
    q, k, v = (torch.randn(shape, generator=gen, dtype=dtype).requires_grad_()
               for shape in ((b, h, g, m, d), (b, h, n, d), (b, h, n, d)))
    start = n - m
    blocks, valid = chosen_blocks(b, h, m, start, block, slots, gen)
    rotary = Rotary(d).to(dtype) if rotate else None
    device = device_for(kernel)
    out = moba_attention(*(t.to(device) for t in (q, k, v, blocks, valid)), start, block, kernel, rotary=rotary)
    q_ref, k_ref = (rotary(q.flatten(1, 2)).view_as(q), rotary(k)) if rotate else (q, k)
    expected = naive_moba_attention(q_ref, k_ref, v, blocks, valid, start, block)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.cpu(), expected, rtol=tol, atol=tol)
    cotangent = torch.randn(out.shape, generator=gen, dtype=dtype)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), cotangent.to(device)),
                         torch.autograd.grad(expected, (q, k, v), cotangent)):
        torch.testing.assert_close(got.cpu(), want, rtol=10 * tol, atol=10 * tol)


def test_a_query_with_no_valid_block_gets_zeros():
    q, k, v = torch.randn(1, 1, 1, 6, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    blocks = torch.zeros(1, 1, 6, 1, dtype=torch.long)
    valid = (torch.arange(6) >= 3).view(1, 1, 6, 1)
    out = moba_attention(q, k, v, blocks, valid, 0, 4, "torch")
    assert (out[..., :3, :] == 0).all() and (out[..., 3:, :] != 0).all()
