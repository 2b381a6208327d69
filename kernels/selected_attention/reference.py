"""NSA's selected-block attention in plain PyTorch, chunk by chunk (the CPU path).

Each query position attends, with all query heads of its GQA group together, to the keys of the
`num_selected` fine blocks chosen for that position and group. Blocks are gathered by index one
chunk of query positions at a time; the backward pass recomputes the gather from the saved
log-sum-exp (as flash attention does) and scatter-adds dk, dv into the block layout with
`index_add_` (race-free on the CPU, and deterministic). Memory is O(chunk), never a copy of the
selected keys per query for the whole sequence. Chunks run over the flattened (batch_kv, position)
rows and are sized to stay in cache: a gather is a memory copy, and a cache-resident one is about
eight times cheaper on a CPU than one streamed through DRAM.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import at_least_fp32

# gathered key elements per chunk, sized to stay in cache (the backward holds twice as much)
_FORWARD_CHUNK = 1 << 20
_BACKWARD_CHUNK = 1 << 19


def _block_table(x: Tensor, block: int) -> Tensor:
    """[batch_kv, seq, dim] -> [batch_kv * num_blocks, block * dim], zero-padded at the end."""
    bh, n, d = x.shape
    pad = (-n) % block
    if pad:
        x = torch.cat((x, x.new_zeros(bh, pad, d)), dim=1)
    return x.reshape(-1, block * d)


class _Rows:
    """The flattened problem: row r is query position (r % seq_q) of batch_kv (r // seq_q)."""

    def __init__(self, q: Tensor, indices: Tensor, valid: Tensor, start: int, block: int, seq_k: int, chunk: int):
        bh, m, g, d = q.shape
        blocks = -(-seq_k // block)
        self.block, self.dim = block, d
        self.table_rows = (torch.arange(bh, device=q.device) * blocks)[:, None, None]
        self.indices = (indices + self.table_rows).reshape(bh * m, -1)  # rows of the block table
        self.key_pos = (indices[..., None] * block + torch.arange(block, device=q.device)).reshape(bh * m, -1)
        self.valid = valid.reshape(bh * m, -1).repeat_interleave(block, dim=-1)
        self.positions = (start + torch.arange(m, device=q.device)).repeat(bh)
        self.step = max(1, chunk // (self.key_pos.shape[-1] * d))

    def chunks(self):
        total = self.indices.shape[0]
        for r0 in range(0, total, self.step):
            yield slice(r0, min(total, r0 + self.step))

    def gather(self, table: Tensor, rows: slice) -> Tensor:
        """[chunk, selected * block, dim]: the chunk's selected keys (or values)."""
        return F.embedding(self.indices[rows], table).view(-1, self.key_pos.shape[-1], self.dim)

    def slot_weights(self, weights: Tensor) -> Tensor:
        """[rows, 1, selected * block]: each slot's weight repeated over its keys."""
        return at_least_fp32(weights).reshape(self.indices.shape[0], -1).repeat_interleave(self.block, -1)[:, None]

    def allowed(self, rows: slice) -> Tensor:
        """[chunk, 1, selected * block]: valid slots, keys at or before the query position."""
        return ((self.key_pos[rows] <= self.positions[rows, None]) & self.valid[rows])[:, None]


def _finite(lse: Tensor) -> Tensor:
    """Log-sum-exp with empty rows (-inf) set to 0, so their probabilities come out 0, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def distinct_slots(indices: Tensor, valid: Tensor) -> Tensor:
    """The chosen blocks (or keys) are a set: indices, valid [batch_kv, seq_q, slots] (or any leading
    dims) -> valid with every slot that names the same index as an earlier valid slot of its row made
    invalid, so each counts once and the first slot keeps its weight. A stable sort per row,
    O(slots log slots): gather attention's rows hold thousands of slots."""
    slots = indices.shape[-1]
    if slots < 2:
        return valid
    # unused slots get distinct negative keys, so that they never match each other or a used one
    keys = torch.where(valid, indices, torch.arange(-1, -1 - slots, -1, device=indices.device))
    ordered, order = keys.sort(dim=-1, stable=True)  # stable: equal indices stay in slot order
    first = torch.ones_like(valid).scatter_(-1, order[..., 1:], ordered[..., 1:] != ordered[..., :-1])
    return valid & first


class SelectedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, valid, start, block, weights):
        bh, m, g, d = q.shape
        valid = distinct_slots(indices, valid)  # a block in several slots counts once; backward reuses it
        scale = d**-0.5
        rows = _Rows(q, indices, valid, start, block, k.shape[1], _FORWARD_CHUNK)
        slot_weights = None if weights is None else rows.slot_weights(weights)
        k_table, v_table = _block_table(k, block), _block_table(v, block)
        qf = q.reshape(bh * m, g, d)
        out = torch.empty_like(qf)
        lse = at_least_fp32(q.new_empty(bh * m, g))
        for r in rows.chunks():
            scores = at_least_fp32(torch.bmm(qf[r], rows.gather(k_table, r).transpose(1, 2))) * scale
            scores = scores.masked_fill(~rows.allowed(r), float("-inf"))
            lse[r] = scores.logsumexp(-1)
            probs = (scores - _finite(lse[r])[..., None]).exp()
            if slot_weights is not None:
                probs = probs * slot_weights[r]
            out[r] = torch.bmm(probs.to(q.dtype), rows.gather(v_table, r))
        ctx.save_for_backward(q, k, v, indices, valid, lse, weights)
        ctx.start, ctx.block = start, block
        return out.view(bh, m, g, d), lse.view(bh, m, g)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, indices, valid, lse, weights = ctx.saved_tensors
        bh, m, g, d = q.shape
        scale = d**-0.5
        rows = _Rows(q, indices, valid, ctx.start, ctx.block, k.shape[1], _BACKWARD_CHUNK)
        slot_weights = None if weights is None else rows.slot_weights(weights)
        dweights = None if weights is None else at_least_fp32(torch.zeros_like(weights)).view(bh * m, -1)
        k_table, v_table = _block_table(k, ctx.block), _block_table(v, ctx.block)
        dk_table, dv_table = torch.zeros_like(k_table), torch.zeros_like(v_table)
        qf, dof = q.reshape(bh * m, g, d), dout.reshape(bh * m, g, d)
        dq = torch.empty_like(qf)
        # dS = P * (dP - rowsum(dO * O) + dlse), with rowsum(dO * O) = rowsum(P * dP) taken per chunk
        dlse = None if dlse is None else at_least_fp32(dlse).reshape(bh * m, g)
        for r in rows.chunks():
            kg, vg = rows.gather(k_table, r), rows.gather(v_table, r)
            scores = at_least_fp32(torch.bmm(qf[r], kg.transpose(1, 2))) * scale
            probs = (scores - _finite(lse[r])[..., None]).exp().masked_fill(~rows.allowed(r), 0.0)
            dprobs = at_least_fp32(torch.bmm(dof[r], vg.transpose(1, 2)))
            weighted = probs
            if slot_weights is not None:  # out = sum_s w_s P_s V_s: w_s gets sum(P_s * dP_s)
                dweights[r] = (probs * dprobs).sum(1).view(probs.shape[0], -1, ctx.block).sum(-1)
                weighted, dprobs = probs * slot_weights[r], dprobs * slot_weights[r]
            delta = (probs * dprobs).sum(-1, keepdim=True)  # dprobs carries the slot weights here
            if dlse is not None:
                delta -= dlse[r, :, None]
            dscores = (probs * (dprobs - delta) * scale).to(q.dtype)
            dq[r] = torch.bmm(dscores, kg)
            flat = rows.indices[r].flatten()
            dkg = torch.bmm(dscores.transpose(1, 2), qf[r])
            dvg = torch.bmm(weighted.to(q.dtype).transpose(1, 2), dof[r])
            dk_table.index_add_(0, flat, dkg.view(flat.shape[0], -1))
            dv_table.index_add_(0, flat, dvg.view(flat.shape[0], -1))
        n = k.shape[1]
        dk = dk_table.view(bh, -1, d)[:, :n]
        dv = dv_table.view(bh, -1, d)[:, :n]
        if dweights is not None:
            dweights = dweights.view_as(weights).to(weights.dtype)
        return dq.view(bh, m, g, d), dk, dv, None, None, None, None, dweights
