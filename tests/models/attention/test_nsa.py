"""Native Sparse Attention: causality, the branches' definitions, caching, odd lengths; on CUDA (the gpu
tier): cached decoding, the first step against the CPU's for every kernel, training in each precision."""

import pytest
import torch
from einops import rearrange
import torch.nn.functional as F

from kernels.nsa_attention.compressed import compressed_attention
from kernels.nsa_attention.compressed_naive import compressed_attention as naive
from kernels import span_attention
from kernels import dispatch
import kernels.nsa_attention as nsa_kernels
from kernels.nsa_attention import reference as branches
from models.attention.dense import DenseAttention
from models.attention.nsa import BRANCH_NAMES, BlockCompressor, NativeSparseAttention, branch_closed, open_branches
from experiments.bench.agreement import lm_loss
from tests.helpers.attention_checks import assert_attention_dropout_only_in_training, assert_truncated_cache_forgets
from tests.helpers.gpu import (PRECISIONS, assert_cached_decoding_on_cuda, assert_devices_agree, assert_loss_falls,
                               train_on_cuda)
from tests.helpers.kernel_checks import TRITON_DEVICE, device_for
from tests.helpers.runs import TINY_NSA
from models.lm import nsa_lm

# the selected and window branches from position 0: plain PyTorch, and the span-attention CPU kernel
KERNELS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(not span_attention.available(),
                                                                 reason="no C compiler for the CPU kernel"))]
# and the fused Triton kernels (kernels/nsa_attention/; in Triton's interpreter without a GPU), which
# need dim_head 16 or more
TRITON = pytest.param("triton", marks=pytest.mark.triton)
KNOBS = dict(kv_heads=2, sliding_window_size=8, compress_block_size=4, compress_stride=2, fine_block_size=4,
             num_fine_selected=3)


def tiny_nsa(**overrides):
    torch.manual_seed(0)
    return nsa_lm(**{"num_tokens": 64, "dim": 32, "depth": 2, "heads": 4, "dim_head": 8, **KNOBS, **overrides}).eval()


# on a CPU, auto is the C kernels; torch the PyTorch path (which no-grad forwards take under auto)
@pytest.mark.parametrize("kernel", ["auto", "torch"])
@pytest.mark.parametrize("t", [0, 2, 3, 4, 7, 8, 15, 16, 30, 45])
def test_causal_by_perturbation(t, kernel):
    """Changing every token after t leaves the logits at <= t unchanged (block boundaries included)."""
    model = tiny_nsa(kernel=kernel)
    x = torch.randint(0, 64, (2, 48))
    changed = x.clone()
    changed[:, t + 1 :] = (changed[:, t + 1 :] + 1 + torch.randint(0, 62, changed[:, t + 1 :].shape)) % 64
    base, out = model(x), model(changed)
    assert torch.equal(out[:, : t + 1], base[:, : t + 1])
    if t < 47:
        assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :])


@pytest.mark.parametrize("kernel", ["auto", "torch"])
@pytest.mark.parametrize("t", [3, 16, 29])
def test_causal_by_gradient(t, kernel):
    """The logits at t have zero gradient with respect to every later input embedding."""
    model = tiny_nsa(kernel=kernel)
    x = torch.randint(0, 64, (1, 40))
    emb = model.token_emb(x).detach().requires_grad_()
    h = emb
    for block in model.blocks:
        h = block(h)
    logits = model.to_logits(model.norm(h))
    (grad,) = torch.autograd.grad(logits[0, t].sum(), emb)
    assert grad[0, t + 1 :].abs().max() == 0
    assert grad[0, : t + 1].abs().max() > 0


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("n", [4, 37, 64])
def test_all_blocks_selected_equals_dense_causal_attention(n, kernel):
    """With every block selected, the selected branch is dense causal attention; so is a window
    as long as the sequence."""
    d = 8
    attn = NativeSparseAttention(dim=16, heads=4, dim_head=d, kv_heads=2, sliding_window_size=n,
                                 compress_block_size=4, compress_stride=2, fine_block_size=4, num_fine_selected=16,
                                 kernel=kernel)
    q = torch.randn(2, 2, 2, n, d)  # [batch, kv_heads, group, seq, dim_head]
    k, v = torch.randn(2, 2, n, d), torch.randn(2, 2, n, d)
    importance = torch.rand(4, n, -(-n // 4))  # [batch * kv_heads, seq, fine blocks]
    scores, indices = (t.view(2, 2, n, -1) for t in attn.rules.choose(importance, 0, 13))
    dense = F.scaled_dot_product_attention(q, k[:, :, None], v[:, :, None], is_causal=True)
    torch.testing.assert_close(branches.selected(q, k, v, scores, indices, 0, attn.rules, runs(q, attn.kernel)), dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(branches.window(q, k, v, 0, attn.rules, runs(q, attn.kernel)), dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("selected", [1, 2, 3, 5])
def test_selected_branch_equals_masked_attention_over_the_chosen_blocks(selected, kernel):
    """The tiled forced blocks merged with the gathered free blocks equal one softmax over the
    union of the blocks, for every priority cut-off."""
    n, d, l = 29, 8, 4
    attn = NativeSparseAttention(dim=16, heads=2, dim_head=d, kv_heads=1, sliding_window_size=4,
                                 compress_block_size=4, compress_stride=2, fine_block_size=l, num_fine_selected=selected,
                                 kernel=kernel)
    q, k, v = torch.randn(1, 1, 2, n, d), torch.randn(1, 1, n, d), torch.randn(1, 1, n, d)
    importance = torch.rand(1, n, -(-n // l))
    positions = torch.arange(n)
    allowed = attn.rules.forced_visible(positions[:, None], positions[None])
    scores, indices = attn.rules.choose(importance, 0, max(0, selected - 3))
    valid = scores > float("-inf")
    for s_ in range(indices.shape[-1]):
        allowed |= ((positions[None] // l) == indices[0, :, s_, None]) & valid[0, :, s_, None]
    allowed &= positions[None] <= positions[:, None]
    expected = F.scaled_dot_product_attention(q, k[:, :, None], v[:, :, None], attn_mask=allowed)
    torch.testing.assert_close(branches.selected(q, k, v, scores[None], indices[None], 0, attn.rules, runs(q, attn.kernel)), expected, rtol=1e-5, atol=1e-5)
    blocks_per_query = F.pad(allowed, (0, (-n) % l)).view(n, -1, l).any(-1).sum(-1)
    assert (blocks_per_query <= selected).all()
    assert (blocks_per_query[-1] == min(selected, -(-n // l)))


@pytest.mark.parametrize("kernel", KERNELS)
def test_window_sees_exactly_the_last_w_tokens(kernel):
    attn = NativeSparseAttention(dim=16, heads=2, dim_head=8, kv_heads=1, sliding_window_size=5,
                                 compress_block_size=4, compress_stride=2, fine_block_size=4, num_fine_selected=2,
                                 kernel=kernel)
    n = 23
    q, k, v = torch.randn(1, 1, 2, n, 8), torch.randn(1, 1, n, 8), torch.randn(1, 1, n, 8)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    mask = (j <= i) & (j > i - 5)
    expected = F.scaled_dot_product_attention(q, k[:, :, None], v[:, :, None], attn_mask=mask)
    torch.testing.assert_close(branches.window(q, k, v, 0, attn.rules, runs(q, attn.kernel)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not span_attention.available(), reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("diff_topk", [False, True])
@pytest.mark.parametrize("n", [23, 64, 77])
def test_cpu_kernel_trains_as_the_torch_path(n, diff_topk):
    """A training forward and backward on the CPU kernels (block selection with the compressed
    branch's output, span attention) gives the outputs and gradients of the PyTorch path, at
    lengths off every block size."""
    knobs = dict(dim=32, heads=4, dim_head=16, kv_heads=2, sliding_window_size=8, compress_block_size=8,
                 compress_stride=4, fine_block_size=8, num_fine_selected=4, diff_topk=diff_topk)
    assert_trains_as_the_torch_path(knobs, "cpu", n)


@pytest.mark.skipif(not span_attention.available(), reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("block,stride,fine", [(8, 8, 4), (16, 8, 4)])
def test_exact_ties_choose_the_same_blocks_on_the_cpu_kernels_and_the_torch_path(block, stride, fine):
    """Fine blocks shorter than the compression stride are worth exactly the same (the same compressed
    blocks cover them): both paths give the tie to the earlier block, so a training forward (the C
    pass on the CPU) and a no-grad one or decoding (the PyTorch path) attend to the same keys."""
    knobs = dict(dim=32, heads=4, dim_head=16, kv_heads=2, sliding_window_size=8, compress_block_size=block,
                 compress_stride=stride, fine_block_size=fine, num_fine_selected=5)
    assert_trains_as_the_torch_path(knobs, "cpu", 77)


def assert_trains_as_the_torch_path(knobs: dict, kernel: str, n: int, device: str = "cpu") -> None:
    """A training forward and backward of one layer (width 32) on `kernel` gives the outputs, the
    input's and every parameter's gradients of the PyTorch path from the same weights."""
    torch.manual_seed(0)
    reference = NativeSparseAttention(**knobs, kernel="torch").to(device)
    fast = NativeSparseAttention(**knobs, kernel=kernel).to(device)
    fast.load_state_dict(reference.state_dict())
    x = torch.randn(2, n, 32, requires_grad=True, device=device)
    results = []
    for attn in (reference, fast):
        out = attn(x)
        results.append((out, *torch.autograd.grad(out.square().sum(), [x, *attn.parameters()])))
    for expected, got in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not span_attention.available(), reason="no C compiler for the CPU kernel")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cpu_kernel_training_keeps_neither_projection(precision):
    """The query and key/value projections are recomputed in the backward (models/recompute.py):
    none of their storage is among what the training forward saves, nor a copy of their values
    (batch 2 with 2 kv heads: flattening (batch, kv heads) of a projection's view would copy; in
    bf16, the kernels' fp32 inputs would be copies)."""
    attn = NativeSparseAttention(dim=32, heads=4, dim_head=16, kernel="cpu", **KNOBS)
    projections = []  # the query, key/value and gate projections run as one product
    attn._project[0].register_forward_hook(lambda module, args, out: projections.append(out))
    saved = []
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with autocast, torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = attn(torch.randn(2, 40, 32, requires_grad=True))
    assert len(projections) == 1 and saved
    storages = {t.untyped_storage().data_ptr() for t in projections}
    assert not storages & {t.untyped_storage().data_ptr() for t in saved}
    q, *kv, _ = attn._project[0].split(projections[0])
    views = [rearrange(q, "b n (h g d) -> b h g n d", h=attn.kv_heads, g=attn.group)]  # as the kernels take them
    views += [t.transpose(1, 2) for t in torch.cat(kv, -1).unflatten(-1, (6, attn.kv_heads, -1)).unbind(2)]
    copies = [t for t in saved for v in views for view in (v, v.flatten(0, 1))
              if t.shape == view.shape and torch.equal(t.to(view.dtype), view)]
    assert not copies, [tuple(t.shape) for t in copies]
    out.sum().backward()  # and the backward runs from what was kept


@pytest.mark.parametrize("shared_kv", [False, True], ids=["own-kv", "shared-kv"])
def test_the_projection_padded_to_aligned_rows_computes_each_projection(shared_kv):
    """The one product of the query, key/value and gate projections is padded to a multiple of ALIGN
    columns (4 * 8 + 6 * 2 * 8 + 3 * 4 = 140 -> 144 here): each view is its own layer's product, the
    output's rows start ALIGN floats apart, and every weight's gradient is that of the layers alone."""
    from models.attention.nsa import InputProjection

    attn = NativeSparseAttention(dim=32, heads=4, dim_head=8, shared_kv=shared_kv, **KNOBS)
    assert "projection_padding" not in attn.state_dict()  # a buffer of zeros, not a weight to save
    project = attn._project[0]
    project.padding = attn.projection_padding
    x = torch.randn(2, 40, 32)
    out = project(x)
    assert out.shape[-1] % InputProjection.ALIGN == 0 and out.shape[-1] - sum(project.widths) < InputProjection.ALIGN
    views = project.split(out)
    assert [v.shape[-1] for v in views] == project.widths
    weights = torch.cat([layer.weight for layer in project.layers]).split(project.widths)
    for view, weight in zip(views, weights):
        torch.testing.assert_close(view, x @ weight.T)
    grads = [torch.randn_like(v) for v in views]
    torch.autograd.backward(views, grads)
    dw = torch.cat([g.flatten(0, 1) for g in grads], -1).T @ x.flatten(0, 1)  # the layers' own weight gradient
    torch.testing.assert_close(torch.cat([layer.weight.grad for layer in project.layers]), dw)


@pytest.mark.parametrize("kernel", KERNELS)
def test_bf16_training_keeps_one_cast_of_the_input(kernel):
    """Under autocast the query, key/value and gate projections read one bf16 cast of x: a layer
    keeps one copy of its input for their weight gradients, not one per projection."""
    attn = NativeSparseAttention(dim=32, heads=4, dim_head=16, kernel=kernel, **KNOBS)
    x = torch.randn(2, 40, 32, requires_grad=True) * 1.0  # not a leaf: autocast caches casts of leaves only
    saved = []
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        attn(x)
    casts = {t.untyped_storage().data_ptr() for t in saved
             if t.dtype == torch.bfloat16 and t.numel() == x.numel() and torch.equal(t.float(), x.bfloat16().float().view_as(t))}
    assert len(casts) == 1


def test_cpu_kernel_without_a_compiler_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(span_attention, "available", lambda: False)
    with pytest.raises(ValueError, match="kernel=cpu needs a working C compiler"):
        tiny_nsa(kernel="cpu")


def test_selection_forces_own_initial_and_previous_blocks():
    attn = NativeSparseAttention(dim=16, heads=2, dim_head=8, kv_heads=1, sliding_window_size=4,
                                 compress_block_size=4, compress_stride=4, fine_block_size=4, num_fine_selected=4)
    n = 40
    importance = torch.zeros(1, n, n // 4)
    importance[..., 5] = 1.0  # fine block 5 is the most important wherever it is visible
    scores, indices = attn.rules.choose(importance, 0, 1)
    valid = scores > float("-inf")
    positions = torch.arange(n)
    forced = attn.rules.forced_visible(positions[:, None], torch.arange(0, n, 4)[None])  # [query, block]
    for t in (0, 5, 13, 27, 39):
        own = t // 4
        assert set(forced[t].nonzero().flatten().tolist()) == {own, 0, max(own - 1, 0)}
        free = set(indices[0, t][valid[0, t]].tolist())
        assert not free & {own, 0, own - 1}, "a forced block was chosen twice"
        assert all(b <= own for b in free), "a future block was selected"
        assert (5 in free) == (own > 6)


def test_cached_decoding_equals_parallel_forward():
    model = tiny_nsa()
    x = torch.randint(0, 64, (2, 45))
    full = model(x)
    cache = model.new_cache()
    pieces = [model(x[:, :9], cache=cache)]
    pieces += [model(x[:, t : t + 1], cache=cache) for t in range(9, 30)]
    pieces.append(model(x[:, 30:], cache=cache))  # several tokens at once after a cache
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_cached_decoding_equals_parallel_forward_on_cuda(kernel):
    """dim_head 16, so that kernel=auto runs the Triton kernels; 15 tokens at once at the end."""
    assert_cached_decoding_on_cuda(tiny_nsa(dim_head=16, kernel=kernel), torch.randint(0, 64, (2, 45)),
                                   [9] + [1] * 21 + [15])


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["auto", "torch", "triton", *KERNELS[1:]])
def test_first_step_agrees_between_the_cpu_and_cuda(kernel):
    """Every model.kernel on CUDA against the CPU's (triton against torch there: the CPU runs Triton only
    in its interpreter; cpu on CUDA is the torch path)."""
    on_cpu = "torch" if kernel == "triton" else kernel
    assert_devices_agree(lambda device: tiny_nsa(dim_head=16, kernel=on_cpu if device == "cpu" else kernel),
                         lm_loss(64, 45))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_trains_on_cuda(tmp_path, precision):
    assert_loss_falls(train_on_cuda(tmp_path, precision, base=TINY_NSA))


@pytest.mark.parametrize("keep", [3, 9, 16, 22])
def test_truncated_cache_forgets_the_rolled_back_tokens(keep):
    """Rolling the cache back (speculative decoding's rollback) forgets the later tokens and the
    compressed blocks they completed, inside a block and at block boundaries."""
    assert_truncated_cache_forgets(tiny_nsa(num_fine_selected=5).double(), torch.randint(0, 64, (2, 31)), keep=keep)


@pytest.mark.parametrize("n", [1, 3, 5, 17, 33])
def test_lengths_not_multiples_of_blocks_give_finite_gradients(n):
    model = tiny_nsa().train()
    x = torch.randint(0, 64, (2, n))
    loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name


def test_attention_dropout_drops_in_training_and_not_in_eval():
    assert_attention_dropout_only_in_training(tiny_nsa, torch.randint(0, 64, (2, 24)))


@pytest.mark.parametrize("mult", [0.5, 2.0])
def test_compress_hidden_mult_sets_the_compressors_hidden_width(mult):
    compressor = tiny_nsa(compress_hidden_mult=mult).blocks[0].attn.compressor
    assert compressor.w1.shape[-1] == compressor.w2.shape[-2] == int(8 * mult)  # dim_head 8


@pytest.mark.parametrize("bad,message", [
    (dict(kv_heads=3), "multiple of kv_heads"),
    (dict(compress_stride=8), "compress_stride"),
    (dict(num_fine_selected=0), "num_fine_selected"),
    (dict(branches=()), "model.branches"),
    (dict(branches=("window", "local")), "model.branches"),
    (dict(gate_bias=(3.0,)), "model.gate_bias"),
])
def test_invalid_knobs_say_how_to_fix_them(bad, message):
    with pytest.raises(ValueError, match=message):
        tiny_nsa(**bad)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_branch_left_out_adds_nothing_and_learns_nothing(kernel):
    """branches=(selected, window): the compressed values may be anything, and nothing of the
    compressed branch's own (its value compressor) gets a gradient; its keys still rank blocks."""
    tokens = torch.randint(0, 64, (2, 30))
    model = tiny_nsa(branches=("selected", "window"), kernel=kernel, num_fine_selected=4).train()
    out = model(tokens)
    out.square().mean().backward()
    for layer in model.blocks:
        compressor, values = layer.attn.compressor, slice(layer.attn.kv_heads, None)  # the value compressor's heads
        assert all(p.grad is None or not p.grad[values].any() for p in compressor.parameters())
        with torch.no_grad():
            compressor.w2[values].normal_()
    with torch.no_grad():
        assert torch.allclose(model(tokens), out, atol=1e-6)
        whole = tiny_nsa(kernel=kernel, num_fine_selected=4).train()
        assert not torch.allclose(whole(tokens), out, atol=1e-3)  # the same weights with every branch



def test_a_branch_closed_at_evaluation_computes_as_the_model_built_without_it():
    """branch_closed(model, name) is the knock-out: the same weights give what a model built with
    branches lacking `name` gives, and the model's own branches come back on exit."""
    tokens = torch.randint(0, 64, (2, 30))
    model = tiny_nsa()
    trained = model(tokens)
    assert open_branches(model) == ["compressed", "selected", "window"]
    for name in open_branches(model):
        others = tuple(b for b in ("compressed", "selected", "window") if b != name)
        without = tiny_nsa(branches=others)
        without.load_state_dict(model.state_dict())
        with branch_closed(model, name):
            knocked_out = model(tokens)
            assert name not in open_branches(model)
        torch.testing.assert_close(knocked_out, without(tokens), rtol=0, atol=0)
        assert not torch.allclose(knocked_out, trained, atol=1e-3)
    torch.testing.assert_close(model(tokens), trained, rtol=0, atol=0)
    assert open_branches(tiny_nsa(branches=("window",))) == ["window"]
    assert open_branches(torch.nn.Linear(2, 2)) == []  # no NSA layers: nothing to knock out


def _forced_blocks_mask(n: int, block: int) -> torch.Tensor:
    """[n, n] bool: each query's own block up to it, the initial block and the previous block."""
    query, key = torch.arange(n)[:, None] // block, torch.arange(n)[None] // block
    return ((key == query) | (key == 0) | (key == query - 1)) & torch.ones(n, n, dtype=torch.bool).tril()


@pytest.mark.parametrize("kernel", [*KERNELS, TRITON])
@pytest.mark.parametrize("branch,num_fine_selected,mask", [
    ("window", 3, None),            # a window as long as the sequence: causal attention
    ("selected", 10, None),         # every block selected: causal attention
    ("selected", 3, "forced"),      # the forced blocks alone: attention masked to them
], ids=["window", "selected-every-block", "selected-forced-blocks"])
def test_one_branch_held_open_trains_as_dense_attention_over_its_keys(kernel, branch, num_fine_selected, mask):
    """One branch, the others closed and its gate held at 1, is the dense baseline's attention
    (rotary positions included) over the keys the branch reaches, on the training path: the same
    weights give the same output and the same gradients. So what an ablation of NSA learns
    differently from dense attention comes from the keys it reaches, its gates and its other
    branches, not from how a branch computes."""
    torch.manual_seed(0)
    dim, heads, d, n, block = 32, 2, 16, 40, 4
    mask = _forced_blocks_mask(n, block) if mask else None
    dense = DenseAttention(dim=dim, heads=heads, dim_head=d, mask=mask)
    index = BRANCH_NAMES.index(branch)
    nsa = NativeSparseAttention(dim=dim, heads=heads, dim_head=d, kv_heads=heads, sliding_window_size=n,
                                compress_block_size=4, compress_stride=2, fine_block_size=block,
                                num_fine_selected=num_fine_selected, branches=(branch,),
                                gate_bias=tuple(30.0 if i == index else 0.0 for i in range(3)),  # sigmoid(30) = 1 in fp32
                                kernel=kernel)
    with torch.no_grad():
        wq, wk, wv = dense.to_qkv.weight.chunk(3)
        nsa.to_q.weight.copy_(wq)
        nsa.to_kv.weight.view(3, 2, heads * d, dim)[index].copy_(torch.stack((wk, wv)))  # the branch's keys, values
        nsa.to_out.weight.copy_(dense.to_out.weight)
        nsa.to_gates.weight.zero_()
    device = device_for(kernel)
    dense, nsa = dense.to(device), nsa.to(device)
    x = torch.randn(2, n, dim).to(device).requires_grad_()
    expected, out = dense(x), nsa(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grad_out = torch.randn_like(out)
    expected_grads = torch.autograd.grad(expected, (x, dense.to_qkv.weight), grad_out)
    grads = torch.autograd.grad(out, (x, nsa.to_q.weight, nsa.to_kv.weight), grad_out)
    torch.testing.assert_close(grads[0], expected_grads[0], rtol=1e-5, atol=1e-6)
    branch_kv = grads[2].view(3, 2 * heads * d, dim)[index]
    torch.testing.assert_close(torch.cat((grads[1], branch_kv)), expected_grads[1], rtol=1e-5, atol=1e-5)  # sums over tokens


def test_gate_bias_starts_the_gates_where_a_learnt_bias_would():
    """gate_bias offsets each branch's gate logit: the same as a model whose gate biases were set
    to those values, in output and in gradient."""
    tokens = torch.randint(0, 64, (2, 30))
    offset = tiny_nsa(gate_bias=(3.0, -2.0, 0.5)).train()
    biased = tiny_nsa().train()
    with torch.no_grad():
        for layer in biased.blocks:
            gates = layer.attn.to_gates.bias.view(3, -1)  # [branch, heads]
            gates += torch.tensor([3.0, -2.0, 0.5])[:, None]
    out, expected = offset(tokens), biased(tokens)
    torch.testing.assert_close(out, expected)
    out.square().mean().backward()
    expected.square().mean().backward()
    torch.testing.assert_close(offset.blocks[0].attn.to_q.weight.grad, biased.blocks[0].attn.to_q.weight.grad)
    assert not torch.allclose(tiny_nsa()(tokens), out, atol=1e-3)


def test_shared_kv_gives_every_branch_one_projection():
    """shared_kv: one key/value projection read by all three branches, the same as separate
    projections holding equal weights (its gradient the sum of theirs)."""
    tokens = torch.randint(0, 64, (2, 30))
    shared = tiny_nsa(shared_kv=True).train()
    separate = tiny_nsa().train()
    state = shared.state_dict()
    for i, layer in enumerate(shared.blocks):
        assert layer.attn.to_kv.weight.shape[0] == separate.blocks[i].attn.to_kv.weight.shape[0] // 3
        state[f"blocks.{i}.attn.to_kv.weight"] = layer.attn.to_kv.weight.detach().repeat(3, 1)
    separate.load_state_dict(state)
    out, expected = shared(tokens), separate(tokens)
    torch.testing.assert_close(out, expected)
    out.square().mean().backward()
    expected.square().mean().backward()
    summed = separate.blocks[0].attn.to_kv.weight.grad.view(3, -1, 32).sum(0)
    torch.testing.assert_close(shared.blocks[0].attn.to_kv.weight.grad, summed)


def runs(q, kernel: str) -> str:
    """Which kernels the branch functions may call under model.kernel `kernel` (kernels/dispatch.py)."""
    return dispatch.choose(q, kernel, nsa_kernels.triton_problem(q.shape[2], q.shape[-1], 4), nsa_kernels.cpu_built)


def _selected_branch(attn, diff_topk):
    """The selected branch of one layer from fixed inputs, with selection differentiable or not:
    -> (output, compressed keys)"""
    gen = torch.Generator().manual_seed(0)
    n, d = 40, 8
    q = torch.randn(1, 1, 2, n, d, generator=gen)
    k, v = torch.randn(1, 1, n, d, generator=gen), torch.randn(1, 1, n, d, generator=gen)
    kc = torch.randn(1, 1, attn.compressor.num_blocks(n), d, generator=gen, requires_grad=True)
    _, scores, indices = compressed_attention(q.flatten(0, 1), kc.flatten(0, 1), kc.detach().flatten(0, 1), 0, 4, 2, 4,
                                              lambda imp, first: attn.rules.choose(imp, first, 2), importance_grad=diff_topk)
    return branches.selected(q, k, v, scores[None], indices[None], 0, attn.rules, runs(q, attn.kernel)), kc


def test_diff_topk_passes_gradient_to_the_compressed_keys_through_selection():
    """With differentiable selection the free blocks' shares of the output carry the importance's
    gradient to the compressed keys (the value is unchanged); without it they carry none."""
    attn = NativeSparseAttention(dim=16, heads=2, dim_head=8, kv_heads=1, sliding_window_size=4,
                                 compress_block_size=4, compress_stride=2, fine_block_size=4, num_fine_selected=5)
    plain, kc_plain = _selected_branch(attn, diff_topk=False)
    differentiable, kc = _selected_branch(attn, diff_topk=True)
    torch.testing.assert_close(differentiable, plain, rtol=0, atol=0)
    assert not plain.requires_grad  # nothing reaches the compressed keys without diff_topk
    (grad,) = torch.autograd.grad(differentiable.square().sum(), kc)
    assert grad.abs().max() > 0


def test_diff_topk_model_trains_the_compressor_through_selection():
    """In a whole model, diff_topk leaves the logits as they are and changes the compressor's gradient."""
    grads = []
    for diff_topk in (False, True):
        model = tiny_nsa(diff_topk=diff_topk, num_fine_selected=5).train()  # two freely chosen blocks
        x = torch.randint(0, 64, (2, 33))
        logits = model(x)
        F.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
        grads.append((logits.detach(), model.blocks[0].attn.compressor.w1.grad[:1].clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0])  # the same up to rounding: another summation order
    assert not torch.allclose(grads[0][1], grads[1][1])


@pytest.mark.parametrize("n", [37, 64, 101])
def test_selection_equals_the_dense_formulation(n):
    """The blocks chosen from the chunked, banded importance are those chosen from the dense
    [queries, blocks] x [blocks, fine blocks] formulation (sharp scores: no near-ties)."""
    attn = NativeSparseAttention(dim=16, heads=4, dim_head=8, kv_heads=2, sliding_window_size=4, compress_block_size=6,
                                 compress_stride=4, fine_block_size=8, num_fine_selected=6)
    gen = torch.Generator().manual_seed(n)
    blocks, num_fine = attn.compressor.num_blocks(n), -(-n // 8)
    q = 4 * torch.randn(4, 2, n, 8, dtype=torch.float64, generator=gen)
    kc = 4 * torch.randn(4, blocks, 8, dtype=torch.float64, generator=gen)
    _, scores, indices = compressed_attention(q, kc, kc, 0, 6, 4, 8, attn.rules.chooser(n))
    _, importance = naive(q, kc, kc, 0, 6, 4, 8, num_fine)
    ref_scores, ref_indices = attn.rules.choose(importance, 0, 3)
    valid = ref_scores > float("-inf")
    assert torch.equal(scores > float("-inf"), valid)
    assert torch.equal(indices[valid], ref_indices[valid])
    torch.testing.assert_close(scores[valid], ref_scores[valid])


@pytest.mark.parametrize("block,stride", [(16, 8), (12, 4), (8, 8), (12, 8), (8, 3)])
@pytest.mark.parametrize("n,first", [(7, 0), (16, 0), (41, 0), (41, 2)])
def test_compressor_is_an_mlp_over_each_blocks_tokens_and_positions(block, stride, n, first):
    """Block c (from block `first` on) is the MLP of its tokens, each plus its intra-block position,
    concatenated; values and gradients, whether or not the block is a whole number of strides."""
    torch.manual_seed(n)
    comp = BlockCompressor(1, block, stride, 8, 12).double()  # one key head, one value head
    comp.pos.data.normal_()
    comp.b1.data.normal_()
    x_in = torch.randn(3, n, 4, 8, dtype=torch.double, requires_grad=True)
    x = x_in[:, :, 1:3].transpose(1, 2)  # [b, heads, n, d], a strided view of a wider projection, as NSA's
    nc = comp.num_blocks(n - first * stride)
    expected = torch.stack([
        F.gelu(torch.einsum("bhx,hxy->bhy", (x[:, :, (first + c) * stride:][:, :, :block] + comp.pos).flatten(-2),
                            comp.w1) + comp.b1[:, 0]) for c in range(nc)], dim=2) if nc else x.new_zeros(3, 2, 0, 12)
    expected = torch.einsum("bhcy,hyd->bhcd", expected, comp.w2)
    out = comp(x.transpose(1, 2), first, kernel="torch").transpose(1, 2)  # [b, heads, blocks, d]: keys', values' heads
    torch.testing.assert_close(out, expected)
    if nc:
        grad = torch.randn_like(out)
        params = [x, comp.w1, comp.w2, comp.pos, comp.b1]
        for got, want in zip(torch.autograd.grad(out, params, grad), torch.autograd.grad(expected, params, grad)):
            torch.testing.assert_close(got, want)


def test_recorded_selection_holds_the_blocks_the_selected_branch_attends():
    """Each layer records, per query, its forced blocks and the one it chose, and says which of
    them holds a given position."""
    from models.attention.nsa import recording_selection

    model = tiny_nsa(num_fine_selected=4)
    tokens = torch.randint(0, 64, (2, 24))
    with torch.no_grad(), recording_selection(model) as selections:
        model(tokens)
    assert len(selections) == 2 and model.blocks[0].attn.selections is None  # one per layer, then off
    first = selections[0]
    assert first.blocks.shape[:3] == (2, 2, 24) and first.forced == 3
    t = 21  # own block 5, initial 0, previous 4, one of blocks 1..3 chosen
    chosen = set(first.blocks[0, 0, t].tolist()) - {-1}
    assert {5, 0, 4} <= chosen and len(chosen) == 4
    positions = torch.full((2, 24), -1)
    for block in range(6):
        positions[0, t] = 4 * block + 1
        selected, forced = first.holds(positions)
        assert selected[0, 0, t] == (block in chosen) and forced[0, 0, t] == (block in {0, 4, 5})
        assert not selected[1].any() and not selected[0, :, :t].any()  # only where a position was asked


@pytest.mark.triton
@pytest.mark.parametrize("n", [23, 77])
def test_triton_kernels_train_as_the_torch_path(n):
    """A training forward and backward on the Triton kernels (compressed attention and block
    selection from one scoring, selected blocks, the window) gives the outputs and gradients of the
    PyTorch path, at lengths off every block size (under TRITON_INTERPRET=1 without a GPU)."""
    knobs = dict(dim=32, heads=4, dim_head=16, kv_heads=2, sliding_window_size=8, compress_block_size=8,
                 compress_stride=4, fine_block_size=16, num_fine_selected=4)
    assert_trains_as_the_torch_path(knobs, "triton", n, "cuda" if torch.cuda.is_available() else "cpu")


def test_triton_kernel_refuses_a_dim_head_it_cannot_tile():
    with pytest.raises(ValueError, match="kernel=triton needs dim_head=8 to be a power of two from 16 to 256"):
        NativeSparseAttention(dim=16, heads=2, dim_head=8, kv_heads=1, sliding_window_size=4, compress_block_size=4,
                              compress_stride=2, fine_block_size=4, num_fine_selected=2, kernel="triton")


@pytest.mark.triton
def test_triton_kernels_decode_as_the_parallel_forward_and_see_no_future():
    """On the fused kernels, cached decoding (one token and several at a time) equals the parallel
    pass, and changing the tokens after t leaves the logits up to t as they were."""
    torch.manual_seed(0)
    model = nsa_lm(num_tokens=64, dim=32, depth=2, heads=4, dim_head=16, **KNOBS, kernel="triton").eval()
    model, x = model.to(TRITON_DEVICE), torch.randint(0, 64, (1, 40), device=TRITON_DEVICE)
    full = model(x)
    cache = model.new_cache()
    pieces = [model(x[:, :9], cache=cache), model(x[:, 9:10], cache=cache), model(x[:, 10:], cache=cache)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-5)
    for t in (3, 17):
        changed = x.clone()
        changed[:, t + 1 :] = (changed[:, t + 1 :] + 1) % 64
        # to the bit in the interpreter; on a GPU the chosen blocks' atomic sums may round otherwise
        tol = 0 if TRITON_DEVICE.type == "cpu" else 1e-6
        torch.testing.assert_close(model(changed)[:, : t + 1], full[:, : t + 1], rtol=tol, atol=tol)


@pytest.mark.triton
def test_triton_kernels_compile_whole_and_train_as_eager():
    """torch.compile traces the fused kernels' custom operator in one graph (no break, no Python
    float reaching a kernel) and the compiled layer's output and gradients equal the eager ones."""
    torch.manual_seed(0)
    layer = NativeSparseAttention(dim=32, heads=4, dim_head=16, kv_heads=2, sliding_window_size=8,
                                  compress_block_size=8, compress_stride=4, fine_block_size=16, num_fine_selected=4,
                                  kernel="triton").to(TRITON_DEVICE)
    x = torch.randn(1, 37, 32).to(TRITON_DEVICE).requires_grad_()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    results = []
    for run in (layer, compiled):
        out = run(x)
        results.append((out, *torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])))
    for eager, traced in zip(*results):
        torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-5)


# ---- compressor=mean (InfLLM-v2's: no parameters) ---------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
def test_mean_compressor_has_no_parameters_and_trains_as_the_torch_path(kernel):
    knobs = dict(dim=32, heads=4, dim_head=8, **KNOBS, compressor="mean")
    assert not [n for n, _ in NativeSparseAttention(**knobs).named_parameters() if "compressor" in n]
    assert_trains_as_the_torch_path(knobs, kernel, 37)


def test_mean_compressor_feeds_the_compressed_branch_the_block_means():
    """With only the compressed branch open, the output is attention over the blocks' mean keys and values."""
    from models.attention.nsa import MeanCompressor

    attn = NativeSparseAttention(dim=32, heads=4, dim_head=8, **KNOBS, compressor="mean", kernel="torch")
    assert isinstance(attn.compressor, MeanCompressor)
    x = torch.randn(1, 13, 2, 8)
    blocks = attn.compressor(x)
    starts = range(0, 13 - 4 + 1, 2)
    torch.testing.assert_close(blocks, torch.stack([x[:, s: s + 4].mean(1) for s in starts], 1))


def test_mean_compressor_decodes_as_the_parallel_forward():
    from tests.helpers.attention_checks import assert_cached_decoding_equals_parallel

    model = tiny_nsa(compressor="mean", kernel="torch").double()
    assert_cached_decoding_equals_parallel(model, torch.randint(0, 64, (2, 23)), [5, 1, 7, 10])
