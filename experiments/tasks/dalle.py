"""task=dalle: a discrete-VAE stage (unless the VAE is given), then DALL-E on the frozen VAE's codes.

    python train.py experiment=dalle                     # the VAE first, then DALL-E, in one run
    python train.py experiment=dalle task.vae_path=outputs/2026-11-22/10-00-00   # a trained VAE

It trains two members: the VAE ("vae_", for task.vae_steps steps at task.vae_lr, run by a
DiscreteVAETask as its stage) and then DALL-E ("", for trainer.max_steps steps). With
task.vae_path the VAE comes from a dvae or dalle run and there is no VAE stage. A checkpoint holds
what rebuilding both needs (`dalle_hparams`, `vae_config`, `tokenizer`), so generation needs only it.
"""

import logging
from functools import partial
from typing import Optional

import torch
import yaml
from omegaconf import OmegaConf

from experiments.data.tokenizer import tokenize
from experiments.runtime import checkpoint
from experiments.runtime.errors import UserError
from experiments.runtime.image_grid import save_grid
from experiments.runtime.schedule import warmup_cosine
from experiments.runtime.throughput import training_flops_per_token
from experiments.tasks.dvae import DiscreteVAETask, check_images
from experiments.tasks.members import build_member
from experiments.tasks.task import Context, Member, Task
from models.dvae import DiscreteVAE

log = logging.getLogger(__name__)


class TextToImageTask(Task):
    name = "dalle"

    def __init__(self, vae_path: Optional[str], vae_steps: int, vae_lr: float, num_samples: int,
                 temperature: float, filter_thres: float, cond_scale: float):
        if vae_steps < 0:
            raise ValueError(f"vae_steps={vae_steps} must be >= 0")
        if not 0 <= filter_thres < 1:
            raise ValueError(f"filter_thres={filter_thres} must lie in [0, 1)")
        self.vae_path, self.vae_steps, self.vae_lr = vae_path, vae_steps, vae_lr
        self.num_samples, self.temperature, self.filter_thres, self.cond_scale = (
            num_samples, temperature, filter_thres, cond_scale)
        self.vae_stage = DiscreteVAETask(num_samples, prefix="vae_")

    def attach(self, ctx: Context) -> None:
        super().attach(ctx)
        self.vae_stage.attach(ctx)

    def check_parts(self, nets, data_kind, data_name):
        if not isinstance(nets.get(""), partial):
            raise UserError("task=dalle needs model=dalle (a DALL-E over the VAE's codes): use experiment=dalle")
        if data_kind != "images":
            raise UserError(f"task=dalle trains on captioned images, and data={data_name} is not: use data=shapes "
                            "or data=image_folder (experiment=dalle)")

    def setup(self, nets):
        ctx = self.ctx
        self.check_run_parts(nets)
        make_dalle = nets[""]
        if self.vae_path is not None:
            vae, self.vae_config = load_vae(self.vae_path)
            log.info("VAE from %s (the `vae` section is not used); no VAE stage", self.vae_path)
            self.vae_steps = 0
            ctx.run.update_summary(vae_path=str(self.vae_path))
            check_images(ctx.data, vae, f"the VAE of task.vae_path={self.vae_path}", configurable=False)
        elif nets.get("vae_") is not None:
            vae, self.vae_config = nets["vae_"], OmegaConf.to_yaml(ctx.cfg.vae, resolve=True)
            check_images(ctx.data, vae, "vae")
        else:
            raise UserError("task=dalle needs a VAE: task.vae_path=<dvae run or checkpoint>, or a `vae` section "
                            "(`- /model@vae: dvae` in the defaults, as experiment=dalle has)")
        self.tokenizer = ctx.data.tokenizer
        built_here = {"num_text_tokens": self.tokenizer.vocab_size, "text_seq_len": ctx.data.text_seq_len,
                      "num_image_tokens": vae.num_tokens, "image_fmap_size": vae.fmap_size}
        self.dalle_hparams = {**make_dalle.keywords, **built_here}
        try:
            dalle = make_dalle(**built_here)
        except (ValueError, TypeError) as e:
            raise UserError(f"model: {e}") from None
        return {"": dalle, "vae_": vae}

    # ---- stages

    @property
    def total_steps(self) -> int:
        return self.vae_steps + self.ctx.trainer.max_steps

    def in_vae_stage(self, step: int) -> bool:
        return step < self.vae_steps

    def active(self, step: int) -> list[Member]:
        return [self.ctx.members[1 if self.in_vae_stage(step) else 0]]

    @property
    def dalle(self):
        return self.ctx.members[0].model

    def optimizer_for(self, prefix, optimizer):
        return partial(optimizer, lr=self.vae_lr) if prefix == "vae_" else optimizer

    def schedule_for(self, prefix, schedule):
        if prefix == "vae_":  # the VAE stage decays over its own length
            return partial(warmup_cosine, warmup_steps=0, total_steps=max(self.vae_steps, 1), min_lr_ratio=0.1)
        return schedule

    def tokens_per_sample(self, prefix: str) -> int:
        return self.vae_stage.tokens_per_sample(prefix) if prefix == "vae_" else self.dalle.seq_len

    def flops_per_token(self, prefix, net, seq_len=None) -> float:  # one length: the text's and the image's
        if prefix == "vae_":
            return self.vae_stage.flops_per_token(prefix, net)
        return training_flops_per_token(net, net.seq_len, self.ctx.backend.device)

    # ---- batches, losses, validation

    def micro_batch(self, step: int, micro: int):
        if self.in_vae_stage(step):
            return self.vae_stage.micro_batch(step, micro)
        tr, backend = self.ctx.trainer, self.ctx.backend
        text, images = self.ctx.data.train_batch(tr.batch_size, seed=tr.seed, step=step, micro=micro,
                                                 rank=backend.rank, world_size=backend.world_size)
        return self._sequence(text.to(backend.device), images.to(backend.device))

    def _sequence(self, text, images):
        vae = self.vae_stage.vae.eval()
        with self.ctx.backend.autocast():
            codes = vae.codebook_indices(images)
        return self.dalle.sequence(text, codes)

    def loss(self, member: Member, batch):
        if member.prefix == "vae_":
            return self.vae_stage.loss(member, batch)
        tokens, targets = batch
        loss, text_loss, image_loss = member.trainee.forward(tokens, targets=targets)
        return loss, {"text_loss": float(text_loss), "image_loss": float(image_loss)}

    def validation_metrics(self, member: Member) -> dict[str, float]:
        if member.prefix == "vae_":
            return self.vae_stage.validation_metrics(member)
        tr, backend, sums = self.ctx.trainer, self.ctx.backend, {}
        for text, images in self.ctx.data.val_batches(tr.val_batches, tr.batch_size * backend.world_size):
            text, images = (t.to(backend.device) for t in self.val_shard((text, images)))
            tokens, targets = self._sequence(text, images)
            with backend.autocast():
                figures = member.model(tokens, targets=targets)
            for name, value in zip(("val_loss", "val_text_loss", "val_image_loss"), figures):
                sums[name] = sums.get(name, 0.0) + float(value) / tr.val_batches
        return {k: backend.all_reduce_mean(v) for k, v in sums.items()}

    # ---- samples

    @torch.no_grad()
    def sample(self, step: int) -> None:
        if step <= self.vae_steps:  # the VAE stage's end, or a step inside it
            self.vae_stage.sample(step)
            return
        ctx = self.ctx
        captions = ctx.data.prompts(self.num_samples)
        gen = torch.Generator(device=ctx.backend.device).manual_seed(ctx.trainer.seed + step)
        with ctx.backend.autocast():
            images = generate_images(self.dalle, self.vae_stage.vae, self.tokenizer, captions,
                                     temperature=self.temperature, filter_thres=self.filter_thres,
                                     cond_scale=self.cond_scale, generator=gen)
        if ctx.run.is_main:
            save_grid(ctx.run.samples_dir / f"step_{step:07d}.png", images, captions, columns=8)
        ctx.tracker.log_images("samples", images, captions, step)
        scores = ctx.data.score(images, captions) if hasattr(ctx.data, "score") else {}
        if scores:
            ctx.run.update_summary(**{k: round(v, 4) for k, v in scores.items()})
            ctx.run.log_metrics({"step": step, **scores})
            ctx.tracker.log(scores, step)
            log.info("step %d | %s", step, " | ".join(f"{k} {v:.3f}" for k, v in scores.items()))

    def checkpoint_extras(self) -> dict:
        return {
            "dalle_hparams": yaml.safe_dump(_plain(self.dalle_hparams)),
            "vae_config": self.vae_config,
            "tokenizer": yaml.safe_dump(self.tokenizer.spec()),
        }


def load_vae(spec: str) -> tuple[DiscreteVAE, str]:
    """The VAE of a dvae or dalle run (directory or checkpoint) -> (vae, its config as yaml)."""
    path = checkpoint.resolve(spec, key="task.vae_path")
    state = checkpoint.load(path)
    prefix = "vae_" if "vae_config" in state else ""
    vae = build_member(state, prefix, path, key="task.vae_path")
    if not isinstance(vae, DiscreteVAE):
        raise UserError(f"task.vae_path={spec}: {path} is neither a dvae nor a dalle run")
    config = state["vae_config"] if prefix else OmegaConf.to_yaml(OmegaConf.create(state["config"]).model, resolve=True)
    return vae, config


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
