"""Dense attention keeps what flash attention's backward needs, and nothing more."""

import torch

from models.attention.dense import DenseAttention
from tests.helpers.attention_checks import saved_bytes


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
