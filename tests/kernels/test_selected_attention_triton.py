"""The Triton selected-attention kernel against the plain-torch reference: output, log-sum-exp
and every gradient. On a machine without CUDA the kernel runs in Triton's interpreter."""

import pytest
import torch

from kernels.selected_attention import selected_attention
from tests.helpers.chosen_keys import random_selection, repeat_some_slots
from tests.helpers.kernel_checks import assert_all_close, values_and_grads

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# tolerances against the fp32 reference on the same (rounded) inputs
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}

CASES = [  # (batch_kv, seq_q, seq_k, group, dim_head, block, selected, dtype)
    (2, 21, 21, 2, 32, 4, 3, torch.float32),  # length not a multiple of the block
    (1, 16, 16, 1, 64, 8, 2, torch.float32),  # GQA ratio 1
    (1, 13, 13, 16, 32, 4, 2, torch.float32),  # GQA ratio 16
    (1, 7, 30, 4, 128, 8, 3, torch.float32),  # decoding: queries at the end; dim_head 128
    (1, 33, 33, 2, 32, 16, 3, torch.float16),  # blocks at the start and the end
    (1, 12, 12, 4, 64, 4, 3, torch.bfloat16),
    (2, 40, 40, 2, 32, 16, 3, torch.float32),  # tensor-core tiles (block and dim_head >= 16)
    (1, 37, 37, 4, 64, 16, 2, torch.float16),  # tiles in fp16, length not a multiple of the block
    (1, 37, 37, 4, 64, 16, 2, torch.bfloat16),  # bf16 (tiles on a GPU; sums in the interpreter)
    (1, 35, 35, 1, 128, 16, 3, torch.float32),  # tiles, group of 1: a backward tile of 64 queries
    (1, 34, 34, 16, 64, 16, 3, torch.float32),  # tiles, group of 16: a backward tile of 4 queries
    (2, 29, 29, 2, 128, 16, 2, torch.bfloat16),
]


@pytest.mark.parametrize(
    "bh,m,n,g,d,block,selected,dtype", CASES,
    ids=[f"BH{c[0]}-Q{c[1]}-K{c[2]}-G{c[3]}-D{c[4]}-blk{c[5]}-S{c[6]}-{str(c[7])[6:]}" for c in CASES])
def test_kernel_matches_the_reference(bh, m, n, g, d, block, selected, dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(bh, m, g, d, generator=gen).to(dtype)
    k = torch.randn(bh, n, d, generator=gen).to(dtype)
    v = torch.randn(bh, n, d, generator=gen).to(dtype)
    indices, valid = random_selection(bh, m, n - m, block, selected, gen)
    valid[:, 0, 1:] = False  # some slots unused
    results = []
    for kernel, tensors in (("torch", (q.float(), k.float(), v.float())), ("triton", (q, k, v))):
        leaves = [t.to(DEVICE).requires_grad_() for t in tensors]
        out, lse = selected_attention(*leaves, indices.to(DEVICE), valid.to(DEVICE), n - m, block, kernel)
        results.append(values_and_grads(out, lse, leaves))
    assert_all_close(results[1], results[0], TOLERANCE[dtype])


@pytest.mark.parametrize("d,block", [(32, 4), (32, 16)], ids=["sums", "tiles"])
def test_kernel_matches_the_reference_with_slot_weights(d, block):
    gen = torch.Generator().manual_seed(3)
    bh, m, g, selected = 2, 21, 2, 3
    q, k, v = torch.randn(bh, m, g, d, generator=gen), torch.randn(bh, m, d, generator=gen), torch.randn(bh, m, d, generator=gen)
    weights = torch.rand(bh, m, selected, generator=gen) + 0.5
    indices, valid = random_selection(bh, m, 0, block, selected, gen)
    results = []
    for kernel in ("torch", "triton"):
        leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v, weights)]
        out, lse = selected_attention(*leaves[:3], indices.to(DEVICE), valid.to(DEVICE), 0, block, kernel, leaves[3])
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        results.append([out, lse, *torch.autograd.grad((out * grad_out).sum() + lse.sum(), leaves)])
    for name, ref, ours in zip(("out", "lse", "dq", "dk", "dv", "dweights"), *results):
        torch.testing.assert_close(ours.cpu(), ref.cpu(), rtol=2e-5, atol=2e-5, msg=f"{name} differs")


def test_unsupported_shapes_fail_with_the_constraint():
    q = torch.randn(1, 4, 2, 48)  # dim_head 48 is not a power of two
    k = v = torch.randn(1, 4, 48)
    indices = torch.zeros(1, 4, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="kernel=triton needs dim_head=48 to be a power of two.*model.kernel=auto or torch"):
        selected_attention(q, k, v, indices, torch.ones_like(indices, dtype=torch.bool), 0, 4, "triton")


@pytest.mark.parametrize("diff_topk", [False, True])
def test_nsa_model_gives_the_same_logits_and_gradients_with_either_kernel(diff_topk):
    from models.lm import nsa_lm

    knobs = dict(num_tokens=64, dim=32, depth=1, heads=4, dim_head=32, kv_heads=2, sliding_window_size=4,
                 compress_block_size=4, compress_stride=2, fine_block_size=4, num_fine_selected=5,
                 diff_topk=diff_topk)
    models = {}
    for kernel in ("torch", "triton"):
        torch.manual_seed(0)
        models[kernel] = nsa_lm(**knobs, kernel=kernel).to(DEVICE)
    x = torch.randint(0, 64, (2, 19), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    outputs = {}
    for kernel, model in models.items():
        logits = model(x)
        logits.square().mean().backward()
        outputs[kernel] = (logits, {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(outputs["triton"][0], outputs["torch"][0], rtol=1e-4, atol=1e-5)
    for name, grad in outputs["torch"][1].items():
        torch.testing.assert_close(outputs["triton"][1][name], grad, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a CPU-only machine gives")
def test_triton_kernel_without_cuda_or_interpreter_is_refused_before_training(monkeypatch):
    from models.lm import nsa_lm

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="kernel=triton needs a CUDA device.*model.kernel=auto or torch"):
        nsa_lm(num_tokens=64, dim=32, depth=1, heads=2, dim_head=16, kv_heads=1, sliding_window_size=4,
               compress_block_size=4, compress_stride=2, fine_block_size=4, num_fine_selected=3, kernel="triton")


def test_the_custom_operator_passes_torch_library_checks():
    """Schema, fake tensors, autograd registration: what torch.compile relies on."""
    from kernels.selected_attention.triton import selected_forward

    gen = torch.Generator().manual_seed(4)
    bh, m, g, d, block, selected = 1, 12, 2, 16, 4, 2
    q, k, v = (torch.randn(*shape, generator=gen).to(DEVICE).requires_grad_()
               for shape in ((bh, m, g, d), (bh, m, d), (bh, m, d)))
    indices, valid = (t.to(DEVICE) for t in random_selection(bh, m, 0, block, selected, gen))
    torch.library.opcheck(selected_forward, (q, k, v, indices, valid, 0, block, None),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_a_block_named_in_several_valid_slots_counts_once(weighted):
    """The chosen blocks are a set: the kernel gives the naive definition's values and gradients, and
    to the bit what it gives with the repeated slots marked unused (a repeated slot's weight: no
    gradient)."""
    from kernels.selected_attention.naive import selected_attention as naive

    gen = torch.Generator().manual_seed(6)
    bh, m, g, d, block, selected = 1, 14, 2, 16, 4, 3
    tensors = (torch.randn(bh, m, g, d, generator=gen), torch.randn(bh, m, d, generator=gen),
               torch.randn(bh, m, d, generator=gen), torch.rand(bh, m, selected, generator=gen) + 0.5)
    indices, valid, counts = repeat_some_slots(*random_selection(bh, m, 0, block, selected, gen), gen)
    assert (valid & ~counts).any(), "the case must repeat some blocks in valid slots"
    results = []
    for attend, slots_valid in (("triton", valid), ("triton", counts), (naive, valid)):
        leaves = [t.to(DEVICE).requires_grad_() for t in (tensors if weighted else tensors[:3])]
        args = (indices.to(DEVICE), slots_valid.to(DEVICE), 0, block)
        w = leaves[3] if weighted else None
        out, lse = (selected_attention(*leaves[:3], *args, attend, w) if attend == "triton"
                    else attend(*leaves[:3], *args, w))
        results.append(values_and_grads(out, lse, leaves))
    assert_all_close(results[0], results[1], 0, " from the repeats unused")
    assert_all_close(results[0], results[2], 2e-5, " from the definition")
    if weighted:
        assert (results[0][-1].cpu()[valid & ~counts] == 0).all()
