"""The Triton gather-attention kernel against the plain-torch reference: output, log-sum-exp and
every gradient; its reverse index, and what it reports to kernels.counters. On a machine without
CUDA the kernel runs in Triton's interpreter."""

import pytest
import torch

from kernels import counters
from kernels.gather_attention import gather_attention
from kernels.gather_attention.triton import KEY_TILE, key_runs
from tests.helpers.chosen_keys import random_indices, repeat_some_slots
from tests.helpers.kernel_checks import assert_all_close, values_and_grads

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# tolerances against the fp32 reference on the same (rounded) inputs
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}

CASES = [  # (batch_kv, seq_q, seq_k, group, dim_head, top_k, dtype)
    (2, 21, 21, 2, 8, 5, torch.float32),  # sums (dim_head < 16)
    (1, 19, 19, 1, 32, 6, torch.float32),  # GQA ratio 1, tensor-core tiles
    (1, 13, 13, 16, 16, 4, torch.float32),  # GQA ratio 16
    (1, 7, 37, 4, 64, 9, torch.float32),  # decoding: queries at the end; several key tiles
    (2, 35, 35, 2, 32, 20, torch.float16),  # two slot tiles a query; length not a multiple of the key tile
    (1, 18, 18, 4, 32, 5, torch.bfloat16),  # bf16 (tiles on a GPU; sums in the interpreter)
]


@pytest.mark.parametrize("bh,m,n,g,d,top_k,dtype", CASES,
                         ids=[f"BH{c[0]}-Q{c[1]}-K{c[2]}-G{c[3]}-D{c[4]}-top{c[5]}-{str(c[6])[6:]}" for c in CASES])
def test_kernel_matches_the_reference(bh, m, n, g, d, top_k, dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(bh, m, g, d, generator=gen).to(dtype)
    k = torch.randn(bh, n, d, generator=gen).to(dtype)
    v = torch.randn(bh, n, d, generator=gen).to(dtype)
    indices = random_indices(bh, m, n - m, top_k, gen).to(DEVICE)
    results = []
    for kernel, tensors in (("torch", (q.float(), k.float(), v.float())), ("triton", (q, k, v))):
        leaves = [t.to(DEVICE).requires_grad_() for t in tensors]
        out, lse = gather_attention(*leaves, indices, n - m, kernel)
        results.append(values_and_grads(out, lse, leaves))
    assert_all_close(results[1], results[0], TOLERANCE[dtype])


def test_reverse_index_lists_each_query_once_per_key_tile_with_the_keys_it_chose():
    gen = torch.Generator().manual_seed(4)
    bh, m, n, top_k = 2, 40, 45, 6
    indices = random_indices(bh, m, n - m, top_k, gen)
    indices[0, 3, 1] = n - m + 10  # a key after its query: never listed
    first, run_row, run_bits = key_runs(indices, n - m, n)
    tiles = -(-n // KEY_TILE)
    expected = {}
    for b in range(bh):
        for row in range(m):
            for key in indices[b, row].tolist():
                if 0 <= key <= n - m + row:
                    slot = (b * tiles + key // KEY_TILE, row)
                    expected[slot] = expected.get(slot, 0) | 1 << key % KEY_TILE
    found = {}
    for tile in range(bh * tiles):
        for r in range(first[tile], first[tile + 1]):
            assert (tile, int(run_row[r])) not in found
            found[tile, int(run_row[r])] = int(run_bits[r])
    assert found == expected and first[-1] == len(expected)


def test_launches_report_their_tiles_and_the_pairs_they_need():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 24, 2, 16, generator=gen).to(DEVICE).requires_grad_()
    k, v = (torch.randn(1, 24, 16, generator=gen).to(DEVICE).requires_grad_() for _ in range(2))
    indices = random_indices(1, 24, 0, 4, gen)
    needed = int((indices >= 0).sum()) * 2  # pairs per head of the group
    with counters.recording() as launches:
        out, _ = gather_attention(q, k, v, indices.to(DEVICE), 0, "triton")
        out.sum().backward()
    names = [launch.kernel for launch in launches]
    assert names == ["gather_attention_forward", "gather_attention_backward_q", "gather_attention_backward_kv"]
    for launch in launches:
        assert launch.needed == needed and launch.visited >= needed
    forward = launches[0]
    assert forward.grid == (24, 1) and forward.visited == 24 * 16 * 16  # one tile of 16 slots, 16 rows (tl.dot)


def test_unsupported_shapes_fail_with_the_constraint():
    q = torch.randn(1, 4, 2, 48)  # dim_head 48 is not a power of two
    k = v = torch.randn(1, 4, 48)
    with pytest.raises(ValueError, match="kernel=triton needs dim_head=48 to be a power of two.*model.kernel=auto or torch"):
        gather_attention(q, k, v, torch.zeros(1, 4, 1, dtype=torch.long), 0, "triton")


def test_a_key_named_in_several_slots_counts_once():
    """The chosen keys are a set: the kernel gives the naive definition's values and gradients, and
    to the bit what it gives with the repeats unused (-1); a repeat in a key tile's bit mask would
    name another key."""
    from kernels.gather_attention.naive import gather_attention as naive

    gen = torch.Generator().manual_seed(7)
    bh, m, g, d, top_k = 1, 19, 2, 16, 6
    tensors = (torch.randn(bh, m, g, d, generator=gen), torch.randn(bh, m, d, generator=gen),
               torch.randn(bh, m, d, generator=gen))
    chosen = random_indices(bh, m, 0, top_k, gen)
    indices, _, counts = repeat_some_slots(chosen, chosen >= 0, gen)
    assert ((indices >= 0) & ~counts).any(), "the case must repeat some keys"
    results = []
    for attend, chosen_keys in (("triton", indices), ("triton", indices.masked_fill(~counts, -1)), (naive, indices)):
        leaves = [t.to(DEVICE).requires_grad_() for t in tensors]
        out, lse = (gather_attention(*leaves, chosen_keys.to(DEVICE), 0, attend) if attend == "triton"
                    else attend(*leaves, chosen_keys.to(DEVICE), 0))
        results.append(values_and_grads(out, lse, leaves))
    assert_all_close(results[0], results[1], 0, " from the repeats unused")
    assert_all_close(results[0], results[2], 2e-5, " from the definition")
