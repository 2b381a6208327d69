"""The training loop: one object that drives a task through its steps.

    Loop(task, run=run, cfg=cfg, backend=backend, data=data, optimizer=..., schedule=...,
         tracker=tracker, models={"model": ..., "draft": ...}).train() -> the summary's result figure

The task says what a batch, a loss, a validation and a sample are (experiments/tasks/task.py);
the loop owns the rest: its members (each model with its optimizer and schedule), the steps and
gradient accumulation, throughput and MFU, the validation, sample and checkpoint cadence, and
resume (which checkpoint, refused when its config differs, continued exactly).
"""

import logging
import math
import time

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from experiments.runtime import checkpoint, init_from
from experiments.runtime.errors import TrainingError, UserError
from experiments.runtime.throughput import device_name, matmul_peak_flops
from experiments.tasks import positions
from experiments.tasks.task import Context, Member, Task

log = logging.getLogger(__name__)

_SLOTS = {"model": "", "draft": "draft_", "vae": "vae_"}  # model configs and their members' prefixes

# what summary.json records of the session that runs: a resumed run names the machine it goes on with
_SESSION_KEYS = ("pid", "host", "device", "processor", "threads", "matmul_peak_gflops")
# config sections that must match for a checkpoint to continue this run
_RESUME_MUST_MATCH = ("model", "draft", "vae", "data", "optimizer", "schedule", "task")
# the trainer's keys that shape the steps and what validation measures, and the weights the run started
# from (a resume never reloads them: another init_from would only misdescribe the run); the rest
# (max_steps, how often to validate, log or checkpoint, threads, device, compile, ...) a resumed run may change
_RESUME_MUST_MATCH_TRAINER = ("batch_size", "grad_accum", "seed", "precision", "clip_grad_norm", "val_batches",
                              "init_from", "init_strict")


class Loop:
    def __init__(self, task: Task, *, run, cfg, backend, data, optimizer, schedule, tracker, models: dict):
        self.task, self.run, self.cfg, self.trainer = task, run, cfg, cfg.trainer
        self.backend, self.data, self.tracker = backend, data, tracker
        self.optimizer, self.schedule = optimizer, schedule
        self.models = models
        self.init_report = None  # what trainer.init_from loaded, when this session starts from it
        self.config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
        self.ctx = Context(run=run, cfg=cfg, backend=backend, data=data, tracker=tracker)
        task.attach(self.ctx)

    @property
    def members(self) -> list[Member]:
        return self.ctx.members

    def train(self) -> float:
        task, run, backend, data = self.task, self.run, self.backend, self.data
        # the model first, whatever the keyword order: members[0] is the model the task samples
        nets = task.setup({prefix: self.models[slot] for slot, prefix in _SLOTS.items()
                           if self.models.get(slot) is not None})
        resume_from, state = self._find_checkpoint()
        if state is not None:  # weights before the backend wraps the models (DeepSpeed copies them)
            self._load_models(state, resume_from, nets)
        elif self.trainer.init_from:  # a new run from another's weights: read only when it starts
            self.init_report = init_from.initialise(
                nets, self.trainer.init_from, strict=self.trainer.init_strict,
                model_cfg={prefix: OmegaConf.to_container(self.cfg[slot], resolve=True)
                           for slot, prefix in _SLOTS.items() if prefix in nets})
        device = backend.device
        # counted before the backend wraps the models (ZeRO-3 partitions the parameters)
        self.param_counts = {prefix: sum(p.numel() for p in net.parameters()) for prefix, net in nets.items()}
        # FLOPs too: a wrapper's gradient hooks must see only training
        self.flops = {(prefix, length): task.flops_per_token(prefix, net.to(device), length)
                      for prefix, net in nets.items() for length in task.train_seq_lens()}
        for prefix, net in nets.items():
            trainee = backend.prepare(prefix, net, task.optimizer_for(prefix, self.optimizer))
            self.members.append(Member(trainee, task.schedule_for(prefix, self.schedule)(trainee.optimizer)))
        peak_dtype = torch.bfloat16 if backend.precision == "bf16" else torch.float32
        self.peak_flops = matmul_peak_flops(device, peak_dtype)
        run.update_summary(
            task=task.name,
            model=run.choices.get("model"),
            **{f"{prefix}params": params for prefix, params in self.param_counts.items()},
            data=data.name,
            data_fingerprint=data.fingerprint,
            device=str(device),
            processor=device_name(device),  # what the speed figures were measured on
            threads=torch.get_num_threads(),  # CPU threads (trainer.threads, or a share of the CPUs)
            precision=backend.precision,
            flops_per_token=round(self._flops_at(task.total_steps - 1, self.members)),  # at the full length
            matmul_peak_gflops=round(self.peak_flops / 1e9, 1),
            step=0,
        )
        if self.init_report is not None:
            run.update_summary(init_from=self.init_report)
            for line in init_from.describe(self.init_report):
                log.info(line)
        self._throughput: list[tuple[float, float, int]] = []  # (tokens/s, FLOPs/token, steps) per window
        start = self._restore(resume_from, state)
        run.accept(start)
        if start >= task.total_steps and run.completed_before():  # run again: nothing to train or record
            log.info("the run completed at step %d: nothing to train, and its summary.json stands", start)
            run.leave_summary()
        log.info("model %s: %.2fM parameters on %s, %s; data %s", run.choices.get("model"),
                 sum(self.param_counts.values()) / 1e6, device, backend.precision, data.fingerprint)
        run.write_summary("running")  # now with the model's and the data's figures
        self.tracker.start(run, OmegaConf.to_container(self.cfg, resolve=True, throw_on_missing=False))
        status = "failed"
        try:
            self._train(start)
            status = "interrupted" if run.stop_requested else "completed"
        finally:
            self.tracker.finish(status)
        return run.summary.get(task.result_key, float("nan"))

    # ---- the loop ------------------------------------------------------------------------------

    def _train(self, start: int) -> None:
        tr, run = self.trainer, self.run
        samples_per_step = tr.batch_size * tr.grad_accum * self.backend.world_size
        bar = tqdm(total=self.task.total_steps, initial=start, desc="train", disable=not (tr.progress and run.is_main),
                   dynamic_ncols=True, mininterval=1.0)
        window_t, window_steps, window_flops = time.perf_counter(), 0, 0.0
        step, stopping = start, False
        compiling = self.backend.compile  # the first step compiles: its time is not training time
        while step < self.task.total_steps and not stopping:
            active = self.task.active(step)
            figures = self._train_step(step, active)
            if compiling:
                compile_s = time.perf_counter() - window_t
                log.info("step %d compiled the training forward and backward in %.1f s (mode %s; not counted in "
                         "tokens/s)", step + 1, compile_s, compiling)
                run.update_summary(compile_s=round(compile_s, 1), compile_mode=compiling)
                compiling, window_t = False, time.perf_counter()
            else:
                window_flops += self._flops_at(step, active)
                window_steps += 1
            step += 1
            bar.update(1)
            last = step == self.task.total_steps
            stage_ends = not last and self.task.active(step) != active
            if step % tr.log_every == 0 or last or stage_ends:
                row = {"step": step, **figures, "lr": active[0].schedule.get_last_lr()[0]}
                if window_steps:  # none when the window held only the compiling step
                    elapsed = time.perf_counter() - window_t
                    tok_s = samples_per_step * self.task.tokens_per_sample(active[0].prefix) * window_steps / elapsed
                    flops = window_flops / window_steps  # per token: a length curriculum's steps differ
                    row.update(tokens_per_s=round(tok_s, 1), mfu=round(tok_s * flops / self.peak_flops, 4))
                    bar.set_postfix(loss=f"{figures[f'{active[0].prefix}loss']:.3f}", tok_s=f"{tok_s:,.0f}")
                    self._throughput.append((tok_s, flops, window_steps))
                row["wall_s"] = round(run.wall_s(), 2)
                run.log_metrics(row)
                self.tracker.log(row, step)
                window_t, window_steps, window_flops = time.perf_counter(), 0, 0.0
            # a signal may reach the ranks at different steps: they stop together, or collectives hang
            stopping = self.backend.all_reduce_mean(float(run.stop_requested)) > 0
            run.stop_requested |= stopping  # the summary says "interrupted" on every rank
            if (tr.validate_every and step % tr.validate_every == 0) or last or stage_ends:
                self._validate(step, active)
            if (tr.generate_every and step % tr.generate_every == 0) or last or stage_ends:
                t0 = time.perf_counter()
                self.task.sample(step)
                log.info("step %d | samples written in %.1f s", step, time.perf_counter() - t0)
            if (tr.checkpoint_every and step % tr.checkpoint_every == 0) or last or stopping or stage_ends:
                self._checkpoint(step)
            if stage_ends:  # tokens/s and MFU in the summary are the last stage's
                self._throughput.clear()
            if window_steps == 0:  # evaluation time is not training time
                window_t = time.perf_counter()
        bar.close()

    def _flops_at(self, step: int, members: list[Member]) -> float:
        """Counted training FLOPs per token of these members at this step's length."""
        return sum(self.flops[m.prefix, self.task.train_seq_len(step)] for m in members)

    def _train_step(self, step: int, active: list[Member]) -> dict[str, float]:
        """One optimizer step of the active members on the same micro-batches -> {"loss", ...}."""
        tr = self.trainer
        totals: dict[str, float] = {}
        for micro in range(tr.grad_accum):
            batch = self.task.micro_batch(step, micro)
            if self.backend.compile == "reduce-overhead":  # the last replay's outputs are read: graphs may reuse them
                torch.compiler.cudagraph_mark_step_begin()
            for m in active:
                m.model.train()
                with self.backend.accumulating(m.trainee, last=micro == tr.grad_accum - 1):
                    with self.backend.autocast():
                        loss, extras = self.task.loss(m, batch)
                    self.backend.backward(loss / tr.grad_accum, m.trainee)
                for name, value in {"loss": loss.item(), **extras}.items():
                    key = f"{m.prefix}{name}"
                    totals[key] = totals.get(key, 0.0) + value / tr.grad_accum
        totals = {key: self.backend.all_reduce_mean(total) for key, total in totals.items()}
        for m in active:
            total = totals[f"{m.prefix}loss"]
            if not math.isfinite(total):
                raise TrainingError(
                    f"the training {m.prefix}loss is {total} at step {step + 1}; the last good checkpoint is kept. "
                    "Lower optimizer.lr, set trainer.clip_grad_norm, or use trainer.precision=fp32"
                )
        self.backend.step([m.trainee for m in active], tr.clip_grad_norm)
        for m in active:
            _step_schedule(m, totals[f"{m.prefix}loss"])
            m.model.after_optimizer_step()
        return totals

    @torch.no_grad()
    def _validate(self, step: int, active: list[Member]) -> None:
        row = {"step": step}
        for m in active:
            m.model.eval()
            metrics = self.task.validation_metrics(m)
            figures = {f"{m.prefix}{k}": _rounded(v) for k, v in metrics.items()}
            row.update(figures)
            best = min(self.run.summary.get(f"{m.prefix}best_val_loss", float("inf")), metrics["val_loss"])
            self.run.update_summary(**figures, **{f"{m.prefix}best_val_loss": round(best, 5)})
            if "val_bpc" in metrics:
                self.run.update_summary(**{f"{m.prefix}best_val_bpc": round(best / math.log(2), 5)})
        row["wall_s"] = round(self.run.wall_s(), 2)
        self.run.update_summary(step=step)
        self.run.log_metrics(row)
        self.tracker.log(positions.scalars(row), step)
        log.info("step %d | %s", step, " | ".join(f"{k} {v:.4f}" for k, v in row.items()
                                                  if "val_" in k and not positions.is_figure(v)))

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
            "init_from": self.run.summary.get("init_from"),  # the weights this run started from, if any
            **self.task.checkpoint_extras(),
        })
        for m in self.members:
            state[f"{m.prefix}schedule"] = m.schedule.state_dict()
        checkpoint.save(state, self.run.checkpoint_dir, keep=self.trainer.keep_checkpoints)
        log.info("checkpoint %s", path)

    def _find_checkpoint(self):
        """The checkpoint trainer.resume names, loaded (None, None when there is none)."""
        spec = self.trainer.resume
        own = checkpoint.latest(self.run.checkpoint_dir)
        if self.trainer.init_from and spec not in ("auto", "never"):
            raise UserError(f"trainer.resume={spec} and trainer.init_from={self.trainer.init_from} both name weights "
                            "to start from: keep trainer.init_from (a new run from its weights) and trainer.resume=auto")
        if spec == "never":
            if own is not None:
                raise UserError(
                    f"{self.run.dir} already holds checkpoints and trainer.resume=never would overwrite this "
                    f"run: choose a new {self.run.dir_setting}, or trainer.resume=auto to continue it"
                )
            return None, None
        path = own if spec == "auto" else checkpoint.resolve(spec)
        if own is not None and not self._continues(path):
            # started from other weights and stopped since: the same command goes on from its own
            # checkpoints, never back to the weights it started from
            log.info("%s holds this run's own checkpoints: continuing them, not %s", self.run.dir, path)
            path = own
        if path is None:
            return None, None
        return path, checkpoint.load(path, map_location="cpu")

    def _continues(self, path) -> bool:
        """Whether the checkpoint is this run's own (continued exactly), not weights from elsewhere."""
        return path.parent == self.run.checkpoint_dir

    def _restore(self, path, state) -> int:
        """Continue from the loaded checkpoint (weights are in already); returns the start step."""
        if state is None:
            return 0
        if not self._continues(path):  # weights from elsewhere
            log.info("initialised the model from %s", path)
            return 0
        self.backend.load_checkpoint_state([m.trainee for m in self.members], state, path)
        for m in self.members:
            m.schedule.load_state_dict(state[f"{m.prefix}schedule"])
        _set_rng_state(state["rng"])
        step = int(state["step"])
        self.run.continue_wall_clock(float(state["wall_s"]))
        # the earlier sessions' figures (the step reached among them), but the machine of the session
        # that goes on
        earlier = {k: v for k, v in state["summary"].items() if k not in ("status", "error", *_SESSION_KEYS)}
        self.run.update_summary(**earlier)
        log.info("resumed from %s at step %d", path, step)
        if self.trainer.init_from:
            log.info("trainer.init_from=%s is not read again: a resumed run goes on from its own weights",
                     self.trainer.init_from)
        return step

    def _load_models(self, state: dict, path, nets: dict) -> None:
        """Load the weights, refusing (with the differing keys) a checkpoint of another config."""
        saved = OmegaConf.create(state["config"])
        current = OmegaConf.create(self.config_yaml)
        differ = [
            f"{section}.{key}" for section in _RESUME_MUST_MATCH
            for key in sorted(set(saved.get(section) or {}) | set(current.get(section) or {}))
            if _comparable(saved.get(section), key) != _comparable(current.get(section), key)
        ] + [f"trainer.{key}" for key in _RESUME_MUST_MATCH_TRAINER
             if _comparable(saved.get("trainer"), key) != _comparable(current.get("trainer"), key)]
        if differ and self._continues(path):
            raise UserError(
                f"{path} was trained with a different config ({', '.join(_source(self.cfg, k) for k in differ)} "
                "differ), so this run "
                f"cannot continue it: use a new {self.run.dir_setting}, or pass the same overrides as before"
            )
        trained_on = state.get("data_fingerprint")
        if trained_on and trained_on != self.data.fingerprint and self._continues(path):  # a file changed in place
            raise UserError(
                f"{path} was trained on other data: {trained_on}, where this config now reads "
                f"{self.data.fingerprint} (name:train+validation size:digest; the data changed, or this version "
                f"reads it otherwise), so this run cannot continue it: put that data back, or start a new run "
                f"(another {self.run.dir_setting}; trainer.init_from={self.run.dir} starts it from these weights)"
            )
        for prefix, net in nets.items():
            checkpoint.load_weights(net, state, f"{prefix}model", path, built_from_checkpoint=False)

    def _update_throughput_summary(self) -> None:
        if not self._throughput:
            return
        # the first window holds warm-up (allocations, first-call costs): leave it out when we can
        windows = self._throughput[1:] or self._throughput
        steps = sum(n for _, _, n in windows)
        tok_s = sum(t * n for t, _, n in windows) / steps
        mfu = sum(t * f * n for t, f, n in windows) / steps / self.peak_flops
        self.run.update_summary(
            tokens_per_s=round(tok_s, 1),
            mfu=round(mfu, 4),
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


def _rounded(value):
    """A validation figure to 5 decimals: a number, or each number of a by-position figure."""
    if positions.is_figure(value):
        return {"edges": value["edges"], "values": [round(v, 5) for v in value["values"]]}
    return round(value, 5)


def _source(cfg, dotted: str) -> str:
    """`section.key`, and the setting it takes its value from where it is one's interpolation
    (`schedule.total_steps (from trainer.max_steps)`): the key the user typed."""
    section, key = dotted.split(".", 1)
    node = cfg.get(section)
    raw = node._get_node(key)._value() if node is not None and key in node else None
    if isinstance(raw, str) and raw.startswith("${") and raw.endswith("}") and ":" not in raw:
        return f"{dotted} (from {raw[2:-1]})"
    return dotted


def _comparable(section, key: str):
    """A config value as resume compares it: a `_target_` by its name alone, so that checkpoints
    written before a module moved (experiments.language_model -> experiments.tasks.lm) continue."""
    value = (section or {}).get(key)
    return value.rsplit(".", 1)[-1] if key == "_target_" and isinstance(value, str) else value


def _step_schedule(member: Member, loss: float) -> None:
    """A plateau schedule decides from the training loss; the others count steps."""
    if getattr(member.schedule, "needs_loss", False):
        member.schedule.step(loss)
    else:
        member.schedule.step()
