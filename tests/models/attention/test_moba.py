"""Mixture of Block Attention: causality, the gate and the blocks against the definition on every
kernel, caching, odd lengths and block sizes, bad knobs."""

import pytest
import torch

from kernels import span_attention
from models.attention.moba import MixtureOfBlockAttention
from models.lm import moba_lm
from tests.helpers.attention_checks import (assert_cached_decoding_equals_parallel, assert_causal_by_gradient,
                                            assert_causal_by_perturbation, assert_truncated_cache_forgets)
from tests.helpers.kernel_checks import device_for

CPU_KERNEL = pytest.mark.skipif(not span_attention.available(), reason="no C compiler for the CPU kernel")
# the torch path in float64 (exact checks); the C kernel and Triton (interpreted on a CPU) in fp32
KERNELS = ["torch", pytest.param("cpu", marks=CPU_KERNEL), pytest.param("triton", marks=pytest.mark.triton)]


def tiny_moba(kernel="torch", **overrides):
    torch.manual_seed(0)
    knobs = dict(num_tokens=32, dim=32, depth=2, heads=4, dim_head=16, kv_heads=2, block_size=4, top_k=3,
                 kernel=kernel)
    model = moba_lm(**{**knobs, **overrides})
    return model.double() if kernel == "torch" else model


@pytest.mark.parametrize("own", [True, False], ids=["own-block", "no-own-block"])
@pytest.mark.parametrize("mode", ["eval", "train"])
# block ends, starts, middles; from 9 on an earlier block loses the gate to another (before 9, with
# top_k 3 of blocks of 4, every earlier block is chosen whatever the scores)
@pytest.mark.parametrize("t", [0, 3, 4, 5, 9, 11, 12, 21])
def test_causal_by_perturbation(t, mode, own):
    model = tiny_moba(include_own_block=own).train(mode == "train")
    assert_causal_by_perturbation(model, torch.randint(0, 32, (2, 23)), t)


@CPU_KERNEL
@pytest.mark.parametrize("t", [3, 12])
def test_causal_by_perturbation_on_the_cpu_kernel(t):
    model = tiny_moba("cpu").train()
    assert_causal_by_perturbation(model, torch.randint(0, 32, (2, 23)), t)


@pytest.mark.parametrize("t", [2, 4, 11, 16])
def test_causal_by_gradient(t):
    assert_causal_by_gradient(tiny_moba().train(), torch.randint(0, 32, (2, 21)), t)


def definition(q, k, v, block, top_k, own_block):
    """MoBA as its paper states it, dense and masked, one head at a time: q, k, v [b, h, n, d]
    (rotated) -> [b, h, n, d]. Query t scores every complete block before its own by q . mean(K),
    keeps the top_k (its own block first when included), causal inside its own block."""
    n = q.shape[2]
    complete = n // block
    means = k[:, :, : complete * block].unflatten(2, (complete, block)).mean(3)
    scores = torch.einsum("bhnd,bhcd->bhnc", q, means)
    own = torch.arange(n) // block
    scores = scores.masked_fill(torch.arange(complete) >= own[:, None], float("-inf"))
    picked = scores.topk(min(top_k - 1 if own_block else top_k, complete), dim=-1)
    key_block = torch.arange(n) // block
    chosen = ((key_block == picked.indices[..., None]) & (picked.values > float("-inf"))[..., None]).any(-2)
    if own_block:
        chosen |= key_block == own[:, None]
    chosen &= torch.arange(n) <= torch.arange(n)[:, None]
    scores = torch.einsum("bhnd,bhkd->bhnk", q, k) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~chosen, float("-inf")).softmax(-1).nan_to_num(0.0)
    return probs @ v


CASES = [  # (block_size, top_k, seq, include_own_block)
    (4, 3, 23, True),  # length not a multiple of the block
    (4, 2, 17, False),
    (4, 1, 19, True),  # the own block alone (no block to choose)
    (12, 2, 29, True),  # a block that is no power of two: sub-blocks of 4
    (160, 2, 340, True),  # a block over 128 tokens: sub-blocks of 32 (too long for Triton's interpreter)
]
KERNEL_MARKS = {"torch": [], "cpu": [CPU_KERNEL], "triton": [pytest.mark.triton]}


@pytest.mark.parametrize("block,top_k,n,own,kernel", [
    pytest.param(*case, kernel, marks=marks, id=f"blk{case[0]}-top{case[1]}-n{case[2]}-own{case[3]}-{kernel}")
    for case in CASES for kernel, marks in KERNEL_MARKS.items() if kernel != "triton" or case[1:3] in ((2, 17), (2, 29))])
def test_attention_follows_the_definition_on_every_kernel(block, top_k, n, own, kernel):
    """One head per kv head (the paper's per-head gate), values and gradients against the dense
    masked definition; the C kernel (rotary positions inside it) and Triton in fp32."""
    dtype = torch.float64 if kernel == "torch" else torch.float32
    torch.manual_seed(1)
    attn = MixtureOfBlockAttention(dim=16, heads=2, dim_head=16, kv_heads=2, block_size=block, top_k=top_k,
                                   include_own_block=own, kernel=kernel).to(device_for(kernel), dtype)
    x = torch.randn(2, n, 16, dtype=dtype).to(device_for(kernel)).requires_grad_()
    out = attn(x)
    q = attn.to_q(x).unflatten(-1, (2, 16)).transpose(1, 2)
    k, v = attn.to_kv(x).unflatten(-1, (2, 2, 16)).permute(2, 0, 3, 1, 4)
    expected = attn.to_out(definition(attn.rotary(q), attn.rotary(k), v, block, top_k, own).transpose(1, 2).flatten(2))
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    grads = [torch.autograd.grad(y.square().sum(), [x, *attn.parameters()]) for y in (out, expected)]
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=10 * tol, atol=10 * tol)


def test_a_group_shares_the_blocks_its_summed_scores_choose():
    """kv_heads < heads: the two heads of a group attend to the same blocks, chosen by the sum of
    their scores, which neither head's own scores need choose."""
    torch.manual_seed(2)
    attn = MixtureOfBlockAttention(dim=16, heads=2, dim_head=8, kv_heads=1, block_size=2, top_k=2).double()
    q = torch.randn(1, 1, 2, 9, 8, dtype=torch.double)
    means = torch.randn(1, 1, 4, 8, dtype=torch.double)
    blocks, valid = attn._choose(q, means, 0)
    scores = torch.einsum("bhgnd,bhcd->bhnc", q, means)  # summed over the group
    for t in range(4, 9):
        assert blocks[0, 0, t, 0] == t // 2 and valid[0, 0, t].all()
        assert blocks[0, 0, t, 1] == scores[0, 0, t, : t // 2].argmax()


@pytest.mark.parametrize("pieces", [[23], [1] * 23, [5, 3, 8, 7], [8, 1, 1, 13]], ids=str)
@pytest.mark.parametrize("kernel", ["torch", pytest.param("cpu", marks=CPU_KERNEL)])
def test_cached_decoding_equals_parallel_forward(pieces, kernel):
    atol = 1e-10 if kernel == "torch" else 1e-5
    assert_cached_decoding_equals_parallel(tiny_moba(kernel).eval(), torch.randint(0, 32, (2, 23)), pieces, atol)


def test_truncated_cache_forgets_the_rolled_back_tokens():
    assert_truncated_cache_forgets(tiny_moba().eval(), torch.randint(0, 32, (2, 17)), keep=9)


def test_without_its_own_block_a_query_in_the_first_block_sees_nothing():
    torch.manual_seed(3)
    attn = MixtureOfBlockAttention(dim=16, heads=2, dim_head=8, kv_heads=2, block_size=4, top_k=2,
                                   include_own_block=False).double()
    out = attn(torch.randn(1, 10, 16, dtype=torch.double))
    assert (out[0, :4] == 0).all() and (out[0, 4:] != 0).all()


@CPU_KERNEL
def test_cpu_kernel_trains_as_the_torch_path():
    torch.manual_seed(0)
    reference = MixtureOfBlockAttention(dim=32, heads=4, dim_head=16, kv_heads=2, block_size=8, top_k=3,
                                        kernel="torch")
    fast = MixtureOfBlockAttention(dim=32, heads=4, dim_head=16, kv_heads=2, block_size=8, top_k=3, kernel="cpu")
    fast.load_state_dict(reference.state_dict())
    x = torch.randn(2, 45, 32, requires_grad=True)
    results = []
    for attn in (reference, fast):
        out = attn(x)
        results.append((out, *torch.autograd.grad(out.square().sum(), [x, *attn.parameters()])))
    for expected, got in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad, message", [
    (dict(kv_heads=3), "heads=4 must be a multiple of kv_heads=3"), (dict(block_size=0), "block_size=0"),
    (dict(top_k=0), "top_k=0"), (dict(attn_dropout=0.1), "set model.attn_dropout=0"),
    (dict(kernel="triton", dim_head=24), "dim_head=24 to be a power of two"),
])
def test_bad_knobs_are_refused_with_the_key(bad, message):
    with pytest.raises(ValueError, match=message):
        tiny_moba(**{"kernel": "torch", **bad})


def test_deepspeed_trains_it(tmp_path):
    from tests.helpers.runs import TINY, read_summary, train

    train(tmp_path, "model=moba", "model.kv_heads=1", "model.block_size=4", "trainer.max_steps=2",
          "backend=deepspeed", base=TINY, timeout=600)
    summary = read_summary(tmp_path)
    assert summary["status"] == "completed" and summary["val_bpc"] > 0


# ---- on CUDA (the gpu tier; tests/conftest.py skips it where there is none) ------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_cached_decoding_equals_parallel_forward_on_cuda(kernel):
    from tests.helpers.gpu import assert_cached_decoding_on_cuda

    assert_cached_decoding_on_cuda(tiny_moba(kernel), torch.randint(0, 32, (2, 23)), [5, 3, 8, 7])


@pytest.mark.gpu
def test_first_step_agrees_between_the_cpu_and_cuda():
    from experiments.bench.agreement import lm_loss
    from tests.helpers.gpu import assert_devices_agree

    assert_devices_agree(lambda device: tiny_moba("auto").float(), lm_loss(32, 24))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_trains_on_cuda(tmp_path, precision):
    from tests.helpers.gpu import assert_loss_falls, train_on_cuda
    from tests.helpers.runs import TINY

    assert_loss_falls(train_on_cuda(tmp_path, precision, "model=moba", "model.kv_heads=1", "model.block_size=8",
                                    base=TINY))
