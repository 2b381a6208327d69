"""NSA's compressed attention and block importance chunk by chunk in plain PyTorch: the pass that
serves decoding, differentiable selection and the importance of a training step (see __init__.py)."""

from bisect import bisect_right
from math import gcd
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import at_least_fp32
from kernels.nsa_attention.blocks import visible_compressed

# score elements (fp32) per chunk: large enough for efficient products, small enough for the cache
_CHUNK_ELEMENTS = 1 << 20


class Layout:
    """Chunks of queries with the blocks each may see (the leading queries that see no block are
    skipped), and the banded map from block probabilities to fine-block importance."""

    def __init__(self, q: Tensor, num_blocks: int, start: int, block: int, stride: int, fine_block: int):
        bh, g, m, _ = q.shape
        self.start, self.fine_block = start, fine_block
        self.positions = torch.arange(start, start + m, device=q.device)
        self.counts = visible_compressed(self.positions, block, stride, num_blocks)
        counts = self.counts.tolist()
        self.chunks = []
        c0 = next((i for i, c in enumerate(counts) if c > 0), m)
        self.blind = c0  # leading queries that see no block yet
        while c0 < m:  # the longest chunk whose scores [bh, g, chunk, blocks seen] fit the budget
            tile = lambda c1: (c1 - c0) * counts[c1 - 1] * bh * g  # noqa: E731
            c1 = max(min(m, c0 + 16), bisect_right(range(c0 + 1, m + 1), _CHUNK_ELEMENTS, key=tile) + c0)
            self.chunks.append((c0, c1, counts[c0], counts[c1 - 1]))
            c0 = c1
        unit = gcd(gcd(block, stride), fine_block)
        self.per_block, self.step, self.per_fine = block // unit, stride // unit, fine_block // unit

    def probabilities(self, q_scaled: Tensor, kc: Tensor, c0: int, c1: int, k0: int, k1: int) -> Tensor:
        """Softmax over the blocks visible to queries c0..c1 in fp32 at least, [bh, g, chunk, k1]."""
        bh, g, _, d = q_scaled.shape
        size = c1 - c0
        scores = torch.bmm(q_scaled[:, :, c0:c1].reshape(bh, g * size, d), kc[:, :k1].transpose(1, 2))
        scores = at_least_fp32(scores.view(bh, g, size, k1))
        if k0 < k1:  # blocks k0.. that the chunk's earlier queries cannot see yet
            hidden = torch.arange(k0, k1, device=kc.device)[None] >= self.counts[c0:c1, None]
            scores[..., k0:].masked_fill_(hidden, float("-inf"))
        return scores.softmax(-1)

    def fine_blocks(self, c1: int) -> int:
        """Fine blocks that start at or before the chunk's last query."""
        return (self.start + c1 - 1) // self.fine_block + 1

    def spread(self, probs: Tensor) -> Tensor:
        """[..., k blocks] -> [..., fine blocks reached]: each block's probability spread evenly over
        its segments, summed per fine block."""
        k = probs.shape[-1]
        fine = -(-((k - 1) * self.step + self.per_block) // self.per_fine)
        segments = probs.new_zeros(*probs.shape[:-1], fine * self.per_fine)
        for r in range(self.per_block):
            segments[..., r : r + (k - 1) * self.step + 1 : self.step] += probs
        return _strided_sum(segments, self.per_fine).div_(self.per_block)

    def spread_backward(self, grad: Tensor, k: int) -> Tensor:
        """[..., fine blocks] -> [..., k blocks]: the gradient of spread's input."""
        segments = grad.repeat_interleave(self.per_fine, dim=-1)
        out = segments[..., : (k - 1) * self.step + 1 : self.step].clone()
        for r in range(1, self.per_block):
            out += segments[..., r : r + (k - 1) * self.step + 1 : self.step]
        return out.div_(self.per_block)


def _chunked_pass(q_scaled: Tensor, kc: Tensor, vc: Tensor, layout: Layout, choose: Callable,
                  with_output: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The output (if asked for) and the chosen blocks, chunk by chunk."""
    bh, g, m, d = q_scaled.shape
    out = q_scaled.new_zeros(bh, g, m, d) if with_output else None
    picks = []
    if layout.blind:  # no complete block yet: every fine block is equally unimportant
        picks.append(choose(q_scaled.new_zeros(bh, layout.blind, layout.fine_blocks(layout.blind),
                                               dtype=torch.float32), layout.start))
    for c0, c1, k0, k1 in layout.chunks:
        probs = layout.probabilities(q_scaled, kc, c0, c1, k0, k1)
        if with_output:
            out[:, :, c0:c1] = torch.bmm(probs.to(vc.dtype).flatten(1, 2), vc[:, :k1]).view(bh, g, c1 - c0, d)
        importance = layout.spread(_group_sum(probs))
        importance = F.pad(importance, (0, layout.fine_blocks(c1) - importance.shape[-1]))
        picks.append(choose(importance, layout.start + c0))
    scores, indices = (torch.cat(part, dim=1) for part in zip(*picks))
    return out, scores, indices


def _group_sum(probs: Tensor) -> Tensor:
    """[bh, g, chunk, k] -> [bh, chunk, k]: the probabilities of a GQA group's heads added up, as
    adds of whole slices (85 us against sum(1)'s 200 us for [2, 2, 256, 1023] on an AMD EPYC)."""
    total = probs[:, 0].clone()
    for head in range(1, probs.shape[1]):
        total += probs[:, head]
    return total


def _strided_sum(x: Tensor, width: int) -> Tensor:
    """[..., n * width] -> [..., n]: the sum of each run of `width` elements, as width - 1 adds of
    strided views (a reduction over a short inner axis runs element by element on the CPU)."""
    out = x[..., ::width].clone()
    for r in range(1, width):
        out += x[..., r::width]
    return out


class CompressedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kc, vc, layout, choose, importance_grad):
        q_scaled = q * q.shape[-1] ** -0.5
        kc, vc = kc.to(q.dtype), vc.to(q.dtype)
        out, scores, indices = _chunked_pass(q_scaled, kc, vc, layout, choose, True)
        ctx.save_for_backward(q_scaled, kc, vc, indices)
        ctx.layout = layout
        ctx.mark_non_differentiable(indices)
        if not importance_grad:
            ctx.mark_non_differentiable(scores)
        return out, scores, indices

    @staticmethod
    def backward(ctx, dout, dscores, _):
        q_scaled, kc, vc, indices = ctx.saved_tensors
        layout = ctx.layout
        bh, g, m, d = q_scaled.shape
        dtype = q_scaled.dtype
        dout = dout.to(dtype)
        dq, dkc, dvc = torch.zeros_like(q_scaled), torch.zeros_like(kc), torch.zeros_like(vc)
        for c0, c1, k0, k1 in layout.chunks:
            size = c1 - c0
            doc = dout[:, :, c0:c1].reshape(bh, g * size, d)
            probs = layout.probabilities(q_scaled, kc, c0, c1, k0, k1)
            dprobs = torch.bmm(doc, vc[:, :k1].transpose(1, 2)).view(bh, g, size, k1).to(probs.dtype)
            if dscores is not None:  # every head of the group adds its probability to the importance
                width, chosen = layout.fine_blocks(c1), indices[:, c0:c1]
                dimportance = dscores.new_zeros(bh, size, max(width, chosen.shape[-1]))
                dimportance.scatter_add_(-1, chosen.clamp(max=dimportance.shape[-1] - 1), dscores[:, c0:c1])
                dimportance = dimportance[..., :width]  # blocks past the chunk's last query have no importance
                dprobs += layout.spread_backward(dimportance, k1)[:, None].to(dprobs.dtype)
            dlogits = torch._softmax_backward_data(dprobs, probs, -1, probs.dtype).to(dtype).flatten(1, 2)
            dvc[:, :k1] += torch.bmm(probs.to(dtype).flatten(1, 2).transpose(1, 2), doc)
            dq[:, :, c0:c1] = torch.bmm(dlogits, kc[:, :k1]).view(bh, g, size, d)
            dkc[:, :k1] += torch.bmm(dlogits.transpose(1, 2), q_scaled[:, :, c0:c1].reshape(bh, g * size, d))
        return dq * d**-0.5, dkc, dvc, None, None, None


@torch.no_grad()
def select(q: Tensor, kc: Tensor, layout: Layout, choose: Callable) -> tuple[Tensor, Tensor]:
    """The importance pass alone, without gradient: what `choose` picks -> scores, indices."""
    _, scores, indices = _chunked_pass(q * q.shape[-1] ** -0.5, kc.to(q.dtype), None, layout, choose, False)
    return scores, indices
