"""The definition of sliding-window attention, as dense attention masked to the window (small
shapes only: it builds the whole [seq_q, seq_k] score matrix)."""

import torch
from torch import Tensor


def window_attention(q: Tensor, k: Tensor, v: Tensor, window: int, start: int = 0) -> tuple[Tensor, Tensor]:
    """Shapes as kernels.window_attention.triton_window_attention -> out, lse (zeros and -inf for a
    query that sees no key)."""
    t = start + torch.arange(q.shape[2], device=q.device)[:, None]
    j = torch.arange(k.shape[1], device=q.device)
    visible = (j <= t) & (j > t - window)
    scores = torch.einsum("bgmd,bnd->bgmn", q, k) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = scores.logsumexp(-1)
    probs = (scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None]).exp()
    return torch.einsum("bgmn,bnd->bgmd", probs, v), lse
