"""DALL-E on the backbone: causal over [caption; image] for every attention type, cached decoding
equal to the parallel pass, the loss's targets, conditioning on the text, shared layers; on CUDA
(the gpu tier): cached decoding, the first step against the CPU's, training in each precision."""

import pytest
import torch

from tests.helpers.attention_checks import (assert_cached_decoding_equals_parallel, assert_causal_by_gradient,
                              assert_causal_by_perturbation)
from tests.helpers.gpu import PRECISIONS, assert_cached_decoding_on_cuda, assert_devices_agree, train_on_cuda
from tests.helpers.runs import TINY_DALLE
from models.dalle import DALLE, IGNORE, attention_mask

TEXT_LEN, FMAP = 6, 4
SPARSE = {"nsa": dict(kv_heads=1, sliding_window_size=6, compress_block_size=4, compress_stride=2,
                      fine_block_size=4, num_fine_selected=2),
          "sinkhorn": dict(bucket_size=4), "routing": dict(window_size=4, num_clusters=2)}
TYPES = ["full", "axial_row", "axial_col", "conv_like", "nsa", "sinkhorn", "routing"]


def tiny(attn_types=("full",), **kwargs) -> DALLE:
    torch.manual_seed(0)
    options = dict(num_text_tokens=20, text_seq_len=TEXT_LEN, num_image_tokens=12, image_fmap_size=FMAP, dim=32,
                   depth=2, heads=2, dim_head=16, attn_types=list(attn_types), kernel_size=3, sparse_options=SPARSE)
    return DALLE(**{**options, **kwargs}).double()


def batch(model, b=2):
    gen = torch.Generator().manual_seed(1)
    text = torch.randint(1, model.num_text_tokens, (b, TEXT_LEN), generator=gen)
    text[:, 4:] = 0  # padded captions
    codes = torch.randint(0, model.num_image_tokens, (b, FMAP * FMAP), generator=gen)
    return text, codes


def test_masks_follow_their_pattern():
    # text_len 2, a 3x3 grid; the query at 2 + k predicts code k, the key at 3 + j holds code j
    row, col, conv = (attention_mask(kind, 2, 3, kernel_size=3) for kind in ("axial_row", "axial_col", "conv_like"))
    q = lambda k: 2 + k  # noqa: E731
    key = lambda j: 3 + j  # noqa: E731
    assert row[q(4), key(3)] and not row[q(4), key(1)]  # code 4 (row 1, col 1): code 3 shares its row
    assert col[q(4), key(1)] and not col[q(4), key(3)]  # ... code 1 its column
    assert conv[q(4), key(0)] and conv[q(4), key(3)] and not conv[q(8), key(0)]  # 3x3 window around
    for mask in (row, col, conv):
        assert not mask.triu(1).any(), "a pattern lets a query see a later position"
        assert mask[:, :3].tril().equal(torch.ones(11, 3, dtype=torch.bool).tril()), "the caption is always visible"
    assert attention_mask("full", 2, 3) is None  # plain causal attention: the fast path


VARIANTS = [pytest.param(kind, False, id=kind) for kind in TYPES] + [
    pytest.param(kind, True, id=f"{kind}-shift_tokens") for kind in ("full", "axial_row", "routing")]


@pytest.mark.parametrize("kind, shift", VARIANTS)
def test_causal_over_text_and_image(kind, shift):
    model = tiny([kind], shift_tokens=shift).eval()
    tokens, _ = model.sequence(*batch(model))
    for t in (2, TEXT_LEN, TEXT_LEN + 5):  # inside the caption, its end, inside the image
        assert_causal_by_perturbation(model, tokens, t)
    model.train()
    assert_causal_by_gradient(model, tokens, TEXT_LEN + 3)


@pytest.mark.parametrize("kind, shift", VARIANTS)
def test_cached_decoding_equals_the_parallel_pass(kind, shift):
    model = tiny([kind], shift_tokens=shift).eval()
    tokens, _ = model.sequence(*batch(model))
    n = tokens.shape[1]
    # float64: sums in another order (NSA's compressed blocks) differ by ~1e-9, a wrong mask by O(1)
    assert_cached_decoding_equals_parallel(model, tokens, [TEXT_LEN + 1] + [1] * (n - TEXT_LEN - 1), atol=1e-8)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", TYPES)
def test_cached_decoding_equals_the_parallel_pass_on_cuda(kind):
    model = tiny([kind])
    tokens, _ = model.sequence(*batch(model))
    assert_cached_decoding_on_cuda(model, tokens, [TEXT_LEN + 1] + [1] * (tokens.shape[1] - TEXT_LEN - 1))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", TYPES)
def test_first_step_agrees_between_the_cpu_and_cuda(kind):
    """Sinkhorn layers in eval mode: in training they draw Gumbel noise, each device from its own
    generator."""
    model = tiny([kind])
    tokens, targets = model.sequence(*batch(model))
    assert_devices_agree(lambda device: tiny([kind]).float(),
                         lambda dalle, device: dalle(tokens.to(device), targets=targets.to(device))[0],
                         train=kind != "sinkhorn")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_trains_on_cuda(tmp_path, precision):
    """Both stages (the VAE, then DALL-E) run on CUDA, each logging its losses."""
    rows = train_on_cuda(tmp_path, precision, base=TINY_DALLE, steps=3)  # and task.vae_steps=3
    assert [r["step"] for r in rows if "vae_loss" in r] == [1, 2, 3]
    assert [r["step"] for r in rows if "image_loss" in r] == [4, 5, 6]


def test_targets_are_the_caption_then_the_codes():
    model = tiny()
    text, codes = batch(model)
    tokens, targets = model.sequence(text, codes)
    assert tokens.shape == targets.shape == (2, TEXT_LEN + FMAP * FMAP)
    assert (tokens[:, 0] == 0).all() and torch.equal(tokens[:, 1 : TEXT_LEN + 1], text)
    assert torch.equal(targets[:, TEXT_LEN:], codes + model.num_text_tokens)
    # the first pad (end of caption) is a target, later pads are not
    assert targets[0, 4] == 0 and (targets[:, 5:TEXT_LEN] == IGNORE).all()


def test_loss_weights_image_and_text():
    model = tiny(loss_img_weight=3.0)
    tokens, targets = model.sequence(*batch(model))
    loss, text_loss, image_loss = model(tokens, targets=targets)
    torch.testing.assert_close(loss.float(), (text_loss + 3.0 * image_loss) / 4.0)
    logits = model(tokens)
    # the parallel logits put no mass on the other modality
    assert torch.isinf(logits[:, :TEXT_LEN, model.num_text_tokens :]).all()
    assert torch.isinf(logits[:, TEXT_LEN:, : model.num_text_tokens]).all()


def test_generation_is_conditioned_on_the_text():
    model = tiny().eval()
    text, _ = batch(model)
    other = text.clone()
    other[:, :3] = (other[:, :3] + 1) % model.num_text_tokens
    first = lambda t: model(torch.cat([torch.zeros_like(t[:, :1]), t], 1))[:, -1]  # noqa: E731
    assert not torch.allclose(first(text), first(other)), "the first code's distribution ignores the caption"
    codes = model.generate_codes(text, generator=torch.Generator().manual_seed(0))
    assert codes.shape == (2, FMAP * FMAP) and 0 <= codes.min() and codes.max() < model.num_image_tokens
    again = model.generate_codes(text, generator=torch.Generator().manual_seed(0))
    assert torch.equal(codes, again)


def test_guidance_scale_one_is_plain_sampling_and_greedy_is_the_argmax():
    model = tiny(cond_drop_prob=0.2).eval()
    text, _ = batch(model)
    plain = model.generate_codes(text, generator=torch.Generator().manual_seed(3))
    assert torch.equal(plain, model.generate_codes(text, cond_scale=1.0, generator=torch.Generator().manual_seed(3)))
    guided = model.generate_codes(text, cond_scale=3.0, temperature=0.0)
    tokens = torch.cat([torch.zeros_like(text[:, :1]), text], 1)
    null = torch.cat([torch.zeros_like(text[:, :1]), torch.zeros_like(text)], 1)
    cond, uncond = (model(t)[:, -1, model.num_text_tokens :] for t in (tokens, null))
    assert torch.equal(guided[:, 0], (uncond + 3.0 * (cond - uncond)).argmax(-1))


def test_shared_layers_share_parameters_and_gradients_are_exact_when_reversible():
    shared = tiny(depth=4, shared_attn_ids=[0, 1], shared_ff_ids=[0, 0, 1, 1], reversible=True)
    plain = tiny(depth=4)
    assert shared.blocks[0].attn is shared.blocks[2].attn and shared.blocks[0].ff is shared.blocks[1].ff
    assert sum(p.numel() for p in shared.parameters()) < sum(p.numel() for p in plain.parameters())
    tokens, targets = shared.sequence(*batch(shared))
    shared(tokens, targets=targets)[0].backward()
    recomputed = {n: p.grad.clone() for n, p in shared.named_parameters()}
    shared.zero_grad()
    # the same couplings through plain autograd: the inference path, with gradients on
    hidden = shared.hidden(tokens, cache=shared.new_cache())
    torch.nn.functional.cross_entropy(
        torch.nn.functional.linear(hidden[:, TEXT_LEN:], shared.to_logits.weight[shared.num_text_tokens :]).flatten(0, 1),
        (targets[:, TEXT_LEN:] - shared.num_text_tokens).flatten(),
    ).mul(shared.loss_img_weight / (shared.loss_img_weight + 1)).add(
        torch.nn.functional.cross_entropy(
            torch.nn.functional.linear(hidden[:, :TEXT_LEN], shared.to_logits.weight[: shared.num_text_tokens]).flatten(0, 1),
            targets[:, :TEXT_LEN].flatten(), ignore_index=IGNORE,
        ).div(shared.loss_img_weight + 1)
    ).backward()
    for name, p in shared.named_parameters():
        torch.testing.assert_close(recomputed[name], p.grad, msg=name)


def test_shared_ids_refuse_layers_of_different_types():
    with pytest.raises(ValueError, match="shared_attn_ids"):
        tiny(["full", "axial_row"], shared_attn_ids=[0, 0])


def test_tied_embeddings_and_bad_types():
    model = tiny(share_input_output_emb=True)
    assert model.to_logits.weight is model.token_emb.weight
    with pytest.raises(ValueError, match="attn_types"):
        tiny(["sparse"])


def test_shift_tokens_read_the_previous_position_and_the_code_above():
    from models.dalle import ShiftTokens

    seen = {}
    probe = lambda x, cache=None: seen.setdefault("x", x)  # noqa: E731
    shift = ShiftTokens(probe, text_len=2, fmap=3)
    x = torch.arange(11, dtype=torch.float64)[None, :, None].repeat(1, 1, 8) + 1  # position p holds p + 1
    shift(x)
    out = seen["x"][0]
    assert out[0, 0] == 0 and out[5, 0] == 5  # first quarter: the previous position (none for the first)
    assert out[5, 4] == 6 == x[0, 5, 4]  # the last half of the channels stay
    assert out[2, 2] == 3  # a text position keeps its second quarter
    assert (out[3:6, 2] == 0).all()  # codes 0-2 (positions 3-5), the first row, have no code above them
    assert out[6, 2] == 4  # code 3 (position 6) reads code 0 (position 3), one row up


def test_filter_thres_keeps_the_top_fraction_of_the_image_logits():
    model = tiny().eval()
    text, _ = batch(model)
    # 12 image tokens, (1 - 0.95) of them: the top 1, so sampling at any temperature is greedy
    sampled = model.generate_codes(text, filter_thres=0.95, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampled, model.generate_codes(text, temperature=0.0))


def test_a_dropped_caption_is_no_target():
    model = tiny(cond_drop_prob=0.9).train()
    tokens, targets = model.sequence(*batch(model))
    torch.manual_seed(0)
    dropped_tokens, dropped_targets = model._drop_captions(tokens, targets)
    dropped = (dropped_tokens[:, 1 : TEXT_LEN + 1] == 0).all(1)
    assert dropped.any()
    assert (dropped_targets[dropped, :TEXT_LEN] == IGNORE).all()
    assert torch.equal(dropped_targets[:, TEXT_LEN:], targets[:, TEXT_LEN:])
