"""kernels/nsa_attention/compressor.py: NSA's block compressor on token-first input, its torch path
and its Triton kernels (in Triton's interpreter on a CPU), against the definition written out here
block by block: values and every gradient, launch counts, the custom operators."""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from experiments.runtime.op_counts import count_ops
from kernels.nsa_attention import compressor_triton
from kernels.nsa_attention.compressor import compress_backward, compress_blocks, compress_forward
from tests.helpers.kernel_checks import TRITON_DEVICE, device_for

triton = pytest.mark.triton
KERNELS = ["torch", pytest.param("triton", marks=triton)]


@dataclass(frozen=True)
class Case:
    batch: int
    seq: int
    heads: int
    dim: int
    block: int
    stride: int
    hidden: int = 16
    first: int = 0
    strided: bool = True  # x a view of a wider projection's output, as the model passes it

    def __str__(self) -> str:
        return (f"B{self.batch}-T{self.seq}-H{self.heads}-D{self.dim}-l{self.block}-s{self.stride}"
                + (f"-hid{self.hidden}" if self.hidden != 16 else "") + (f"-first{self.first}" if self.first else "")
                + ("" if self.strided else "-contiguous"))

    @property
    def blocks(self) -> int:
        return max(0, (self.seq - self.first * self.stride - self.block) // self.stride + 1)


CASES = [
    Case(2, 40, 3, 16, 8, 4),  # block two strides; 3 heads (2 * kv_heads need not be a power of two)
    Case(1, 37, 2, 16, 6, 4, hidden=24),  # block not a multiple of the stride, length off it, hidden padded
    Case(2, 33, 2, 16, 4, 4),  # block = stride: no overlap
    Case(1, 50, 2, 16, 8, 4, first=3),  # decoding: only the blocks from index 3 on
    Case(1, 45, 2, 32, 8, 2, hidden=32, strided=False),  # four strides a block, contiguous x
    Case(1, 300, 1, 16, 8, 4),  # 74 blocks: two programs' tiles, dw2 summed over their parts
    Case(2, 7, 2, 16, 8, 4),  # shorter than a block: no block at all
]


def naive(x, pos, w1, b1, w2, block, stride, first=0):
    """The definition, one block at a time: out[c] = gelu(flatten(x[block c] + pos) @ w1 + b1) @ w2,
    block c = tokens (first + c) * stride + [0, block)."""
    batch, seq, heads, dim = x.shape
    outs = []
    c = 0
    while (first + c) * stride + block <= seq:
        start = (first + c) * stride
        tokens = x[:, start: start + block] + pos.transpose(0, 1)  # [b, l, h, d]
        flat = tokens.permute(0, 2, 1, 3).reshape(batch, heads, block * dim)  # [b, h, l * d]
        hidden = F.gelu(torch.einsum("bhx,hxy->bhy", flat, w1) + b1[:, 0])
        outs.append(torch.einsum("bhy,hyd->bhd", hidden, w2))
        c += 1
    if not outs:  # empty, and joined to every input: their gradients are zeros
        return x[:, :0] + 0 * sum(t.sum() for t in (pos, w1, b1, w2))
    return torch.stack(outs, 1)


def inputs(case: Case, dtype=torch.float32, seed=0, device="cpu"):
    """x [b, seq, heads, d] (a strided view of a [b, seq, 3, heads, d] buffer unless case.strided is
    False) and the weights, all random (pos and b1 too, so that a dropped term shows), on `device`."""
    g = torch.Generator().manual_seed(seed)
    b, n, h, d, l, hid = case.batch, case.seq, case.heads, case.dim, case.block, case.hidden
    if case.strided:
        x = torch.randn(b, n, 3, h, d, generator=g, dtype=dtype).to(device)[:, :, 1]
    else:
        x = torch.randn(b, n, h, d, generator=g, dtype=dtype).to(device)
    pos = torch.randn(h, l, d, generator=g, dtype=dtype) * 0.5
    w1 = torch.randn(h, l * d, hid, generator=g, dtype=dtype) / (l * d) ** 0.5
    b1 = torch.randn(h, 1, hid, generator=g, dtype=dtype) * 0.5
    w2 = torch.randn(h, hid, d, generator=g, dtype=dtype) / hid ** 0.5
    return (x, *(t.to(device) for t in (pos, w1, b1, w2)))


def values_and_grads(fn, tensors, dout):
    """fn's output and every input's gradient for the cotangent dout, on the CPU."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(dout.to(out.device))
    return out.detach().cpu(), [None if t.grad is None else t.grad.cpu() for t in leaves]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_values_and_every_gradient_match_the_definition(case, kernel):
    """fp32 output and the gradients of x, pos, w1, b1, w2 against the block-by-block definition in
    fp64 (0 blocks: an empty output, and gradients that are there and zero)."""
    tensors = inputs(case, device=device_for(kernel))
    assert case.strided == (not tensors[0].is_contiguous())
    k = dict(block=case.block, stride=case.stride, first=case.first)
    # the output's gradient head-first, as a consumer that transposes the output passes it back: strided
    dout = torch.randn(case.batch, case.heads, case.blocks, case.dim,
                       generator=torch.Generator().manual_seed(1)).transpose(1, 2)
    want, want_grads = values_and_grads(lambda *t: naive(*t, **k), [t.cpu().double() for t in tensors], dout.double())
    got, grads = values_and_grads(lambda *t: compress_blocks(*t, **k, kernel=kernel), tensors, dout)
    assert got.shape == (case.batch, case.blocks, case.heads, case.dim) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)
    for name, grad, want_grad, t in zip(("x", "pos", "w1", "b1", "w2"), grads, want_grads, tensors):
        assert grad is not None and grad.shape == t.shape, name
        if case.blocks == 0:
            assert not grad.any(), name
        else:
            assert want_grad.abs().max() > 0.1, name  # the check below is not vacuous
        torch.testing.assert_close(grad.double(), want_grad, atol=5e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kernel, weights", [("torch", "bf16-weights"),
                                             pytest.param("triton", "bf16-weights", marks=triton),
                                             pytest.param("triton", "fp32-weights", marks=triton)])
def test_bf16_inputs(kernel, weights):
    """bf16 x (as under autocast): a bf16 output and x gradient, each weight's gradient in its own
    dtype, all within bf16's rounding of the definition. fp32 weights under a bf16 x (a model's
    parameters under autocast) only for the custom op: plain einsums take one dtype, autocast casts them."""
    case = Case(1, 30, 2, 16, 8, 4, hidden=24)
    tensors = inputs(case, device=device_for(kernel))
    x, params = tensors[0].bfloat16(), [t.bfloat16() if weights == "bf16-weights" else t for t in tensors[1:]]
    dout = torch.randn(1, case.blocks, 2, 16, generator=torch.Generator().manual_seed(1))
    k = dict(block=case.block, stride=case.stride)
    got, grads = values_and_grads(lambda *t: compress_blocks(*t, **k, kernel=kernel), [x, *params], dout.bfloat16())
    want, want_grads = values_and_grads(lambda *t: naive(*t, **k), [t.cpu().double() for t in (x, *params)],
                                        dout.double())
    assert got.dtype == torch.bfloat16 and [g.dtype for g in grads] == [t.dtype for t in (x, *params)]
    for name, value, reference in zip(("out", "x", "pos", "w1", "b1", "w2"), (got, *grads), (want, *want_grads)):
        error = (value.double() - reference).abs().max()
        assert error <= 0.02 * reference.abs().max(), f"{name}: {error:.3g} off, of {reference.abs().max():.3g}"


@pytest.mark.parametrize("case", [Case(2, 40, 2, 16, 8, 4, first=1), Case(1, 29, 2, 16, 6, 4, hidden=12)], ids=str)
def test_torch_path_is_the_definition_in_fp64(case):
    """The torch path (the readable one) is the definition, to fp64 rounding."""
    x, pos, w1, b1, w2 = inputs(case, torch.float64)
    ours = compress_blocks(x, pos, w1, b1, w2, case.block, case.stride, case.first, kernel="torch")
    torch.testing.assert_close(ours, naive(x, pos, w1, b1, w2, case.block, case.stride, case.first),
                               atol=1e-12, rtol=1e-12)


@triton
def test_triton_weight_gradients_split_over_features(monkeypatch):
    """dw1's programs hold WEIGHT_ROWS of a block position's dim_head rows each (64 on a GPU): at 16, a
    dim_head of 32 splits in two, and every gradient still matches the definition."""
    monkeypatch.setattr(compressor_triton, "WEIGHT_ROWS", 16)
    case = Case(1, 26, 2, 32, 6, 4, hidden=24)
    tensors = inputs(case, device=TRITON_DEVICE)
    dout = torch.randn(1, case.blocks, 2, 32)
    k = dict(block=case.block, stride=case.stride)
    with count_ops() as counts:
        _, grads = values_and_grads(lambda *t: compress_blocks(*t, **k, kernel="triton"), tensors, dout)
    _, want_grads = values_and_grads(lambda *t: naive(*t, **k), [t.cpu().double() for t in tensors], dout.double())
    assert counts.triton[-1].grid[0] == (6 * 2 + 1) * 2 + 1 * 2 * 1  # the split weight programs, then dx's
    for name, grad, want_grad in zip(("x", "pos", "w1", "b1", "w2"), grads, want_grads):
        torch.testing.assert_close(grad.double(), want_grad, atol=5e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@triton
def test_triton_gradients_are_deterministic():
    """Every sum runs in a fixed order (no atomics): two backwards agree bit for bit."""
    case = Case(1, 24, 2, 16, 8, 4)
    tensors = inputs(case, device=TRITON_DEVICE)
    dout = torch.randn(1, case.blocks, 2, 16)
    runs = [values_and_grads(lambda *t: compress_blocks(*t, 8, 4, kernel="triton"), tensors, dout)[1]
            for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@triton
def test_triton_launches_within_budget():
    """Under op_counts: forward one launch (at most 2), backward two Triton launches, forward + backward
    at most 6 in all (aten and Triton), every Triton launch reported with 64 rows a program."""
    case = Case(1, 80, 2, 16, 8, 4)
    x, pos, w1, b1, w2 = (t.requires_grad_() for t in inputs(case, device=TRITON_DEVICE))
    with count_ops() as fwd:
        out = compress_blocks(x, pos, w1, b1, w2, 8, 4, kernel="triton")
    with count_ops() as bwd:
        out.backward(torch.ones_like(out))
    assert fwd.launches <= 2 and len(fwd.triton) == 1, fwd.format()
    assert fwd.launches + bwd.launches <= 6 and len(bwd.triton) == 2, bwd.format()
    for counts in (fwd, bwd):
        assert not counts.unreported() and not counts.syncs, counts.format()
    assert all(launch.rows == 64 for launch in fwd.reported + bwd.reported)


@triton
def test_custom_operators_pass_opcheck():
    """sparse_attention::compress_forward and compress_backward under torch.library.opcheck: schema,
    fake (meta) shapes, autograd registration, AOT dispatch, on a strided x."""
    case = Case(1, 14, 2, 16, 6, 4, hidden=24, first=1)
    x, pos, w1, b1, w2 = inputs(case, device=TRITON_DEVICE)
    args = (x, pos.requires_grad_(), w1.requires_grad_(), b1, w2, case.block, case.stride, case.first)
    torch.library.opcheck(compress_forward, args)
    dout = torch.randn(1, case.blocks, 2, 16, device=TRITON_DEVICE)
    torch.library.opcheck(compress_backward, (dout, x, pos.detach(), w1.detach(), b1, w2, case.block, case.stride,
                                              case.first), test_utils=("test_schema", "test_faketensor"))


@triton
def test_triton_refuses_what_it_does_not_take():
    x, pos, w1, b1, w2 = inputs(Case(1, 16, 1, 24, 4, 4), device=TRITON_DEVICE)
    with pytest.raises(ValueError, match="kernel=triton needs dim_head=24 to be a power of two.*model.kernel=auto or torch"):
        compress_blocks(x, pos, w1, b1, w2, 4, 4, kernel="triton")
    x, pos, w1, b1, w2 = inputs(Case(1, 16, 1, 16, 4, 4, hidden=300), device=TRITON_DEVICE)
    with pytest.raises(ValueError, match=r"hidden width \(300\) to be at most 256"):
        compress_blocks(x, pos, w1, b1, w2, 4, 4, kernel="triton")


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="kernel='cuda'"):
        compress_blocks(*inputs(Case(1, 16, 1, 16, 4, 4)), 4, 4, kernel="cuda")


# ---- compress_mean: InfLLM-v2's parameter-free compressor (model.compressor=mean) -----------------


@pytest.mark.parametrize("seq,block,stride,first", [(23, 4, 2, 0), (23, 4, 2, 3), (16, 4, 4, 0), (17, 5, 3, 1),
                                                    (3, 4, 2, 0)])
def test_compress_mean_is_each_complete_blocks_mean(seq, block, stride, first):
    """Block c of out is the mean of tokens [(first + c) * stride, (first + c) * stride + block), written
    out block by block; the gradient reaches each token once per block that holds it."""
    from kernels.nsa_attention.compressor import compress_mean

    x = torch.randn(2, seq, 3, 8, dtype=torch.float64, requires_grad=True)
    out = compress_mean(x, block, stride, first)
    starts = range(first * stride, seq - block + 1, stride)
    expected = torch.stack([x[:, s: s + block].mean(1) for s in starts], 1) if starts else x[:, :0]
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-15)
    weights = torch.randn_like(out)
    (grad,) = torch.autograd.grad((out * weights).sum(), x)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), x)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-15)
