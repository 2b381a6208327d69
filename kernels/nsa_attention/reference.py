"""NSA's selected branch and sliding window in plain PyTorch, with the span-attention CPU kernel
where it runs: the readable path (`model.kernel=torch`), and the one for decoding and
differentiable selection. Queries [b, h, g, n, d] (a GQA group's heads together), keys and values
[b, h, n, d], queries from position `start`, rotary positions already applied (after a cache, to
the queries; the keys read are rotated here)."""

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from kernels import at_least_fp32
from kernels import span_attention as spans
from kernels.nsa_attention.blocks import BlockRules
from kernels.selected_attention import selected_attention
from kernels.nsa_attention.tiled import tiled_attention


def selected(q: Tensor, k: Tensor, v: Tensor, scores: Tensor, indices: Tensor, start: int, rules: BlockRules,
             runs: str, rotary=None) -> Tensor:
    """Attention over the forced and the freely chosen fine blocks -> [b, h, g, n, d]; the free
    blocks' indices and scores [b, h, n, free] come from `rules.choose` (-inf: slot unused).

    From position 0 the forced blocks (own, initial, previous) are the same for every query of a
    fine block, so they are attended tile by tile; only the freely chosen blocks are gathered per
    query. The two partial attentions cover disjoint blocks and are merged exactly through their
    log-sum-exps. On the CPU kernel (runs "cpu") every block is a span of keys; the free blocks run
    on the selected-attention Triton kernel where runs is "triton". After a cache, each query
    gathers all its blocks at once, and with `rotary` rotates the keys it gathered (a cache keeps
    them as projected)."""
    b, h, g, m, d = q.shape
    valid = scores > float("-inf")
    weights = None
    if scores.requires_grad:  # differentiable selection: 1 in value, the scores' gradient
        chosen = scores.masked_fill(~valid, 0.0)
        weights = 1.0 + (chosen - chosen.detach())
    if start:
        return gathered(q, k, v, *rules.with_forced(indices, valid, start), start, rules.fine, rotary)
    if runs == "cpu":
        if weights is not None:  # the forced blocks keep their whole share
            weights = torch.cat((weights.new_ones(b, h, m, rules.forced), weights), dim=-1).flatten(0, 1)
        blocks = rules.block_spans(*rules.with_forced(indices.flatten(0, 1), valid.flatten(0, 1)))
        out, _ = spans.span_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), blocks, weights)
        return out.view_as(q)
    sink = rules.fine if rules.forced >= 2 else 0
    out_forced, lse_forced = tiled_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), rules.fine,
                                             rules.forced_visible, sink)
    out_forced, lse_forced = out_forced.view_as(q), lse_forced.view(b, h, g, m)
    if indices.shape[-1] == 0:
        return out_forced
    out_free, lse_free = selected_attention(
        rearrange(q, "b h g n d -> (b h) n g d"), k.flatten(0, 1), v.flatten(0, 1), indices.flatten(0, 1),
        valid.flatten(0, 1), start, rules.fine, "triton" if runs == "triton" else "torch",
        None if weights is None else weights.flatten(0, 1),
    )
    out_free = rearrange(out_free, "(b h) n g d -> b h g n d", b=b)
    lse_free = rearrange(lse_free, "(b h) n g -> b h g n", b=b)
    lse = torch.logaddexp(lse_forced, lse_free)
    return (out_forced * (lse_forced - lse).exp()[..., None].to(q.dtype)
            + out_free * (lse_free - lse).exp()[..., None].to(q.dtype))


def window(q: Tensor, k: Tensor, v: Tensor, start: int, rules: BlockRules, runs: str, dropout: float = 0.0,
           rotary=None) -> Tensor:
    """Sliding-window attention: query t sees keys (t - w, t]. -> [b, h, g, n, d]; after a cache,
    `rotary` rotates the keys read (a cache keeps them as projected)."""
    b, h, g, m, d = q.shape
    w = rules.window
    if start == 0 and dropout == 0.0 and runs == "cpu":
        out, _ = spans.span_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), rules.window_spans(m, q.device))
        return out.view_as(q)
    if start == 0:  # tiles of w queries see their tile and the previous one, fused
        pad = (-m) % w
        tiles = (m + pad) // w
        qt = rearrange(F.pad(q, (0, 0, 0, pad)), "b h g (c w) d -> c (b h g) w d", w=w)
        kt, vt = (rearrange(F.pad(t, (0, 0, 0, pad)), "b h (c w) d -> c (b h) w d", w=w) for t in (k, v))
        kt, vt = (torch.cat((F.pad(t, (0, 0, 0, 0, 0, 0, 1, 0))[:-1], t), dim=2) for t in (kt, vt))
        tile_start = torch.arange(tiles, device=q.device)[:, None, None] * w
        query_pos = tile_start + torch.arange(w, device=q.device)[:, None]  # [c, w, 1]
        key_pos = tile_start - w + torch.arange(2 * w, device=q.device)  # [c, 1, 2w]
        mask = (rules.window_visible(query_pos, key_pos) & (key_pos >= 0))[:, None]  # [c, 1, w, 2w]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, dropout_p=dropout, enable_gqa=True)
        return rearrange(out, "c (b h g) w d -> b h g (c w) d", b=b, h=h)[:, :, :, :m]
    lo = max(0, start - w + 1)  # decoding: the last w keys before the first query suffice
    k, v = k[:, :, lo:], v[:, :, lo:]
    k = k if rotary is None else rotary(k, lo)
    qpos = torch.arange(start, start + m, device=q.device)[:, None]
    mask = rules.window_visible(qpos, torch.arange(lo, lo + k.shape[2], device=q.device))
    out = F.scaled_dot_product_attention(q.flatten(2, 3), k, v, attn_mask=mask.repeat(g, 1), dropout_p=dropout)
    return out.view(b, h, g, m, d)


def gathered(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, valid: Tensor, start: int, block: int,
             rotary=None) -> Tensor:
    """Each query over the keys of its own selected blocks, causal, gathered by index (decoding);
    with `rotary`, the gathered keys rotated by their positions.

    q [b, h, g, m, d]; k, v [b, h, seq, d]; indices, valid [b, h, m, blocks] -> [b, h, g, m, d]"""
    b, h, g, m, d = q.shape
    key_pos = (indices[..., None] * block + torch.arange(block, device=q.device)).flatten(-2)  # [b, h, m, keys]
    allowed = (valid.repeat_interleave(block, dim=-1) & (key_pos < start + torch.arange(m, device=q.device)[:, None] + 1))
    safe = key_pos.clamp(max=k.shape[2] - 1)
    heads = (torch.arange(b, device=q.device)[:, None, None, None], torch.arange(h, device=q.device)[None, :, None, None])
    keys, values = k[heads + (safe,)], v[heads + (safe,)]  # [b, h, m, keys, d]
    if rotary is not None:
        keys = rotated_at(keys, rotary.phases(k.shape[2], q.device), safe)
    scores = torch.einsum("bhgmd,bhmkd->bhgmk", q, keys)
    scores = at_least_fp32(scores) * d**-0.5
    probs = scores.masked_fill(~allowed[:, :, None], float("-inf")).softmax(-1)
    return torch.einsum("bhgmk,bhmkd->bhgmd", probs.to(q.dtype), values)


def rotated_at(x: Tensor, phases: Tensor, positions: Tensor) -> Tensor:
    """x [..., d] with channel pairs (2j, 2j + 1) turned by the angles of `positions` [...] (int64)
    from phases [end, d / 2, 2] (cos, sin)."""
    cos, sin = phases[positions].to(x.dtype).unbind(-1)  # [..., d / 2]
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), -1).flatten(-2)
