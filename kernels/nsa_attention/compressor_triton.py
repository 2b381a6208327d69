"""NSA's block compressor (keys' and values' MLPs, one set of weights over their heads) in Triton:
one launch forward, two backward. kernels/nsa_attention/compressor.py states the op and holds the
readable torch path; this file only runs it.

For head h, block c covers tokens start + c * stride + [0, block) of x [batch, seq, heads, dim_head]
(start = first * stride), and

    pre[c]  = sum_t (x[start + c * stride + t] + pos[t]) @ w1[t * dim_head : (t + 1) * dim_head] + b1
    out[c]  = gelu(pre[c]) @ w2

Launches (rows = blocks per program, BC = 64):
    compress_forward                  grid (tiles of BC blocks, heads, batch): out
    compress_backward_rows            same grid: recomputes pre, writes its gradient dpre [batch, heads,
                                      blocks, HP] (fp32) and each program's part of dw2
    compress_backward_inputs_weights  one flat grid of two kinds of program:
        (block * dim_head / BD + 1) * heads   dw1 BD <= 64 rows of one block position's slice per
                              program (summed over batch and blocks), its dpos, db1; the last of a
                              head's sums dw2's parts
        (tiles of BC token strides) * heads * batch   dx, each token gathering from the
                              <= ceil(block / stride) blocks covering it (no atomics)
Every sum is in a fixed order: the gradients are deterministic. Products take x's dtype (weight
tiles cast to it, as autocast casts them for a matmul: fp32 weights under a bf16 x run on bf16 tensor
cores), with fp32 accumulation; the gradients leave in their tensors' dtypes.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import counters
from kernels.nsa_attention.compressor import num_blocks, triton_problem
from kernels.triton_tiles import pv, qk, refuse, tiles_usable

BC = 64  # blocks (or token strides) per program: a tensor-core tile's rows
WEIGHT_ROWS = 64  # rows of a block position's [dim_head, hidden] slice of dw1 per program: no more held


def hidden_tile(hidden: int) -> int:
    """The hidden layer's width in the kernels: the next power of two, at least a tile's 16 (masked)."""
    return max(16, triton.next_power_of_2(hidden))


@triton.jit
def _gelu(z):
    """The exact (erf) GELU, as torch.nn.functional.gelu's default."""
    return 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))


@triton.jit
def _gelu_grad(z):
    """d gelu / dz = Phi(z) + z phi(z)."""
    return 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476)) + z * tl.exp(-0.5 * z * z) * 0.3989422804014327


@triton.jit
def _tn(a, b, USE_DOT: tl.constexpr):
    """a [K, M]^T @ b [K, N] -> [M, N] in fp32, a cast to b's dtype for the tile."""
    if USE_DOT:
        return tl.dot(tl.trans(a.to(b.dtype)), b, input_precision="ieee" if b.dtype == tl.float32 else None)
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[:, None, :], axis=0)


@triton.jit
def _block_inputs(x, pos, b, h, t, rows, live, sxb, sxn, sxh, sxd, start, stride, block, d0,
                  D: tl.constexpr, DW: tl.constexpr):
    """Position t of blocks `rows`, features [d0, d0 + DW), with its position embedding added -> [BC, DW]
    fp32, 0 where not live. Overlapping blocks simply read their shared tokens again."""
    dd = d0 + tl.arange(0, DW)
    tokens = start + rows * stride + t
    # 64-bit offsets: a batch of long sequences in the key/value projection's layout passes 2**31 elements
    rows_x = x + tl.cast(b, tl.int64) * sxb + h * sxh + tokens[:, None] * sxn
    xt = tl.load(rows_x + dd[None, :] * sxd, mask=live[:, None], other=0.0)
    pt = tl.load(pos + (h * block + t) * D + dd)
    return tl.where(live[:, None], xt.to(tl.float32) + pt.to(tl.float32)[None, :], 0.0)


@triton.jit
def _w1_slice(w1, h, t, block, hidden, d0, D: tl.constexpr, DW: tl.constexpr, HP: tl.constexpr):
    """w1[h, t * D + d0 : t * D + d0 + DW] -> [DW, HP], 0 in the padding columns."""
    dd, hh = tl.arange(0, DW), tl.arange(0, HP)
    rows = (h * block + t) * D + d0 + dd
    return tl.load(w1 + rows[:, None] * hidden + hh[None, :], mask=(hh < hidden)[None, :], other=0.0)


@triton.jit
def _pre_activation(x, pos, w1, b1, b, h, rows, live, sxb, sxn, sxh, sxd, start, stride, block, hidden,
                    D: tl.constexpr, HP: tl.constexpr, BC: tl.constexpr, USE_DOT: tl.constexpr):
    """The first layer for blocks `rows` -> [BC, HP] fp32: one [BC, D] x [D, HP] product per block
    position, so the block's l * D row is never held whole."""
    hh = tl.arange(0, HP)
    acc = tl.zeros((BC, HP), dtype=tl.float32)
    for t in range(0, block):
        a = _block_inputs(x, pos, b, h, t, rows, live, sxb, sxn, sxh, sxd, start, stride, block, 0, D, D)
        acc += pv(a, _w1_slice(w1, h, t, block, hidden, 0, D, D, HP).to(x.dtype.element_ty), USE_DOT)
    return acc + tl.load(b1 + h * hidden + hh, mask=hh < hidden, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _w2_tile(w2, h, hidden, D: tl.constexpr, HP: tl.constexpr):
    """w2[h] -> [HP, D], 0 in the padding rows."""
    dd, hh = tl.arange(0, D), tl.arange(0, HP)
    return tl.load(w2 + (h * hidden + hh)[:, None] * D + dd[None, :], mask=(hh < hidden)[:, None], other=0.0)


@triton.jit
def _compress_forward(x, pos, w1, b1, w2, out, sxb, sxn, sxh, sxd, sob, soc, soh, nc, start, stride, block, hidden,
                      D: tl.constexpr, HP: tl.constexpr, BC: tl.constexpr, USE_DOT: tl.constexpr):
    tile, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tile * BC + tl.arange(0, BC)
    live = rows < nc
    pre = _pre_activation(x, pos, w1, b1, b, h, rows, live, sxb, sxn, sxh, sxd, start, stride, block, hidden,
                          D, HP, BC, USE_DOT)
    o = pv(_gelu(pre), _w2_tile(w2, h, hidden, D, HP).to(x.dtype.element_ty), USE_DOT)
    dd = tl.arange(0, D)
    ptrs = out + tl.cast(b, tl.int64) * sob + h * soh + rows[:, None] * soc + dd[None, :]
    tl.store(ptrs, o.to(out.dtype.element_ty), mask=live[:, None])


@triton.jit
def _compress_backward_rows(x, pos, w1, b1, w2, dout, dpre, dw2_parts, sxb, sxn, sxh, sxd, sgb, sgc, sgh, sgd,
                            heads, nc, start, stride, block, hidden,
                            D: tl.constexpr, HP: tl.constexpr, BC: tl.constexpr, USE_DOT: tl.constexpr):
    tile, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tile * BC + tl.arange(0, BC)
    live = rows < nc
    dd, hh = tl.arange(0, D), tl.arange(0, HP)
    # the pre-activation is recomputed, not saved: it is as large as the output times hidden / dim_head
    pre = _pre_activation(x, pos, w1, b1, b, h, rows, live, sxb, sxn, sxh, sxd, start, stride, block, hidden,
                          D, HP, BC, USE_DOT)
    w2t = _w2_tile(w2, h, hidden, D, HP).to(x.dtype.element_ty)
    rows_g = dout + tl.cast(b, tl.int64) * sgb + h * sgh + rows[:, None] * sgc
    g = tl.load(rows_g + dd[None, :] * sgd, mask=live[:, None], other=0.0)
    dhid = qk(g.to(w2t.dtype), w2t, USE_DOT)  # [BC, HP]
    keep = live[:, None] & (hh < hidden)[None, :]
    dp = tl.where(keep, dhid * _gelu_grad(pre), 0.0)
    tl.store(dpre + ((b * heads + h) * nc + rows[:, None]) * HP + hh[None, :], dp, mask=live[:, None])
    # this program's part of dw2 = gelu(pre)^T @ dout, summed over the parts by the weights' launch
    part = _tn(tl.where(keep, _gelu(pre), 0.0), g, USE_DOT)  # [HP, D]
    index = (b * tl.num_programs(0) + tile) * heads + h
    tl.store(dw2_parts + (index * HP + hh[:, None]) * D + dd[None, :], part)


@triton.jit
def _token_gradients(w1, dpre, dx, tile, h, b, sdb, sdn, sdh, heads, seq, nc, first, stride, block, hidden,
                     D: tl.constexpr, HP: tl.constexpr, BC: tl.constexpr, USE_DOT: tl.constexpr):
    """dx for token strides [tile * BC, (tile + 1) * BC) of head h, batch b."""
    i = tile * BC + tl.arange(0, BC)  # token strides: tokens i * stride + u, u < stride
    dd, hh = tl.arange(0, D), tl.arange(0, HP)
    for u in range(0, stride):
        acc = tl.zeros((BC, D), dtype=tl.float32)
        # token i * stride + u is position t = q * stride + u of block c = i - first - q: the blocks
        # covering it, at most ceil(block / stride), each read once (no atomics)
        for q in range(0, tl.cdiv(block - u, stride)):
            c = i - first - q
            ok = (c >= 0) & (c < nc)
            dp = tl.load(dpre + ((b * heads + h) * nc + c[:, None]) * HP + hh[None, :], mask=ok[:, None], other=0.0)
            w1t = _w1_slice(w1, h, q * stride + u, block, hidden, 0, D, D, HP).to(dx.dtype.element_ty)
            acc += qk(dp.to(w1t.dtype), w1t, USE_DOT)  # dpre @ w1_t^T: [BC, D]
        tokens = i * stride + u  # tokens covered by no block (before `first`, the tail) get 0
        rows_dx = dx + tl.cast(b, tl.int64) * sdb + h * sdh + tokens[:, None] * sdn
        tl.store(rows_dx + dd[None, :], acc.to(dx.dtype.element_ty), mask=(tokens < seq)[:, None])


@triton.jit
def _weight_gradients(x, pos, w1, dpre, dw2_parts, dpos, dw1, db1, dw2, j, h, sxb, sxn, sxh, sxd,
                      batch, heads, nc, parts, start, stride, block, hidden,
                      D: tl.constexpr, BD: tl.constexpr, HP: tl.constexpr, BC: tl.constexpr, USE_DOT: tl.constexpr):
    """Program j < block * D / BD of head h: block position t = j // (D / BD), features d0 + [0, BD):
    those rows of dw1[h] summed over every batch and block, of dpos[h, t] (and db1[h] at j = 0);
    j = block * D / BD: dw2[h], the sum of the rows' parts."""
    dd, hh = tl.arange(0, D), tl.arange(0, HP)
    t, d0 = j // (D // BD), (j % (D // BD)) * BD  # BD features a program: [BD, HP] held, not [D, HP]
    if t < block:
        db = d0 + tl.arange(0, BD)
        acc = tl.zeros((BD, HP), dtype=tl.float32)
        dbias = tl.zeros((HP,), dtype=tl.float32)
        for b in range(0, batch):
            for c0 in range(0, nc, BC):
                rows = c0 + tl.arange(0, BC)
                live = rows < nc
                a = _block_inputs(x, pos, b, h, t, rows, live, sxb, sxn, sxh, sxd, start, stride, block, d0, D, BD)
                dp = tl.load(dpre + ((b * heads + h) * nc + rows[:, None]) * HP + hh[None, :], mask=live[:, None],
                             other=0.0)
                acc += _tn(a, dp.to(x.dtype.element_ty), USE_DOT)
                dbias += tl.sum(dp, axis=0)
        tl.store(dw1 + ((h * block + t) * D + db[:, None]) * hidden + hh[None, :], acc.to(dw1.dtype.element_ty),
                 mask=(hh < hidden)[None, :])
        # pos[t] enters pre as every block's input at t does: its gradient is the sum over blocks of
        # dpre @ w1_t^T = (sum of dpre) @ w1_t^T, the bias's gradient through w1_t
        w1t = _w1_slice(w1, h, t, block, hidden, d0, D, BD, HP).to(tl.float32)
        tl.store(dpos + (h * block + t) * D + db, tl.sum(w1t * dbias[None, :], axis=1).to(dpos.dtype.element_ty))
        if j == 0:
            tl.store(db1 + h * hidden + hh, dbias.to(db1.dtype.element_ty), mask=hh < hidden)
    else:
        acc2 = tl.zeros((HP, D), dtype=tl.float32)
        for p in range(0, parts):
            acc2 += tl.load(dw2_parts + ((p * heads + h) * HP + hh[:, None]) * D + dd[None, :])
        tl.store(dw2 + (h * hidden + hh[:, None]) * D + dd[None, :], acc2.to(dw2.dtype.element_ty),
                 mask=(hh < hidden)[:, None])


@triton.jit
def _compress_backward_inputs_weights(x, pos, w1, dpre, dw2_parts, dx, dpos, dw1, db1, dw2, sxb, sxn, sxh, sxd,
                                      sdb, sdn, sdh, batch, heads, seq, nc, parts, first, stride, block, hidden,
                                      TOKEN_TILES, D: tl.constexpr, BD: tl.constexpr, HP: tl.constexpr,
                                      BC: tl.constexpr, USE_DOT: tl.constexpr):
    """One launch for both what reads only dpre and the inputs: the (block * D / BD + 1) * heads weight
    programs first (each walks every block: started first, they do not trail), then a program per (tile
    of token strides, head, batch) for dx."""
    pid = tl.program_id(0)
    weights = (block * (D // BD) + 1) * heads
    if pid < weights:
        _weight_gradients(x, pos, w1, dpre, dw2_parts, dpos, dw1, db1, dw2, pid // heads, pid % heads, sxb, sxn, sxh,
                          sxd, batch, heads, nc, parts, first * stride, stride, block, hidden, D, BD, HP, BC, USE_DOT)
    else:
        rest = pid - weights
        tile, h, b = rest % TOKEN_TILES, (rest // TOKEN_TILES) % heads, rest // (TOKEN_TILES * heads)
        _token_gradients(w1, dpre, dx, tile, h, b, sdb, sdn, sdh, heads, seq, nc, first, stride, block, hidden,
                         D, HP, BC, USE_DOT)


def _check(x: Tensor, w1: Tensor) -> None:
    refuse("compressor", x, triton_problem(x.shape[3], w1.shape[2]))


def _record(name: str, grid: tuple, block: int) -> None:
    if counters.counting():
        counters.record(counters.Launch(name, tuple(grid), BC, block))


def _meta(x: Tensor, w1: Tensor) -> dict:
    hp = hidden_tile(w1.shape[2])
    return dict(D=x.shape[3], HP=hp, BC=BC, USE_DOT=tiles_usable(x.dtype, 16, x.shape[3], hp))


def forward(x: Tensor, pos: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, block: int, stride: int, first: int
            ) -> Tensor:
    """x [batch, seq, heads, dim_head] (any strides) -> out [batch, blocks, heads, dim_head] in x's dtype."""
    _check(x, w1)
    batch, seq, heads, dim = x.shape
    nc = num_blocks(seq, block, stride, first)
    out = x.new_empty(batch, nc, heads, dim)
    if nc == 0 or batch == 0:
        return out
    pos, w1, b1, w2 = (t.contiguous() for t in (pos, w1, b1, w2))  # parameters are: no copy
    grid = (triton.cdiv(nc, BC), heads, batch)
    _compress_forward[grid](x, pos, w1, b1, w2, out, *x.stride(), out.stride(0), out.stride(1), out.stride(2),
                            nc, first * stride, stride, block, w1.shape[2], **_meta(x, w1))
    _record("compress_forward", grid, block)
    return out


def backward(dout: Tensor, x: Tensor, pos: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, block: int, stride: int,
             first: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients dx [batch, seq, heads, dim_head] (contiguous, x's dtype), dpos, dw1, db1, dw2 (their
    parameters' shapes and dtypes) given dout [batch, blocks, heads, dim_head] (any strides)."""
    _check(x, w1)
    batch, seq, heads, dim = x.shape
    hidden = w1.shape[2]
    nc = num_blocks(seq, block, stride, first)
    meta = _meta(x, w1)
    hp = meta["HP"]
    pos, w1, b1, w2 = (t.contiguous() for t in (pos, w1, b1, w2))
    dx = torch.empty(batch, seq, heads, dim, dtype=x.dtype, device=x.device)
    dpos, dw1, db1, dw2 = (torch.empty_like(t) for t in (pos, w1, b1, w2))
    tiles = triton.cdiv(nc, BC)
    dpre = torch.empty(batch, heads, nc, hp, dtype=torch.float32, device=x.device)
    dw2_parts = torch.empty(batch * tiles, heads, hp, dim, dtype=torch.float32, device=x.device)
    if nc and batch:
        grid = (tiles, heads, batch)
        _compress_backward_rows[grid](x, pos, w1, b1, w2, dout, dpre, dw2_parts, *x.stride(), *dout.stride(), heads,
                                      nc, first * stride, stride, block, hidden, **meta)
        _record("compress_backward_rows", grid, block)
    token_tiles = triton.cdiv(triton.cdiv(seq, stride), BC)  # tokens i * stride + u, u < stride
    bd = min(dim, WEIGHT_ROWS)
    grid = ((block * (dim // bd) + 1) * heads + token_tiles * heads * batch,)
    _compress_backward_inputs_weights[grid](x, pos, w1, dpre, dw2_parts, dx, dpos, dw1, db1, dw2, *x.stride(),
                                            dx.stride(0), dx.stride(1), dx.stride(2), batch, heads, seq, nc,
                                            batch * tiles, first, stride, block, hidden, token_tiles, BD=bd, **meta)
    _record("compress_backward_inputs_weights", grid, block)
    return dx, dpos, dw1, db1, dw2
