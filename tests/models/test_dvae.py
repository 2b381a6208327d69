"""The discrete VAE: codes and decoded images of the right shape, reconstructions that improve
with training, the temperature schedule, and clear errors for impossible shapes; on CUDA (the gpu
tier): the first step against the CPU's, training in each precision."""

import math

import pytest
import torch

from experiments.data.shapes import Shapes
from models.dvae import DiscreteVAE
from tests.helpers.gpu import PRECISIONS, assert_devices_agree, assert_loss_falls, train_on_cuda
from tests.helpers.runs import TINY_DVAE
import torch.nn.functional as F


def tiny(**kwargs) -> DiscreteVAE:
    torch.manual_seed(0)
    return DiscreteVAE(**{**dict(image_size=16, num_tokens=32, codebook_dim=16, num_layers=2, hidden_dim=16,
                                     num_resnet_blocks=0, temperature=0.9, anneal_rate=0.0), **kwargs})


def test_hard_codes_decode_to_images_of_the_right_shape():
    vae = tiny(num_layers=3, image_size=32).eval()
    images = torch.rand(3, 3, 32, 32)
    codes = vae.codebook_indices(images)
    assert codes.shape == (3, 16) and codes.dtype == torch.long
    assert 0 <= codes.min() and codes.max() < 32
    decoded = vae.decode(codes)
    assert decoded.shape == (3, 3, 32, 32) and 0 <= decoded.min() and decoded.max() <= 1
    assert torch.equal(vae.reconstruct(images), decoded)


def test_hard_reconstructions_improve_with_training():
    data = Shapes(image_size=16)
    vae = tiny(anneal_rate=0.01)
    _, val = next(data.val_batches(1, 32))
    hard_error = lambda: torch.nn.functional.mse_loss(vae.eval().reconstruct(val), val).item()  # noqa: E731
    before = hard_error()
    opt = torch.optim.Adam(vae.parameters(), lr=3e-3)
    for step in range(150):
        _, images = data.train_batch(16, seed=0, step=step)
        loss, _ = vae.train()(images)
        opt.zero_grad()
        loss.backward()
        opt.step()
        vae.after_optimizer_step()
    after = hard_error()
    assert after < 0.5 * before, f"hard reconstruction error {before:.4f} -> {after:.4f}"


def test_temperature_anneals_per_optimizer_step_to_its_floor():
    vae = tiny(temperature=1.0, temperature_min=0.5, anneal_rate=0.1)
    assert vae.temperature == 1.0
    for _ in range(3):
        vae.after_optimizer_step()
    assert vae.temperature == pytest.approx(math.exp(-0.3))
    for _ in range(20):
        vae.after_optimizer_step()
    assert vae.temperature == 0.5
    state = vae.state_dict()  # the schedule resumes with the weights
    fresh = tiny(temperature=1.0, temperature_min=0.5, anneal_rate=0.1)
    fresh.load_state_dict(state)
    assert fresh.temperature == 0.5


def test_evaluation_is_deterministic_and_training_draws_noise():
    vae = tiny()
    images = torch.rand(2, 3, 16, 16)
    assert torch.equal(vae.eval()(images)[0], vae(images)[0])
    vae.train()
    assert not torch.equal(vae(images)[0], vae(images)[0])


def test_straight_through_uses_one_hot_codes_in_the_forward_pass():
    vae = tiny(straight_through=True).train()
    seen = {}
    handle = vae.decoder.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    vae(torch.rand(1, 3, 16, 16))
    handle.remove()
    # each cell's mixed codebook vector is exactly one codebook row
    rows = seen["x"].permute(0, 2, 3, 1).reshape(-1, 16)
    distances = (rows[:, None] - vae.codebook.weight[None]).abs().amax(-1).min(1).values
    assert distances.max() < 1e-5


def test_impossible_shapes_are_refused():
    with pytest.raises(ValueError, match="divisible"):
        tiny(image_size=20, num_layers=3)
    with pytest.raises(ValueError, match="temperature_min"):
        tiny(temperature=0.1, temperature_min=0.5)


@pytest.mark.gpu
def test_first_step_agrees_between_the_cpu_and_cuda():
    """In eval mode (the softmax at temperature_min): training draws Gumbel noise, each device from its
    own generator. TF32 off, so cuDNN's convolutions compute in fp32 as the CPU's do."""
    images = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    assert_devices_agree(lambda device: tiny(), lambda vae, device: vae(images.to(device))[0], train=False)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_trains_on_cuda(tmp_path, precision):
    assert_loss_falls(train_on_cuda(tmp_path, precision, base=TINY_DVAE))


def _decoder_input(vae, images):
    seen = {}
    handle = vae.decoder.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    _, figures = vae(images)
    handle.remove()
    return seen["x"], figures


def test_dvae_kl_to_uniform_and_the_temperatures_of_evaluation_and_training():
    vae = tiny(temperature=1.0, temperature_min=0.5, anneal_rate=0.1)
    for _ in range(3):
        vae.after_optimizer_step()  # temperature exp(-0.3) ~ 0.74
    images = torch.rand(2, 3, 16, 16)
    logits = vae.logits(images).detach()
    log_q = logits.log_softmax(1)
    mixed, figures = _decoder_input(vae.eval(), images)
    assert figures["kl"] == pytest.approx(((log_q.exp() * log_q).sum(1).mean() + math.log(32)).item(), rel=1e-5)
    expected = torch.einsum("bnhw,nd->bdhw", F.softmax(logits / 0.5, dim=1), vae.codebook.weight)
    torch.testing.assert_close(mixed, expected)
    vae.train()
    torch.manual_seed(1)
    mixed, _ = _decoder_input(vae, images)
    torch.manual_seed(1)
    relaxed = F.gumbel_softmax(logits, tau=vae.temperature, dim=1)
    torch.testing.assert_close(mixed, torch.einsum("bnhw,nd->bdhw", relaxed, vae.codebook.weight))
