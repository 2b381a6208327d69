"""kernels/ranking.py: the ranking keys order scores as fp32 does, equal scores (-0.0 and +0.0 among
them) by position in the direction asked for."""

import pytest
import torch

from kernels.ranking import ranking_keys


@pytest.mark.parametrize("later_first", [True, False], ids=["later-first", "earlier-first"])
def test_the_keys_order_is_a_stable_sort_of_the_scores(later_first):
    values = torch.tensor([-float("inf"), -3.5, -1.0, -0.0, 0.0, 1e-30, 0.25, 2.0, float("inf")])
    scores = values[torch.randint(0, len(values), (64, 40), generator=torch.Generator().manual_seed(0))]
    order = ranking_keys(scores, later_first).argsort(dim=-1, descending=True)
    # the definition: descending by score, ties in position order (reversed for the later first)
    flip = (lambda t: t.flip(-1)) if later_first else (lambda t: t)
    expected = flip(scores).sort(dim=-1, descending=True, stable=True).indices
    if later_first:
        expected = scores.shape[-1] - 1 - expected
    assert torch.equal(order, expected)


def test_half_precision_scores_rank_as_their_fp32_values():
    scores = torch.randn(8, 33, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert torch.equal(ranking_keys(scores, False), ranking_keys(scores.float(), False))
