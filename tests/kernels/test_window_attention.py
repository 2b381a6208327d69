"""The Triton sliding-window kernel against its definition (naive.py): output, log-sum-exp and
every gradient. On a machine without CUDA the kernel runs in Triton's interpreter."""

import pytest
import torch

from kernels.window_attention import triton_window_attention
from kernels.window_attention.naive import window_attention as naive

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}

CASES = [  # (batch_kv, group, seq_q, seq_k, dim_head, window, dtype)
    (2, 2, 37, 37, 16, 5, torch.float32),  # a window that divides no tile; a length that is a multiple of none
    (1, 1, 40, 40, 64, 16, torch.float32),  # group of 1, dim_head 64
    (1, 16, 21, 21, 16, 8, torch.float32),  # group of 16
    (1, 2, 19, 19, 128, 64, torch.float32),  # dim_head 128; the window spans the whole sequence
    (1, 2, 5, 45, 16, 20, torch.float32),  # queries after a cache
    (1, 2, 35, 35, 64, 12, torch.bfloat16),
    (1, 1, 21, 21, 128, 1, torch.bfloat16),  # a window of one: each query sees itself
    (1, 2, 40, 40, 16, 2, torch.float32),  # a key tile's last reader is the first query of the next tile
]


@pytest.mark.parametrize("bh,g,m,n,d,window,dtype", CASES,
                         ids=[f"BH{c[0]}-G{c[1]}-Q{c[2]}-K{c[3]}-D{c[4]}-w{c[5]}-{str(c[6])[6:]}" for c in CASES])
def test_kernel_matches_the_definition(bh, g, m, n, d, window, dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(bh, g, m, d, generator=gen).to(dtype)
    k, v = (torch.randn(bh, n, d, generator=gen).to(dtype) for _ in range(2))
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    ref, ref_lse = naive(*ref_leaves, window, n - m)
    out, lse = triton_window_attention(*leaves, window, n - m)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double().cpu(), ref.detach(), rtol=tol, atol=tol, msg="out differs")
    torch.testing.assert_close(lse.double().cpu(), ref_lse.detach(), rtol=tol, atol=tol, msg="lse differs")
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    ref_grads = torch.autograd.grad((ref * grad_out.double()).sum(), ref_leaves)
    grads = torch.autograd.grad((out.float() * grad_out.to(DEVICE)).sum(), leaves)
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref_grads):
        torch.testing.assert_close(a.double().cpu(), b, rtol=tol, atol=tol, msg=f"{name} differs")
