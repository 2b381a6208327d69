"""The Triton compressed-attention and block-selection kernels against naive.py's definitions:
output, log-sum-exp and every gradient; the chosen blocks against the importance and the rule
(forced blocks and the future excluded, most important first, ties to the earlier block). On a
machine without CUDA the kernels run in Triton's interpreter."""

import pytest
import torch

from kernels.compressed_attention.naive import compressed_attention as naive
from kernels.compressed_attention.triton import triton_compressed_attention, triton_selection

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}

CASES = [  # (batch_kv, group, seq_q, start, dim_head, block, stride, fine block, dtype)
    (2, 2, 37, 0, 16, 4, 2, 4, torch.float32),  # a length that is a multiple of no block size
    (1, 1, 40, 0, 64, 8, 4, 8, torch.float32),  # group of 1, dim_head 64
    (1, 16, 21, 0, 16, 4, 2, 8, torch.float32),  # group of 16
    (1, 2, 19, 0, 128, 6, 4, 8, torch.float32),  # dim_head 128; the stride divides no block
    (1, 2, 5, 40, 16, 4, 2, 4, torch.float32),  # queries after a cache
    (1, 2, 3, 0, 16, 4, 2, 4, torch.float32),  # shorter than a block: no block complete
    (1, 2, 35, 0, 64, 8, 4, 8, torch.bfloat16),
    (1, 1, 21, 0, 128, 4, 2, 4, torch.bfloat16),
]
IDS = [f"BH{c[0]}-G{c[1]}-Q{c[2]}-S{c[3]}-D{c[4]}-l{c[5]}-d{c[6]}-f{c[7]}-{str(c[8])[6:]}" for c in CASES]


def inputs(bh, g, m, start, d, block, stride, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks = max(0, (start + m - block) // stride + 1)
    q = torch.randn(bh, g, m, d, generator=gen).to(dtype)
    kc = torch.randn(bh, blocks, d, generator=gen).to(dtype)
    vc = torch.randn(bh, blocks, d, generator=gen).to(dtype)
    return q, kc, vc


def reference_lse(q, kc, start, block, stride):
    positions = start + torch.arange(q.shape[2])
    visible = torch.arange(kc.shape[1]) * stride + block - 1 <= positions[:, None]
    scores = torch.einsum("bgmd,bcd->bgmc", q, kc) * q.shape[-1] ** -0.5
    return scores.masked_fill(~visible, float("-inf")).logsumexp(-1)


@pytest.mark.parametrize("bh,g,m,start,d,block,stride,fine,dtype", CASES, ids=IDS)
def test_attention_matches_the_definition(bh, g, m, start, d, block, stride, fine, dtype):
    q, kc, vc = inputs(bh, g, m, start, d, block, stride, dtype)
    ref_leaves = [t.double().requires_grad_() for t in (q, kc, vc)]
    ours_leaves = [t.to(DEVICE).requires_grad_() for t in (q, kc, vc)]
    ref, _ = naive(*ref_leaves, start, block, stride, fine, 1)
    ref_lse = reference_lse(ref_leaves[0], ref_leaves[1], start, block, stride)
    out, lse = triton_compressed_attention(*ours_leaves, start, block, stride)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double().cpu(), ref.detach(), rtol=tol, atol=tol, msg="out differs")
    torch.testing.assert_close(lse.double().cpu(), ref_lse.detach(), rtol=tol, atol=tol, msg="lse differs")
    assert lse.dtype == torch.float32
    if kc.shape[1] == 0:
        assert not out.any() and (lse == float("-inf")).all()
        return
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    ref_grads = torch.autograd.grad((ref * grad_out.double()).sum(), ref_leaves)
    grads = torch.autograd.grad((out.float() * grad_out.to(DEVICE)).sum(), ours_leaves)
    for name, a, b in zip(("dq", "dkc", "dvc"), grads, ref_grads):
        torch.testing.assert_close(a.double().cpu(), b, rtol=tol, atol=tol, msg=f"{name} differs")


@pytest.mark.parametrize("forced,free", [(3, 2), (1, 3), (2, 4)], ids=["forced3-free2", "forced1-free3", "forced2-free4"])
@pytest.mark.parametrize("bh,g,m,start,d,block,stride,fine,dtype", CASES[:5] + CASES[6:7], ids=IDS[:5] + IDS[6:7])
def test_selection_picks_the_most_important_blocks_by_the_rule(bh, g, m, start, d, block, stride, fine, dtype,
                                                              forced, free):
    q, kc, _ = inputs(bh, g, m, start, d, block, stride, dtype)
    num_fine = -(-(start + m) // fine)
    _, importance = naive(q.double(), kc.double(), kc.double(), start, block, stride, fine, num_fine)
    lse = reference_lse(q.double(), kc.double(), start, block, stride).float()
    scores, indices = triton_selection(q.to(DEVICE), kc.to(DEVICE), lse.to(DEVICE), start, block, stride, fine,
                                       forced, free)
    scores, indices = scores.cpu(), indices.cpu()

    t = start + torch.arange(m)[:, None]
    f = torch.arange(num_fine)
    own = t // fine
    taken = (f * fine > t) | (f == own)
    if forced >= 2:
        taken |= f == 0
    if forced >= 3:
        taken |= f == own - 1
    masked = importance.masked_fill(taken, float("-inf"))
    expected, order = masked.sort(dim=-1, descending=True, stable=True)  # ties to the earlier block
    expected = torch.nn.functional.pad(expected, (0, free), value=float("-inf"))[..., :free]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(scores.double(), expected, rtol=tol, atol=tol)
    used = scores > float("-inf")
    chosen_importance = masked.gather(-1, indices.clamp(max=num_fine - 1))
    torch.testing.assert_close(chosen_importance[used], scores.double()[used], rtol=tol, atol=tol)
    assert (indices[~used] == 0).all()
    for row in indices.masked_fill(~used, -1).flatten(0, 1):  # each block chosen once
        picked = row[row >= 0]
        assert picked.unique().numel() == picked.numel()
    if dtype == torch.float32:  # no near-ties in random fp32 inputs: the very blocks of the rule
        expected_order = torch.nn.functional.pad(order, (0, free))[..., :free]
        assert torch.equal(indices[used], expected_order[used])


def test_unsupported_dim_head_fails_with_the_constraint():
    q = torch.randn(1, 2, 8, 48)
    kc = vc = torch.randn(1, 3, 48)
    with pytest.raises(ValueError, match="dim_head=48 must be a power of two.*model.kernel=torch"):
        triton_compressed_attention(q, kc, vc, 0, 4, 2)
