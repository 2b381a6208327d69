"""The language-modelling task: next-byte prediction with validation, samples and checkpoints.

train.py builds the parts from the config and calls the task with them; the task owns the loop.
"""

import logging
import math
import time
from typing import Optional

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from tqdm import tqdm

from experiments import checkpoint
from experiments.errors import TrainingError, UserError
from experiments.throughput import matmul_peak_flops, training_flops_per_token
from models.sampling import generate

log = logging.getLogger(__name__)

# config sections that must match for a checkpoint to continue this run
_RESUME_MUST_MATCH = ("model", "data", "optimizer", "schedule", "task")


class LanguageModelTask:
    def __init__(self, prime_length: int = 64, generate_length: int = 256, num_samples: int = 1,
                 temperature: float = 1.0, top_k: Optional[int] = None):
        self.prime_length = prime_length
        self.generate_length = generate_length
        self.num_samples = num_samples
        self.temperature = temperature
        self.top_k = top_k

    def __call__(self, *, run, cfg, backend, data, model, optimizer, schedule, tracker) -> float:
        trainer = cfg.trainer
        if self.prime_length >= data.seq_len:
            raise UserError(f"task.prime_length={self.prime_length} must be shorter than data.seq_len={data.seq_len}")
        self.run, self.trainer, self.backend, self.data, self.tracker = run, trainer, backend, data, tracker
        self.model = backend.prepare(model)
        self.optimizer = optimizer(self.model.parameters())
        self.schedule = schedule(self.optimizer)
        self.config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
        self.params = sum(p.numel() for p in self.model.parameters())
        device = backend.device
        self.flops_per_token = training_flops_per_token(self.model, data.seq_len, device)
        peak_dtype = torch.bfloat16 if backend.precision == "bf16" else torch.float32
        self.peak_flops = matmul_peak_flops(device, peak_dtype)
        run.update_summary(
            task="lm",
            model=run.choices.get("model"),
            params=self.params,
            data=data.name,
            data_fingerprint=data.fingerprint,
            device=str(device),
            precision=backend.precision,
            flops_per_token=round(self.flops_per_token),
            matmul_peak_gflops=round(self.peak_flops / 1e9, 1),
            step=0,
        )
        self._throughput: list[tuple[float, int]] = []  # (tokens/s, steps) per logging window
        start = self._restore()
        log.info("model %s: %.2fM parameters on %s, %s; data %s", run.choices.get("model"), self.params / 1e6,
                 device, backend.precision, data.fingerprint)
        tracker.start(run, OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
        status = "failed"
        try:
            self._train(start)
            status = "interrupted" if run.stop_requested else "completed"
        finally:
            tracker.finish(status)
        return run.summary.get("val_bpc", float("nan"))

    # ---- the loop ------------------------------------------------------------------------------

    def _train(self, start: int) -> None:
        tr, run = self.trainer, self.run
        tokens_per_step = tr.batch_size * tr.grad_accum * self.data.seq_len * self.backend.world_size
        bar = tqdm(total=tr.max_steps, initial=start, desc="train", disable=not (tr.progress and run.is_main),
                   dynamic_ncols=True, mininterval=1.0)
        window_t, window_steps = time.perf_counter(), 0
        step = start
        while step < tr.max_steps and not run.stop_requested:
            loss = self._train_step(step)
            step += 1
            window_steps += 1
            bar.update(1)
            if step % tr.log_every == 0 or step == tr.max_steps:
                elapsed = time.perf_counter() - window_t
                tok_s = tokens_per_step * window_steps / elapsed
                row = {"step": step, "loss": loss, "lr": self.schedule.get_last_lr()[0], "tokens_per_s": round(tok_s, 1),
                       "mfu": round(tok_s * self.flops_per_token / self.peak_flops, 4), "wall_s": round(run.wall_s(), 2)}
                run.log_metrics(row)
                self.tracker.log(row, step)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
                self._throughput.append((tok_s, window_steps))
                window_t, window_steps = time.perf_counter(), 0
            last = step == tr.max_steps
            if (tr.validate_every and step % tr.validate_every == 0) or last:
                self._validate(step)
            if (tr.generate_every and step % tr.generate_every == 0) or last:
                self._sample(step)
            if (tr.checkpoint_every and step % tr.checkpoint_every == 0) or last or run.stop_requested:
                self._checkpoint(step)
            if window_steps == 0:  # evaluation time is not training time
                window_t = time.perf_counter()
        bar.close()

    def _train_step(self, step: int) -> float:
        tr, model, data = self.trainer, self.model, self.data
        model.train()
        total = 0.0
        for micro in range(tr.grad_accum):
            batch = data.train_batch(tr.batch_size, seed=tr.seed, step=step, micro=micro, rank=self.backend.rank)
            batch = batch.to(self.backend.device, non_blocking=True)
            with self.backend.autocast():
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()) + model.aux_loss()
            self.backend.backward(loss / tr.grad_accum)
            total += loss.item() / tr.grad_accum
        if not math.isfinite(total):
            raise TrainingError(
                f"the training loss is {total} at step {step + 1}; the last good checkpoint is kept. "
                "Lower optimizer.lr, set trainer.clip_grad_norm, or use trainer.precision=fp32"
            )
        self.backend.step(self.optimizer, model.parameters(), tr.clip_grad_norm)
        self.schedule.step()
        return total

    @torch.no_grad()
    def _validate(self, step: int) -> None:
        tr, model = self.trainer, self.model
        model.eval()
        losses = []
        for batch in self.data.val_batches(tr.val_batches, tr.batch_size):
            batch = batch.to(self.backend.device)
            with self.backend.autocast():
                logits = model(batch[:, :-1])
            losses.append(F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).item())
        val_loss = self.backend.all_reduce_mean(sum(losses) / len(losses))
        row = {"step": step, "val_loss": round(val_loss, 5), "val_bpc": round(val_loss / math.log(2), 5),
               "wall_s": round(self.run.wall_s(), 2)}
        self.run.log_metrics(row)
        self.tracker.log(row, step)
        best = min(self.run.summary.get("best_val_loss", float("inf")), val_loss)
        self.run.update_summary(step=step, val_loss=row["val_loss"], val_bpc=row["val_bpc"],
                                best_val_loss=round(best, 5), best_val_bpc=round(best / math.log(2), 5))
        log.info("step %d | val_loss %.4f | val_bpc %.4f", step, val_loss, row["val_bpc"])

    @torch.no_grad()
    def _sample(self, step: int) -> None:
        self.model.eval()
        gen = torch.Generator(device=self.backend.device).manual_seed(self.trainer.seed + step)
        texts = []
        for i in range(self.num_samples):
            prime = self.data.prime(self.prime_length, index=i).to(self.backend.device)
            with self.backend.autocast():
                out = generate(self.model, prime[None], self.generate_length, self.temperature, self.top_k, gen)
            texts.append(f"=== prime\n{self.data.decode(prime)}\n=== generated\n{self.data.decode(out[0])}\n")
        text = "\n".join(texts)
        self.run.write_sample(f"step_{step:07d}.txt", text)
        self.tracker.log_text("samples", text, step)

    # ---- checkpoints ---------------------------------------------------------------------------

    def _checkpoint(self, step: int) -> None:
        self._update_throughput_summary()
        self.run.update_summary(step=step)
        if not self.run.is_main:
            return
        state = {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "scaler": self.backend.scaler.state_dict(),
            "rng": _rng_state(),
            "config": self.config_yaml,
            "data_fingerprint": self.data.fingerprint,
            "wall_s": self.run.wall_s(),
            "summary": dict(self.run.summary),
        }
        path = checkpoint.save(state, self.run.checkpoint_dir, keep=self.trainer.keep_checkpoints)
        log.info("checkpoint %s", path)

    def _restore(self) -> int:
        """Load the checkpoint trainer.resume names; returns the step to continue from."""
        spec = self.trainer.resume
        own = checkpoint.latest(self.run.checkpoint_dir)
        if own is None:  # a new run in this directory: its .hydra files are the ones to keep
            self.run.keep_hydra_files()
        if spec == "never":
            if own is not None:
                self.run.restore_hydra_files()
                raise UserError(
                    f"{self.run.dir} already holds checkpoints and trainer.resume=never would overwrite this "
                    "run: choose a new hydra.run.dir, or trainer.resume=auto to continue it"
                )
            return 0
        path = own if spec == "auto" else checkpoint.resolve(spec)
        if path is None:
            return 0
        state = checkpoint.load(path, map_location=self.backend.device)
        self._load_model(state, path)
        if spec != "auto" and path.parent != self.run.checkpoint_dir:  # weights from elsewhere: a new run
            log.info("initialised the model from %s", path)
            return 0
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.backend.scaler.load_state_dict(state["scaler"])
        _set_rng_state(state["rng"])
        step = int(state["step"])
        self.run.continue_wall_clock(float(state["wall_s"]))
        earlier = {k: v for k, v in state["summary"].items() if k not in ("status", "error", "pid", "host")}
        self.run.update_summary(**earlier)
        self.run.truncate_metrics(step)
        log.info("resumed from %s at step %d", path, step)
        return step

    def _load_model(self, state: dict, path) -> None:
        """Load the weights, refusing (with the differing keys) a checkpoint of another config."""
        saved = OmegaConf.create(state["config"])
        current = OmegaConf.create(self.config_yaml)
        differ = [
            f"{section}.{key}" for section in _RESUME_MUST_MATCH
            for key in sorted(set(saved.get(section, {})) | set(current.get(section, {})))
            if saved.get(section, {}).get(key) != current.get(section, {}).get(key)
        ]
        if differ and self.trainer.resume == "auto":
            self.run.restore_hydra_files()  # the run's own config, not the refused one
            raise UserError(
                f"{path} was trained with a different config ({', '.join(differ)} differ), so this run "
                "cannot continue it: use a new hydra.run.dir, or pass the same overrides as before"
            )
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as e:
            raise UserError(f"{path} does not fit this model ({str(e).splitlines()[0]}); check the model overrides") from None

    def _update_throughput_summary(self) -> None:
        if not self._throughput:
            return
        # the first window holds warm-up (allocations, first-call costs): leave it out when we can
        windows = self._throughput[1:] or self._throughput
        steps = sum(n for _, n in windows)
        tok_s = sum(t * n for t, n in windows) / steps
        self.run.update_summary(
            tokens_per_s=round(tok_s, 1),
            mfu=round(tok_s * self.flops_per_token / self.peak_flops, 4),
            peak_mem_mb=round(self.backend.peak_memory_mb(), 1),
        )


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
