"""The definition of NSA's gated branches given the compressed keys, as dense attention under three
masks (small shapes only: it builds [seq_q, seq_k] scores): what the Triton kernels must compute.
Shapes as kernels/nsa_attention/triton_kernels.py; rotary angles from `phases`."""

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.nsa_attention.compressed_naive import compressed_attention


def rotate(x: Tensor, phases: Tensor, start: int = 0) -> Tensor:
    """x [b, seq, heads, d] with channel pairs (2j, 2j + 1) turned by phases [positions, d / 2, 2]."""
    cos, sin = phases[start : start + x.shape[1], None].unbind(-1)  # [seq, 1, d / 2]
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), -1).flatten(-2)


def choose(importance: Tensor, start: int, fine: int, forced: int, free: int, num_fine: int) -> Tensor:
    """The `free` most important fine blocks of each query besides its forced ones and its future,
    ties to the earlier block: importance [bh, n, fine blocks] -> [bh, n, free] (num_fine: unused)."""
    t = start + torch.arange(importance.shape[1], device=importance.device)[:, None]
    block = torch.arange(importance.shape[2], device=importance.device)
    own = t // fine
    taken = (block * fine > t) | (block == own)
    if forced >= 2:
        taken |= block == 0
    if forced >= 3:
        taken |= block == own - 1
    scores = importance.masked_fill(taken, float("-inf"))
    ranked, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    chosen = order[..., :free].masked_fill(ranked[..., :free] == float("-inf"), num_fine)
    return F.pad(chosen, (0, free - chosen.shape[-1]), value=num_fine)


def _masked(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
    """q [b, n, h, d], k, v [b, s, kv, d], allowed [b, kv, n, s] -> [b, n, h, d] (zeros where none)."""
    group = q.shape[2] // k.shape[2]
    scores = torch.einsum("bnhd,bshd->bhns", q, k.repeat_interleave(group, 2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed.repeat_interleave(group, 1), float("-inf"))
    probs = scores.softmax(-1).nan_to_num(0.0)
    return torch.einsum("bhns,bshd->bnhd", probs, v.repeat_interleave(group, 2))


def nsa_attention(q: Tensor, kc: Tensor, vc: Tensor, k_slc: Tensor, v_slc: Tensor, k_win: Tensor, v_win: Tensor,
                  gates: Tensor, phases: Tensor, start: int, block: int, stride: int, fine: int, forced: int, free: int,
                  window: int) -> tuple[Tensor, Tensor]:
    """-> out [b, n, heads, d] and the chosen blocks [b, kv_heads, n, free] (num_fine where unused)."""
    b, n, heads, d = q.shape
    kv, num_keys = kc.shape[1], k_slc.shape[1]
    group, num_fine = heads // kv, -(-num_keys // fine)
    q_groups = q.unflatten(2, (kv, group)).permute(0, 2, 3, 1, 4).flatten(0, 1)  # [b * kv, group, n, d]
    out_cmp, importance = compressed_attention(q_groups, kc.flatten(0, 1), vc.flatten(0, 1), start, block, stride,
                                               fine, num_fine)
    out_cmp = out_cmp.unflatten(0, (b, kv)).flatten(1, 2).transpose(1, 2)  # [b, n, heads, d]
    chosen = choose(importance, start, fine, forced, free, num_fine).view(b, kv, n, free)
    t = start + torch.arange(n)[:, None]
    key = torch.arange(num_keys)[None]
    own, key_block = t // fine, key // fine
    allowed = key_block == own
    if forced >= 2:
        allowed = allowed | (key_block == 0)
    if forced >= 3:
        allowed = allowed | (key_block == own - 1)
    allowed = allowed[None, None] | (key_block[None, None, None] == chosen[..., None]).any(-2)
    causal = key <= t
    q_rot, k_slc, k_win = rotate(q, phases, start), rotate(k_slc, phases), rotate(k_win, phases)
    out_slc = _masked(q_rot, k_slc, v_slc, allowed & causal)
    out_win = _masked(q_rot, k_win, v_win, (causal & (key > t - window)).expand(b, kv, -1, -1))
    g = torch.sigmoid(gates)  # [b, n, 3, heads]
    return (g[:, :, 0, :, None] * out_cmp + g[:, :, 1, :, None] * out_slc + g[:, :, 2, :, None] * out_win), chosen
