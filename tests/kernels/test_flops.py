"""Our kernels report the attention FLOPs a counter cannot see: exactly their (query, key) pairs."""

import pytest
import torch

from kernels import flops
from kernels.nsa_attention.compressed import cpu_compressed_selection, cpu_selection_available
from kernels.span_attention import available, span_attention


def test_the_ledger_counts_only_inside_counting_and_nested_counts_reach_the_outer():
    flops.attention(lambda: pytest.fail("pairs counted with nobody counting"), 2, 8)
    with flops.counting() as outer:
        flops.attention(lambda: 1, 1, 1)
        with flops.counting() as inner:
            flops.attention(lambda: 2, 3, 4, backward=True)
    assert inner.total == 10 * 2 * 3 * 4
    assert outer.total == 4 + inner.total


@pytest.mark.skipif(not available(), reason="no C compiler to build the span-attention kernel")
def test_span_attention_reports_its_pairs_forward_and_backward():
    bh, g, m, d = 2, 3, 20, 8
    q = torch.randn(bh, g, m, d, requires_grad=True)
    k, v = torch.randn(bh, m, d), torch.randn(bh, m, d)
    i = torch.arange(m)
    spans = torch.stack([torch.stack([(i - 4).clamp(min=0), i + 1], -1),  # a window of 5
                         torch.stack([torch.zeros_like(i), torch.zeros_like(i)], -1),  # an unused slot
                         torch.stack([i, torch.zeros_like(i)], -1)], 1)  # end < start: unused too
    pairs = bh * sum(min(t + 1, 5) for t in range(m))
    with flops.counting() as forward:
        out, _ = span_attention(q, k, v, spans)
    with flops.counting() as backward:
        out.sum().backward()
    assert forward.total == 4 * pairs * g * d and backward.total == 10 * pairs * g * d


@pytest.mark.skipif(not cpu_selection_available(), reason="no C compiler to build the block-selection kernel")
@pytest.mark.parametrize("m,block,stride", [(40, 8, 4), (37, 16, 8), (5, 8, 4)])
def test_the_compressed_pass_reports_the_blocks_each_query_sees(m, block, stride):
    bh, g, d = 2, 2, 8
    blocks = max(0, (m - block) // stride + 1)
    q, kc, vc = torch.randn(bh, g, m, d), torch.randn(bh, blocks, d), torch.randn(bh, blocks, d)
    # query t sees block i when the block is complete by t: i * stride + block - 1 <= t
    seen = sum(1 for t in range(m) for i in range(blocks) if i * stride + block - 1 <= t)
    with flops.counting() as ledger:
        cpu_compressed_selection(q, kc, vc, block, stride, 4, 0, 1)
    assert ledger.total == 4 * bh * seen * g * d
