"""Text-to-image: the discrete-VAE task, the DALL-E task, and generating images from a run.

    python train.py experiment=dvae                      # the VAE alone
    python train.py experiment=dalle                     # the VAE first, then DALL-E, in one run
    python train.py experiment=dalle task.vae_path=outputs/2026-11-22/10-00-00   # a trained VAE
    python -m experiments.text_to_image outputs/<run> --prompt "a large red circle at the top left"

task=dalle trains two members: the VAE ("vae_", for task.vae_steps steps, at task.vae_lr) and then
DALL-E ("", for trainer.max_steps steps) on the codes of the frozen VAE. With task.vae_path the
VAE comes from a dvae or dalle run and there is no VAE stage. A checkpoint holds what rebuilding
both needs (`dalle_hparams`, `vae_config`, `tokenizer`), so generation needs only the checkpoint.
"""

import argparse
import logging
import sys
from functools import partial
from pathlib import Path
from typing import Optional

import torch
import yaml
from omegaconf import OmegaConf

from experiments import checkpoint
from experiments.errors import UserError
from experiments.image_grid import save_grid
from experiments.schedule import warmup_cosine
from experiments.throughput import counted_flops, training_flops_per_token
from experiments.tokenizer import from_spec, tokenize
from experiments.training import Member, TrainingTask
from models.dvae import DiscreteVAE

log = logging.getLogger(__name__)


# ---- the VAE ---------------------------------------------------------------------------------


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


class DiscreteVAETask(TrainingTask):
    """task=dvae: trains `model` (a DiscreteVAE) to reconstruct the data's images."""

    task_name = "dvae"

    def __init__(self, num_samples: int = 8):
        self.num_samples = num_samples

    def setup(self, nets):
        if not isinstance(nets[""], DiscreteVAE):
            raise UserError("task=dvae trains a discrete VAE: use model=dvae (experiment=dvae)")
        check_images(self.data, nets[""], "model")
        return nets

    def tokens_per_sample(self, prefix: str) -> int:
        return self.members[0].model.fmap_size**2

    def flops_per_token(self, prefix, net) -> float:
        return vae_flops_per_token(net, self.backend.device)

    def micro_batch(self, step: int, micro: int):
        tr = self.trainer
        _, images = self.data.train_batch(tr.batch_size, seed=tr.seed, step=step, micro=micro,
                                          rank=self.backend.rank, world_size=self.backend.world_size)
        return images.to(self.backend.device, non_blocking=True)

    def loss(self, member: Member, images):
        loss, figures = member.trainee.forward(images)
        return loss, {k: float(v) for k, v in figures.items()} | {"temperature": member.model.temperature}

    def validation_metrics(self, member: Member) -> dict[str, float]:
        return self._reduce(vae_validation(member.model, self._val_images(), getattr(self.data, "score", None)))

    def _val_images(self):
        """(captions, images) of this rank's rows of the validation batches."""
        tr, world = self.trainer, self.backend.world_size
        for text, images in self.data.val_batches(tr.val_batches, tr.batch_size * world):
            text, images = self.val_shard((text, images))
            yield [self.data.tokenizer.decode(t) for t in text], images.to(self.backend.device)

    def _reduce(self, metrics: dict[str, float]) -> dict[str, float]:
        return {k: self.backend.all_reduce_mean(v) for k, v in metrics.items()}

    @torch.no_grad()
    def sample(self, step: int) -> None:
        self.sample_reconstructions(step, self.members[0].model)

    def sample_reconstructions(self, step: int, vae) -> None:
        """The first validation images over their hard reconstructions, as one PNG."""
        vae.eval()
        _, images = next(self.data.val_batches(1, min(self.num_samples, 8)))
        images = images.to(self.backend.device)
        shown = torch.cat([images, vae.reconstruct(images)])
        captions = ["original"] * len(images) + ["reconstruction"] * len(images)
        if self.run.is_main:
            save_grid(self.run.samples_dir / f"step_{step:07d}_vae.png", shown, captions, columns=len(images))
        self.tracker.log_images("vae_reconstructions", shown, captions, step)


def check_images(data, vae, key: str, configurable: bool = True) -> None:
    """The data's images must be the VAE's; `key` names the VAE (its config section if configurable)."""
    if data.image_size != vae.image_size or data.channels != vae.channels:
        fix = f"set data.image_size={vae.image_size}" + (f" or {key}.image_size={data.image_size}" if configurable else "")
        raise UserError(f"data gives {data.channels}x{data.image_size}x{data.image_size} images but {key} expects "
                        f"{vae.channels}x{vae.image_size}x{vae.image_size}: {fix}")


def load_vae(spec: str):
    """The VAE of a dvae or dalle run (directory or checkpoint) -> (vae, its config as yaml)."""
    from hydra.utils import instantiate

    path = checkpoint.resolve(spec, key="task.vae_path")
    state = checkpoint.load(path)
    if "vae_config" in state:  # a dalle run
        node, key = OmegaConf.create(state["vae_config"]), "vae_model"
    elif OmegaConf.create(state["config"]).task.get("_target_", "").endswith("DiscreteVAETask"):
        node, key = OmegaConf.create(state["config"]).model, "model"
    else:
        raise UserError(f"task.vae_path={spec}: {path} is neither a dvae nor a dalle run")
    vae = instantiate(node)
    checkpoint.load_weights(vae, state, key, path)
    return vae, OmegaConf.to_yaml(node, resolve=True)


# ---- DALL-E ----------------------------------------------------------------------------------


class TextToImageTask(DiscreteVAETask):
    """task=dalle: a VAE stage (unless the VAE is given), then DALL-E on the VAE's codes."""

    task_name = "dalle"

    def __init__(self, vae_path: Optional[str] = None, vae_steps: int = 1000, vae_lr: float = 3e-3,
                 num_samples: int = 32, temperature: float = 1.0, filter_thres: float = 0.9, cond_scale: float = 1.0):
        super().__init__(num_samples)
        self.vae_path = vae_path
        if vae_steps < 0:
            raise ValueError(f"vae_steps={vae_steps} must be >= 0")
        if not 0 <= filter_thres < 1:
            raise ValueError(f"filter_thres={filter_thres} must lie in [0, 1)")
        self.vae_steps, self.vae_lr = vae_steps, vae_lr
        self.temperature, self.filter_thres, self.cond_scale = temperature, filter_thres, cond_scale

    def setup(self, nets):
        make_dalle = nets.get("")
        if not isinstance(make_dalle, partial):
            raise UserError("task=dalle needs model=dalle (a DALL-E over the VAE's codes): use experiment=dalle")
        if self.vae_path is not None:
            vae, self.vae_config = load_vae(self.vae_path)
            log.info("VAE from %s (the `vae` section is not used); no VAE stage", self.vae_path)
            self.vae_steps = 0
            self.run.update_summary(vae_path=str(self.vae_path))
        elif nets.get("vae_") is not None:
            vae, self.vae_config = nets["vae_"], OmegaConf.to_yaml(self.cfg.vae, resolve=True)
        else:
            raise UserError("task=dalle needs a VAE: task.vae_path=<dvae run or checkpoint>, or a `vae` section "
                            "(`- /model@vae: dvae` in the defaults, as experiment=dalle has)")
        if self.vae_path is None:
            check_images(self.data, vae, "vae")
        else:
            check_images(self.data, vae, f"the VAE of task.vae_path={self.vae_path}", configurable=False)
        self.tokenizer = self.data.tokenizer
        self.dalle_hparams = {**make_dalle.keywords, "num_text_tokens": self.tokenizer.vocab_size,
                              "text_seq_len": self.data.text_seq_len, "num_image_tokens": vae.num_tokens,
                              "image_fmap_size": vae.fmap_size}
        try:
            dalle = make_dalle(**{k: self.dalle_hparams[k] for k in
                                  ("num_text_tokens", "text_seq_len", "num_image_tokens", "image_fmap_size")})
        except (ValueError, TypeError) as e:
            raise UserError(f"model: {e}") from None
        return {"": dalle, "vae_": vae}

    # ---- stages

    @property
    def total_steps(self) -> int:
        return self.vae_steps + self.trainer.max_steps

    def active(self, step: int) -> list[Member]:
        return [self.vae_member if step < self.vae_steps else self.dalle_member]

    @property
    def dalle_member(self) -> Member:
        return self.members[0]

    @property
    def vae_member(self) -> Member:
        return self.members[1]

    def optimizer_for(self, prefix, optimizer):
        return partial(optimizer, lr=self.vae_lr) if prefix == "vae_" else optimizer

    def schedule_for(self, prefix, schedule):
        if prefix == "vae_":  # the VAE stage decays over its own length
            return partial(warmup_cosine, warmup_steps=0, total_steps=max(self.vae_steps, 1), min_lr_ratio=0.1)
        return schedule

    def tokens_per_sample(self, prefix: str) -> int:
        if prefix == "vae_":
            return self.vae_member.model.fmap_size**2
        return self.dalle_member.model.seq_len

    def flops_per_token(self, prefix, net) -> float:
        if prefix == "vae_":
            return vae_flops_per_token(net, self.backend.device)
        return training_flops_per_token(net, net.seq_len, self.backend.device)

    # ---- batches, losses, validation

    def micro_batch(self, step: int, micro: int):
        tr = self.trainer
        text, images = self.data.train_batch(tr.batch_size, seed=tr.seed, step=step, micro=micro,
                                             rank=self.backend.rank, world_size=self.backend.world_size)
        device = self.backend.device
        if step < self.vae_steps:
            return images.to(device, non_blocking=True)
        return self._sequence(text.to(device), images.to(device))

    def _sequence(self, text, images):
        vae = self.vae_member.model.eval()
        with self.backend.autocast():
            codes = vae.codebook_indices(images)
        return self.dalle_member.model.sequence(text, codes)

    def loss(self, member: Member, batch):
        if member is self.vae_member:
            return super().loss(member, batch)
        tokens, targets = batch
        loss, text_loss, image_loss = member.trainee.forward(tokens, targets=targets)
        return loss, {"text_loss": float(text_loss), "image_loss": float(image_loss)}

    def validation_metrics(self, member: Member) -> dict[str, float]:
        if member is self.vae_member:
            return super().validation_metrics(member)
        tr, world, sums = self.trainer, self.backend.world_size, {}
        for text, images in self.data.val_batches(tr.val_batches, tr.batch_size * world):
            text, images = (t.to(self.backend.device) for t in self.val_shard((text, images)))
            tokens, targets = self._sequence(text, images)
            with self.backend.autocast():
                figures = member.model(tokens, targets=targets)
            for name, value in zip(("val_loss", "val_text_loss", "val_image_loss"), figures):
                sums[name] = sums.get(name, 0.0) + float(value) / tr.val_batches
        return self._reduce(sums)

    # ---- samples

    @torch.no_grad()
    def sample(self, step: int) -> None:
        if step <= self.vae_steps:  # the VAE stage
            self.sample_reconstructions(step, self.vae_member.model)
            return
        captions = self.data.prompts(self.num_samples)
        gen = torch.Generator(device=self.backend.device).manual_seed(self.trainer.seed + step)
        with self.backend.autocast():
            images = generate_images(self.dalle_member.model, self.vae_member.model, self.tokenizer, captions,
                                     temperature=self.temperature,
                                     filter_thres=self.filter_thres, cond_scale=self.cond_scale, generator=gen)
        if self.run.is_main:
            save_grid(self.run.samples_dir / f"step_{step:07d}.png", images, captions, columns=8)
        self.tracker.log_images("samples", images, captions, step)
        scores = self.data.score(images, captions) if hasattr(self.data, "score") else {}
        if scores:
            self.run.update_summary(**{k: round(v, 4) for k, v in scores.items()})
            self.run.log_metrics({"step": step, **scores})
            self.tracker.log(scores, step)
            log.info("step %d | %s", step, " | ".join(f"{k} {v:.3f}" for k, v in scores.items()))

    def checkpoint_extras(self) -> dict:
        return {
            "dalle_hparams": yaml.safe_dump(_plain(self.dalle_hparams)),
            "vae_config": self.vae_config,
            "tokenizer": yaml.safe_dump(self.tokenizer.spec()),
        }


def _plain(value):
    """Config values (ListConfig, enums) as plain yaml-able Python."""
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@torch.no_grad()
def generate_images(dalle, vae, tokenizer, captions: list[str], *, temperature: float = 1.0,
                    filter_thres: float = 0.9, cond_scale: float = 1.0, generator=None, truncate: bool = True):
    """captions -> images [batch, channels, size, size] in [0, 1]."""
    dalle.eval()
    vae.eval()
    device = next(dalle.parameters()).device
    text = tokenize(tokenizer, captions, dalle.text_seq_len, truncate=truncate).to(device)
    codes = dalle.generate_codes(text, temperature=temperature, filter_thres=filter_thres, cond_scale=cond_scale,
                                 generator=generator)
    return vae.decode(codes).float()


def load_run(spec: str, device: str = "cpu"):
    """(dalle, vae, tokenizer) of a dalle run directory or checkpoint."""
    from hydra.utils import instantiate

    from models.dalle import DALLE

    path = checkpoint.resolve(spec, key="run")
    state = checkpoint.load(path, map_location=device)
    if "dalle_hparams" not in state:
        raise UserError(f"{path} is not a dalle run's checkpoint (no dalle_hparams)")
    dalle = DALLE(**yaml.safe_load(state["dalle_hparams"]))
    checkpoint.load_weights(dalle, state, "model", path)
    vae = instantiate(OmegaConf.create(state["vae_config"]))
    checkpoint.load_weights(vae, state, "vae_model", path)
    tokenizer = from_spec(yaml.safe_load(state["tokenizer"]))
    return dalle.to(device).eval(), vae.to(device).eval(), tokenizer


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a dalle run directory or checkpoint")
    parser.add_argument("--prompt", required=True, help="the caption to draw")
    parser.add_argument("--num-images", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: <run>/samples/generated.png)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--filter-thres", type=float, default=0.9, help="keep the top (1 - this) of the image logits")
    parser.add_argument("--cond-scale", type=float, default=1.0, help="classifier-free guidance scale (1: none)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        dalle, vae, tokenizer = load_run(args.run)
        images = generate_images(dalle, vae, tokenizer, [args.prompt] * args.num_images,
                                 temperature=args.temperature, filter_thres=args.filter_thres,
                                 cond_scale=args.cond_scale, generator=torch.Generator().manual_seed(args.seed))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    run_dir = Path(args.run) if Path(args.run).is_dir() else Path(args.run).parent.parent
    out = args.out or run_dir / "samples" / "generated.png"
    save_grid(out, images, [args.prompt] * args.num_images)
    from experiments.shapes import score

    scores = score(images, [args.prompt] * args.num_images)
    print(f"wrote {out}" + "".join(f"  {k} {v:.2f}" for k, v in scores.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
