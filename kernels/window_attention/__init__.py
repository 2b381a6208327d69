"""NSA's sliding-window branch: query t attends to the keys (t - window, t], all query heads of a
GQA group over the same keys.

    naive.py  dense attention masked to the window: the definition the kernel must match
    Triton    kernels/triton_flash.py with the window mask: each tile of queries walks only the keys
              in its reach, so the cost is seq x window, not seq^2, forward and backward

The CPU's kernel for the window is span attention's (kernels/span_attention/, one span per query);
the torch path is the model's tiles of fused attention (models/attention/nsa.py).
"""

from torch import Tensor

from kernels.triton_flash import WINDOW, PositionalFlashAttention


def triton_window_attention(q: Tensor, k: Tensor, v: Tensor, window: int, start: int = 0) -> tuple[Tensor, Tensor]:
    """q [batch_kv, group, seq_q, dim_head] from position `start`, k, v [batch_kv, seq_k, dim_head]
    from position 0 -> out [batch_kv, group, seq_q, dim_head] (passing gradient to q, k, v) and its
    log-sum-exp [batch_kv, group, seq_q] in fp32."""
    return PositionalFlashAttention.apply(q, k, v, start, WINDOW, window, 1)
