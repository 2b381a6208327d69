"""NSA's compressed attention and block importance against the dense formulation: values, the
importance handed to `choose`, and every gradient, in float64 so the tolerance can be tight; the
CPU selection kernel's choice against the dense importance and the rule it implements."""

import pytest
import torch
import torch.nn.functional as F

import kernels.nsa_attention.compressed_chunked as module
from kernels.nsa_attention.blocks import BlockRules
from kernels.nsa_attention.compressed import compressed_attention, cpu_compressed_selection, cpu_selection_available
from kernels.nsa_attention.compressed_naive import compressed_attention as naive


def whole_importance(num_fine):
    """A `choose` that keeps every fine block's importance, so the test can read all of it."""
    def choose(importance, first):
        full = F.pad(importance, (0, num_fine - importance.shape[-1]))
        return full, torch.arange(num_fine).expand(full.shape).contiguous()
    return choose


CASES = [  # (batch_kv, group, seq_q, start, dim_head, block, stride, fine block)
    (1, 1, 16, 0, 8, 4, 2, 4),
    (2, 2, 37, 0, 8, 4, 2, 4),  # a length that is a multiple of no block size
    (2, 3, 50, 0, 16, 16, 8, 16),  # the default knobs' shape
    (1, 2, 45, 0, 8, 6, 4, 8),  # gcd(block, stride, fine) = 2: segments of 2 tokens
    (1, 2, 29, 0, 8, 5, 3, 7),  # coprime sizes: segments of one token
    (2, 2, 5, 40, 8, 4, 2, 4),  # queries after a cache
    (1, 2, 1, 63, 8, 16, 8, 16),  # one decoding query
    (1, 1, 3, 0, 8, 4, 2, 4),  # shorter than a block: no block complete
]


@pytest.mark.parametrize("importance_grad", [False, True], ids=["const", "diff"])
@pytest.mark.parametrize("bh,g,m,start,d,block,stride,fine", CASES,
                         ids=[f"BH{c[0]}-G{c[1]}-Q{c[2]}-S{c[3]}-D{c[4]}-l{c[5]}-d{c[6]}-f{c[7]}" for c in CASES])
def test_matches_dense_formulation(bh, g, m, start, d, block, stride, fine, importance_grad):
    gen = torch.Generator().manual_seed(0)
    seq = start + m
    blocks, num_fine = max(0, (seq - block) // stride + 1), -(-seq // fine)
    q = torch.randn(bh, g, m, d, dtype=torch.float64, generator=gen, requires_grad=True)
    kc = torch.randn(bh, blocks, d, dtype=torch.float64, generator=gen, requires_grad=True)
    vc = torch.randn(bh, blocks, d, dtype=torch.float64, generator=gen, requires_grad=True)
    out, importance, _ = compressed_attention(q, kc, vc, start, block, stride, fine, whole_importance(num_fine),
                                              importance_grad=importance_grad)
    ref, ref_importance = naive(q, kc, vc, start, block, stride, fine, num_fine)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(importance.double(), ref_importance.detach(), rtol=1e-6, atol=1e-6)  # fp32 importance
    if not blocks:
        return
    grad_out, grad_imp = torch.randn_like(out), torch.randn_like(ref_importance)
    loss = (out * grad_out).sum() + ((importance.double() * grad_imp).sum() if importance_grad else 0)
    ref_loss = (ref * grad_out).sum() + ((ref_importance * grad_imp).sum() if importance_grad else 0)
    ours = torch.autograd.grad(loss, (q, kc, vc))
    theirs = torch.autograd.grad(ref_loss, (q, kc, vc))
    for a, b, name in zip(ours, theirs, ("q", "kc", "vc")):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"d{name} differs")


def test_constant_importance_passes_no_gradient():
    q, kc, vc = (torch.randn(1, 2, 40, 8, requires_grad=True), torch.randn(1, 19, 8, requires_grad=True),
                 torch.randn(1, 19, 8))
    _, importance, _ = compressed_attention(q, kc, vc, 0, 4, 2, 4, whole_importance(10))
    assert not importance.requires_grad


def test_chunking_does_not_change_the_result(monkeypatch):
    """Chunks of a few queries and one chunk for everything give the same values and gradients."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 70, 8, generator=gen, requires_grad=True)
    kc = torch.randn(2, 34, 8, generator=gen, requires_grad=True)
    vc = torch.randn(2, 34, 8, generator=gen, requires_grad=True)
    results = []
    for budget in (1 << 20, 64):
        monkeypatch.setattr(module, "_CHUNK_ELEMENTS", budget)
        out, importance, _ = compressed_attention(q, kc, vc, 0, 4, 2, 4, whole_importance(18), importance_grad=True)
        results.append((out, importance, *torch.autograd.grad(out.square().sum() + importance.sum(), (q, kc, vc))))
    assert len(module.Layout(q, 34, 0, 4, 2, 4).chunks) == 5  # the small budget split them (16 at least each)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_choose_sees_each_chunk_once_in_order():
    seen = []

    def choose(importance, first):
        seen.append((first, importance.shape[1], importance.shape[2]))
        return importance[..., :1], importance[..., :1].long()

    monkey_budget = module._CHUNK_ELEMENTS
    try:
        module._CHUNK_ELEMENTS = 64
        compressed_attention(torch.randn(1, 2, 41, 8), torch.randn(1, 19, 8), torch.randn(1, 19, 8), 0, 4, 2, 4,
                             choose)
    finally:
        module._CHUNK_ELEMENTS = monkey_budget
    firsts = [first for first, _, _ in seen]
    assert firsts[0] == 0 and seen[0][1] == 3  # positions 0-2 see no complete block
    assert all(a + size == b for (a, size, _), b in zip(seen, firsts[1:])) and firsts[-1] + seen[-1][1] == 41
    assert all(width == (first + size - 1) // 4 + 1 for first, size, width in seen)  # blocks up to the last query


def choose_from_dense(importance, m, fine, forced, free):
    """The definition of a training step's choice: the `free` most important fine blocks, never the
    forced ones (own, initial, previous, as many as `forced`) nor any that starts after the query;
    ties to the earlier block."""
    t = torch.arange(m)[:, None]
    f = torch.arange(importance.shape[-1])
    own = t // fine
    taken = (f == own) | ((f == 0) & (forced >= 2)) | ((f == own - 1) & (forced >= 3)) | (f * fine > t)
    ranked = importance.masked_fill(taken, float("-inf")).sort(dim=-1, descending=True, stable=True)
    return ranked.values[..., :free], ranked.indices[..., :free]


def cpu_selection(q, kc, block, stride, fine, forced, free):
    """The CPU pass's choice alone (scores, indices), whatever the values."""
    return cpu_compressed_selection(q, kc, torch.zeros_like(kc), block, stride, fine, forced, free)[1:]


SELECTION_CASES = [  # (batch_kv, group, seq_q, dim_head, block, stride, fine block, forced, free)
    (2, 2, 70, 16, 16, 8, 16, 3, 1),  # the default knobs' shape
    (1, 3, 77, 24, 16, 8, 8, 3, 3),  # a length that is a multiple of no block size; odd group
    (2, 2, 61, 8, 6, 4, 8, 2, 2),  # segments of 2 tokens; two forced blocks
    (1, 2, 45, 8, 5, 3, 7, 1, 4),  # coprime sizes: segments of one token; the own block only
    (1, 1, 12, 8, 16, 8, 4, 3, 2),  # shorter than a block: nothing complete, every choice a tie at 0
    (1, 2, 700, 16, 16, 8, 8, 3, 3),  # 88 fine blocks: the choice scans them 16 at a time, most passed over
    (1, 2, 300, 8, 16, 4, 16, 3, 2),  # a stride of one segment, four segments a fine block
]


@pytest.mark.skipif(not cpu_selection_available(), reason="no C compiler to build the block-selection kernel")
@pytest.mark.parametrize("bh,g,m,d,block,stride,fine,forced,free", SELECTION_CASES,
                         ids=[f"BH{c[0]}-G{c[1]}-Q{c[2]}-D{c[3]}-l{c[4]}-d{c[5]}-f{c[6]}-F{c[7]}-n{c[8]}"
                              for c in SELECTION_CASES])
def test_cpu_selection_matches_dense_formulation(bh, g, m, d, block, stride, fine, forced, free):
    gen = torch.Generator().manual_seed(0)
    blocks, num_fine = max(0, (m - block) // stride + 1), -(-m // fine)
    q = torch.randn(bh, g, m, d, dtype=torch.float64, generator=gen) * 2
    kc = torch.randn(bh, blocks, d, dtype=torch.float64, generator=gen)
    _, importance = naive(q, kc, kc, 0, block, stride, fine, num_fine)
    ref_scores, ref_indices = choose_from_dense(importance, m, fine, forced, free)
    scores, indices = cpu_selection(q.float(), kc.float(), block, stride, fine, forced, free)
    valid = ref_scores > float("-inf")
    assert torch.equal(scores > float("-inf"), valid)
    torch.testing.assert_close(scores[valid].double(), ref_scores[valid], rtol=1e-5, atol=1e-6)
    assert torch.equal(indices[valid], ref_indices[valid])
    assert (indices[~valid] == 0).all()


OUTPUT_CASES = SELECTION_CASES + [
    (2, 2, 83, 64, 16, 8, 16, 3, 1),  # the default knobs with a real head width
    (1, 2, 600, 64, 16, 8, 16, 3, 1),  # 74 blocks: the backward's chunks of 64 blocks, the last one partial
    (1, 3, 560, 8, 16, 8, 16, 3, 1),  # 69 blocks, odd group: two heads of the group at once, then one alone
]


@pytest.mark.skipif(not cpu_selection_available(), reason="no C compiler to build the block-selection kernel")
@pytest.mark.parametrize("bh,g,m,d,block,stride,fine,forced,free", OUTPUT_CASES,
                         ids=[f"BH{c[0]}-G{c[1]}-Q{c[2]}-D{c[3]}-l{c[4]}-d{c[5]}-f{c[6]}-F{c[7]}-n{c[8]}"
                              for c in OUTPUT_CASES])
def test_cpu_selection_with_the_attention_output_matches_dense_attention(bh, g, m, d, block, stride, fine, forced,
                                                                         free):
    """The pass's output: its values and every gradient against the dense formulation, its choice
    that of the dense formulation, on 1 and 3 threads alike."""
    gen = torch.Generator().manual_seed(1)
    blocks = max(0, (m - block) // stride + 1)
    q, kc, vc = (torch.randn(*shape, dtype=torch.float64, generator=gen)
                 for shape in ((bh, g, m, d), (bh, blocks, d), (bh, blocks, d)))
    dout = torch.randn(bh, g, m, d, dtype=torch.float64, generator=gen)
    ref, importance = naive(q.requires_grad_(), kc.requires_grad_(), vc.requires_grad_(), 0, block, stride, fine,
                            -(-m // fine))
    ref_scores, ref_indices = choose_from_dense(importance.detach(), m, fine, forced, free)
    ref_grads = torch.autograd.grad(ref, (q, kc, vc), dout) if blocks else [torch.zeros_like(t) for t in (q, kc, vc)]
    previous, results = torch.get_num_threads(), []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            inputs = [t.detach().float().requires_grad_() for t in (q, kc, vc)]
            out, scores, indices = cpu_compressed_selection(*inputs, block, stride, fine, forced, free)
            results.append((out, scores, indices, torch.autograd.grad(out, inputs, dout.float())))
    finally:
        torch.set_num_threads(previous)
    out, scores, indices, grads = results[0]
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-4)
    valid = ref_scores > float("-inf")
    assert torch.equal(scores > float("-inf"), valid) and torch.equal(indices[valid], ref_indices[valid])
    assert torch.equal(results[1][0], out) and torch.equal(results[1][2], indices)


@pytest.mark.skipif(not cpu_selection_available(), reason="no C compiler to build the block-selection kernel")
def test_cpu_selection_reads_a_query_view_of_a_projection_where_it_lies():
    """q [b, h, g, m, d] as a strided view of a [b, m, h * g * d] projection (batch 2: no flatten of
    (b, h) is a view): the output, the choice and the projection's gradient of the dense
    formulation over contiguous [b * h, g, m, d] queries."""
    b, h, g, m, d, block, stride, fine = 2, 2, 2, 53, 16, 8, 4, 8
    gen = torch.Generator().manual_seed(6)
    blocks = (m - block) // stride + 1
    projection = torch.randn(b, m, h * g * d, dtype=torch.float64, generator=gen)
    kc, vc = (torch.randn(b * h, blocks, d, dtype=torch.float64, generator=gen) for _ in range(2))
    dout = torch.randn(b * h, g, m, d, dtype=torch.float64, generator=gen)
    x = projection.clone().requires_grad_()
    q = x.unflatten(-1, (h, g, d)).permute(0, 2, 3, 1, 4).flatten(0, 1)  # a copy: [b * h, g, m, d]
    ref, importance = naive(q, kc, vc, 0, block, stride, fine, -(-m // fine))
    ref_scores, ref_indices = choose_from_dense(importance.detach(), m, fine, 3, 2)
    ref_grad, = torch.autograd.grad(ref, x, dout)
    x32 = projection.float().requires_grad_()
    view = x32.unflatten(-1, (h, g, d)).permute(0, 2, 3, 1, 4)  # [b, h, g, m, d], strided
    out, scores, indices = cpu_compressed_selection(view, kc.float(), vc.float(), block, stride, fine, 3, 2)
    grad, = torch.autograd.grad(out, x32, dout.float())
    torch.testing.assert_close(out.double().view_as(ref), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-4)
    valid = ref_scores > float("-inf")
    assert torch.equal(scores > float("-inf"), valid) and torch.equal(indices[valid], ref_indices[valid])


@pytest.mark.skipif(not cpu_selection_available(), reason="no C compiler to build the block-selection kernel")
def test_cpu_selection_ties_go_to_the_earlier_block():
    """Before the first compressed block is complete every fine block is worth 0: the earliest
    eligible ones are chosen, in order."""
    q, kc = torch.randn(1, 2, 19, 8), torch.randn(1, 0, 8)
    scores, indices = cpu_selection(q, kc, 20, 4, 4, 3, 2)
    assert indices[0, 18].tolist() == [1, 2] and scores[0, 18].tolist() == [0.0, 0.0]  # own 4, previous 3, initial 0
    assert indices[0, 14].tolist() == [1, 0] and scores[0, 14].tolist() == [0.0, float("-inf")]  # blocks 0..3


@pytest.mark.parametrize("selected,first", [(5, 0), (4, 0), (6, 13)])
def test_the_torch_choice_follows_the_rule_ties_included(selected, first):
    """BlockRules.choose (the PyTorch path's) against the definition on importance full of exact ties
    (fine blocks under the same compressed blocks are worth the same): the same blocks, the earlier
    first among equals, as the CPU pass and naive.py choose."""
    m, num_fine, fine = 40, 14, 4
    importance = torch.randint(0, 3, (2, m, num_fine), generator=torch.Generator().manual_seed(0)).double()
    rules = BlockRules(fine, selected, window=8)
    free = rules.free(first + m)
    scores, indices = rules.choose(importance, first, free)
    padded = torch.cat((torch.zeros(2, first, num_fine, dtype=importance.dtype), importance), dim=1)
    ref_scores, ref_indices = (t[:, first:] for t in choose_from_dense(padded, first + m, fine, rules.forced, free))
    assert torch.equal(scores, ref_scores)
    valid = ref_scores > float("-inf")
    assert torch.equal(indices[valid], ref_indices[valid])


@pytest.mark.skipif(not cpu_selection_available(), reason="no C compiler to build the block-selection kernel")
def test_cpu_selection_is_the_same_on_any_number_of_threads():
    q, kc = torch.randn(2, 2, 100, 16), torch.randn(2, 11, 16)
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 3):
            torch.set_num_threads(threads)
            results.append(cpu_selection(q, kc, 16, 8, 8, 3, 2))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.skipif(not cpu_selection_available(), reason="no C compiler to build the block-selection kernel")
def test_cpu_selection_with_the_attention_output_keeps_bf16_inputs_bf16():
    """bf16 (autocast) inputs: the pass runs in fp32, the output and every gradient come back in
    bf16, close to the dense formulation on the same rounded inputs."""
    gen = torch.Generator().manual_seed(2)
    q, kc, vc = (torch.randn(*shape, generator=gen).bfloat16() for shape in ((2, 2, 83, 64), (2, 9, 64), (2, 9, 64)))
    dout = torch.randn(2, 2, 83, 64, generator=gen).bfloat16()
    inputs = [t.clone().requires_grad_() for t in (q, kc, vc)]
    out, _, _ = cpu_compressed_selection(*inputs, 16, 8, 16, 3, 1)
    grads = torch.autograd.grad(out, inputs, dout)
    exact = [t.double().requires_grad_() for t in (q, kc, vc)]
    ref, _ = naive(*exact, 0, 16, 8, 16, 6)
    ref_grads = torch.autograd.grad(ref, exact, dout.double())
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad.double(), ref_grad, rtol=5e-2, atol=5e-2)


@pytest.mark.skipif(not cpu_selection_available(), reason="no C compiler to build the block-selection kernel")
@pytest.mark.parametrize("m", [29, 3])
def test_the_custom_operator_passes_opcheck(m):
    """sparse_attention::compressed_selection and its backward under torch.library.opcheck: the schema (no input
    written, no output aliasing an input), the fake implementation against the kernel, the
    autograd registration and AOTAutograd tracing with dynamic shapes, for a strided query view of
    a projection and for no complete block."""
    gen = torch.Generator().manual_seed(8)
    b, h, g, d, block, stride = 2, 2, 2, 16, 4, 4
    blocks = max(0, (m - block) // stride + 1)
    projection = torch.randn(b, m, h * g * d, generator=gen)
    q = projection.unflatten(-1, (h, g, d)).permute(0, 2, 3, 1, 4).requires_grad_()  # [b, h, g, m, d], strided
    kc, vc = (torch.randn(b * h, blocks, d, generator=gen, requires_grad=True) for _ in range(2))
    torch.library.opcheck(torch.ops.sparse_attention.compressed_selection.default, (q, kc, vc, block, stride, 4, 3, 2))
    # and its backward, whose fake must give the strides the kernel gives (contiguous), not the view's
    out, lse, _, _ = torch.ops.sparse_attention.compressed_selection.default(q, kc, vc, block, stride, 4, 3, 2)
    dout = torch.randn(out.shape, generator=gen)
    torch.library.opcheck(torch.ops.sparse_attention.compressed_selection_backward.default,
                          tuple(t.detach() for t in (q, kc, vc, out, lse, dout)) + (block, stride))
