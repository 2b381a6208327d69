"""The language-modelling task: next-byte prediction with validation, samples and checkpoints.

train.py builds the parts from the config and calls the task with them; the task owns the loop.
It trains one model, or several on the same batches (a speculative-decoding pair): each member
has its own optimizer, schedule, losses, validation and checkpoint entries, named by its prefix
("" for the model, "draft_" for the draft).
"""

import logging
import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from tqdm import tqdm

from experiments import checkpoint
from experiments.backends import Trainee
from experiments.errors import TrainingError, UserError
from experiments.throughput import matmul_peak_flops, training_flops_per_token
from models.sampling import generate

log = logging.getLogger(__name__)

IGNORE = -100  # target value that cross_entropy skips

# config sections that must match for a checkpoint to continue this run
_RESUME_MUST_MATCH = ("model", "draft", "data", "optimizer", "schedule", "task")


@dataclass
class Member:
    trainee: Trainee  # the model as the backend trains it
    schedule: torch.optim.lr_scheduler.LRScheduler

    @property
    def prefix(self) -> str:  # of its metrics and checkpoint entries: "" for the model, "draft_" for the draft
        return self.trainee.prefix

    @property
    def model(self) -> nn.Module:
        return self.trainee.module


class LanguageModelTask:
    task_name = "lm"

    def __init__(self, prime_length: int = 64, generate_length: int = 256, num_samples: int = 1,
                 temperature: float = 1.0, top_k: Optional[int] = None, randomly_truncate_sequence: bool = False):
        self.randomly_truncate_sequence = randomly_truncate_sequence
        self.prime_length = prime_length
        self.generate_length = generate_length
        self.num_samples = num_samples
        self.temperature = temperature
        self.top_k = top_k

    def __call__(self, *, run, cfg, backend, data, model, optimizer, schedule, tracker, draft=None) -> float:
        if self.prime_length >= data.seq_len:
            raise UserError(f"task.prime_length={self.prime_length} must be shorter than data.seq_len={data.seq_len}")
        self.run, self.trainer, self.backend, self.data, self.tracker = run, cfg.trainer, backend, data, tracker
        self.config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
        nets = {prefix: net for prefix, net in (("", model), ("draft_", draft)) if net is not None}
        resume_from, state = self._find_checkpoint()
        if state is not None:  # weights before the backend wraps the models (DeepSpeed copies them)
            self._load_models(state, resume_from, nets)
        device = backend.device
        # counted before the backend wraps the models (ZeRO-3 partitions the parameters)
        self.param_counts = {prefix: sum(p.numel() for p in net.parameters()) for prefix, net in nets.items()}
        # FLOPs too: a wrapper's gradient hooks must see only training
        self.flops_per_token = sum(training_flops_per_token(net.to(device), data.seq_len, device)
                                   for net in nets.values())
        self.members = []
        for prefix, net in nets.items():
            trainee = backend.prepare(prefix, net, optimizer)
            self.members.append(Member(trainee, schedule(trainee.optimizer)))
        self.model = self.members[0].model
        peak_dtype = torch.bfloat16 if backend.precision == "bf16" else torch.float32
        self.peak_flops = matmul_peak_flops(device, peak_dtype)
        run.update_summary(
            task=self.task_name,
            model=run.choices.get("model"),
            **{f"{prefix}params": params for prefix, params in self.param_counts.items()},
            data=data.name,
            data_fingerprint=data.fingerprint,
            device=str(device),
            precision=backend.precision,
            flops_per_token=round(self.flops_per_token),
            matmul_peak_gflops=round(self.peak_flops / 1e9, 1),
            step=0,
        )
        self._throughput: list[tuple[float, int]] = []  # (tokens/s, steps) per logging window
        start = self._restore(resume_from, state)
        log.info("model %s: %.2fM parameters on %s, %s; data %s", run.choices.get("model"),
                 run.summary["params"] / 1e6, device, backend.precision, data.fingerprint)
        run.write_summary("running")  # now with the model's and the data's figures
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
        step, stopping = start, False
        while step < tr.max_steps and not stopping:
            losses = self._train_step(step)
            step += 1
            window_steps += 1
            bar.update(1)
            if step % tr.log_every == 0 or step == tr.max_steps:
                elapsed = time.perf_counter() - window_t
                tok_s = tokens_per_step * window_steps / elapsed
                row = {"step": step, **losses, "lr": self.members[0].schedule.get_last_lr()[0],
                       "tokens_per_s": round(tok_s, 1), "mfu": round(tok_s * self.flops_per_token / self.peak_flops, 4),
                       "wall_s": round(run.wall_s(), 2)}
                run.log_metrics(row)
                self.tracker.log(row, step)
                bar.set_postfix(loss=f"{losses['loss']:.3f}", tok_s=f"{tok_s:,.0f}")
                self._throughput.append((tok_s, window_steps))
                window_t, window_steps = time.perf_counter(), 0
            last = step == tr.max_steps
            # a signal may reach the ranks at different steps: they stop together, or collectives hang
            stopping = self.backend.all_reduce_mean(float(run.stop_requested)) > 0
            run.stop_requested |= stopping  # the summary says "interrupted" on every rank
            if (tr.validate_every and step % tr.validate_every == 0) or last:
                self._validate(step)
            if (tr.generate_every and step % tr.generate_every == 0) or last:
                self._sample(step)
            if (tr.checkpoint_every and step % tr.checkpoint_every == 0) or last or stopping:
                self._checkpoint(step)
            if window_steps == 0:  # evaluation time is not training time
                window_t = time.perf_counter()
        bar.close()

    def _train_step(self, step: int) -> dict[str, float]:
        """One optimizer step of every member on the same micro-batches -> {"loss", "draft_loss"}."""
        tr, data = self.trainer, self.data
        totals = {m.prefix: 0.0 for m in self.members}
        for micro in range(tr.grad_accum):
            batch = data.train_batch(tr.batch_size, seed=tr.seed, step=step, micro=micro, rank=self.backend.rank,
                                     world_size=self.backend.world_size)
            batch = batch.to(self.backend.device, non_blocking=True)
            targets = batch[:, 1:]
            if self.randomly_truncate_sequence:
                targets = self._truncated(targets, step, micro)
            for m in self.members:
                m.model.train()
                with self.backend.accumulating(m.trainee, last=micro == tr.grad_accum - 1):
                    with self.backend.autocast():
                        logits = m.trainee.forward(batch[:, :-1])
                        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)
                        loss = loss + m.model.aux_loss()
                    self.backend.backward(loss / tr.grad_accum, m.trainee)
                totals[m.prefix] += loss.item() / tr.grad_accum
        totals = {prefix: self.backend.all_reduce_mean(total) for prefix, total in totals.items()}
        for prefix, total in totals.items():
            if not math.isfinite(total):
                raise TrainingError(
                    f"the training {prefix}loss is {total} at step {step + 1}; the last good checkpoint is kept. "
                    "Lower optimizer.lr, set trainer.clip_grad_norm, or use trainer.precision=fp32"
                )
        self.backend.step([m.trainee for m in self.members], tr.clip_grad_norm)
        for m in self.members:
            m.schedule.step()
            m.model.after_optimizer_step()
        return {f"{prefix}loss": total for prefix, total in totals.items()}

    def _truncated(self, targets: torch.Tensor, step: int, micro: int) -> torch.Tensor:
        """The seed's randomly_truncate_sequence: each row keeps a random length in [1, seq] and
        its later targets are ignored. For a causal model that is training on the truncated row
        (no position sees the ones after it), without reshaping the batch."""
        tr, rank = self.trainer, self.backend.rank
        gen = torch.Generator().manual_seed(hash((tr.seed, step, micro, 1)) & (2**62 - 1))
        b, n = targets.shape
        # drawn for the global batch, each rank taking its rows, as the crops are
        lengths = torch.randint(1, n + 1, (b * self.backend.world_size, 1), generator=gen)[rank * b : (rank + 1) * b]
        lengths = lengths.to(targets.device)
        beyond = torch.arange(n, device=targets.device)[None, :] >= lengths
        return targets.masked_fill(beyond, IGNORE)

    @torch.no_grad()
    def _validate(self, step: int) -> None:
        tr = self.trainer
        row = {"step": step}
        for m in self.members:
            m.model.eval()
            losses = []
            rank, b = self.backend.rank, tr.batch_size
            # the global batches of every rank together, shared out by rows as in training
            for batch in self.data.val_batches(tr.val_batches, b * self.backend.world_size):
                batch = batch[rank * b : (rank + 1) * b].to(self.backend.device)
                with self.backend.autocast():
                    logits = m.model(batch[:, :-1])
                losses.append(F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).item())
            val_loss = self.backend.all_reduce_mean(sum(losses) / len(losses))
            row[f"{m.prefix}val_loss"] = round(val_loss, 5)
            row[f"{m.prefix}val_bpc"] = round(val_loss / math.log(2), 5)
            best = min(self.run.summary.get(f"{m.prefix}best_val_loss", float("inf")), val_loss)
            self.run.update_summary(**{f"{m.prefix}val_loss": row[f"{m.prefix}val_loss"],
                                       f"{m.prefix}val_bpc": row[f"{m.prefix}val_bpc"],
                                       f"{m.prefix}best_val_loss": round(best, 5),
                                       f"{m.prefix}best_val_bpc": round(best / math.log(2), 5)})
        row["wall_s"] = round(self.run.wall_s(), 2)
        self.run.update_summary(step=step)
        self.run.log_metrics(row)
        self.tracker.log(row, step)
        log.info("step %d | %s", step, " | ".join(f"{k} {v:.4f}" for k, v in row.items() if "val_" in k))

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
        path = checkpoint.checkpoint_path(self.run.checkpoint_dir, step)
        self.run.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        # every rank: a distributed backend writes its own state collectively
        state = self.backend.checkpoint_state([m.trainee for m in self.members], self.run.checkpoint_dir, path.stem)
        if not self.run.is_main:
            return
        state.update({
            "step": step,
            "rng": _rng_state(),
            "config": self.config_yaml,
            "data_fingerprint": self.data.fingerprint,
            "wall_s": self.run.wall_s(),
            "summary": dict(self.run.summary),
        })
        for m in self.members:
            state[f"{m.prefix}schedule"] = m.schedule.state_dict()
        checkpoint.save(state, self.run.checkpoint_dir, keep=self.trainer.keep_checkpoints)
        log.info("checkpoint %s", path)

    def _find_checkpoint(self):
        """The checkpoint trainer.resume names, loaded (None, None when there is none)."""
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
            return None, None
        path = own if spec == "auto" else checkpoint.resolve(spec)
        if path is None:
            return None, None
        return path, checkpoint.load(path, map_location="cpu")

    def _restore(self, path, state) -> int:
        """Continue from the loaded checkpoint (weights are in already); returns the start step."""
        if state is None:
            return 0
        if self.trainer.resume != "auto" and path.parent != self.run.checkpoint_dir:  # weights from elsewhere
            log.info("initialised the model from %s", path)
            return 0
        self.backend.load_checkpoint_state([m.trainee for m in self.members], state, path)
        for m in self.members:
            m.schedule.load_state_dict(state[f"{m.prefix}schedule"])
        _set_rng_state(state["rng"])
        step = int(state["step"])
        self.run.continue_wall_clock(float(state["wall_s"]))
        earlier = {k: v for k, v in state["summary"].items() if k not in ("status", "error", "pid", "host")}
        self.run.update_summary(**earlier)
        self.run.truncate_metrics(step)
        log.info("resumed from %s at step %d", path, step)
        return step

    def _load_models(self, state: dict, path, nets: dict) -> None:
        """Load the weights, refusing (with the differing keys) a checkpoint of another config."""
        saved = OmegaConf.create(state["config"])
        current = OmegaConf.create(self.config_yaml)
        differ = [
            f"{section}.{key}" for section in _RESUME_MUST_MATCH
            for key in sorted(set(saved.get(section) or {}) | set(current.get(section) or {}))
            if (saved.get(section) or {}).get(key) != (current.get(section) or {}).get(key)
        ]
        if differ and self.trainer.resume == "auto":
            self.run.restore_hydra_files()  # the run's own config, not the refused one
            raise UserError(
                f"{path} was trained with a different config ({', '.join(differ)} differ), so this run "
                "cannot continue it: use a new hydra.run.dir, or pass the same overrides as before"
            )
        for prefix, net in nets.items():
            try:
                net.load_state_dict(state[f"{prefix}model"])
            except (RuntimeError, KeyError) as e:
                raise UserError(f"{path} does not fit this {prefix}model ({str(e).splitlines()[0]}); "
                                "check the model overrides") from None

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
