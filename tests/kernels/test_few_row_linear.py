"""The few-row linear kernel against torch.nn.functional.linear: every row count a block takes (1 to
6, and more rows than a block), widths that are not a multiple of the vector, output counts that
are not a multiple of a block's 4, and more threads than blocks."""

import pytest
import torch

from kernels import few_row_linear

pytestmark = pytest.mark.skipif(not few_row_linear.available(), reason="no C compiler: the kernel is not built here")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 16])
@pytest.mark.parametrize("features", [(256, 768), (37, 13), (1024, 64), (5, 1)], ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_equals_the_linear(rows, features, bias):
    torch.manual_seed(rows)
    fan_in, out = features
    x, w = torch.randn(rows, fan_in), torch.randn(out, fan_in)
    b = torch.randn(out) if bias else None
    torch.testing.assert_close(few_row_linear.few_row_linear(x, w, b, 2), torch.nn.functional.linear(x, w, b),
                               rtol=1e-5, atol=1e-5 * fan_in**0.5)


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_any_number_of_threads_gives_the_same_outputs(threads):
    torch.manual_seed(0)
    x, w, b = torch.randn(6, 40), torch.randn(9, 40), torch.randn(9)  # 3 blocks of outputs: some threads get none
    one = few_row_linear.few_row_linear(x, w, b, 1)
    assert torch.equal(few_row_linear.few_row_linear(x, w, b, threads), one)  # each output is one thread's sum


def test_rows_that_are_a_strided_view_are_read_as_they_are():
    torch.manual_seed(0)
    x, w = torch.randn(4, 2 * 48)[:, ::2], torch.randn(12, 48)  # every other column
    torch.testing.assert_close(few_row_linear.few_row_linear(x, w, None, 2), x @ w.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.float32, torch.float16)], ids=str)
def test_anything_but_fp32_is_refused_before_c_reads_it(dtypes):
    x, w = torch.randn(2, 16).to(dtypes[0]), torch.randn(8, 16).to(dtypes[1])
    with pytest.raises(ValueError, match="few_row_linear takes fp32 CPU tensors"):
        few_row_linear.few_row_linear(x, w, None, 2)


def test_shapes_that_do_not_go_together_are_refused_before_c_reads_them():
    with pytest.raises(ValueError, match="do not go together"):
        few_row_linear.few_row_linear(torch.randn(2, 16), torch.randn(8, 15), None, 2)
    with pytest.raises(ValueError, match="do not go together"):
        few_row_linear.few_row_linear(torch.randn(2, 16), torch.randn(8, 16), torch.randn(7), 2)
