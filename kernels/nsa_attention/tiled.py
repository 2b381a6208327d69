"""Attention in tiles of queries that each see their own tile, the previous tile and, optionally,
a fixed block of initial keys (a sink): NSA's forced selected blocks in training (tile = fine
block; own, previous and initial block), whose log-sum-exp merges them with the freely chosen ones.

Only q, k, v and the log-sum-exp are kept for the backward pass, which rebuilds each tile's keys
and recomputes its probabilities, as flash attention does: memory stays O(n) and no [n, n] or
per-tile copy of the keys outlives the call. Masks come from positions through a rule
`visible(query_pos, key_pos) -> bool`, broadcast over the heads of a GQA group, never repeated.
"""

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import at_least_fp32

Rule = Callable[[Tensor, Tensor], Tensor]


def tiled_attention(q: Tensor, k: Tensor, v: Tensor, tile: int, visible: Rule, sink: int = 0
                    ) -> tuple[Tensor, Tensor]:
    """Softmax attention of each query over the keys of [sink | previous tile | own tile] that
    `visible` allows (keys at negative positions and sink keys also in the previous or own tile
    never count), for queries from position 0.

    q [batch_kv, group, seq, dim_head]; k, v [batch_kv, seq, dim_head]
    visible(query_pos [..., 1], key_pos [..., 1, keys]) -> bool [..., queries, keys]; it must allow
    each query its own position
    returns out [batch_kv, group, seq, dim_head] and the log-sum-exp [batch_kv, group, seq] (fp32 at least),
    so that attentions over disjoint key sets can be merged exactly
    """
    return _TiledAttention.apply(q, k, v, tile, visible, sink)


class _Tiles:
    """The padded tile layout of one call: query tiles, key tiles and their mask [tiles, 1, tile, keys]."""

    def __init__(self, seq: int, tile: int, visible: Rule, sink: int, device):
        self.seq, self.tile, self.sink = seq, tile, sink
        self.pad = (-seq) % tile
        self.count = (seq + self.pad) // tile
        starts = torch.arange(self.count, device=device)[:, None] * tile
        query_pos = starts + torch.arange(tile, device=device)  # [tiles, tile]
        key_pos = torch.cat((torch.arange(sink, device=device).expand(self.count, sink),
                             query_pos - tile, query_pos), dim=1)  # [tiles, sink + 2 * tile]
        mask = visible(query_pos[:, :, None], key_pos[:, None, :]) & (key_pos >= 0)[:, None, :]
        if sink:  # a sink key already in the previous or own tile counts there only
            mask[:, :, :sink] &= (key_pos[:, None, :sink] < starts[:, :, None] - tile)
        self.mask = mask[:, None]

    def queries(self, q: Tensor) -> Tensor:
        """[bh, g, seq, d] -> [bh, tiles, g * tile, d]"""
        bh, g, _, d = q.shape
        q = F.pad(q, (0, 0, 0, self.pad)).view(bh, g, self.count, self.tile, d)
        return q.transpose(1, 2).reshape(bh, self.count, g * self.tile, d)

    def untile(self, x: Tensor, g: int) -> Tensor:
        """[bh, tiles, g * tile, ...] -> [bh, g, seq, ...]"""
        bh, rest = x.shape[0], x.shape[3:]
        x = x.view(bh, self.count, g, self.tile, *rest).transpose(1, 2)
        return x.reshape(bh, g, self.count * self.tile, *rest)[:, :, : self.seq]

    def keys(self, k: Tensor) -> Tensor:
        """[bh, seq, d] -> [bh, tiles, sink + 2 * tile, d]"""
        bh, _, d = k.shape
        own = F.pad(k, (0, 0, 0, self.pad)).view(bh, self.count, self.tile, d)
        previous = F.pad(own, (0, 0, 0, 0, 1, 0))[:, :-1]
        parts = [previous, own]
        if self.sink:
            parts.insert(0, F.pad(k[:, : self.sink], (0, 0, 0, self.sink - min(self.sink, k.shape[1])))
                         [:, None].expand(bh, self.count, self.sink, d))
        return torch.cat(parts, dim=2)

    def scores(self, qt: Tensor, kt: Tensor, g: int) -> Tensor:
        """Masked scores in fp32 at least, [bh, tiles, g, tile, keys]."""
        bh, count = qt.shape[:2]
        scores = (qt @ kt.transpose(-1, -2)).view(bh, count, g, self.tile, -1)
        scores = at_least_fp32(scores)
        return scores.masked_fill_(~self.mask, float("-inf"))


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tile, visible, sink):
        bh, g, n, d = q.shape
        tiles = _Tiles(n, tile, visible, sink, q.device)
        scores = tiles.scores(tiles.queries(q) * d**-0.5, tiles.keys(k), g)
        lse = scores.logsumexp(-1)
        probs = (scores - lse[..., None]).exp_()
        out = tiles.untile(probs.to(v.dtype).flatten(2, 3) @ tiles.keys(v), g)
        ctx.save_for_backward(q, k, v, lse)
        ctx.tiles = tiles
        return out, tiles.untile(lse.flatten(2, 3), g)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, lse = ctx.saved_tensors  # lse in the tile layout [bh, tiles, g, tile]
        tiles = ctx.tiles
        bh, g, n, d = q.shape
        qt, kt, vt = tiles.queries(q) * d**-0.5, tiles.keys(k), tiles.keys(v)
        dot = tiles.queries(dout.to(v.dtype))
        probs = (tiles.scores(qt, kt, g) - lse[..., None]).exp_()
        dprobs = (dot @ vt.transpose(-1, -2)).view_as(probs).to(probs.dtype)
        # dS = P * (dP - rowsum(P * dP) + dlse): the log-sum-exp output adds its own gradient
        delta = (probs * dprobs).sum(-1, keepdim=True)
        if dlse is not None:
            delta -= tiles.queries(dlse[..., None]).view(bh, tiles.count, g, tiles.tile, 1).to(delta.dtype)
        dvt = probs.to(v.dtype).flatten(2, 3).transpose(-1, -2) @ dot
        dscores = (probs * (dprobs - delta)).to(q.dtype).flatten(2, 3)
        dq = tiles.untile(dscores @ kt, g) * d**-0.5
        dkt = dscores.transpose(-1, -2) @ qt
        return dq, _fold(dkt, tiles, k), _fold(dvt, tiles, v), None, None, None


def _fold(grad_tiles: Tensor, tiles: _Tiles, like: Tensor) -> Tensor:
    """The gradient of _Tiles.keys: [bh, tiles, sink + 2 * tile, d] -> [bh, seq, d]."""
    bh, count, _, d = grad_tiles.shape
    s, t = tiles.sink, tiles.tile
    previous, own = grad_tiles[:, :, s : s + t], grad_tiles[:, :, s + t :]
    folded = own.clone()
    folded[:, :-1] += previous[:, 1:]
    folded = folded.reshape(bh, count * t, d)[:, : tiles.seq]
    if s:
        reach = min(s, tiles.seq)
        folded[:, :reach] += grad_tiles[:, :, :reach].sum(1)
    return folded.to(like.dtype)
