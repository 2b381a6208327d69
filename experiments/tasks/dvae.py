"""task=dvae: a discrete VAE (models/dvae.py) learns to reconstruct the data's images. DALL-E's
task (experiments/tasks/dalle.py) runs the same steps as its first stage.

    python train.py experiment=dvae
"""

import torch

from experiments.runtime.errors import UserError
from experiments.runtime.image_grid import save_grid
from experiments.runtime.throughput import counted_flops
from experiments.tasks.task import Member, Task
from models.dvae import DiscreteVAE


def vae_flops_per_token(vae, device) -> float:
    """Counted FLOPs of forward + backward on one image, per code of its grid."""
    images = torch.rand(1, vae.channels, vae.image_size, vae.image_size, generator=torch.Generator().manual_seed(0))
    return counted_flops(vae, lambda: vae(images.to(device))[0]) / vae.fmap_size**2


@torch.no_grad()
def vae_validation(vae, batches, score=None) -> dict[str, float]:
    """Relaxed (soft codes at the final temperature, no noise) and hard (argmax codes)
    reconstruction errors, in the [-1, 1] units of the training loss, and the share of the
    codebook in use. val_loss is the hard error: what DALL-E's codes decode to. With a scorer
    (data=shapes), how often the hard reconstructions still show the captioned colour and shape:
    the ceiling of what DALL-E's samples can score. batches: (captions, images [b, c, s, s])."""
    sums, used, n = {}, set(), 0
    for captions, images in batches:
        _, figures = vae(images)
        codes = vae.codebook_indices(images)
        recon = vae.decode(codes)
        figures = {"val_recon_loss": float(figures["recon_loss"]),
                   "val_hard_recon_loss": float(torch.nn.functional.mse_loss(recon * 2 - 1, images * 2 - 1)),
                   **({f"val_{k}": v for k, v in score(recon, captions).items()} if score else {})}
        for k, v in figures.items():
            sums[k] = sums.get(k, 0.0) + v
        used.update(codes.unique().tolist())
        n += 1
    means = {k: v / n for k, v in sums.items()}
    return {"val_loss": means["val_hard_recon_loss"], **means, "val_codebook_usage": len(used) / vae.num_tokens}


def check_images(data, vae, key: str, configurable: bool = True) -> None:
    """The data's images must be the VAE's; `key` names the VAE (its config section if configurable)."""
    if not hasattr(data, "image_size"):
        raise UserError(f"{key} reads images, and this data is not images: use data=shapes or data=image_folder")
    if data.image_size != vae.image_size or data.channels != vae.channels:
        knob = "channels" if data.channels != vae.channels else "image_size"
        fix = f"set data.{knob}={getattr(vae, knob)}"
        fix += f" or {key}.{knob}={getattr(data, knob)}" if configurable else ""
        raise UserError(f"data gives {data.channels}x{data.image_size}x{data.image_size} images but {key} expects "
                        f"{vae.channels}x{vae.image_size}x{vae.image_size}: {fix}")


class DiscreteVAETask(Task):
    """Trains the member `prefix` ("" alone; "vae_" as DALL-E's first stage) to reconstruct images."""

    name = "dvae"

    def __init__(self, num_samples: int, prefix: str = ""):
        self.num_samples = num_samples
        self.prefix = prefix

    def check_parts(self, nets, data_kind, data_name):
        if not isinstance(nets[""], DiscreteVAE):
            raise UserError("task=dvae trains a discrete VAE: use model=dvae (experiment=dvae)")
        if data_kind != "images":
            raise UserError(f"task=dvae trains on images, and data={data_name} is not: use data=shapes or "
                            "data=image_folder (experiment=dvae)")

    def setup(self, nets):
        self.check_run_parts(nets)
        check_images(self.ctx.data, nets[""], "model")
        return nets

    @property
    def vae(self) -> DiscreteVAE:
        return next(m.model for m in self.ctx.members if m.prefix == self.prefix)

    def tokens_per_sample(self, prefix: str) -> int:
        return self.vae.fmap_size**2

    def flops_per_token(self, prefix, net, seq_len=None) -> float:  # images of one size
        return vae_flops_per_token(net, self.ctx.backend.device)

    def micro_batch(self, step: int, micro: int):
        tr, backend = self.ctx.trainer, self.ctx.backend
        _, images = self.ctx.data.train_batch(tr.batch_size, seed=tr.seed, step=step, micro=micro,
                                              rank=backend.rank, world_size=backend.world_size)
        return images.to(backend.device, non_blocking=True)

    def loss(self, member: Member, images):
        loss, figures = member.trainee.forward(images)
        return loss, {k: float(v) for k, v in figures.items()} | {"temperature": member.model.temperature}

    def validation_metrics(self, member: Member) -> dict[str, float]:
        metrics = vae_validation(member.model, self._val_images(), getattr(self.ctx.data, "score", None))
        return {k: self.ctx.backend.all_reduce_mean(v) for k, v in metrics.items()}

    def _val_images(self):
        """(captions, images) of this rank's rows of the validation batches."""
        tr, data = self.ctx.trainer, self.ctx.data
        for text, images in data.val_batches(tr.val_batches, tr.batch_size * self.ctx.backend.world_size):
            text, images = self.val_shard((text, images))
            yield [data.tokenizer.decode(t) for t in text], images.to(self.ctx.backend.device)

    @torch.no_grad()
    def sample(self, step: int) -> None:
        """The first validation images over their hard reconstructions, as one PNG."""
        ctx, vae = self.ctx, self.vae.eval()
        _, images = next(ctx.data.val_batches(1, min(self.num_samples, 8)))
        images = images.to(ctx.backend.device)
        shown = torch.cat([images, vae.reconstruct(images)])
        captions = ["original"] * len(images) + ["reconstruction"] * len(images)
        if ctx.run.is_main:
            save_grid(ctx.run.samples_dir / f"step_{step:07d}_vae.png", shown, captions, columns=len(images))
        ctx.tracker.log_images("vae_reconstructions", shown, captions, step)
