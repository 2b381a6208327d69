"""Native Sparse Attention (Yuan et al. 2025): compressed, selected and sliding-window branches
over each query's causal past, mixed by learned per-head sigmoid gates.

Notation of the paper -> knob: l = compress_block_size, d = compress_stride,
l' = fine_block_size, n = num_fine_selected, w = sliding_window_size.

- compressed: blocks of l keys every d tokens, each compressed to one key (and one value) by an
  MLP over the block plus a learned intra-block position embedding. A block is visible to query t
  only once it is complete (its last token <= t); a query that sees no block gets zeros, not NaN.
- selected: block importance is the compressed-attention probability summed over the query heads
  of a GQA group and spread onto the fine blocks by token overlap; each position keeps its top n
  fine blocks, always including its own block, the initial block and the previous block (in that
  order of priority). Keys after t inside its own block are masked. As in the paper, the choice
  of blocks passes no gradient.
- sliding window: the last w keys, t included.

Each branch has its own keys and values (as the paper: no gradient shortcuts between branches);
the query projection is shared. Rotary positions apply to the selected and window branches; the
compressed branch gets its positions from the intra-block embedding and the causal block mask.
All branches are written for queries starting at any position, so the cached (incremental) path
runs the same code as training.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from kernels.selected_attention import selected_attention, triton_runnable
from models.rotary import Rotary

BRANCHES = 3  # compressed, selected, window


class BlockCompressor(nn.Module):
    """Per-KV-head MLP from a block [l, dim_head] (+ intra-block position) to one [dim_head]."""

    def __init__(self, kv_heads: int, block: int, stride: int, dim_head: int, hidden: int):
        super().__init__()
        self.block, self.stride = block, stride
        self.pos = nn.Parameter(torch.zeros(kv_heads, block, dim_head))
        self.w1 = nn.Parameter(torch.randn(kv_heads, block * dim_head, hidden) / math.sqrt(block * dim_head))
        self.b1 = nn.Parameter(torch.zeros(kv_heads, 1, hidden))
        self.w2 = nn.Parameter(torch.randn(kv_heads, hidden, dim_head) / math.sqrt(hidden))

    def num_blocks(self, seq: int) -> int:
        return max(0, (seq - self.block) // self.stride + 1)

    def forward(self, x: Tensor, first: int = 0) -> Tensor:
        """x [batch, kv_heads, seq, dim_head] -> [batch, kv_heads, blocks, dim_head] for the
        complete blocks from block index `first` on."""
        x = x[:, :, first * self.stride :]
        if self.num_blocks(x.shape[2]) == 0:
            return x.new_zeros(*x.shape[:2], 0, x.shape[3])
        blocks = x.unfold(2, self.block, self.stride).transpose(-1, -2)  # [b, h, nc, l, d]
        blocks = (blocks + self.pos[:, None]).flatten(-2)  # [b, h, nc, l * d]
        hidden = F.gelu(torch.einsum("bhcx,hxy->bhcy", blocks, self.w1) + self.b1)
        return torch.einsum("bhcy,hyd->bhcd", hidden, self.w2)


class NativeSparseAttention(nn.Module):
    def __init__(
        self,
        *,
        dim: int,
        heads: int,
        dim_head: int,
        kv_heads: int,
        sliding_window_size: int,
        compress_block_size: int,
        compress_stride: int,
        fine_block_size: int,
        num_fine_selected: int,
        compress_hidden_mult: float = 1.0,
        dropout: float = 0.0,
        kernel: str = "auto",
    ):
        super().__init__()
        _check(heads, kv_heads, sliding_window_size, compress_block_size, compress_stride, fine_block_size,
               num_fine_selected, kernel)
        self.heads, self.kv_heads, self.dim_head = heads, kv_heads, dim_head
        self.group = heads // kv_heads
        self.window = sliding_window_size
        self.fine_block = fine_block_size
        self.num_selected = num_fine_selected
        self.dropout = dropout
        self.kernel = kernel
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, BRANCHES * 2 * kv_heads * dim_head, bias=False)
        self.to_gates = nn.Linear(dim, BRANCHES * heads)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)
        hidden = max(1, int(dim_head * compress_hidden_mult))
        self.compress_k = BlockCompressor(kv_heads, compress_block_size, compress_stride, dim_head, hidden)
        self.compress_v = BlockCompressor(kv_heads, compress_block_size, compress_stride, dim_head, hidden)
        self.rotary = Rotary(dim_head)

    def forward(self, x: Tensor, cache: Optional[dict] = None) -> Tensor:
        """x [batch, seq, dim] -> [batch, seq, dim]; with `cache`, x continues the cached tokens."""
        b, m, _ = x.shape
        start = 0 if cache is None else cache.get("pos", 0)
        q = rearrange(self.to_q(x), "b n (h g d) -> b h g n d", h=self.kv_heads, g=self.group)
        kv = rearrange(self.to_kv(x), "b n (s h d) -> s b h n d", s=2 * BRANCHES, h=self.kv_heads)
        k_cmp, v_cmp, k_slc, v_slc, k_win, v_win = kv
        q_rot = self.rotary(q.flatten(1, 2), start).view_as(q)
        k_slc, k_win = self.rotary(k_slc, start), self.rotary(k_win, start)
        if cache is not None:
            k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, kc, vc = self._extend_cache(
                cache, start, m, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win)
        else:
            kc, vc = self.compress_k(k_cmp), self.compress_v(v_cmp)

        out_cmp = self._compressed(q, kc, vc, start)
        out_slc = self._selected(q_rot, k_slc, v_slc, self._importance(q, kc, start, k_slc.shape[2]), start)
        out_win = self._window(q_rot, k_win, v_win, start)

        gates = torch.sigmoid(self.to_gates(x))  # [b, n, 3 * heads]
        gates = rearrange(gates, "b n (s h g) -> s b h g n 1", s=BRANCHES, h=self.kv_heads)
        out = gates[0] * out_cmp + gates[1] * out_slc + gates[2] * out_win
        return self.to_out(rearrange(out, "b h g n d -> b n (h g d)"))

    # ---- branches ------------------------------------------------------------------------------

    def _compressed_visible(self, start: int, m: int, num_blocks: int, device) -> Tensor:
        """[queries, compressed blocks]: a block is visible once its last token is in the past."""
        positions = torch.arange(start, start + m, device=device)
        block_end = torch.arange(num_blocks, device=device) * self.compress_k.stride + self.compress_k.block - 1
        return block_end[None, :] <= positions[:, None]

    def _compressed(self, q: Tensor, kc: Tensor, vc: Tensor, start: int) -> Tensor:
        """Attention over complete compressed blocks -> [b, h, g, n, d]. Queries before the first
        complete block see nothing and get zeros; the rest go through fused attention."""
        b, h, g, m, d = q.shape
        first = min(m, max(0, self.compress_k.block - 1 - start))  # leading queries with no block
        out = q.new_zeros(b, h, g, m, d)
        if first < m:
            visible = self._compressed_visible(start + first, m - first, kc.shape[2], q.device)
            rows = q[:, :, :, first:].flatten(2, 3)  # the group joins the query axis: [b, h, g * n, d]
            attended = F.scaled_dot_product_attention(rows, kc, vc, attn_mask=visible.repeat(g, 1))
            out = torch.cat((out[:, :, :, :first], attended.view(b, h, g, m - first, d)), dim=3)
        return out

    @torch.no_grad()
    def _importance(self, q: Tensor, kc: Tensor, start: int, seq_k: int) -> Tensor:
        """Fine-block importance [b, h, n, fine blocks]: the compressed-attention probabilities,
        summed over the query heads of a GQA group and spread onto fine blocks by token overlap.
        Only ranks blocks (no gradient), so it is computed in chunks of queries without keeping
        the [n, compressed blocks] probabilities."""
        b, h, g, m, d = q.shape
        num_fine = -(-seq_k // self.fine_block)
        overlap = _overlap(kc.shape[2], num_fine, self.compress_k.block, self.compress_k.stride,
                           self.fine_block, q.device, torch.float32)
        scores = q.new_zeros(b, h, m, num_fine, dtype=torch.float32)
        chunk = max(1, (1 << 22) // max(1, b * h * g * kc.shape[2]))
        for c0 in range(0, m, chunk):
            c1 = min(m, c0 + chunk)
            visible = self._compressed_visible(start + c0, c1 - c0, kc.shape[2], q.device)
            logits = torch.einsum("bhgnd,bhcd->bhgnc", q[:, :, :, c0:c1], kc).float() * d**-0.5
            probs = logits.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num_(0.0)  # no block: 0
            scores[:, :, c0:c1] = probs.sum(2) @ overlap
        return scores

    def _selected(self, q: Tensor, k: Tensor, v: Tensor, importance: Tensor, start: int) -> Tensor:
        """Attention over the selected fine blocks -> [b, h, g, n, d].

        The forced blocks (own, initial, previous) are the same for every query of a fine block, so
        they are attended tile by tile from contiguous keys; only the freely chosen blocks are
        gathered per query. The two partial attentions cover disjoint blocks and are merged exactly
        through their log-sum-exps."""
        b = q.shape[0]
        out_forced, lse_forced = self._forced_blocks(q, k, v, start)
        indices, valid = self._select(importance, start)
        if indices.shape[-1] == 0:
            return out_forced
        out_free, lse_free = selected_attention(
            rearrange(q, "b h g n d -> (b h) n g d"), k.flatten(0, 1), v.flatten(0, 1),
            indices.flatten(0, 1), valid.flatten(0, 1), start, self.fine_block, self.kernel,
        )
        out_free = rearrange(out_free, "(b h) n g d -> b h g n d", b=b)
        lse_free = rearrange(lse_free, "(b h) n g -> b h g n", b=b)
        lse = torch.logaddexp(lse_forced, lse_free)
        return (out_forced * (lse_forced - lse).exp()[..., None].to(q.dtype)
                + out_free * (lse_free - lse).exp()[..., None].to(q.dtype))

    def _num_forced(self) -> int:
        return min(3, self.num_selected)

    def _forced_mask(self, query_pos: Tensor, key_pos: Tensor) -> Tensor:
        """[queries, keys]: key in the query's own block (at or before it), the initial block, or
        the previous block, as many of these as num_fine_selected allows, in that priority."""
        own = query_pos[:, None] // self.fine_block
        key_block = (key_pos // self.fine_block)[None]
        forced = key_block == own
        if self._num_forced() >= 2:
            forced |= key_block == 0
        if self._num_forced() >= 3:
            forced |= key_block == own - 1
        return forced & (key_pos[None] <= query_pos[:, None]) & (key_pos[None] >= 0)

    def _forced_blocks(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Attention over the forced blocks -> (out [b, h, g, n, d], log-sum-exp [b, h, g, n])."""
        b, h, g, m, d = q.shape
        l = self.fine_block
        if start == 0 and m > l:  # training: one tile per fine block, keys [initial | previous | own]
            pad = (-m) % l
            qp, kp, vp = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
            nb = (m + pad) // l
            qt = rearrange(qp, "b h g (c l) d -> b h c (g l) d", l=l)
            kt, vt = (rearrange(t, "b h (c l) d -> b h c l d", l=l) for t in (kp, vp))
            kt, vt = (torch.cat((t[:, :, :1].expand_as(t), F.pad(t, (0, 0, 0, 0, 1, 0))[:, :, :-1], t), dim=3)
                      for t in (kt, vt))
            tile = torch.arange(nb, device=q.device)
            query_pos = tile[:, None] * l + torch.arange(l, device=q.device)  # [c, l]
            key_pos = torch.cat((torch.arange(l, device=q.device)[None].expand(nb, l),
                                 query_pos - l, query_pos), dim=1)  # [c, 3l]
            mask = torch.stack([self._forced_mask(qp_, kp_) for qp_, kp_ in zip(query_pos, key_pos)])
            # a block seen twice (the initial block is also the own or previous one early on) counts once
            mask[:1, :, :l] = False  # tile 0: the initial block is the own block
            mask[1:2, :, :l] = False  # tile 1: the initial block is the previous block
            mask = mask.repeat(1, g, 1)  # [c, g * l, 3l]
            out, lse = _masked_attention(qt, kt, vt, mask)
            out = rearrange(out, "b h c (g l) d -> b h g (c l) d", g=g)[:, :, :, :m]
            return out, rearrange(lse, "b h c (g l) -> b h g (c l)", g=g)[..., :m]
        query_pos = torch.arange(start, start + m, device=q.device)
        mask = self._forced_mask(query_pos, torch.arange(k.shape[2], device=q.device))
        out, lse = _masked_attention(q.flatten(2, 3), k, v, mask.repeat(g, 1))
        return out.view(b, h, g, m, d), lse.view(b, h, g, m)

    def _select(self, importance: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """The freely chosen fine blocks per (batch, kv head, position): the most important ones
        (importance [b, h, n, fine blocks]) besides the forced blocks, never in the future.
        -> indices, validity [b, h, n, free]"""
        m, num_fine = importance.shape[2], importance.shape[3]
        query_pos = torch.arange(start, start + m, device=importance.device)
        fine_start = torch.arange(num_fine, device=importance.device) * self.fine_block
        taken = self._forced_mask(query_pos, fine_start) | (fine_start[None] > query_pos[:, None])
        scores = importance.masked_fill(taken, float("-inf"))
        free = max(0, min(self.num_selected - self._num_forced(), num_fine))
        values, indices = scores.topk(free, dim=-1)
        return indices, values > float("-inf")

    def _window(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        """Sliding-window attention: query t sees keys (t - w, t]. -> [b, h, g, n, d]"""
        b, h, g, m, d = q.shape
        w = self.window
        dropout = self.dropout if self.training else 0.0
        if start == 0 and m > w:  # training: blocks of w queries see their block and the previous
            pad = (-m) % w
            qp, kp, vp = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
            nb = (m + pad) // w
            qb = rearrange(qp, "b h g (c w) d -> b h c (g w) d", w=w)
            kb, vb = (rearrange(t, "b h (c w) d -> b h c w d", w=w) for t in (kp, vp))
            kb, vb = (torch.cat((F.pad(t, (0, 0, 0, 0, 1, 0))[:, :, :-1], t), dim=3) for t in (kb, vb))
            qpos = torch.arange(w, device=q.device) + w  # positions relative to the previous block
            kpos = torch.arange(2 * w, device=q.device)
            mask = (kpos[None] <= qpos[:, None]) & (kpos[None] > qpos[:, None] - w)  # [w, 2w]
            first = mask.clone()
            first[:, :w] = False  # block 0 has no previous block: its padding must stay unseen
            mask = torch.stack([first] + [mask] * (nb - 1)).repeat(1, g, 1)  # [c, g * w, 2w]
            out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, dropout_p=dropout)
            return rearrange(out, "b h c (g w) d -> b h g (c w) d", g=g)[:, :, :, :m]
        lo = max(0, start - w + 1)  # decoding: the last w keys before the first query suffice
        k, v = k[:, :, lo:], v[:, :, lo:]
        qpos = torch.arange(start, start + m, device=q.device)
        kpos = torch.arange(lo, lo + k.shape[2], device=q.device)
        mask = (kpos[None] <= qpos[:, None]) & (kpos[None] > qpos[:, None] - w)
        out = F.scaled_dot_product_attention(q.flatten(2, 3), k, v, attn_mask=mask.repeat(g, 1), dropout_p=dropout)
        return out.view(b, h, g, m, d)

    # ---- cache ---------------------------------------------------------------------------------

    def truncate_cache(self, cache: dict, length: int) -> None:
        """Roll back to the first `length` positions (compressed blocks completed after it go too)."""
        if cache.get("pos", 0) > length:
            _truncate(cache, length, self.compress_k.num_blocks(length))

    def _extend_cache(self, cache: dict, start: int, m: int, *new: Tensor):
        """Append the new raw keys and values of every branch; compress blocks completed by them."""
        names = ("k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win")
        for name, t in zip(names, new):
            cache[name] = torch.cat((cache[name], t), dim=2) if start else t
        total = start + m
        done = cache["kc"].shape[2] if start else 0
        todo = self.compress_k.num_blocks(total) - done
        kc_new = self.compress_k(cache["k_cmp"], first=done)[:, :, :todo]
        vc_new = self.compress_v(cache["v_cmp"], first=done)[:, :, :todo]
        cache["kc"] = torch.cat((cache["kc"], kc_new), dim=2) if start else kc_new
        cache["vc"] = torch.cat((cache["vc"], vc_new), dim=2) if start else vc_new
        cache["pos"] = total
        return (*(cache[name] for name in names), cache["kc"], cache["vc"])


def _truncate(cache: dict, length: int, blocks: int) -> None:
    for name in ("k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win"):
        cache[name] = cache[name][:, :, :length]
    cache["kc"], cache["vc"] = cache["kc"][:, :, :blocks], cache["vc"][:, :, :blocks]
    cache["pos"] = length


def _masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax attention with a boolean mask, also returning the log-sum-exp; rows with no visible
    key give zeros and -inf. q [..., nq, d], k, v [..., nk, d], mask [..., nq, nk]."""
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(-1)
    probs = (scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None]).exp()
    return probs.to(q.dtype) @ v, lse


def _overlap(num_cmp: int, num_fine: int, block: int, stride: int, fine_block: int, device, dtype) -> Tensor:
    """[compressed blocks, fine blocks]: the fraction of compressed block i inside fine block j."""
    c_start = torch.arange(num_cmp, device=device)[:, None] * stride
    f_start = torch.arange(num_fine, device=device)[None, :] * fine_block
    inter = (torch.minimum(c_start + block, f_start + fine_block) - torch.maximum(c_start, f_start)).clamp(min=0)
    return (inter / block).to(dtype)


def _check(heads, kv_heads, window, block, stride, fine_block, num_selected, kernel) -> None:
    """Reject knob combinations NSA cannot run, saying how to fix them."""
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads} (GQA groups): change model.kv_heads")
    for name, value in (("sliding_window_size", window), ("compress_block_size", block),
                        ("compress_stride", stride), ("fine_block_size", fine_block), ("num_fine_selected", num_selected)):
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1: set model.{name}")
    if stride > block:
        raise ValueError(f"compress_stride={stride} exceeds compress_block_size={block}, so tokens between "
                         "blocks would never be compressed: lower model.compress_stride")
    if kernel == "triton" and not triton_runnable():
        raise ValueError("kernel=triton needs a CUDA device (or TRITON_INTERPRET=1 to run the kernel slowly "
                         "on the CPU): use model.kernel=auto or torch")
