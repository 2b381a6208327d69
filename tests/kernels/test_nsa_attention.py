"""NSA's fused Triton kernels against their definition (naive.py): the gated output, the chosen
blocks and every gradient, on fresh random inputs. On a machine without CUDA the kernels run in
Triton's interpreter."""

import pytest
import torch

from kernels.nsa_attention import naive, triton as kernels
from kernels.nsa_attention.fused import nsa_forward
from tests.helpers.nsa_inputs import GRADIENTS, inputs

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [  # (seq, heads, kv_heads, dim_head, block, stride, fine, selected, window, dtype)
    (37, 4, 2, 16, 8, 4, 8, 4, 8, torch.float32),  # group 2; a length off every block
    (21, 16, 1, 16, 8, 4, 8, 4, 8, torch.float32),  # group 16: 4 positions a tile
    (30, 2, 2, 64, 8, 4, 8, 5, 12, torch.float32),  # group 1, dim_head 64, two chosen blocks
    (19, 2, 1, 128, 8, 4, 16, 3, 8, torch.float32),  # dim_head 128; forced blocks only
    (24, 4, 2, 16, 4, 4, 4, 1, 5, torch.float32),  # the own block alone; blocks as long as their stride
    (26, 4, 2, 32, 8, 4, 8, 4, 6, torch.bfloat16),
    (45, 4, 2, 16, 16, 8, 8, 4, 8, torch.float32),  # compressed blocks longer than fine ones: read by two steps
    (33, 4, 2, 16, 8, 8, 4, 5, 8, torch.float32),  # fine blocks shorter than the stride: exact ties, to the earlier
]


def definition(tensors, phases, knobs, start=0):
    return naive.nsa_attention(*tensors, phases.double(), start, knobs.block, knobs.stride, knobs.fine, knobs.forced,
                               knobs.free, knobs.window)


def assert_close(name, got, expected, dtype):
    got, expected = got.double().cpu(), expected.double()
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5, msg=f"{name} differs")
    else:  # bf16 operands: a relative error of the whole tensor
        error = (got - expected).norm() / expected.norm()
        assert error < 1.5e-2, f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("fsa", [False, True], ids=["paper-order", "flash-sparse-order"])
@pytest.mark.parametrize("seq,heads,kv_heads,dim_head,block,stride,fine,selected,window,dtype", CASES,
                         ids=[f"T{c[0]}-H{c[1]}-KV{c[2]}-D{c[3]}-cmp{c[4]}x{c[5]}-fine{c[6]}-S{c[7]}-w{c[8]}-"
                              f"{str(c[9])[6:]}" for c in CASES])
def test_kernels_match_the_definition(seq, heads, kv_heads, dim_head, block, stride, fine, selected, window, dtype,
                                      fsa):
    """Either order of the chosen blocks: the paper's (a program per query) and Flash Sparse
    Attention's (a program per block, over the queries that chose it)."""
    tensors, phases, knobs = inputs(seq, heads, kv_heads, dim_head, block, stride, fine, selected, window, dtype)
    leaves = [t.double().requires_grad_() for t in tensors]
    expected, expected_blocks = definition(leaves, phases, knobs)
    device_tensors = [t.to(DEVICE) for t in tensors]
    out, blocks, saved, lse, order, ranked = kernels.forward(*device_tensors, phases.to(DEVICE), 0, knobs, save=True,
                                                            fsa=fsa)
    if dtype == torch.float32:  # bf16 rounds the importance: a near tie may go the other way
        assert torch.equal(blocks.long().cpu(), expected_blocks)
    assert_close("out", out, expected.detach(), dtype)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected_grads = torch.autograd.grad((expected * grad.double()).sum(), leaves)
    grads = kernels.backward(grad.to(DEVICE), *device_tensors, phases.to(DEVICE), saved, lse, blocks, order, ranked,
                             knobs, fsa)
    for name, got, want in zip(GRADIENTS, grads, expected_grads):
        assert_close(name, got, want, dtype)


@pytest.mark.parametrize("fsa", [False, True], ids=["paper-order", "flash-sparse-order"])
@pytest.mark.parametrize("new", [1, 3])
def test_queries_after_a_cache_see_what_the_whole_sequence_shows_them(new, fsa):
    """Decoding: the last `new` queries from position seq - new, over every earlier key."""
    seq = 40
    tensors, phases, knobs = inputs(seq, 4, 2, 16, 8, 4, 8, 5, 8, torch.float32, seed=2)
    expected, expected_blocks = definition([t.double() for t in tensors], phases, knobs)
    q, kc, vc, *local, gates = (t.to(DEVICE) for t in tensors)
    out, blocks, *_ = kernels.forward(q[:, -new:], kc, vc, *local, gates[:, -new:], phases.to(DEVICE), seq - new,
                                      knobs, save=False, fsa=fsa)
    assert torch.equal(blocks.long().cpu(), expected_blocks[:, :, -new:])
    assert_close("out", out, expected[:, -new:], torch.float32)


def test_readers_cut_into_chunks_give_the_same_gradients(monkeypatch):
    """The compressed keys' readers and the initial block's, cut into chunks whose partial sums are
    added afterwards, give the gradients of one pass."""
    tensors, phases, knobs = inputs(40, 4, 2, 16, 8, 4, 8, 5, 8, torch.float32, seed=3)
    tensors = [t.to(DEVICE) for t in tensors]
    out, blocks, saved, lse, order, ranked = kernels.forward(*tensors, phases.to(DEVICE), 0, knobs, save=True, fsa=True)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    kept = (saved, lse, blocks, order, ranked, knobs, True)
    whole = kernels.backward(grad, *tensors, phases.to(DEVICE), *kept)
    monkeypatch.setattr(kernels, "READERS_PER_CHUNK", 8)
    chunked = kernels.backward(grad, *tensors, phases.to(DEVICE), *kept)
    for name, a, b in zip(GRADIENTS, chunked, whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name} differs")


@pytest.mark.parametrize("fsa", [False, True], ids=["paper-order", "flash-sparse-order"])
def test_a_forward_that_keeps_no_output_gives_the_backward_the_same_gradients(fsa, monkeypatch):
    """Where the three branches' outputs would outweigh the kernels' inputs (a large GQA group) the
    forward keeps none, and the dq kernels sum rowsum(dO * O) over the keys first: at group 16 by
    itself, and at group 2 made to, the gradients of the definition and of a backward that kept them."""
    tensors, phases, knobs = inputs(21, 16, 1, 16, 8, 4, 8, 4, 8, torch.float32, seed=8)
    assert kernels.forward(*[t.to(DEVICE) for t in tensors], phases.to(DEVICE), 0, knobs, save=True,
                           fsa=fsa)[2].shape[0] == 0
    tensors, phases, knobs = inputs(37, 4, 2, 16, 8, 4, 8, 4, 8, torch.float32, seed=8)
    tensors, phases = [t.to(DEVICE) for t in tensors], phases.to(DEVICE)
    grad = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    results = []
    for keep in (True, False):
        monkeypatch.setattr(kernels, "keeps_outputs", lambda *_: keep)
        out, blocks, saved, lse, order, ranked = kernels.forward(*tensors, phases, 0, knobs, save=True, fsa=fsa)
        assert saved.shape[0] == (3 if keep else 0)
        results.append(kernels.backward(grad, *tensors, phases, saved, lse, blocks, order, ranked, knobs, fsa))
    leaves = [t.double().cpu().requires_grad_() for t in tensors]
    expected, _ = definition(leaves, phases.cpu(), knobs)
    expected_grads = torch.autograd.grad((expected * grad.double().cpu()).sum(), leaves)
    for name, kept, recomputed, want in zip(GRADIENTS, *results, expected_grads):
        assert_close(name, recomputed, want, torch.float32)
        torch.testing.assert_close(recomputed, kept, rtol=1e-5, atol=1e-6, msg=f"{name}: recomputed differs from kept")


def test_deterministic_runs_take_the_order_without_atomic_adds():
    """Flash Sparse Attention's order adds a row's chosen blocks atomically (their sum's rounding
    follows the order the programs finish in); deterministic runs keep the paper's order."""
    assert kernels.flash_sparse_order(2, 13) and not kernels.flash_sparse_order(16, 13)
    try:
        torch.use_deterministic_algorithms(True)
        assert not kernels.flash_sparse_order(2, 13)
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("heads", [2, 16], ids=["outputs-kept", "outputs-recomputed"])
def test_the_custom_operator_passes_torch_library_checks(heads):
    """Schema, fake tensors, autograd registration: what torch.compile relies on."""
    tensors, phases, knobs = inputs(12, heads, 1, 16, 4, 2, 4, 4, 4, torch.float32, seed=5)
    q, kc, vc, *local = tensors
    kvc = torch.cat((kc, vc), dim=1).transpose(1, 2)  # [b, blocks, 2 * kv_heads, d]: the keys' heads, the values'
    args = [t.to(DEVICE).requires_grad_() for t in (q, kvc, *local)]
    torch.library.opcheck(nsa_forward, (*args, phases.to(DEVICE), 0, knobs.block, knobs.stride, knobs.fine,
                                        knobs.forced, knobs.free, knobs.window, True, True),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("fsa", [False, True], ids=["paper-order", "flash-sparse-order"])
def test_inputs_read_where_they_lie_give_what_contiguous_ones_give(fsa):
    """The layer hands the kernels views of one projection (q, the keys and values, wider token
    strides) and the compressed keys and values as views of one tensor; each kernel reads and writes
    by each tensor's own strides: the same output and gradients, to the bit, as contiguous copies."""
    tensors, phases, knobs = inputs(33, 4, 2, 16, 8, 4, 8, 5, 8, torch.float32, seed=6)
    q, kc, vc, *local, gates = (t.to(DEVICE) for t in tensors)
    wide = torch.cat((q.flatten(2), *(t.flatten(2) for t in local), torch.zeros_like(q.flatten(2))), -1)  # [b, n, width]
    q_view = wide[..., : q[0, 0].numel()].unflatten(-1, q.shape[2:])  # the wider token stride
    width, kv_width = q[0, 0].numel(), local[0][0, 0].numel()
    local_views = [wide[..., width + i * kv_width: width + (i + 1) * kv_width].unflatten(-1, t.shape[2:])
                   for i, t in enumerate(local)]
    kvc = torch.cat((kc, vc), dim=1).transpose(1, 2)  # [b, blocks, 2 * kv_heads, d]: kc and vc its views
    kc_view, vc_view = (t.transpose(1, 2) for t in kvc.chunk(2, dim=2))
    assert q_view.stride(1) != q.stride(1) and all(torch.equal(a, b) for a, b in zip(local_views, local))
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    results = []
    for args in ((q, kc, vc, *local, gates), (q_view, kc_view, vc_view, *local_views, gates)):
        out, blocks, saved, lse, order, ranked = kernels.forward(*args, phases.to(DEVICE), 0, knobs, save=True, fsa=fsa)
        grads = kernels.backward(grad, *args, phases.to(DEVICE), saved, lse, blocks, order, ranked, knobs, fsa)
        results.append((out, *grads))
    for name, a, b in zip(("out", *GRADIENTS), *results):
        assert torch.equal(a, b), f"{name} differs"
