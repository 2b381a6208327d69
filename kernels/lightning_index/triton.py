"""The lightning indexer's scoring as a Triton kernel, followed by torch.topk, one chunk of queries
at a time (same signature and results as reference.py).

A program scores a tile of BLOCK_M queries against a tile of BLOCK_N keys, every indexer head in
turn: sum_j w(t, j) * ReLU(q(t, j) . k(s)) accumulates in registers, so no [queries, heads, keys]
product is ever written, and it stores the scores as int64 ranking keys (the fp32 score's bits as
an ordered integer, times 2^32, plus the key's position: kernels.ranking.ranking_keys, the later key
first), which torch.topk over the chunk's [chunk, keys] buffer turns into indices. Tiles wholly after their
queries are not scored (their keys are the lowest). Constraints, checked before launch:
index_dim_head a power of two from 16 to 256. Runs on CUDA tensors, or on CPU tensors under
TRITON_INTERPRET=1 (slow: the tests use tiny shapes).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import counters
from kernels.lightning_index.reference import top_keys
from kernels.lightning_index import triton_problem
from kernels.triton_tiles import qk, refuse, tiles_usable

BLOCK_M, BLOCK_N = 32, 32
_CHUNK = 1 << 22  # ranking keys per chunk (int64: 32 MiB)


def check_supported(q: Tensor) -> None:
    refuse("lightning-indexer", q, triton_problem(q.shape[-1]))


@triton.jit
def _ranking_keys(Q, K, W, KEYS, first, rows, seq_q, seq_k, visible, HEADS: tl.constexpr, D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr):
    """Ranking keys [BLOCK_M, BLOCK_N] of queries first + r (r < rows; positions, as the first
    query of the sequence q holds is at seq_k - seq_q) against keys cols < visible."""
    b = tl.program_id(2)
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    row_ok = r < rows
    t = seq_k - seq_q + first + r  # query positions
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    last = seq_k - seq_q + first + tl.minimum(tl.program_id(0) * BLOCK_M + BLOCK_M, rows) - 1
    if tl.program_id(1) * BLOCK_N <= last:  # some key of the tile is visible to some query
        k = tl.load(K + (b * seq_k + cols[:, None]) * D + d[None, :], mask=cols[:, None] < visible, other=0.0)
        for j in range(HEADS):
            q_rows = (b * seq_q + first + r) * HEADS + j
            q = tl.load(Q + q_rows[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
            w = tl.load(W + q_rows, mask=row_ok, other=0.0).to(tl.float32)
            acc += w[:, None] * tl.maximum(qk(q, k, USE_DOT), 0.0)
    scores = tl.where(cols[None, :] <= t[:, None], acc, float("-inf"))
    bits = scores.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: larger magnitude, smaller key
    ordered = tl.where(ordered == -1, 0, ordered)  # -0.0 ranks as +0.0
    keys = ordered.to(tl.int64) * 4294967296 + cols[None, :]
    tl.store(KEYS + (b * rows + r[:, None]) * visible + cols[None, :], keys,
             mask=row_ok[:, None] & (cols[None, :] < visible))


def index_topk(q: Tensor, k: Tensor, w: Tensor, start: int, top_k: int) -> Tensor:
    """Shapes and meaning as kernels.lightning_index.index_topk (k holds the keys up to the last
    query: start + seq_q of them)."""
    check_supported(q)
    q, k, w = q.contiguous(), k.contiguous(), w.contiguous()
    b, m, heads, d = q.shape
    n = k.shape[1]
    out = torch.empty(b, m, top_k, dtype=torch.long, device=q.device)
    meta = dict(HEADS=heads, D=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, USE_DOT=tiles_usable(q.dtype, BLOCK_M, BLOCK_N, d))
    step = max(1, _CHUNK // n)
    for c0 in range(0, m, step):
        c1 = min(m, c0 + step)
        visible = start + c1  # keys up to the chunk's last query
        keys = torch.empty(b, c1 - c0, visible, dtype=torch.long, device=q.device)
        grid = (triton.cdiv(c1 - c0, BLOCK_M), triton.cdiv(visible, BLOCK_N), b)
        _ranking_keys[grid](q, k, w, keys, c0, c1 - c0, m, n, visible, **meta)
        _record(grid, start + c0, c1 - c0, heads)
        out[:, c0:c1] = top_keys(keys, start + torch.arange(c0, c1, device=q.device), top_k)
    return out


def _record(grid: tuple[int, int, int], first: int, rows: int, heads: int) -> None:
    """The launch for a chunk of `rows` queries from position `first`: the (query, key) pairs of the
    tiles it scores (those reaching a visible key) against the causal pairs, per indexer head."""
    if not counters.counting():
        return
    tiles = sum(min(grid[1], (first + min(i * BLOCK_M + BLOCK_M, rows) - 1) // BLOCK_N + 1) for i in range(grid[0]))
    needed = rows * first + rows * (rows + 1) // 2
    counters.record(counters.Launch("lightning_index_scores", grid, BLOCK_M, BLOCK_N,
                                    visited=tiles * grid[2] * BLOCK_M * BLOCK_N * heads,
                                    needed=needed * grid[2] * heads))
