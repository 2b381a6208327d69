"""The gather-attention CPU kernel (kernels/gather_attention/cpu.py) against the naive definition:
output, log-sum-exp and every gradient, with repeated, unused and future slots, queries that see
nothing, decoding, GQA groups, bf16 and strided views; its custom operators under opcheck; and the
dispatch that picks it."""

import pytest
import torch

from kernels import dispatch
from kernels.gather_attention import cpu_built, gather_attention, gathered_probabilities
from kernels.gather_attention.naive import gather_attention as naive
from tests.helpers.chosen_keys import random_indices, repeat_some_slots
from tests.helpers.kernel_checks import assert_all_close, values_and_grads

pytestmark = pytest.mark.skipif(not cpu_built(), reason="no C compiler to build the gather-attention kernel")

CASES = [  # (batch_kv, seq_q, seq_k, group, dim_head, top_k)
    (1, 16, 16, 1, 8, 4),  # group 1; d below one piece of two vectors (plain loops)
    (2, 37, 37, 2, 16, 5),  # group 2
    (2, 40, 40, 4, 64, 9),  # group 4, the unrolled width
    (3, 30, 30, 8, 32, 12),  # two passes of 4 heads; top_k above the early queries' keys
    (1, 25, 25, 3, 12, 6),  # a group of 3; d off the vector width
    (2, 5, 41, 2, 64, 7),  # decoding: queries at the end of a longer key sequence
    (1, 1, 1, 1, 8, 3),  # a single token
]


def inputs(bh, m, n, g, d, seed=0):
    """q, k, v in float64 (the definition's) and the generator, for the fp32 kernel to follow."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bh, m, g, d, dtype=torch.float64, generator=gen)
    k = torch.randn(bh, n, d, dtype=torch.float64, generator=gen)
    v = torch.randn(bh, n, d, dtype=torch.float64, generator=gen)
    return q, k, v, gen


def check(q, k, v, indices, start, tol=2e-5):
    """The kernel on fp32 copies against the definition on float64: out, lse, dq, dk, dv (lse's
    gradient included, where finite)."""
    wide = [t.clone().requires_grad_() for t in (q, k, v)]
    narrow = [t.float().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = naive(*wide, indices, start)
    out, lse = gather_attention(*narrow, indices, start, "cpu")
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.equal(lse.isinf(), ref_lse.isinf())
    # an empty query's -inf would make its lse term NaN: its gradient is 0 there either way
    expected = values_and_grads(ref_out, ref_lse.masked_fill(ref_lse.isinf(), 0), wide)
    assert_all_close(values_and_grads(out, lse.masked_fill(lse.isinf(), 0), narrow), [t.float() for t in expected], tol)


@pytest.mark.parametrize("bh,m,n,g,d,top_k", CASES,
                         ids=[f"BH{c[0]}-Q{c[1]}-K{c[2]}-G{c[3]}-D{c[4]}-top{c[5]}" for c in CASES])
def test_matches_the_definition(bh, m, n, g, d, top_k):
    q, k, v, gen = inputs(bh, m, n, g, d)
    check(q, k, v, random_indices(bh, m, n - m, top_k, gen), n - m)


@pytest.mark.parametrize("d", [12, 64])
def test_repeated_unused_and_future_slots(d):
    """A key named in several slots counts once, -1 slots are unused, keys after the query are
    masked though named, and a query with no visible key gets zeros, -inf and finite gradients."""
    q, k, v, gen = inputs(2, 24, 24, 4, d)
    indices, _, _ = repeat_some_slots(random_indices(2, 24, 0, 8, gen), torch.ones(2, 24, 8, dtype=torch.bool), gen)
    indices[0, 5] = torch.tensor([9, 23, 6, 9, 6, -1, 6, 20])  # every key after query 5, some named twice
    indices[1, 3] = -1  # nothing at all
    indices[1, 7] = torch.tensor([8, 12, -1, 8, 22, -1, -1, 23])  # only keys after it
    check(q, k, v, indices, 0)
    out, lse = gather_attention(*(t.float().requires_grad_() for t in (q, k, v)), indices, 0, "cpu")
    assert (out[1, 3] == 0).all() and (out[1, 7] == 0).all() and lse[1, [3, 7]].isneginf().all()
    assert lse[0, 5].isneginf().all()  # every key it names is after it


def test_a_query_with_no_visible_key_has_finite_gradients():
    q, k, v, _ = inputs(1, 6, 6, 2, 8)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    out, lse = gather_attention(*leaves, torch.tensor([[[-1, -1]] * 3 + [[0, 1]] * 3]), 0, "cpu")
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves) and (leaves[0].grad[0, :3] == 0).all()


@pytest.mark.parametrize("threads", [1, 2, 3])  # bh = 2: shared key gradients on 1 and 2 threads, per thread on 3
def test_views_of_one_projection_are_read_where_they_lie(threads):
    """q [bh, m, g, d] and k, v [bh, n, d] as strided views of one projection, and a strided output
    gradient, on any number of threads: the definition's values and gradients."""
    bh, m, g, d = 2, 33, 4, 64
    gen = torch.Generator().manual_seed(3)
    projection = torch.randn(m, bh, (g + 2) * d, dtype=torch.float64, generator=gen)
    indices = random_indices(bh, m, 0, 10, gen)
    weight = torch.randn(m, g, bh, d, dtype=torch.float64, generator=gen)

    def run(kernel):
        x = projection.clone().requires_grad_() if kernel == "torch" else projection.float().requires_grad_()
        q = x[..., : g * d].unflatten(-1, (g, d)).transpose(0, 1)  # [bh, m, g, d], strided
        k, v = x[..., g * d :].unflatten(-1, (2, d)).permute(2, 1, 0, 3)  # [bh, m, d] each, strided
        out, lse = naive(q, k, v, indices, 0) if kernel == "torch" else gather_attention(q, k, v, indices, 0, "cpu")
        loss = (out.permute(1, 2, 0, 3).contiguous() * weight).sum() + lse.sum()  # the gradient comes strided
        return out, lse, torch.autograd.grad(loss, x)[0]

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_all_close(run("cpu"), [t.float() for t in run("torch")], 2e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_inputs_come_back_in_their_dtype(dtype):
    """Computed in fp32: the same as fp32 inputs of the same (rounded) values, to the dtype's precision."""
    q, k, v, gen = inputs(2, 29, 29, 4, 64)
    indices = random_indices(2, 29, 0, 8, gen)
    half = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    rounded = [t.detach().float().requires_grad_() for t in half]
    ours = values_and_grads(*gather_attention(*half, indices, 0, "cpu"), half)
    assert ours[0].dtype == dtype and ours[1].dtype == torch.float32 and all(t.dtype == dtype for t in ours[2:])
    assert_all_close(ours, values_and_grads(*gather_attention(*rounded, indices, 0, "cpu"), rounded),
                     3e-2 if dtype == torch.bfloat16 else 4e-3)


def test_the_custom_operators_pass_opcheck():
    """sparse_attention::gather_attention and its backward under torch.library.opcheck: the schema,
    the fake implementations against the kernel, the autograd registration and AOTAutograd tracing
    with dynamic shapes, on a strided q."""
    q, k, v, gen = inputs(2, 19, 19, 2, 16)
    indices = random_indices(2, 19, 0, 5, gen)
    q = q.float().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # [bh, m, g, d], g outermost
    k, v = (t.float().requires_grad_() for t in (k, v))
    forward = torch.ops.sparse_attention.gather_attention.default
    torch.library.opcheck(forward, (q, k, v, indices, 0))
    out, lse = forward(q, k, v, indices, 0)
    dout, dlse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    torch.library.opcheck(torch.ops.sparse_attention.gather_attention_backward.default,
                          tuple(t.detach() for t in (q, k, v, indices)) + (0, lse.detach(), dout, dlse))
    torch.library.opcheck(torch.ops.sparse_attention.gather_attention_backward.default,
                          tuple(t.detach() for t in (q, k, v, indices)) + (0, lse.detach(), dout, None))


def test_kernel_cpu_and_auto_run_the_c_kernel_and_torch_does_not(monkeypatch):
    from kernels.gather_attention import cpu

    calls = []
    monkeypatch.setattr(cpu, "gather_attention", lambda *args: calls.append(args) or (None, None))
    q, k, v, gen = inputs(1, 4, 4, 2, 8)
    indices = random_indices(1, 4, 0, 2, gen)
    for kernel, c_kernel in (("cpu", True), ("auto", True), ("torch", False)):
        calls.clear()
        gather_attention(q.float(), k.float(), v.float(), indices, 0, kernel)
        assert bool(calls) == c_kernel, kernel
    calls.clear()
    gather_attention(q, k, v, indices, 0, "auto")  # float64: the C kernel would round it to fp32
    assert not calls
    assert dispatch.choose(q.float(), "cpu", None, cpu_built) == "cpu"


@pytest.mark.parametrize("g,d,start", [(1, 12, 0), (4, 64, 0), (6, 16, 9)], ids=["G1-D12", "G4-D64", "G6-D16-start9"])
def test_gathered_probabilities_match_the_reference(g, d, start):
    """Each slot's probability summed over the group, from the kernel's log-sum-exp: the reference's,
    with repeated slots (the first gets the key), unused and future slots and an empty query (0)."""
    from kernels.gather_attention.reference import gathered_probabilities as reference

    q, k, v, gen = inputs(2, 20, 20 + start, g, d)
    indices, _, _ = repeat_some_slots(random_indices(2, 20, start, 7, gen), torch.ones(2, 20, 7, dtype=torch.bool), gen)
    indices[0, 2, 3] = start + 10  # after its query
    indices[1, 4] = -1
    q, k = q.float(), k.float()
    _, lse = gather_attention(q, k, v.float(), indices, start, "cpu")
    probs = gathered_probabilities(q, k, indices, lse, start, "cpu")
    assert probs.dtype == torch.float32 and (probs[1, 4] == 0).all() and probs[0, 2, 3] == 0
    torch.testing.assert_close(probs, reference(q, k, indices, lse, start), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probs[0].sum(-1), torch.full((20,), float(g)), rtol=1e-5, atol=1e-5)
    torch.library.opcheck(torch.ops.sparse_attention.gathered_probabilities.default, (q, k, indices, lse, start))
