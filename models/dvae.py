"""The discrete VAE of DALL-E (Ramesh et al. 2021): images <-> a grid of codebook indices.

The encoder halves the resolution `num_layers` times and gives, at each cell of the
[fmap, fmap] grid (fmap = image_size / 2**num_layers), logits over `num_tokens` codes. Training
relaxes the choice with Gumbel-softmax at a temperature annealed per optimizer step,
temperature = max(temperature_min, temperature * exp(-anneal_rate * step)), mixes the codebook
vectors by the relaxed one-hot, and decodes; the loss is the reconstruction's mean squared error
plus kl_weight * KL(q(code | image) || uniform). `straight_through` uses the hard one-hot in the
forward pass and the soft one's gradient.

Images are [batch, channels, image_size, image_size] in [0, 1] at the interface; codes are
[batch, fmap * fmap] in row-major order, the order in which DALL-E generates them.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ResBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, channels, 1),
        )

    def forward(self, x: Tensor) -> Tensor:
        return x + self.net(x)


class DiscreteVAE(nn.Module):
    def __init__(
        self,
        *,
        image_size: int = 32,
        num_tokens: int,
        codebook_dim: int,
        num_layers: int = 2,
        num_resnet_blocks: int,
        hidden_dim: int = 64,
        channels: int = 3,
        temperature: float,
        temperature_min: float = 0.0625,
        anneal_rate: float,
        kl_weight: float = 0.0,
        straight_through: bool = False,
    ):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers={num_layers} must be at least 1")
        if image_size % 2**num_layers:
            raise ValueError(f"image_size={image_size} must be divisible by 2**num_layers={2**num_layers}")
        if not 0 < temperature_min <= temperature:
            raise ValueError(f"need 0 < temperature_min ({temperature_min}) <= temperature ({temperature})")
        self.image_size, self.channels, self.num_tokens = image_size, channels, num_tokens
        self.num_layers = num_layers
        self.fmap_size = image_size // 2**num_layers
        self.temperature0, self.temperature_min, self.anneal_rate = temperature, temperature_min, anneal_rate
        self.kl_weight, self.straight_through = kl_weight, straight_through
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))  # optimizer steps taken (annealing)

        down = []
        width = channels
        for _ in range(num_layers):
            down += [nn.Conv2d(width, hidden_dim, 4, stride=2, padding=1), nn.ReLU()]
            width = hidden_dim
        self.encoder = nn.Sequential(*down, *(ResBlock(hidden_dim) for _ in range(num_resnet_blocks)),
                                     nn.Conv2d(hidden_dim, num_tokens, 1))
        self.codebook = nn.Embedding(num_tokens, codebook_dim)
        up = [nn.Conv2d(codebook_dim, hidden_dim, 1), *(ResBlock(hidden_dim) for _ in range(num_resnet_blocks))]
        for _ in range(num_layers):
            up += [nn.ConvTranspose2d(hidden_dim, hidden_dim, 4, stride=2, padding=1), nn.ReLU()]
        self.decoder = nn.Sequential(*up, nn.Conv2d(hidden_dim, channels, 1))

    @property
    def temperature(self) -> float:
        return max(self.temperature_min, self.temperature0 * math.exp(-self.anneal_rate * int(self.steps)))

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        self.steps += 1

    def logits(self, images: Tensor) -> Tensor:
        """images [b, c, s, s] in [0, 1] -> code logits [b, num_tokens, fmap, fmap]."""
        return self.encoder(images * 2 - 1)

    @torch.no_grad()
    def codebook_indices(self, images: Tensor) -> Tensor:
        """images [b, c, s, s] -> the most likely codes [b, fmap * fmap] (what DALL-E learns)."""
        return self.logits(images).argmax(1).flatten(1)

    def decode(self, codes: Tensor) -> Tensor:
        """codes [b, fmap * fmap] -> images [b, c, s, s] in [0, 1]."""
        f = self.fmap_size
        embedded = self.codebook(codes).view(codes.shape[0], f, f, -1).permute(0, 3, 1, 2)
        return self._to_image(self.decoder(embedded))

    def forward(self, images: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """images [b, c, s, s] in [0, 1] -> (loss, {"recon_loss", "kl"}) through relaxed codes
        (Gumbel noise while training; in eval mode the plain softmax at temperature_min)."""
        logits = self.logits(images)
        if self.training:
            one_hot = F.gumbel_softmax(logits, tau=self.temperature, dim=1, hard=self.straight_through)
        else:  # evaluation is deterministic: no noise, the final temperature
            one_hot = F.softmax(logits / self.temperature_min, dim=1)
        mixed = torch.einsum("bnhw,nd->bdhw", one_hot, self.codebook.weight)
        recon = self.decoder(mixed)
        recon_loss = F.mse_loss(recon, images * 2 - 1)
        log_q = F.log_softmax(logits.float(), dim=1)
        # KL(q || uniform) per cell, averaged over the cells: sum q log q + log num_tokens
        kl = (log_q.exp() * log_q).sum(1).mean() + math.log(self.num_tokens)
        return recon_loss + self.kl_weight * kl, {"recon_loss": recon_loss.detach(), "kl": kl.detach()}

    @torch.no_grad()
    def reconstruct(self, images: Tensor) -> Tensor:
        """The hard reconstruction: images -> argmax codes -> images [b, c, s, s] in [0, 1]."""
        return self.decode(self.codebook_indices(images))

    @staticmethod
    def _to_image(x: Tensor) -> Tensor:
        return ((x + 1) / 2).clamp(0, 1)
