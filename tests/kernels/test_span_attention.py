"""The span-attention CPU kernel against its definition (naive.py): values, log-sum-exps and
gradients, with shared and per-row spans, slot weights, empty rows and lengths off the tile size."""

import pytest
import torch

from kernels.span_attention import available, span_attention
from kernels.span_attention.naive import naive_span_attention

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler to build the span-attention kernel")


def window_and_blocks(m: int, window: int, block: int) -> torch.Tensor:
    """[m, 3, 2] disjoint spans per query: its window, the initial block and the block of key 8 on,
    each cut where the window begins (so nothing overlaps)."""
    i = torch.arange(m)
    begin = (i - window + 1).clamp(min=0)
    return torch.stack([
        torch.stack([begin, i + 1], -1),
        torch.stack([torch.zeros_like(i), begin.clamp(max=block)], -1),
        torch.stack([torch.full_like(i, 2 * block), begin.clamp(max=3 * block)], -1),
    ], dim=-2)


def inputs(bh=3, g=2, m=45, d=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((bh, g, m, d), (bh, m, d), (bh, m, d)))
    return q, k, v


def check(q, k, v, spans, weights=None, gate=None):
    """The kernel (fp32) against the definition (fp64): out, lse and every gradient."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    extra = {name: t.clone().requires_grad_() for name, t in (("weights", weights), ("gate", gate)) if t is not None}
    leaves += list(extra.values())
    ref_out, ref_lse = naive_span_attention(*leaves[:3], spans, **extra)
    out, lse = span_attention(*(t.float() for t in leaves[:3]), spans, **{n: t.float() for n, t in extra.items()})
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-5)
    assert torch.equal(lse.isinf(), ref_lse.isinf())
    finite = ref_lse.isfinite()
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=2e-5, rtol=1e-5)
    gen = torch.Generator().manual_seed(1)
    dout, dlse = torch.randn(out.shape, generator=gen, dtype=torch.float64), torch.randn(lse.shape, generator=gen, dtype=torch.float64)
    expected = torch.autograd.grad((ref_out * dout).sum() + (ref_lse.masked_fill(~finite, 0) * dlse).sum(), leaves)
    got = torch.autograd.grad((out.double() * dout).sum() + (lse.double().masked_fill(~finite, 0) * dlse).sum(), leaves)
    for e, a in zip(expected, got):
        torch.testing.assert_close(a.double(), e, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("d", [24, 64])  # 64: the width the kernel unrolls
@pytest.mark.parametrize("m", [1, 16, 45, 70])
def test_shared_spans_match_the_definition(m, d):
    q, k, v = inputs(m=m, d=d)
    check(q, k, v, window_and_blocks(m, window=7, block=4))


@pytest.mark.parametrize("d", [24, 64])
@pytest.mark.parametrize("g", [1, 3, 4])  # the kernel takes heads in pairs: one alone, a pair and one, two pairs
def test_every_group_size_with_weights_gates_and_an_empty_row(g, d):
    q, k, v = inputs(bh=2, g=g, m=33, d=d)
    gen = torch.Generator().manual_seed(3)
    spans = window_and_blocks(33, window=5, block=3).expand(2, 33, 3, 2).clone()
    spans[1, 9] = 0  # a query that sees nothing
    weights = 1 + torch.rand(2, 33, 3, generator=gen, dtype=torch.float64)
    check(q, k, v, spans, weights, torch.rand(2, g, 33, generator=gen, dtype=torch.float64))


def test_per_row_spans_with_empty_rows_and_slots():
    q, k, v = inputs(bh=2, m=37)
    spans = window_and_blocks(37, window=5, block=3).expand(2, 37, 3, 2).clone()
    spans[0, 4] = 0  # a query that sees nothing: zeros and -inf
    spans[1, 20, 0] = torch.tensor([30, 10])  # an unused slot (end before start)
    out, lse = span_attention(q.float(), k.float(), v.float(), spans)
    assert out[0, :, 4].abs().max() == 0 and lse[0, :, 4].eq(float("-inf")).all()
    check(q, k, v, spans)


@pytest.mark.parametrize("d", [24, 64])
def test_slot_weights_scale_each_share_and_get_their_gradient(d):
    q, k, v = inputs(bh=2, m=40, d=d)
    spans = window_and_blocks(40, window=6, block=4).expand(2, 40, 3, 2)
    weights = torch.rand(2, 40, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) + 0.5
    check(q, k, v, spans, weights)


def test_half_precision_inputs_come_back_in_their_dtype():
    """bf16 in, bf16 out and bf16 gradients, computed in fp32 (as the float64 reference of the
    same bf16 values, to bf16's precision)."""
    q, k, v = inputs(m=20)
    spans = window_and_blocks(20, window=4, block=2)
    half = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    out, lse = span_attention(*half, spans)
    wide = [t.detach().double().requires_grad_() for t in half]
    ref, _ = naive_span_attention(*wide, spans)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    dout = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    out.backward(dout.bfloat16())
    ref.backward(dout.bfloat16().double())
    for got, want in zip(half, wide):
        assert got.grad.dtype == torch.bfloat16
        torch.testing.assert_close(got.grad.double(), want.grad, atol=5e-2, rtol=5e-2)


def test_results_do_not_depend_on_the_thread_count():
    q, k, v = inputs(bh=1, m=64)
    spans = window_and_blocks(64, window=9, block=4)
    results = []
    for threads in (1, 3):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            leaves = [t.float().requires_grad_() for t in (q, k, v)]
            out, lse = span_attention(*leaves, spans)
            results.append((out, *torch.autograd.grad(out.square().sum() + lse.sum(), leaves)))
        finally:
            torch.set_num_threads(before)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("with_weights", [False, True])
def test_gate_scales_each_head_and_gets_its_gradient(with_weights):
    q, k, v = inputs(bh=2, m=29)
    gen = torch.Generator().manual_seed(2)
    gate = torch.rand(2, 2, 29, generator=gen, dtype=torch.float64)
    weights = 1 + torch.rand(2, 29, 3, generator=gen, dtype=torch.float64) if with_weights else None
    spans = window_and_blocks(29, window=5, block=3).expand(2, 29, 3, 2).clone()
    spans[1, 7] = 0  # a query that sees nothing: its gate gets no gradient
    check(q, k, v, spans, weights, gate)


@pytest.mark.parametrize("d", [24, 64])
def test_rotary_phases_rotate_queries_and_keys_as_rotary_does(d):
    """The kernel rotates as it reads: its values and gradients equal the definition applied to
    Rotary's rotation of q and k, the gradients flowing back through the rotation."""
    from models.rotary import Rotary

    rotary = Rotary(d).double()
    q, k, v = inputs(bh=2, m=37, d=d)
    spans = window_and_blocks(37, window=6, block=4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, _ = naive_span_attention(*leaves, spans, rotate=lambda x, inverse: rotary(x, inverse=inverse))
    out, _ = span_attention(*(t.float() for t in leaves), spans, phases=Rotary(d).phases(37, "cpu"))
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-5)
    dout = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    expected = torch.autograd.grad((ref_out * dout).sum(), leaves)
    got = torch.autograd.grad((out.double() * dout).sum(), leaves)
    for e, a in zip(expected, got):
        torch.testing.assert_close(a.double(), e, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 3])  # bh = 4: shared key gradients on 1 and 2 threads, per thread on 3
def test_views_of_one_projection_are_read_where_they_lie(threads):
    """q [b, h, g, n, d] and k, v [b, h, n, d] as strided views of one [b, n, features] projection
    (batch 2, so no flatten of (b, h) is a view), rotated, and the output's gradient strided: the
    values and the projection's gradient of the definition, in the views' shapes."""
    from models.rotary import Rotary

    b, h, g, m, d = 2, 2, 2, 30, 16
    gen = torch.Generator().manual_seed(5)
    projection = torch.randn(b, m, (g + 2) * h * d, generator=gen, dtype=torch.float64)
    spans = window_and_blocks(m, window=5, block=4)
    rotary = Rotary(d).double()
    weight = torch.randn(m, b * h, g, d, generator=gen, dtype=torch.float64)

    def run(kernel: bool):
        x = projection.clone().float().requires_grad_() if kernel else projection.clone().requires_grad_()
        q = x[..., : h * g * d].unflatten(-1, (h, g, d)).permute(0, 2, 3, 1, 4)  # [b, h, g, m, d]
        k, v = (x[..., h * g * d :].unflatten(-1, (2, h, d)).permute(2, 0, 3, 1, 4))  # [b, h, m, d] each
        if kernel:
            out, lse = span_attention(q, k, v, spans, phases=rotary.phases(m, "cpu"))
            assert out.shape == q.shape and lse.shape == (b * h, g, m)
        else:
            out, lse = naive_span_attention(*(t.flatten(0, 1) for t in (q, k, v)), spans,
                                            rotate=lambda t, inverse: rotary(t, inverse=inverse))
        # the output's gradient reaches the kernel strided (positions first), as to_out's does
        loss = (out.reshape(b * h, g, m, d).movedim(-2, 0).contiguous() * weight).sum() + lse.sum()
        return out.reshape(b * h, g, m, d).double(), lse.double(), torch.autograd.grad(loss, x)[0].double()

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for a, e in zip(run(kernel=True), run(kernel=False)):
            torch.testing.assert_close(a, e, atol=5e-5, rtol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_arguments_that_do_not_go_together_are_refused_before_c_reads_them():
    """The kernel trusts every size and span: each of these read or wrote past a tensor (a crash,
    NaNs or values of 1e31) before they were refused."""
    q, k, v = (t.float() for t in inputs(bh=2, m=20))
    spans = window_and_blocks(20, window=4, block=2)
    refused = {
        "rotary phases": dict(phases=torch.zeros(10, 12, 2)),
        "keys .* do not go with": dict(q=q[None]),
        "keys .* do not go with ": dict(k=k[..., :8], v=v[..., :8]),  # another dim_head
        "spans .* do not go with": dict(spans=spans[:5]),  # fewer queries
        "spans .* do not go with ": dict(spans=spans.expand(1, -1, -1, -1)),  # fewer rows than batch_kv
        "gate .* do not go with": dict(gate=torch.ones(1, 2, 20)),
        "weights .* do not go with": dict(weights=torch.ones(2, 20, 2)),
        "a span reaches outside the 20 keys": dict(spans=spans.clone().index_put_((torch.tensor(19), torch.tensor(0),
                                                                                   torch.tensor(1)), torch.tensor(21))),
        "a span reaches outside the 20 keys ": dict(spans=torch.tensor([[[-2, 1]]]).expand(20, 1, 2)),
    }
    for message, change in refused.items():
        args = {"q": q, "k": k, "v": v, "spans": spans, **change}
        with pytest.raises(ValueError, match=message.strip()):
            span_attention(**args)


@pytest.mark.parametrize("layout", ["flat", "views"])
def test_the_custom_operators_pass_opcheck(layout):
    """sparse_attention::span_attention and its backward under torch.library.opcheck: the schema
    (no input written, no output aliasing an input), the fake implementation's shapes, dtypes and
    strides against the kernel's, the autograd registration, and AOTAutograd tracing with dynamic
    shapes; with weights, gate and rotary phases, on contiguous inputs and on strided views of one
    projection (as NSA passes them)."""
    from models.rotary import Rotary

    gen = torch.Generator().manual_seed(7)
    b, h, g, m, d = 2, 2, 2, 21, 16
    if layout == "flat":
        q, k, v = (t.float() for t in inputs(bh=b * h, g=g, m=m, d=d))
    else:
        projection = torch.randn(b, m, (g + 2) * h * d, generator=gen)
        q = projection[..., : h * g * d].unflatten(-1, (h, g, d)).permute(0, 2, 3, 1, 4)  # [b, h, g, m, d]
        k, v = projection[..., h * g * d :].unflatten(-1, (2, h, d)).permute(2, 0, 3, 1, 4)  # [b, h, m, d] each
    spans = window_and_blocks(m, window=5, block=4).to(torch.int32)
    weights = 1 + torch.rand(b * h, m, 3, generator=gen)
    gate = torch.rand(b * h, g, m, generator=gen)
    phases = Rotary(d).phases(m, "cpu").contiguous()
    q, k, v, weights, gate = (t.detach().requires_grad_() for t in (q, k, v, weights, gate))
    forward = torch.ops.sparse_attention.span_attention.default
    torch.library.opcheck(forward, (q, k, v, spans, weights, gate, phases))
    torch.library.opcheck(forward, (q, k, v, spans, None, None, None))
    out, lse = forward(q, k, v, spans, weights, gate, phases)
    dout, dlse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    torch.library.opcheck(torch.ops.sparse_attention.span_attention_backward.default,
                          tuple(t.detach() for t in (q, k, v, spans, weights, gate, phases, lse, dout, dlse)))
