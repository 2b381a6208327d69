"""NSA's three branches as Triton kernels sized for Hopper: tiles of BM = 64 query rows, a GQA
group's heads folded into the rows (row r of a tile is position r // group, head r % group), so a
key tile loaded once serves every head that reads it.

Layouts, read where the projections write them (any strides, dim_head contiguous):
    q        [batch, seq_q, heads, dim_head]        queries from position `start` (head = kv_head * group + g)
    k, v     [batch, seq_k, kv_heads, dim_head]     a branch's keys and values from position 0
    kc, vc   [batch, kv_heads, blocks, dim_head]    compressed keys and values (contiguous)
    gate     [batch, seq_q, heads]                  a branch's gate logits (the sigmoid is taken inside)
    phases   [seq_k, dim_head / 2, 2]               (cos, sin) of each rotary pair's angle, fp32
Written:
    out      [batch, seq_q, heads, dim_head]        the gated branches' sum, each kernel adding its own
    saved    [batch, seq_q, heads, dim_head]        a branch's output before its gate, kept for the backward
    lse      [batch, kv_heads, seq_q, group]        fp32 (a tile's rows lie contiguous)
    blocks   [batch, kv_heads, seq_q, free]         int32 freely chosen fine blocks, `num_fine` if unused

One forward kernel serves the three masks (a constexpr MASK): COMPRESSED (compressed block c is
visible to position t once complete, c * stride + block - 1 <= t), FORCED (the selected branch's
own, initial and previous fine blocks, causal inside the own block) and WINDOW (the last `window`
keys). Each program walks only the key tiles its positions can see, with an online softmax in
exp2. COMPRESSED then walks the compressed keys a second time, a tile of fine blocks at a time, for
block selection: each position's probabilities (recomputed from the log-sum-exp just found),
summed over its group's heads and spread onto fine blocks by token overlap, merge into a running
top-k held in registers (ties to the earlier block), so no [seq, blocks] tensor reaches memory.
FORCED then adds each position's freely chosen blocks in the paper's order: one position's group
against one gathered block at a time, merged with the tile's forced blocks through their
log-sum-exps (the tile's state goes through memory once, behind a barrier).

Backward, from the saved log-sum-exps (no second forward): a dq kernel per branch (over the same
key tiles; it also writes the gate's gradient and the branch's rowsum(dO * O), which its dk/dv
kernel reads: from the output the forward kept or, with RECOMPUTE, summed as P * dP in a first
pass over the keys, where keeping three outputs would outweigh the kernels' inputs), and a dk/dv
kernel per branch with one program per key tile over the query rows that can see it, adding
nothing atomically: the compressed keys' readers are split into chunks of queries (every later
position reads a compressed key), as are the readers of the initial fine block, and the chunks'
partial sums are added in a fixed order. The freely chosen blocks' dk/dv walk the (query, slot)
pairs that chose each block through a reverse index, a tile of 64 rows at a time (Flash Sparse
Attention's order).

Rotary positions (selected and window branches) and the gates are applied inside the kernels, so
no rotated or gated copy is ever written. Softmax scale, tile shapes and masks are constexpr: no
Python float reaches a kernel as a runtime scalar. Runs on CUDA tensors, or on CPU tensors under
TRITON_INTERPRET=1 (slow: the tests use tiny shapes).
"""

import triton
import triton.language as tl

from kernels.triton_tiles import pv, qk

COMPRESSED, FORCED, WINDOW = 0, 1, 2
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


# ---- shared pieces --------------------------------------------------------------------------------


@triton.jit
def _rows(pid_m, seq_q, G: tl.constexpr, BM: tl.constexpr):
    """A tile's rows: query index i (position start + i), head g of the group, and whether real."""
    r = tl.arange(0, BM)
    i = pid_m * (BM // G) + r // G
    return i, r % G, i < seq_q


@triton.jit
def complete(t, L: tl.constexpr, S: tl.constexpr, num_blocks):
    """How many compressed blocks (L tokens every S) are complete at position(s) t."""
    return tl.minimum(tl.where(t + 1 >= L, (t + 1 - L) // S + 1, 0), num_blocks)


@triton.jit
def _visible(t, cols, num_keys, MASK: tl.constexpr, L: tl.constexpr, S: tl.constexpr, FINE: tl.constexpr,
             FORCED_BLOCKS: tl.constexpr, W: tl.constexpr):
    """[rows, keys]: whether key cols [keys] is visible to positions t [rows]."""
    if MASK == 0:
        return cols[None, :] < complete(t, L, S, num_keys)[:, None]
    causal = (cols[None, :] <= t[:, None]) & (cols[None, :] < num_keys)
    if MASK == 2:
        return causal & (cols[None, :] > t[:, None] - W)
    own = (t // FINE)[:, None]
    key_block = (cols // FINE)[None, :]
    forced = key_block == own
    if FORCED_BLOCKS >= 2:
        forced = forced | (key_block == 0)
    if FORCED_BLOCKS >= 3:
        forced = forced | (key_block == own - 1)
    return forced & causal


@triton.jit
def _rotate(x, PH, pos, ok, R: tl.constexpr, D: tl.constexpr, INVERSE: tl.constexpr):
    """x [R, D] fp32 with each channel pair (2j, 2j + 1) turned by the angle of its row's position
    pos [R] (INVERSE: turned back, which is also how a gradient goes back through the turn)."""
    j = tl.arange(0, D // 2)
    at = PH + pos[:, None] * D + 2 * j[None, :]
    cos = tl.load(at, mask=ok[:, None], other=1.0)
    sin = tl.load(at + 1, mask=ok[:, None], other=0.0)
    if INVERSE:
        sin = -sin
    even, odd = tl.split(tl.reshape(x, [R, D // 2, 2]))
    return tl.reshape(tl.join(even * cos - odd * sin, odd * cos + even * sin), [R, D])


@triton.jit
def _keys(K, V, base, skt, cols, ok, PH, d, R: tl.constexpr, D: tl.constexpr, ROTARY: tl.constexpr):
    """Keys (rotated to their positions when ROTARY) and values [R, D] at key positions cols [R]."""
    at = base + cols[:, None] * skt + d[None, :]
    k = tl.load(K + at, mask=ok[:, None], other=0.0)
    v = tl.load(V + at, mask=ok[:, None], other=0.0)
    if ROTARY:
        k = _rotate(k.to(tl.float32), PH, cols, ok, R, D, False).to(v.dtype)
    return k, v


@triton.jit
def _sigmoid(GATE, at, ok):
    """The gate sigmoid(logit) in fp32 (0 where the logit is -inf: a closed branch)."""
    return 1.0 / (1.0 + tl.exp(-tl.load(GATE + at, mask=ok, other=0.0).to(tl.float32)))


@triton.jit
def _step(m, l, acc, s, v, USE_DOT: tl.constexpr):
    """One online-softmax step over scores s [R, N] (log2 units, -inf where masked) and values v [N, D]."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: everything stays 0
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv(p, v, USE_DOT)


@triton.jit
def _finish(m, l, acc):
    """(out [R, D] fp32, lse [R] natural log, -inf and zeros where no key was visible)."""
    has = l > 0
    safe = tl.where(has, l, 1.0)
    return acc / safe[:, None], tl.where(has, (m + tl.log2(safe)) * LN2, float("-inf"))


@triton.jit
def _gated_store(OUT, at, o, sigma, ok, ACCUMULATE: tl.constexpr):
    o = o * sigma[:, None]
    if ACCUMULATE:
        o += tl.load(OUT + at, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + at, o.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _key_runs(t_first, t_last, num_keys, MASK: tl.constexpr, L: tl.constexpr, S: tl.constexpr,
              FINE: tl.constexpr, FORCED_BLOCKS: tl.constexpr, W: tl.constexpr):
    """Two runs of keys, [lo0, hi0) and [lo1, hi1), holding every key that positions t_first..t_last
    can see: the forced blocks' initial block and the rest; one run (the second) for the other masks."""
    if MASK == 0:
        return 0, 0, 0, complete(t_last, L, S, num_keys)
    hi = tl.minimum(t_last + 1, num_keys)
    if MASK == 2:
        return 0, 0, tl.maximum(t_first - W + 1, 0), hi
    first = t_first // FINE
    if FORCED_BLOCKS >= 3:
        first = tl.maximum(first - 1, 0)
    lo = first * FINE
    hi0 = 0
    if FORCED_BLOCKS >= 2:
        hi0 = tl.minimum(FINE, lo)  # the initial block, where the second run does not hold it
    return 0, hi0, lo, hi


# ---- forward ----------------------------------------------------------------------------------------


@triton.jit
def _forward_run(q, t, m, l, acc, K, V, kbase, skt, PH, lo, hi, num_keys, COUNTER, MASK: tl.constexpr,
                 L: tl.constexpr, S: tl.constexpr, FINE: tl.constexpr, FORCED_BLOCKS: tl.constexpr,
                 W: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, STEP: tl.constexpr, D: tl.constexpr,
                 SCALE: tl.constexpr, ROTARY: tl.constexpr, USE_DOT: tl.constexpr, COUNT: tl.constexpr):
    """The online softmax of the tile's rows over keys [lo, hi), STEP keys a tile (BN >= STEP wide)."""
    d = tl.arange(0, D)
    n = tl.arange(0, BN)
    for c0 in range(lo, hi, STEP):
        cols = c0 + n
        ok = (n < STEP) & (cols < hi)
        k, v = _keys(K, V, kbase, skt, cols, ok, PH, d, BN, D, ROTARY)
        visible = _visible(t, cols, num_keys, MASK, L, S, FINE, FORCED_BLOCKS, W) & ok[None, :]
        s = tl.where(visible, qk(q, k, USE_DOT) * (SCALE * LOG2E), float("-inf"))
        m, l, acc = _step(m, l, acc, s, v, USE_DOT)
        if COUNT:
            tl.atomic_add(COUNTER, BM * BN)
    return m, l, acc


@triton.jit
def _select(q, t, lse, pid_m, pid_bh, start, seq_q, num_blocks, num_fine, KC, kbase, skt, BLOCKS, COUNTER,
            G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, L: tl.constexpr, S: tl.constexpr,
            FINE: tl.constexpr, FORCED_BLOCKS: tl.constexpr, FREE: tl.constexpr, FREE_PAD: tl.constexpr,
            FINE_STEP_PAD: tl.constexpr, FINE_STEP: tl.constexpr, COMPRESSED_STEP: tl.constexpr, EXACT: tl.constexpr, SCALE: tl.constexpr,
            USE_DOT: tl.constexpr, DOT_IMPORTANCE: tl.constexpr, COUNT: tl.constexpr):
    """Each of the tile's positions' FREE most important fine blocks besides the forced ones, into
    BLOCKS. FINE_STEP fine blocks a step. EXACT (whole strides in a fine block, blocks no longer than a fine
    block): the COMPRESSED_STEP = FINE_STEP * FINE / S compressed blocks that start in the step, each read once, their
    share of the next step's first fine block carried over; else the COMPRESSED_STEP that overlap the step."""
    P: tl.constexpr = BM // G
    d = tl.arange(0, D)
    pos_i = pid_m * P + tl.arange(0, P)
    pos = start + pos_i
    own = pos // FINE
    seen = complete(t, L, S, num_blocks)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse) * LOG2E
    slot = tl.arange(0, FREE_PAD)[None, :]
    col = tl.arange(0, FINE_STEP_PAD)[None, :]
    c = tl.arange(0, COMPRESSED_STEP)
    top_s = tl.full([P, FREE_PAD], float("-inf"), tl.float32)
    top_i = tl.zeros([P, FREE_PAD], tl.int32)
    carry = tl.zeros([P], tl.float32)  # EXACT: the last step's blocks' share of this step's first fine block
    t_last = start + tl.minimum(pid_m * P + P, seq_q) - 1
    for f0 in range(0, t_last // FINE + 1, FINE_STEP):
        if EXACT:
            cols = f0 * (FINE // S) + c
        else:
            reach = f0 * FINE - L  # the first compressed block that ends after the step's first token
            cols = tl.where(reach >= 0, reach // S + 1, 0) + c
        k = tl.load(KC + kbase + cols[:, None] * skt + d[None, :], mask=cols[:, None] < num_blocks, other=0.0)
        s = qk(q, k, USE_DOT) * (SCALE * LOG2E)
        p = tl.where(cols[None, :] < seen[:, None], tl.exp2(s - lse2[:, None]), 0.0)  # [BM, COMPRESSED_STEP]
        per_position = tl.sum(tl.reshape(p, [P, G, COMPRESSED_STEP]), axis=1)  # the group's sum [P, COMPRESSED_STEP]
        fine = f0 + col
        lo = tl.maximum(cols[:, None] * S, fine * FINE)
        hi = tl.minimum(cols[:, None] * S + L, fine * FINE + FINE)
        # token overlap [COMPRESSED_STEP, FINE_STEP_PAD] as a share of the block
        overlap = tl.maximum(hi - lo, 0).to(tl.float32) / L
        importance = pv(per_position, overlap, DOT_IMPORTANCE)  # [P, FINE_STEP_PAD]
        if EXACT:
            spill = tl.sum(tl.where(col == FINE_STEP, importance, 0.0), 1)
            importance = importance + tl.where(col == 0, carry[:, None], 0.0)
            carry = spill
        taken = (fine * FINE > pos[:, None]) | (fine == own[:, None]) | (col >= FINE_STEP)
        if FORCED_BLOCKS >= 2:
            taken = taken | (fine == 0)
        if FORCED_BLOCKS >= 3:
            taken = taken | (fine == own[:, None] - 1)
        importance = tl.where(taken, float("-inf"), importance)
        # merge into the running top-k: its FREE largest, ties to the earlier block (the running
        # top-k holds only earlier blocks, and argmax takes the leftmost maximum)
        merged_s = tl.full([P, FREE_PAD], float("-inf"), tl.float32)
        merged_i = tl.zeros([P, FREE_PAD], tl.int32)
        for k_ in tl.static_range(FREE):
            best_top, best_new = tl.max(top_s, 1), tl.max(importance, 1)
            at_top, at_new = tl.argmax(top_s, 1), tl.argmax(importance, 1)
            from_top = best_top >= best_new
            index = tl.where(from_top, tl.sum(tl.where(slot == at_top[:, None], top_i, 0), 1), f0 + at_new)
            merged_s = tl.where(slot == k_, tl.where(from_top, best_top, best_new)[:, None], merged_s)
            merged_i = tl.where(slot == k_, index[:, None], merged_i)
            top_s = tl.where((slot == at_top[:, None]) & from_top[:, None], float("-inf"), top_s)
            importance = tl.where((col == at_new[:, None]) & ~from_top[:, None], float("-inf"), importance)
        top_s, top_i = merged_s, merged_i
        if COUNT:
            tl.atomic_add(COUNTER, BM * COMPRESSED_STEP)
    at = (pid_bh * seq_q + pos_i[:, None]) * FREE + slot
    tl.store(BLOCKS + at, tl.where(top_s == float("-inf"), num_fine, top_i), mask=(pos_i[:, None] < seq_q) & (slot < FREE))


@triton.jit
def _free_blocks(Q, K, V, GATE, OUT, SAVED, LSE, PH, BLOCKS, COUNTER, b, h, pid_m, pid_bh, sqb, sqt, sqh, skt,
                 kbase, sgb, sgt, sgh, sob, sot, soh, start, seq_q, num_keys,
                 G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_PAD: tl.constexpr,
                 FINE: tl.constexpr, FREE: tl.constexpr, SCALE: tl.constexpr, USE_DOT: tl.constexpr,
                 ACCUMULATE: tl.constexpr, COUNT: tl.constexpr):
    """The paper's order: each position of the tile, its group's heads together, over its freely
    chosen blocks, continuing the online softmax the tile left in SAVED and LSE for its rows; then
    its gated output."""
    P: tl.constexpr = BM // G
    d = tl.arange(0, D)
    g = tl.arange(0, GROUP_PAD)
    g_ok = g < G
    j = tl.arange(0, BLOCK_PAD)
    for p in range(0, P):
        i = pid_m * P + p
        if i < seq_q:
            t = start + i
            ok = g_ok[:, None]
            at = b * sob + i * sot + (h * G + g)[:, None] * soh + d[None, :]
            pos = t + g * 0
            q = tl.load(Q + b * sqb + i * sqt + (h * G + g)[:, None] * sqh + d[None, :], mask=ok, other=0.0)
            q = _rotate(q.to(tl.float32), PH, pos, g_ok, GROUP_PAD, D, False).to(K.dtype.element_ty)
            lse_at = (pid_bh * seq_q + i) * G + g
            lse = tl.load(LSE + lse_at, mask=g_ok, other=float("-inf"))
            has = lse > float("-inf")
            m = tl.where(has, lse * LOG2E, float("-inf"))
            l = tl.where(has, 1.0, 0.0)
            acc = tl.load(SAVED + at, mask=ok, other=0.0).to(tl.float32) * l[:, None]
            for s_ in range(FREE):
                block = tl.load(BLOCKS + (pid_bh * seq_q + i) * FREE + s_)
                cols = block * FINE + j
                key_ok = (j < FINE) & (cols <= t) & (cols < num_keys)  # all False for an unused slot
                if block * FINE <= t:
                    k, v = _keys(K, V, kbase, skt, cols, key_ok, PH, d, BLOCK_PAD, D, True)
                    s = tl.where(key_ok[None, :], qk(q, k, USE_DOT) * (SCALE * LOG2E), float("-inf"))
                    m, l, acc = _step(m, l, acc, s, v, USE_DOT)
                    if COUNT:
                        tl.atomic_add(COUNTER, GROUP_PAD * BLOCK_PAD)
            o, lse = _finish(m, l, acc)
            tl.store(SAVED + at, o.to(SAVED.dtype.element_ty), mask=ok)
            tl.store(LSE + lse_at, lse, mask=g_ok)
            sigma = _sigmoid(GATE, b * sgb + i * sgt + (h * G + g) * sgh, g_ok)
            _gated_store(OUT, at, o, sigma, ok, ACCUMULATE)


@triton.jit
def _merge_chosen(m, l, acc, i, g, row_ok, pid_bh, seq_q, num_fine, BLOCKS, STATS, G: tl.constexpr,
                  FREE: tl.constexpr, FREE_P: tl.constexpr):
    """Flash Sparse Attention's order, the tile's part: its forced blocks' softmax state (m, l, acc;
    log2 units) and the log-sum-exps its rows had over each chosen block (STATS, from the pairs
    kernel) -> the rows' log-sum-exp over all their blocks (log2 units) and the forced blocks'
    share of the output, so that the chosen blocks' shares can be added to it."""
    slot = tl.arange(0, FREE_P)[None, :]
    pair = (pid_bh * seq_q + i)[:, None] * FREE + slot
    used = row_ok[:, None] & (slot < FREE)
    used = used & (tl.load(BLOCKS + pair, mask=used, other=num_fine) < num_fine)
    chosen = tl.load(STATS + pair * G + g[:, None], mask=used, other=float("-inf"))  # [BM, FREE_P]
    top = tl.maximum(m, tl.max(chosen, 1))  # the own block is always there: m is finite
    total = l * tl.exp2(m - top) + tl.sum(tl.exp2(chosen - top[:, None]), 1)
    return top + tl.log2(total), acc * (tl.exp2(m - top) / total)[:, None]


@triton.jit
def forward_kernel(Q, K, V, GATE, OUT, SAVED, LSE, PH, BLOCKS, STATS, ACC, GATE_S, SAVED_S, COUNTER,
                   sqb, sqt, sqh, skb, skt, skh, sgb, sgt, sgh, sob, sot, soh, start, seq_q, num_keys, num_fine,
                   KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   MASK: tl.constexpr, L: tl.constexpr, S: tl.constexpr, FINE: tl.constexpr,
                   FORCED_BLOCKS: tl.constexpr, FREE: tl.constexpr, W: tl.constexpr, SCALE: tl.constexpr,
                   ROTARY: tl.constexpr, ACCUMULATE: tl.constexpr, SAVE: tl.constexpr, USE_DOT: tl.constexpr,
                   COUNT: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_PAD: tl.constexpr, FREE_PAD: tl.constexpr,
                   FINE_STEP_PAD: tl.constexpr, FINE_STEP: tl.constexpr, COMPRESSED_STEP: tl.constexpr, EXACT: tl.constexpr,
                   DOT_IMPORTANCE: tl.constexpr, FSA: tl.constexpr,
                   FREE_P: tl.constexpr):
    """One branch's attention for a tile of BM rows, gated into OUT (K and V share their strides;
    OUT, SAVED, ACC, SAVED_S share (sob, sot, soh)). With FSA (a group under 16): the selected
    branch leaves its forced blocks' share in ACC (fp32) for the pairs kernel to add the chosen
    blocks' to, and the window kernel finishes it (its gate GATE_S, its output SAVED_S)."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // KVH, pid_bh % KVH
    i, g, row_ok = _rows(pid_m, seq_q, G, BM)
    t = start + i
    d = tl.arange(0, D)
    ok = row_ok[:, None]
    q = tl.load(Q + b * sqb + i[:, None] * sqt + (h * G + g)[:, None] * sqh + d[None, :], mask=ok, other=0.0)
    if ROTARY:
        q = _rotate(q.to(tl.float32), PH, t, row_ok, BM, D, False).to(K.dtype.element_ty)
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    t_first = start + pid_m * (BM // G)
    t_last = start + tl.minimum(pid_m * (BM // G) + BM // G, seq_q) - 1
    lo0, hi0, lo1, hi1 = _key_runs(t_first, t_last, num_keys, MASK, L, S, FINE, FORCED_BLOCKS, W)
    kbase = b * skb + h * skh
    step: tl.constexpr = FINE if MASK == 1 else BN
    m, l, acc = _forward_run(q, t, m, l, acc, K, V, kbase, skt, PH, lo0, hi0, num_keys, COUNTER, MASK, L,
                             S, FINE, FORCED_BLOCKS, W, BM, BN, step, D, SCALE, ROTARY, USE_DOT, COUNT)
    m, l, acc = _forward_run(q, t, m, l, acc, K, V, kbase, skt, PH, lo1, hi1, num_keys, COUNTER, MASK, L,
                             S, FINE, FORCED_BLOCKS, W, BM, BN, step, D, SCALE, ROTARY, USE_DOT, COUNT)
    at = b * sob + i[:, None] * sot + (h * G + g)[:, None] * soh + d[None, :]
    lse_at = (pid_bh * seq_q + pid_m * (BM // G)) * G + tl.arange(0, BM)
    gate_at = b * sgb + i * sgt + (h * G + g) * sgh
    if MASK == 1 and FREE > 0 and FSA:
        lse2, share = _merge_chosen(m, l, acc, i, g, row_ok, pid_bh, seq_q, num_fine, BLOCKS, STATS, G, FREE, FREE_P)
        tl.store(ACC + at, share, mask=ok)
        tl.store(LSE + lse_at, lse2 * LN2, mask=row_ok)
    elif MASK == 1 and FREE > 0:  # the paper's order: the tile's state to memory, then position by position
        o, lse = _finish(m, l, acc)
        tl.store(SAVED + at, o.to(SAVED.dtype.element_ty), mask=ok)
        tl.store(LSE + lse_at, lse, mask=row_ok)
        tl.debug_barrier()
        _free_blocks(Q, K, V, GATE, OUT, SAVED, LSE, PH, BLOCKS, COUNTER, b, h, pid_m, pid_bh, sqb, sqt, sqh, skt,
                     kbase, sgb, sgt, sgh, sob, sot, soh, start, seq_q, num_keys, G, D, BM, GROUP_PAD, BLOCK_PAD, FINE, FREE,
                     SCALE, USE_DOT, ACCUMULATE, COUNT)
    else:
        o, lse = _finish(m, l, acc)
        if SAVE:
            tl.store(SAVED + at, o.to(SAVED.dtype.element_ty), mask=ok)
        tl.store(LSE + lse_at, lse, mask=row_ok)
        o = o * _sigmoid(GATE, gate_at, row_ok)[:, None]
        if MASK == 2 and FSA:  # the selected branch, complete in ACC
            o_s = tl.load(ACC + at, mask=ok, other=0.0)
            if SAVE:
                tl.store(SAVED_S + at, o_s.to(SAVED_S.dtype.element_ty), mask=ok)
            o += o_s * _sigmoid(GATE_S, gate_at, row_ok)[:, None]
        _gated_store(OUT, at, o, tl.full([BM], 1.0, tl.float32), ok, ACCUMULATE)
    if MASK == 0 and FREE > 0:
        _select(q, t, lse, pid_m, pid_bh, start, seq_q, num_keys, num_fine, K, kbase, skt, BLOCKS, COUNTER, G, D, BM,
                L, S, FINE, FORCED_BLOCKS, FREE, FREE_PAD, FINE_STEP_PAD, FINE_STEP, COMPRESSED_STEP, EXACT, SCALE, USE_DOT,
                DOT_IMPORTANCE, COUNT)


@triton.jit
def _pairs_of(SORTED, pid_bh, seq_q, block, FREE: tl.constexpr):
    """[first, end): the positions of `block` in the row's sorted chosen blocks (SORTED [b * kv_heads,
    seq_q * FREE], unused slots last), found by binary search: where ORDER holds its pairs."""
    base = pid_bh * seq_q * FREE
    length = seq_q * FREE
    first = length * 0
    end = length * 0
    for target in tl.static_range(2):
        lo = length * 0
        hi = length + 0
        while lo < hi:
            mid = (lo + hi) // 2
            below = tl.load(SORTED + base + mid) < block + target
            lo = tl.where(below, mid + 1, lo)
            hi = tl.where(below, hi, mid)
        if target == 0:
            first = lo
        else:
            end = lo
    return first, end


@triton.jit
def _pair_rows(ORDER, pair, ok, pid_bh, seq_q, FREE: tl.constexpr):
    """The (query, slot) of pairs [rows] from the reverse index."""
    flat = tl.load(ORDER + pid_bh * seq_q * FREE + pair, mask=ok, other=0)
    return (flat // FREE).to(tl.int32), (flat % FREE).to(tl.int32)


@triton.jit
def pairs_kernel(Q, K, V, LSE, STATS, ACC, PH, SORTED, ORDER, COUNTER, sqb, sqt, sqh, skb, skt, skh, sob, sot, soh,
                 start, seq_q, num_keys, num_fine, KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                 BM: tl.constexpr, BLOCK_PAD: tl.constexpr, FINE: tl.constexpr, FREE: tl.constexpr, SCALE: tl.constexpr,
                 USE_DOT: tl.constexpr, COUNT: tl.constexpr, PASS: tl.constexpr):
    """Flash Sparse Attention's order for a group under 16: one program per fine block gathers the
    (query, slot) pairs that chose it, BM // G pairs x G heads a tile, against the block loaded
    once. PASS 0 writes each pair's log-sum-exp over the block (STATS, log2 units); PASS 1, once
    LSE holds every row's log-sum-exp over all its blocks, adds the block's share of each row's
    output to ACC (fp32, atomically: a row's chosen blocks are different programs)."""
    pid_n, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // KVH, pid_bh % KVH
    r = tl.arange(0, BM)
    g = r % G
    d = tl.arange(0, D)
    j = tl.arange(0, BLOCK_PAD)
    cols = pid_n * FINE + j
    col_ok = (j < FINE) & (cols < num_keys)
    k, v = _keys(K, V, b * skb + h * skh, skt, cols, col_ok, PH, d, BLOCK_PAD, D, True)
    first, end = _pairs_of(SORTED, pid_bh, seq_q, pid_n, FREE)
    for p0 in range(first, end, BM // G):
        pair = p0 + r // G
        ok = pair < end
        i, slot = _pair_rows(ORDER, pair, ok, pid_bh, seq_q, FREE)
        t = start + i
        q = tl.load(Q + b * sqb + i[:, None] * sqt + (h * G + g)[:, None] * sqh + d[None, :], mask=ok[:, None],
                    other=0.0)
        q = _rotate(q.to(tl.float32), PH, t, ok, BM, D, False).to(K.dtype.element_ty)
        visible = ok[:, None] & col_ok[None, :] & (cols[None, :] <= t[:, None])
        s = tl.where(visible, qk(q, k, USE_DOT) * (SCALE * LOG2E), float("-inf"))
        if PASS == 0:
            top = tl.max(s, 1)
            top = tl.where(top == float("-inf"), 0.0, top)
            total = tl.sum(tl.exp2(s - top[:, None]), 1)
            lse2 = tl.where(total > 0, top + tl.log2(tl.where(total > 0, total, 1.0)), float("-inf"))
            tl.store(STATS + ((pid_bh * seq_q + i) * FREE + slot) * G + g, lse2, mask=ok)
        else:
            lse2 = tl.load(LSE + (pid_bh * seq_q + i) * G + g, mask=ok, other=0.0) * LOG2E
            p = tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)
            at = b * sob + i[:, None] * sot + (h * G + g)[:, None] * soh + d[None, :]
            tl.atomic_add(ACC + at, pv(p, v, USE_DOT), mask=ok[:, None])
        if COUNT:
            tl.atomic_add(COUNTER, BM * BLOCK_PAD)


# ---- backward ---------------------------------------------------------------------------------------


@triton.jit
def _dq_run(q, do, t, row_ok, lse2, delta, acc, K, V, kbase, skt, PH, lo, hi, num_keys, COUNTER, MASK: tl.constexpr,
            L: tl.constexpr, S: tl.constexpr, FINE: tl.constexpr, FORCED_BLOCKS: tl.constexpr, W: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, STEP: tl.constexpr, D: tl.constexpr, SCALE: tl.constexpr,
            ROTARY: tl.constexpr, USE_DOT: tl.constexpr, COUNT: tl.constexpr, ROWSUM: tl.constexpr):
    """acc += dq [rows, D] (unscaled, in the rotated frame) from keys [lo, hi): dS = P * (dP - delta);
    ROWSUM: acc [rows] += rowsum(dO * O) = the sum over the keys of P * dP, without O."""
    d = tl.arange(0, D)
    n = tl.arange(0, BN)
    for c0 in range(lo, hi, STEP):
        cols = c0 + n
        ok = (n < STEP) & (cols < hi)
        k, v = _keys(K, V, kbase, skt, cols, ok, PH, d, BN, D, ROTARY)
        visible = _visible(t, cols, num_keys, MASK, L, S, FINE, FORCED_BLOCKS, W) & ok[None, :] & row_ok[:, None]
        p = tl.where(visible, tl.exp2(qk(q, k, USE_DOT) * (SCALE * LOG2E) - lse2[:, None]), 0.0)
        dp = qk(do, v, USE_DOT)
        if ROWSUM:
            acc += tl.sum(p * dp, 1)
        else:
            acc += pv(p * (dp - delta[:, None]), k, USE_DOT)
        if COUNT:
            tl.atomic_add(COUNTER, BM * BN)
    return acc


@triton.jit
def _gated_dout(GATE, DOUT, LSE, at, gate_at, lse_at, ok, dtype: tl.constexpr):
    """For rows of one branch -> (dO = gate * dout in `dtype`, dout in fp32, the gate in fp32, the
    log-sum-exp in log2 units with empty rows at 0)."""
    dout = tl.load(DOUT + at, mask=ok[:, None], other=0.0).to(tl.float32)
    sigma = _sigmoid(GATE, gate_at, ok)
    lse = tl.load(LSE + lse_at, mask=ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse) * LOG2E
    return (dout * sigma[:, None]).to(dtype), dout, sigma, lse2


@triton.jit
def _store_delta(DELTA, DGATE, delta, sigma, lse_at, gate_at, ok):
    """delta = rowsum(dO * O) for the dk/dv kernel, and the gate's gradient, sigma * (1 - sigma) *
    rowsum(dout * O) = (1 - sigma) * delta."""
    tl.store(DELTA + lse_at, delta, mask=ok)
    tl.store(DGATE + gate_at, ((1.0 - sigma) * delta).to(DGATE.dtype.element_ty), mask=ok)


@triton.jit
def _free_blocks_dq(Q, K, V, DOUT, GATE, LSE, DELTA, DGATE, DQ, PH, BLOCKS, COUNTER, b, h, pid_m, pid_bh, sqb, sqt,
                    sqh, skt, kbase, sgb, sgt, sgh, sob, sot, soh, start, seq_q, num_keys, G: tl.constexpr,
                    D: tl.constexpr, BM: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_PAD: tl.constexpr,
                    FINE: tl.constexpr, FREE: tl.constexpr, SCALE: tl.constexpr, USE_DOT: tl.constexpr,
                    COUNT: tl.constexpr, ROWSUM: tl.constexpr):
    """Each position of the tile adds its freely chosen blocks to the dq the tile left in DQ
    (rotated frame, unscaled), then writes its dq; ROWSUM: to the rowsum(dO * O) the tile left in
    DELTA, then writes its delta and gate gradient. Q has its strides (sqb, sqt, sqh); DOUT and DQ
    share theirs (sob, sot, soh)."""
    P: tl.constexpr = BM // G
    d = tl.arange(0, D)
    g = tl.arange(0, GROUP_PAD)
    g_ok = g < G
    j = tl.arange(0, BLOCK_PAD)
    for p in range(0, P):
        i = pid_m * P + p
        if i < seq_q:
            t = start + i
            at = b * sob + i * sot + (h * G + g)[:, None] * soh + d[None, :]
            ok = g_ok[:, None]
            pos = t + g * 0
            q_at = b * sqb + i * sqt + (h * G + g)[:, None] * sqh + d[None, :]
            q = _rotate(tl.load(Q + q_at, mask=ok, other=0.0).to(tl.float32), PH, pos, g_ok, GROUP_PAD, D, False)
            q = q.to(K.dtype.element_ty)
            lse_at = (pid_bh * seq_q + i) * G + g
            gate_at = b * sgb + i * sgt + (h * G + g) * sgh
            do, _, sigma, lse2 = _gated_dout(GATE, DOUT, LSE, at, gate_at, lse_at, g_ok, K.dtype.element_ty)
            delta = tl.load(DELTA + lse_at, mask=g_ok, other=0.0)
            if ROWSUM:
                acc = delta
            else:
                acc = tl.load(DQ + at, mask=ok, other=0.0).to(tl.float32)
            for s_ in range(FREE):
                block = tl.load(BLOCKS + (pid_bh * seq_q + i) * FREE + s_)
                cols = block * FINE + j
                key_ok = (j < FINE) & (cols <= t) & (cols < num_keys)
                if block * FINE <= t:
                    k, v = _keys(K, V, kbase, skt, cols, key_ok, PH, d, BLOCK_PAD, D, True)
                    visible = key_ok[None, :] & g_ok[:, None]
                    p_ = tl.where(visible, tl.exp2(qk(q, k, USE_DOT) * (SCALE * LOG2E) - lse2[:, None]), 0.0)
                    dp = qk(do, v, USE_DOT)
                    if ROWSUM:
                        acc += tl.sum(p_ * dp, 1)
                    else:
                        acc += pv(p_ * (dp - delta[:, None]), k, USE_DOT)
                    if COUNT:
                        tl.atomic_add(COUNTER, GROUP_PAD * BLOCK_PAD)
            if ROWSUM:
                _store_delta(DELTA, DGATE, acc, sigma, lse_at, gate_at, g_ok)
            else:
                dq = _rotate(acc * SCALE, PH, pos, g_ok, GROUP_PAD, D, True)
                tl.store(DQ + at, dq.to(DQ.dtype.element_ty), mask=ok)


@triton.jit
def backward_dq_kernel(Q, K, V, GATE, DOUT, SAVED, LSE, DELTA, DGATE, DQ, DQ_ACC, PH, BLOCKS, COUNTER,
                       sqb, sqt, sqh, skb, skt, skh, sgb, sgt, sgh, sob, sot, soh, start, seq_q, num_keys,
                       KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       MASK: tl.constexpr, L: tl.constexpr, S: tl.constexpr, FINE: tl.constexpr,
                       FORCED_BLOCKS: tl.constexpr, FREE: tl.constexpr, W: tl.constexpr, SCALE: tl.constexpr,
                       ROTARY: tl.constexpr, ACCUMULATE: tl.constexpr, USE_DOT: tl.constexpr, COUNT: tl.constexpr,
                       GROUP_PAD: tl.constexpr, BLOCK_PAD: tl.constexpr, FSA: tl.constexpr,
                       RECOMPUTE: tl.constexpr):
    """One branch's dq for a tile of rows (added to DQ when ACCUMULATE), its gate's gradient and
    its delta = gate * rowsum(dout * O), O read from SAVED or, with RECOMPUTE, summed over the keys
    in a first pass. DOUT, SAVED, DQ and DQ_ACC share the strides (sob, sot, soh). With FSA (a
    group under 16) the selected branch leaves its forced blocks' dq in DQ_ACC (fp32, rotated,
    unscaled) for the pairs' dk/dv kernel to add the chosen blocks' to, and the window kernel, in
    the same frame, finishes it."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // KVH, pid_bh % KVH
    i, g, row_ok = _rows(pid_m, seq_q, G, BM)
    t = start + i
    d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + i[:, None] * sqt + (h * G + g)[:, None] * sqh + d[None, :], mask=row_ok[:, None],
                other=0.0)
    if ROTARY:
        q = _rotate(q.to(tl.float32), PH, t, row_ok, BM, D, False).to(K.dtype.element_ty)
    at = b * sob + i[:, None] * sot + (h * G + g)[:, None] * soh + d[None, :]
    lse_at = (pid_bh * seq_q + pid_m * (BM // G)) * G + tl.arange(0, BM)
    gate_at = b * sgb + i * sgt + (h * G + g) * sgh
    do, dout, sigma, lse2 = _gated_dout(GATE, DOUT, LSE, at, gate_at, lse_at, row_ok, K.dtype.element_ty)
    t_first = start + pid_m * (BM // G)
    t_last = start + tl.minimum(pid_m * (BM // G) + BM // G, seq_q) - 1
    lo0, hi0, lo1, hi1 = _key_runs(t_first, t_last, num_keys, MASK, L, S, FINE, FORCED_BLOCKS, W)
    kbase = b * skb + h * skh
    step: tl.constexpr = FINE if MASK == 1 else BN
    if RECOMPUTE:  # a first pass over the keys for rowsum(dO * O): the forward kept no output
        delta = tl.zeros([BM], tl.float32)
        delta = _dq_run(q, do, t, row_ok, lse2, delta, delta, K, V, kbase, skt, PH, lo0, hi0, num_keys, COUNTER,
                        MASK, L, S, FINE, FORCED_BLOCKS, W, BM, BN, step, D, SCALE, ROTARY, USE_DOT, COUNT, True)
        delta = _dq_run(q, do, t, row_ok, lse2, delta, delta, K, V, kbase, skt, PH, lo1, hi1, num_keys, COUNTER,
                        MASK, L, S, FINE, FORCED_BLOCKS, W, BM, BN, step, D, SCALE, ROTARY, USE_DOT, COUNT, True)
        if MASK == 1 and FREE > 0:  # the tile's part to DELTA, then the chosen blocks' position by position
            tl.store(DELTA + lse_at, delta, mask=row_ok)
            tl.debug_barrier()
            _free_blocks_dq(Q, K, V, DOUT, GATE, LSE, DELTA, DGATE, DQ, PH, BLOCKS, COUNTER, b, h, pid_m, pid_bh, sqb,
                            sqt, sqh, skt, kbase, sgb, sgt, sgh, sob, sot, soh, start, seq_q, num_keys, G, D, BM,
                            GROUP_PAD, BLOCK_PAD, FINE, FREE, SCALE, USE_DOT, COUNT, True)
            tl.debug_barrier()
            delta = tl.load(DELTA + lse_at, mask=row_ok, other=0.0)
        else:
            _store_delta(DELTA, DGATE, delta, sigma, lse_at, gate_at, row_ok)
    else:
        o = tl.load(SAVED + at, mask=row_ok[:, None], other=0.0).to(tl.float32)
        delta = sigma * tl.sum(dout * o, 1)
        _store_delta(DELTA, DGATE, delta, sigma, lse_at, gate_at, row_ok)
    dq = tl.zeros([BM, D], tl.float32)
    dq = _dq_run(q, do, t, row_ok, lse2, delta, dq, K, V, kbase, skt, PH, lo0, hi0, num_keys, COUNTER, MASK, L, S,
                 FINE, FORCED_BLOCKS, W, BM, BN, step, D, SCALE, ROTARY, USE_DOT, COUNT, False)
    dq = _dq_run(q, do, t, row_ok, lse2, delta, dq, K, V, kbase, skt, PH, lo1, hi1, num_keys, COUNTER, MASK, L, S,
                 FINE, FORCED_BLOCKS, W, BM, BN, step, D, SCALE, ROTARY, USE_DOT, COUNT, False)
    if MASK == 1 and FREE > 0 and FSA:
        tl.store(DQ_ACC + at, dq, mask=row_ok[:, None])
    elif MASK == 1 and FREE > 0:  # the tile's part to DQ, then position by position (runs first: no ACCUMULATE)
        tl.store(DQ + at, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])
        tl.debug_barrier()
        _free_blocks_dq(Q, K, V, DOUT, GATE, LSE, DELTA, DGATE, DQ, PH, BLOCKS, COUNTER, b, h, pid_m, pid_bh, sqb,
                        sqt, sqh, skt, kbase, sgb, sgt, sgh, sob, sot, soh, start, seq_q, num_keys, G, D, BM, GROUP_PAD,
                        BLOCK_PAD, FINE, FREE, SCALE, USE_DOT, COUNT, False)
    else:
        if MASK == 2 and FSA:  # the selected branch's dq, complete in DQ_ACC
            dq += tl.load(DQ_ACC + at, mask=row_ok[:, None], other=0.0)
        dq = dq * SCALE
        if ROTARY:
            dq = _rotate(dq, PH, t, row_ok, BM, D, True)
        if ACCUMULATE:
            dq += tl.load(DQ + at, mask=row_ok[:, None], other=0.0).to(tl.float32)
        tl.store(DQ + at, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dkv_rows(Q, DOUT, GATE, LSE, DELTA, i, g, ok, k, v, cols, col_ok, dk, dv, b, h, pid_bh, sqb, sqt, sqh, sob,
              sot, soh, sgb, sgt, sgh, start, seq_q, num_keys, PH, MASK: tl.constexpr, L: tl.constexpr,
              S: tl.constexpr, FINE: tl.constexpr, FORCED_BLOCKS: tl.constexpr, W: tl.constexpr, G: tl.constexpr,
              BM: tl.constexpr, D: tl.constexpr, SCALE: tl.constexpr, ROTARY: tl.constexpr, USE_DOT: tl.constexpr,
              ANY_KEY: tl.constexpr):
    """dk, dv [keys, D] (dk unscaled, rotated frame) plus one tile of query rows (query i [BM], head g
    [BM]), and the rows' dS [BM, keys]; ANY_KEY: every key at or before the row's position counts
    (a chosen block), else the mask."""
    d = tl.arange(0, D)
    t = start + i
    q = tl.load(Q + b * sqb + i[:, None] * sqt + (h * G + g)[:, None] * sqh + d[None, :], mask=ok[:, None], other=0.0)
    if ROTARY:
        q = _rotate(q.to(tl.float32), PH, t, ok, BM, D, False).to(k.dtype)
    sigma = _sigmoid(GATE, b * sgb + i * sgt + (h * G + g) * sgh, ok)
    do = tl.load(DOUT + b * sob + i[:, None] * sot + (h * G + g)[:, None] * soh + d[None, :], mask=ok[:, None],
                 other=0.0).to(tl.float32)
    do = (do * sigma[:, None]).to(k.dtype)
    lse_at = (pid_bh * seq_q + i) * G + g
    lse = tl.load(LSE + lse_at, mask=ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse) * LOG2E
    delta = tl.load(DELTA + lse_at, mask=ok, other=0.0)
    if ANY_KEY:
        visible = (cols[None, :] <= t[:, None]) & col_ok[None, :]
    else:
        visible = _visible(t, cols, num_keys, MASK, L, S, FINE, FORCED_BLOCKS, W) & col_ok[None, :]
    visible = visible & ok[:, None]
    p = tl.where(visible, tl.exp2(qk(q, k, USE_DOT) * (SCALE * LOG2E) - lse2[:, None]), 0.0)  # [BM, keys]
    dv += pv(tl.trans(p), do, USE_DOT)
    ds = p * (qk(do, v, USE_DOT) - delta[:, None])
    dk += pv(tl.trans(ds), q, USE_DOT)
    return dk, dv, ds


@triton.jit
def backward_dkv_kernel(Q, K, V, GATE, DOUT, LSE, DELTA, DK, DV, PK, PV, DQ_ACC, PH, SORTED, ORDER, COUNTER,
                        sqb, sqt, sqh, skb, skt, skh, sgb, sgt, sgh, sob, sot, soh, sdb, sdt, sdh,
                        start, seq_q, num_keys, num_fine, chunk, part_rows,
                        KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        MASK: tl.constexpr, L: tl.constexpr, S: tl.constexpr, FINE: tl.constexpr,
                        FORCED_BLOCKS: tl.constexpr, FREE: tl.constexpr, W: tl.constexpr, SCALE: tl.constexpr,
                        ROTARY: tl.constexpr, CHUNKED: tl.constexpr, USE_DOT: tl.constexpr, COUNT: tl.constexpr,
                        FSA: tl.constexpr):
    """One key tile's dk and dv from the query rows that see it, a tile of BM rows at a time.

    DK, DV are strided like K (sdb, sdt, sdh); partial sums go to PK, PV [chunks, batch * kv_heads,
    part_rows, D] fp32, to be added up afterwards in a fixed order.
    COMPRESSED: program (tile, chunk c) takes the readers among queries [c * chunk, (c + 1) * chunk),
    into PK, PV when CHUNKED. WINDOW: the readers (t in [j, j + W)) in one go.
    FORCED: tile p < num_fine is fine block p (BN >= FINE keys): the queries whose own or previous
    block it is, and the (query, slot) pairs that chose it (SORTED, ORDER: the reverse index); tile
    num_fine + c takes block 0's readers as the initial block among queries [FINE + c * chunk, ...)
    into PK, PV. With FSA the pairs' dq goes to DQ_ACC (fp32, atomically; strided as DOUT)."""
    pid_n, pid_c, pid_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = pid_bh // KVH, pid_bh % KVH
    r = tl.arange(0, BM)
    n = tl.arange(0, BN)
    d = tl.arange(0, D)
    initial = False
    if MASK == 1:
        initial = pid_n >= num_fine
        block = tl.where(initial, 0, pid_n)
        cols = block * FINE + n
        col_ok = (n < FINE) & (cols < num_keys)
    else:
        cols = pid_n * BN + n
        col_ok = cols < num_keys
    k, v = _keys(K, V, b * skb + h * skh, skt, cols, col_ok, PH, d, BN, D, ROTARY)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    # the readers, as query indices [lo, hi)
    if MASK == 0:
        lo = tl.maximum(tl.maximum(pid_n * BN * S + L - 1 - start, 0), pid_c * chunk)
        hi = tl.minimum(seq_q, (pid_c + 1) * chunk)
    elif MASK == 2:
        lo = tl.maximum(pid_n * BN - start, 0)
        hi = tl.minimum(pid_n * BN + BN + W - 1 - start, seq_q)
    else:
        if initial:
            lo = FINE + (pid_n - num_fine) * chunk - start
            hi = tl.minimum(lo + chunk, seq_q)
            lo = tl.maximum(lo, 0)
        else:
            lo = tl.maximum(block * FINE - start, 0)
            last = block + 1  # own-block readers; previous-block readers too, but block 0's other readers
            if FORCED_BLOCKS >= 3:  # see it as the initial block: the tiles after num_fine take them
                last = tl.where(block > 0, block + 2, last)
            hi = tl.minimum(last * FINE - start, seq_q)
    for i0 in range(lo, hi, BM // G):
        i = i0 + r // G
        ok = i < hi
        dk, dv, _ = _dkv_rows(Q, DOUT, GATE, LSE, DELTA, i, r % G, ok, k, v, cols, col_ok, dk, dv, b, h, pid_bh, sqb,
                              sqt, sqh, sob, sot, soh, sgb, sgt, sgh, start, seq_q, num_keys, PH, MASK, L, S, FINE,
                              FORCED_BLOCKS, W, G, BM, D, SCALE, ROTARY, USE_DOT, False)
        if COUNT:
            tl.atomic_add(COUNTER, BM * BN)
    if MASK == 1 and FREE > 0:
        if not initial:  # the (query, slot) pairs that chose this block, BM // G pairs a tile
            first, end = _pairs_of(SORTED, pid_bh, seq_q, block, FREE)
            for p0 in range(first, end, BM // G):
                pair = p0 + r // G
                ok = pair < end
                i, _ = _pair_rows(ORDER, pair, ok, pid_bh, seq_q, FREE)
                dk, dv, ds = _dkv_rows(Q, DOUT, GATE, LSE, DELTA, i, r % G, ok, k, v, cols, col_ok, dk, dv, b, h,
                                       pid_bh, sqb, sqt, sqh, sob, sot, soh, sgb, sgt, sgh, start, seq_q, num_keys, PH,
                                       MASK, L, S, FINE, FORCED_BLOCKS, W, G, BM, D, SCALE, ROTARY, USE_DOT, True)
                if FSA:
                    at = b * sob + i[:, None] * sot + (h * G + r % G)[:, None] * soh + d[None, :]
                    tl.atomic_add(DQ_ACC + at, pv(ds, k, USE_DOT), mask=ok[:, None])
                if COUNT:
                    tl.atomic_add(COUNTER, BM * BN)
    dk = dk * SCALE
    if ROTARY:
        dk = _rotate(dk, PH, cols, col_ok, BN, D, True)
    partial = CHUNKED
    if MASK == 1:
        partial = initial
    if partial:
        chunk_id = pid_c
        if MASK == 1:
            chunk_id = pid_n - num_fine
        at = (chunk_id * tl.num_programs(2) * part_rows + pid_bh * part_rows + cols[:, None]) * D + d[None, :]
        tl.store(PK + at, dk, mask=col_ok[:, None])
        tl.store(PV + at, dv, mask=col_ok[:, None])
    else:
        at = b * sdb + cols[:, None] * sdt + h * sdh + d[None, :]
        tl.store(DK + at, dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
        tl.store(DV + at, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])
