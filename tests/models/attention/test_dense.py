"""Dense attention keeps what flash attention's backward needs, and nothing more; a leak fails the causality check."""

import pytest
import torch

from models.attention.dense import DenseAttention
from models.transformer import TransformerLM
from tests.helpers.attention_checks import assert_causal_by_perturbation, saved_bytes


def test_training_keeps_the_input_q_k_v_and_output_not_the_whole_projection():
    """The rotated q and k are new tensors: a view of v into the projection's output would keep
    the unrotated q and k alive too, two more activations per layer."""
    batch, seq, heads, dim_head = 1, 512, 2, 16
    x = torch.randn(batch, seq, heads * dim_head)
    activation = x.numel() * 4  # x, q, k, v and the output, fp32
    logsumexp = batch * heads * seq * 4
    rotary_phases = seq * dim_head // 2 * 8  # complex64
    kept = saved_bytes(DenseAttention(dim=heads * dim_head, heads=heads, dim_head=dim_head), x)
    assert kept <= 5 * activation + logsumexp + rotary_phases


def test_the_causality_check_catches_an_attention_that_sees_the_future():
    """The perturbation check holds logits to 1e-12, not to the bit: a leak still fails it."""
    torch.manual_seed(0)
    sees_all = torch.ones(16, 16, dtype=torch.bool)
    attention = lambda: DenseAttention(dim=32, heads=2, dim_head=16, mask=sees_all)  # noqa: E731
    model = TransformerLM(num_tokens=32, dim=32, depth=1, attention=attention).double().eval()
    with pytest.raises(AssertionError, match="moved by"):
        assert_causal_by_perturbation(model, torch.randint(0, 32, (2, 16)), 5)
