"""The lightning indexer's top-k: the chunked torch path, the C kernel and the Triton kernel (under
TRITON_INTERPRET=1 on a CPU) against the definition, ties included, and no [seq, seq] tensor; the
chosen keys' scores on the torch path and the C kernel."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.lightning_index import cpu_built, index_topk
from kernels.lightning_index.naive import index_scores
from kernels.lightning_index.naive import index_topk as naive
from tests.helpers.kernel_checks import device_for

CASES = [  # (batch, seq_q, start, heads, dim, top_k)
    (2, 37, 0, 3, 16, 7),  # more keys than slots after the first queries
    (1, 40, 0, 1, 16, 64),  # top_k above every query's keys: all of them
    (2, 5, 30, 2, 32, 8),  # decoding: queries after a cache
    (1, 1, 0, 2, 16, 4),
]
IDS = [f"B{c[0]}-Q{c[1]}-start{c[2]}-H{c[3]}-D{c[4]}-top{c[5]}" for c in CASES]
CPU = pytest.param("cpu", marks=pytest.mark.skipif(not cpu_built(), reason="no C compiler for the indexer's kernel"))


def inputs(b, m, start, heads, d, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, m, heads, d, generator=gen, dtype=dtype), torch.randn(b, start + m, d, generator=gen,
            dtype=dtype), torch.randn(b, m, heads, generator=gen, dtype=dtype))


def test_the_definition_keeps_the_highest_scores_never_a_later_key():
    q, k, w = inputs(1, 30, 0, 2, 16, dtype=torch.float64)
    scores = index_scores(q, k, w, 0)
    kept = naive(q, k, w, 0, 5)
    for t in range(30):
        chosen = kept[0, t][kept[0, t] >= 0]
        assert len(chosen) == min(5, t + 1) and (chosen <= t).all()
        assert scores[0, t, chosen].min() >= scores[0, t, : t + 1].topk(min(5, t + 1)).values.min()
    q_j = torch.einsum("mjd,nd->mjn", q[0], k[0]).relu()
    torch.testing.assert_close(scores[0, 29], (w[0, 29, :, None] * q_j[29]).sum(0))


@pytest.mark.parametrize("kernel", ["torch", CPU, pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("b,m,start,heads,d,top_k", CASES, ids=IDS)
def test_matches_the_definition(b, m, start, heads, d, top_k, kernel):
    q, k, w = inputs(b, m, start, heads, d)
    kept = index_topk(*(t.to(device_for(kernel)) for t in (q, k, w)), start, top_k, kernel)
    assert torch.equal(kept.cpu(), naive(q, k, w, start, top_k))


@pytest.mark.parametrize("kernel", ["torch", CPU, pytest.param("triton", marks=pytest.mark.triton)])
def test_ties_go_to_the_later_key_on_every_path(kernel):
    """Negative weights give exact zeros (ReLU) for many keys: the later ones are kept."""
    q, k, w = inputs(1, 24, 0, 2, 16)
    w = -w.abs()  # every score <= 0, most of them exactly 0
    kept = index_topk(*(t.to(device_for(kernel)) for t in (q, k, w)), 0, 4, kernel).cpu()
    assert torch.equal(kept, naive(q, k, w, 0, 4))
    scores = index_scores(q, k, w, 0)[0, 23]
    zeros = (scores == 0).nonzero().flatten()
    assert len(zeros) >= 4 and torch.equal(kept[0, 23].sort().values, zeros[-4:])


class LargestTensor(TorchDispatchMode):
    """The most elements any operation's output holds, while open."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("kernel,n", [("torch", 4096), pytest.param("triton", 256, marks=pytest.mark.triton)])
def test_no_tensor_holds_every_query_against_every_key(kernel, n, monkeypatch):
    import kernels.lightning_index.triton as triton_path

    monkeypatch.setattr(triton_path, "_CHUNK", n * n // 16)  # the Triton test runs at an interpreter's size
    q, k, w = (t.to(device_for(kernel)) for t in inputs(1, n, 0, 2, 16))
    with LargestTensor() as mode:
        index_topk(q, k, w, 0, 8, kernel)
    assert mode.largest <= n * n // 2


@pytest.mark.parametrize("kernel", ["torch", CPU])
def test_chunks_do_not_change_the_choice(monkeypatch, kernel):
    import kernels.lightning_index.reference as reference

    q, k, w = inputs(2, 50, 3, 2, 16)
    whole = index_topk(q, k, w, 3, 6, kernel)
    monkeypatch.setattr(reference, "_CHUNK", 53 * 2)  # one query a chunk
    assert torch.equal(index_topk(q, k, w, 3, 6, kernel), whole)


@pytest.mark.skipif(not cpu_built(), reason="no C compiler to build the indexer's kernel")
def test_the_c_top_k_equals_the_reference_on_a_longer_sequence_and_passes_opcheck():
    """Many more keys than slots (the heap's replacements), ties at zero, bf16 inputs (their products
    in bf16 as the reference's), and the custom operator under opcheck."""
    q, k, w = inputs(2, 300, 0, 2, 32, seed=3)
    w[:, ::3] = -w[:, ::3].abs()  # some queries with every score <= 0: ties at zero
    for dtype in (torch.float32, torch.bfloat16):
        args = (q.to(dtype), k.to(dtype), w.to(dtype), 0, 16)
        assert torch.equal(index_topk(*args, kernel="cpu"), index_topk(*args, kernel="torch"))
    products = torch.randn(2, 5, 2, 9)
    torch.library.opcheck(torch.ops.sparse_attention.index_topk_rows.default, (products, torch.randn(2, 5, 2), 4, 6))


@pytest.mark.parametrize("kernel", ["torch", "cpu"])
@pytest.mark.parametrize("heads,d", [(2, 32), (3, 12)], ids=["H2-D32", "H3-D12"])
def test_gathered_scores_are_the_definitions_at_the_chosen_keys(kernel, heads, d):
    """The chosen keys' scores (0 in unused slots) and the gradients of q, k and w, on both paths
    (the C kernel in fp32 against the float64 definition), with its custom operators under opcheck."""
    from kernels.lightning_index import cpu_built, gathered_scores
    from tests.helpers.chosen_keys import random_indices

    if kernel == "cpu" and not cpu_built():
        pytest.skip("no C compiler to build the indexer's kernel")
    gen = torch.Generator().manual_seed(6)
    b, m = 2, 27
    q, k, w = (torch.randn(*shape, dtype=torch.float64, generator=gen) for shape in ((b, m, heads, d), (b, m, d),
                                                                                      (b, m, heads)))
    chosen = random_indices(b, m, 0, 8, gen)
    wide = [t.clone().requires_grad_() for t in (q, k, w)]
    expected = index_scores(*wide, 0).gather(-1, chosen.clamp(min=0)).masked_fill(chosen < 0, 0.0)
    leaves = [t.float().requires_grad_() for t in (q, k, w)] if kernel == "cpu" else wide
    scores = gathered_scores(*leaves, chosen, kernel)
    tol = 2e-5 if kernel == "cpu" else 1e-10
    torch.testing.assert_close(scores.double(), expected, rtol=tol, atol=tol)
    cotangent = torch.randn(scores.shape, dtype=torch.float64, generator=gen)
    for got, want in zip(torch.autograd.grad((scores.double() * cotangent).sum(), leaves),
                         torch.autograd.grad((expected * cotangent).sum(), wide)):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    if kernel == "cpu":
        args = tuple(t.detach().requires_grad_() for t in leaves)
        torch.library.opcheck(torch.ops.sparse_attention.gathered_index_scores.default, (*args, chosen))
        torch.library.opcheck(torch.ops.sparse_attention.gathered_index_scores_backward.default,
                              (*(t.detach() for t in args), chosen, cotangent.float()))


@pytest.mark.skipif(not cpu_built(), reason="no C compiler to build the indexer's kernel")
def test_gathered_scores_refuse_what_the_c_kernel_would_read_past():
    from kernels.lightning_index import gathered_scores

    q, k, w = torch.randn(2, 16, 2, 8), torch.randn(2, 16, 8), torch.randn(2, 16, 2)
    chosen = torch.randint(0, 16, (2, 16, 4))
    with pytest.raises(ValueError, match="do not go together"):
        gathered_scores(q, k, w, chosen[:1, :1], "cpu")  # fewer rows than the queries
    with pytest.raises(ValueError, match="do not go together"):
        gathered_scores(q, k[..., :4], w, chosen, "cpu")  # narrower keys
    with pytest.raises(ValueError, match="an index past the 16 keys"):
        gathered_scores(q, k, w, chosen.clone().fill_(16), "cpu")
