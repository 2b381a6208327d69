"""Shared by the Triton kernels: tile products (tensor-core tiles: tl.dot, fp32 accumulation, IEEE
precision for fp32 inputs, where the shapes and the machine allow them, a broadcast multiply-and-sum
where they do not), and the steps of the group-centric attention over chosen keys that gather
attention (DSA's tokens) and selected attention (NSA's and MoBA's blocks) share: a query
program's rows, the online softmax, the backward's recomputed probabilities, and a key tile's
walk over the readers a reverse index lists."""

import torch
import triton
import triton.language as tl

from kernels.dispatch import refuse, triton_interpreting  # noqa: F401 (the kernels' shape checks)
from kernels.triton_interpreter import quicken

if triton_interpreting():
    quicken()


def tiles_usable(dtype: torch.dtype, *sides: int) -> bool:
    """Whether tl.dot can take tiles with these sides: each at least 16, and not bf16 in Triton's
    interpreter (numpy has no bf16 and computes its products wrongly; there the sums serve)."""
    return min(sides) >= 16 and not (triton_interpreting() and dtype == torch.bfloat16)


@triton.jit
def qk(a, b, USE_DOT: tl.constexpr):
    """a [M, D] . b [N, D]^T -> [M, N] in fp32."""
    if USE_DOT:
        return tl.dot(a, tl.trans(b), input_precision="ieee" if a.dtype == tl.float32 else None)
    return tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def pv(p, v, USE_DOT: tl.constexpr):
    """p [M, N] @ v [N, D] -> [M, D] in fp32, p cast to v's dtype for the tile."""
    if USE_DOT:
        return tl.dot(p.to(v.dtype), v, input_precision="ieee" if v.dtype == tl.float32 else None)
    return tl.sum(p.to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)


# Group-centric attention over chosen keys (kernels/gather_attention, kernels/selected_attention):
# a program holds every query head of one GQA group at one query position, as GROUP_PAD rows (the
# group padded for the tiles), and keys and values are [batch_kv, seq_k, DIM]. The helpers below
# are the steps both kernels share; what differs is how a program finds its keys.


def padded_group(group: int, use_dot: bool) -> int:
    """Rows a program gives one query position's heads: a power of two, 16 at least for tensor cores."""
    return max(16 if use_dot else 2, triton.next_power_of_2(group))


def readers_per_tile(group: int, use_dot: bool) -> tuple[int, int]:
    """The dk, dv pass's reader tile: (rows per query position, query positions per tile). A small
    group fills a tensor-core tile of 64 rows with several queries instead of padding with zeros."""
    rows = triton.next_power_of_2(group) if use_dot else padded_group(group, use_dot)
    return rows, max(1, 64 // rows)


def backward_delta(dout: torch.Tensor, out: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """delta [batch_kv, seq_q, group] = rowsum(dO * O) minus the log-sum-exp's own gradient: the
    softmax backward's dS = P * (dP - delta) then covers both outputs."""
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    return delta.contiguous()


@triton.jit
def query_program(GROUP: tl.constexpr, GROUP_PAD: tl.constexpr):
    """A query-centric program on the grid (seq_q, batch_kv): its query position `row` within the
    sequence, its batch_kv row, seq_q, its heads' offsets [GROUP_PAD] into a
    [batch_kv, seq_q, GROUP] tensor (the log-sum-exp, delta) and which of the padded rows are heads."""
    row = tl.program_id(0)
    batch_head = tl.program_id(1)
    seq_q = tl.num_programs(0)
    head = tl.arange(0, GROUP_PAD)
    return row, batch_head, seq_q, (batch_head * seq_q + row) * GROUP + head, head < GROUP


@triton.jit
def with_dim(rows, DIM: tl.constexpr):
    """Offsets [ROWS, DIM] of whole rows, from their offsets [ROWS] in the tensor without its last dim."""
    return rows[:, None] * DIM + tl.arange(0, DIM)[None, :]


@triton.jit
def load_keys(K, V, batch_head, key_pos, mask, seq_k, DIM: tl.constexpr):
    """Keys and values [KEYS, DIM] at positions key_pos [KEYS] (zeros where not mask), and their offsets."""
    offsets = with_dim(batch_head * seq_k + key_pos, DIM)
    k = tl.load(K + offsets, mask=mask[:, None], other=0.0)
    v = tl.load(V + offsets, mask=mask[:, None], other=0.0)
    return k, v, offsets


@triton.jit
def softmax_start(GROUP_PAD: tl.constexpr, DIM: tl.constexpr):
    """The online softmax before any key: running max -inf, running sum 0 [GROUP_PAD], output 0 [GROUP_PAD, DIM]."""
    return (tl.full([GROUP_PAD], float("-inf"), tl.float32), tl.zeros([GROUP_PAD], tl.float32),
            tl.zeros([GROUP_PAD, DIM], tl.float32))


@triton.jit
def softmax_step(q, k, v, visible, scale, weight, row_max, row_sum, acc, WEIGHTED: tl.constexpr,
                 USE_DOT: tl.constexpr):
    """One tile of keys k, v [KEYS, DIM] in the online softmax of q [ROWS, DIM] (visible [KEYS]:
    the others masked): the new running max and sum [ROWS] and output [ROWS, DIM]. With WEIGHTED
    the tile's share of the output, not of the normaliser, is multiplied by weight."""
    scores = tl.where(visible[None, :], qk(q, k, USE_DOT) * scale, float("-inf"))  # [ROWS, KEYS]
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # no key yet: keep everything at 0
    p = tl.exp(scores - safe_max[:, None])
    rescale = tl.exp(row_max - safe_max)
    row_sum = row_sum * rescale + tl.sum(p, axis=1)
    if WEIGHTED:
        p = p * weight
    return new_max, row_sum, acc * rescale[:, None] + pv(p, v, USE_DOT)


@triton.jit
def store_softmax(OUT, LSE, rows, head_ok, acc, row_max, row_sum, DIM: tl.constexpr):
    """Normalise the output [ROWS, DIM] and store it with its log-sum-exp [ROWS] at the heads' rows
    [ROWS]; a row with no visible key gets zeros and -inf (never NaN)."""
    has_keys = row_sum > 0
    out = acc / tl.where(has_keys, row_sum, 1.0)[:, None]  # fp32 until the store
    lse = tl.where(has_keys, row_max + tl.log(tl.where(has_keys, row_sum, 1.0)), float("-inf"))
    tl.store(OUT + with_dim(rows, DIM), out.to(OUT.dtype.element_ty), mask=head_ok[:, None])
    tl.store(LSE + rows, lse, mask=head_ok)


@triton.jit
def load_backward_rows(Q, DOUT, LSE, DELTA, rows, row_ok, DIM: tl.constexpr):
    """What the backward needs of the query rows at `rows` [ROWS] (into [.., GROUP]): q and dout
    [ROWS, DIM], the log-sum-exp (0 for an empty row, whose probabilities then come out 0, not NaN)
    and delta [ROWS]."""
    offsets = with_dim(rows, DIM)
    q = tl.load(Q + offsets, mask=row_ok[:, None], other=0.0)
    do = tl.load(DOUT + offsets, mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + rows, mask=row_ok, other=float("-inf"))
    delta = tl.load(DELTA + rows, mask=row_ok, other=0.0)
    return q, do, tl.where(lse == float("-inf"), 0.0, lse), delta


@triton.jit
def probabilities(q, do, lse, k, v, visible, scale, USE_DOT: tl.constexpr):
    """The probabilities [ROWS, KEYS] recomputed from the log-sum-exp (0 where not visible), and dP = dO . V^T."""
    p = tl.where(visible, tl.exp(qk(q, k, USE_DOT) * scale - lse[:, None]), 0.0)
    return p, qk(do, v, USE_DOT)


@triton.jit
def key_tile_start(K, V, batch_head, tile, seq_k, KEYS: tl.constexpr, KEYS_PAD: tl.constexpr, DIM: tl.constexpr):
    """A dk, dv program's keys tile * KEYS + arange(KEYS_PAD) (lanes from KEYS on are padding):
    their positions and which are in the sequence [KEYS_PAD], keys and values [KEYS_PAD, DIM] and
    their offsets, and dk, dv [KEYS_PAD, DIM] at 0."""
    lane = tl.arange(0, KEYS_PAD)
    key_pos = tile * KEYS + lane
    in_seq = (key_pos < seq_k) & (lane < KEYS)
    k, v, offsets = load_keys(K, V, batch_head, key_pos, in_seq, seq_k, DIM)
    return key_pos, in_seq, k, v, offsets, tl.zeros([KEYS_PAD, DIM], tl.float32), tl.zeros([KEYS_PAD, DIM], tl.float32)


@triton.jit
def load_readers(Q, DOUT, LSE, DELTA, READER_ROW, first, end, batch_head, seq_q, GROUP: tl.constexpr,
                 DIM: tl.constexpr, GROUP_PAD: tl.constexpr, READERS: tl.constexpr):
    """Entries first + arange(READERS) of a reverse index (those from `end` on are padding): the
    entries and which are real [READERS], their query positions READER_ROW[entry] [READERS], which
    of their READERS x GROUP_PAD rows are heads [READERS, GROUP_PAD], and q, dout
    [READERS * GROUP_PAD, DIM], lse, delta [READERS * GROUP_PAD] of those rows (load_backward_rows)."""
    entry = first + tl.arange(0, READERS)
    entry_ok = entry < end
    row = tl.load(READER_ROW + entry, mask=entry_ok, other=0)
    head = tl.arange(0, GROUP_PAD)
    rows = tl.reshape((batch_head * seq_q + row[:, None]) * GROUP + head[None, :], (READERS * GROUP_PAD,))
    head_ok = entry_ok[:, None] & (head[None, :] < GROUP)
    q, do, lse, delta = load_backward_rows(Q, DOUT, LSE, DELTA, rows, tl.reshape(head_ok, (READERS * GROUP_PAD,)), DIM)
    return entry, entry_ok, row, head_ok, q, do, lse, delta


@triton.jit
def visible_to_readers(head_ok, row, chosen, key_pos, in_seq, start, ROWS: tl.constexpr, KEYS: tl.constexpr):
    """[ROWS, KEYS] (ROWS = READERS x GROUP_PAD): the keys each reader row may see: a head
    (head_ok [READERS, GROUP_PAD]) of a query at position start + row [READERS] at or after the key,
    which it chose (chosen [READERS, KEYS]), in the sequence (in_seq [KEYS])."""
    visible = (head_ok[:, :, None] & chosen[:, None, :] & in_seq[None, None, :]
               & (key_pos[None, None, :] <= start + row[:, None, None]))
    return tl.reshape(visible, (ROWS, KEYS))


@triton.jit
def key_grads_step(q, do, lse, delta, k, v, visible, weight, dk, dv, scale, WEIGHTED: tl.constexpr,
                   USE_DOT: tl.constexpr):
    """dk, dv [KEYS, DIM] plus what the rows [ROWS] of q, do add to them (weight [ROWS]: each row's
    factor on its share of the output, where WEIGHTED)."""
    p, dp = probabilities(q, do, lse, k, v, visible, scale, USE_DOT)
    if WEIGHTED:
        dv += pv(tl.trans(p * weight[:, None]), do, USE_DOT)
        dp = dp * weight[:, None]
    else:
        dv += pv(tl.trans(p), do, USE_DOT)
    dk += pv(tl.trans(p * (dp - delta[:, None])), q, USE_DOT)
    return dk, dv


@triton.jit
def store_key_grads(DK, DV, offsets, in_seq, dk, dv, scale):
    """Store a tile's dk (the softmax scale applied here, once) and dv."""
    tl.store(DK + offsets, (dk * scale).to(DK.dtype.element_ty), mask=in_seq[:, None])
    tl.store(DV + offsets, dv.to(DV.dtype.element_ty), mask=in_seq[:, None])
