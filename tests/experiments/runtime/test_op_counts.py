"""The op counter counts what a GPU would launch: each aten op that moves data (matrix products and
glue apart, with the bytes they read and write), nothing for views and allocations, the ops inside
autograd Functions and custom ops, and Triton launches, reported or not."""

import sys

import pytest
import torch
import triton
import triton.language as tl

from experiments.runtime import op_counts
from experiments.runtime.op_counts import count_ops, distinct_bytes
from kernels.counters import Launch, bookkeeping, record


TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a CPU, in Triton's interpreter


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_a_product_and_a_sum_are_two_launches_with_the_bytes_they_move():
    a, b, c = torch.randn(4, 3), torch.randn(3, 5), torch.randn(4, 5)
    with count_ops() as counts:
        out = a @ b + c
    assert counts.aten == {"mm": 1, "add": 1} and counts.launches == 2
    product = a @ b
    assert counts.matmul_bytes == nbytes(a, b, product)
    assert counts.glue_bytes == nbytes(product, c, out)
    assert counts.largest.bytes == nbytes(out) and counts.largest.shape == (4, 5)


def test_views_and_allocations_launch_nothing():
    a = torch.randn(4, 6)
    with count_ops() as counts:
        a.t().unsqueeze(0).expand(2, 6, 4).squeeze(0)
        a.view(2, 12).transpose(0, 1).permute(1, 0).reshape(24)  # back to a's layout: a view
        a[1], a[:, 2:], a.detach(), a.unflatten(1, (2, 3)).unbind(1), a.contiguous()
        torch.empty(8), torch.empty_like(a)
    assert counts.launches == 0 and counts.glue_bytes == 0
    assert counts.largest.op in ("empty", "empty_like") and counts.largest.bytes == nbytes(a)  # memory, no kernel


def test_copies_fills_and_factories_launch_and_move_what_they_write():
    a = torch.randn(4, 6)
    with count_ops() as counts:
        a.t().contiguous()  # a transposed copy
        a.t().reshape(24)  # not a view of a: a copy too
    assert counts.aten == {"clone": 2} and counts.glue_bytes == 2 * 2 * nbytes(a)
    destination = torch.empty(4, 6)
    with count_ops() as counts:
        destination.copy_(a)  # reads a, writes the destination (never read)
        destination.zero_()
        torch.zeros(3), torch.arange(5)
    assert counts.aten == {"copy_": 1, "zero_": 1, "zeros": 1, "arange": 1}
    assert counts.glue_bytes == 2 * nbytes(a) + nbytes(a) + nbytes(torch.zeros(3), torch.arange(5))


def test_a_broadcast_operand_is_read_once():
    x, bias = torch.randn(8, 16), torch.randn(16)
    with count_ops() as counts:
        x + bias
    assert counts.glue_bytes == 2 * nbytes(x) + nbytes(bias)
    assert distinct_bytes(bias.expand(8, 16)) == nbytes(bias)


def test_an_in_place_op_reads_and_writes_its_argument_and_creates_nothing():
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    with count_ops() as counts:
        x.add_(y)
    assert counts.aten == {"add_": 1} and counts.glue_bytes == 3 * nbytes(x) and counts.largest is None


def test_an_in_place_foreach_op_launches_though_it_returns_nothing():
    tensors = [torch.randn(8), torch.randn(4, 4)]
    with count_ops() as counts:
        torch._foreach_mul_(tensors, 0.5)
    assert counts.aten == {"_foreach_mul_": 1} and counts.glue_bytes == 2 * nbytes(*tensors)


def test_values_the_host_waits_for_are_syncs():
    x = torch.randn(16)
    with count_ops() as counts:
        int((x > 0).sum())
        x.nonzero()
    assert counts.syncs == {"_local_scalar_dense": 1, "nonzero": 1}
    assert counts.aten == {"gt": 1, "sum": 1, "nonzero": 1}  # reading a value back launches no kernel


class SinWithCosBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.cos()


def test_the_ops_inside_an_autograd_function_count_forward_and_backward():
    x = torch.randn(16, requires_grad=True)
    with count_ops() as counts:
        SinWithCosBackward.apply(x).backward(torch.ones(16))
    assert counts.aten["sin"] == 1 and counts.aten["cos"] == 1 and counts.aten["mul"] == 1


@torch.library.custom_op("test_op_counts::sin_of_double", mutates_args=())
def sin_of_double(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).sin()


sin_of_double.register_fake(lambda x: torch.empty_like(x))
sin_of_double.register_autograd(lambda ctx, grad: grad * 2 * (ctx.saved_tensors[0] * 2).cos(),
                                setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


def test_a_custom_op_counts_the_ops_of_its_implementation_not_itself():
    x = torch.randn(16, requires_grad=True)
    with count_ops() as counts:
        sin_of_double(x).backward(torch.ones(16))
    assert "sin_of_double" not in counts.aten
    assert counts.aten["sin"] == 1 and counts.aten["cos"] == 1  # the implementation's, and the backward's


@triton.jit
def _double(X, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, tl.load(X + i) * 2)


def double(x: torch.Tensor, report: bool) -> torch.Tensor:
    y = torch.empty_like(x)
    _double[(1,)](x, y, N=x.numel())
    if report:
        with bookkeeping():  # what only the report needs (here a value read back) is no launch of the program
            rows = int(torch.tensor(x.shape).prod())
        record(Launch("double", (1,), rows=rows, keys=0))
    return y


@pytest.mark.triton
def test_a_triton_launch_counts_once_with_its_report_and_without_the_interpreters_copies():
    x = torch.randn(16, device=TRITON_DEVICE)
    with count_ops() as counts:
        y = double(x, report=True)
    assert torch.equal(y, 2 * x)
    assert counts.aten_launches == 0 and counts.launches == 1 and not counts.syncs
    assert [(launch.kernel, launch.grid, dict(launch.meta)) for launch in counts.triton] == [("_double", (1,), {"N": 16})]
    assert counts.reported == [Launch("double", (1,), rows=16, keys=0)] and counts.unreported() == []
    with count_ops() as counts:
        double(x, report=False)
    assert counts.unreported() == counts.triton and "no Launch reported (N=16)" in counts.format()


def test_each_report_accounts_for_one_launch_of_its_grid():
    launch = op_counts.TritonLaunch("_double", (1,), (("N", 16),))
    counts = op_counts.OpCounts(triton=[launch, launch], reported=[Launch("double", (1,), rows=16, keys=0)])
    assert counts.unreported() == [launch]


@torch.library.triton_op("test_op_counts::double_exp", mutates_args=())
def double_exp(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    torch.library.wrap_triton(_double)[(1,)](x, y, N=x.numel())
    return y.exp()


@pytest.mark.triton
def test_a_triton_op_counts_its_kernel_and_its_aten_ops():
    x = torch.randn(16, device=TRITON_DEVICE)
    with count_ops() as counts:
        out = double_exp(x)
    assert torch.allclose(out, (2 * x).exp())
    assert counts.aten == {"exp": 1} and [launch.kernel for launch in counts.triton] == ["_double"]


def test_the_interpreter_is_switched_on_only_before_triton_is_imported(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "set TRITON_INTERPRET=1" in op_counts.interpret_triton_here()  # triton is imported here
    assert "TRITON_INTERPRET" not in op_counts.os.environ
    monkeypatch.delitem(sys.modules, "triton")
    assert op_counts.interpret_triton_here() is None and op_counts.os.environ["TRITON_INTERPRET"] == "1"
