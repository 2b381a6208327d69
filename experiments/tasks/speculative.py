"""task=speculative: a target and a draft trained together on the same batches; its samples time
plain against speculative decoding (Leviathan et al. 2023) and record the speedup and acceptance.

    python train.py experiment=speculative
"""

import time
from typing import Optional

import torch
import torch.nn.functional as F

from experiments.runtime.errors import UserError
from experiments.tasks.lm import LanguageModelTask
from experiments.tasks.task import Member
from models.decoding import ENGINES, StaticDecoder, choose_engine, greedy, speculative_greedy
from models.sampling import decoding_linears, generate
from models.speculative import speculative_generate
from models.transformer import IGNORE


def compare_decoding(target, draft, prompt, length: int, gamma: int, temperature: float, top_k: Optional[int],
                     seed: int = 0, engine: str = "cache") -> dict:
    """Plain against speculative decoding of prompt [batch, prime]: outputs and figures. engine
    (models/decoding.py ENGINES): "cache", the growing cache, both decoding through the same
    linears plan, measured before either is timed; otherwise greedy decoding on static-cache
    engines, each step shape compiled (or recorded as a CUDA graph) before either is timed."""
    if engine == "cache":
        plain, spec, stats, plain_s, spec_s = _growing_cache_decoding(target, draft, prompt, length, gamma,
                                                                        temperature, top_k, seed)
    else:
        plain, spec, stats, plain_s, spec_s = _static_decoding(target, draft, prompt, length, gamma, ENGINES[engine])
    tokens = prompt.shape[0] * length
    return {
        "plain": plain,
        "speculative": spec,
        "base_tokens_per_s": round(tokens / plain_s, 1),
        "spec_tokens_per_s": round(tokens / spec_s, 1),
        "speedup": round(plain_s / spec_s, 3),
        "accepted_per_step": round(stats.mean_accepted, 3),
        "acceptance_rate": round(stats.mean_accepted / gamma, 4),  # as a fraction of gamma
        "same_output": bool(torch.equal(plain, spec)),
    }


def _growing_cache_decoding(target, draft, prompt, length, gamma, temperature, top_k, seed):
    device = prompt.device
    with decoding_linears(target, draft):
        t0 = time.perf_counter()
        plain = generate(target, prompt, length, temperature, top_k, torch.Generator(device=device).manual_seed(seed))
        plain_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        spec, stats = speculative_generate(target, draft, prompt, length, gamma, temperature, top_k,
                                           torch.Generator(device=device).manual_seed(seed))
        spec_s = time.perf_counter() - t0
    return plain, spec, stats, plain_s, spec_s


def _static_decoding(target, draft, prompt, length, gamma, mode):
    """Greedy plain and speculative decoding of prompt [1, prime] on static-cache engines."""
    capacity = prompt.shape[1] + length + gamma + 1
    target_engine, draft_engine = (StaticDecoder(model, 1, capacity, mode) for model in (target, draft))
    target_engine.warm_up(1, gamma + 1)
    draft_engine.warm_up(1)
    t0 = time.perf_counter()
    plain = greedy(target_engine, prompt, length)
    plain_s = _synced(t0, plain)
    t0 = time.perf_counter()
    spec, stats = speculative_greedy(target_engine, draft_engine, prompt, length, gamma)
    spec_s = _synced(t0, spec)
    return plain, spec, stats, plain_s, spec_s


def _synced(t0: float, out: torch.Tensor) -> float:
    """Seconds since t0 once `out` is computed (the device's queue drained on CUDA)."""
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    return time.perf_counter() - t0


def distillation_kl(logits, target_logits, mask):
    """KL(softmax(target_logits) || softmax(logits)) per position, averaged over the positions where
    mask is true: logits, target_logits [batch, seq, vocab], mask [batch, seq] -> scalar."""
    log_q = F.log_softmax(logits.float(), dim=-1)
    log_p = F.log_softmax(target_logits.float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return (kl * mask).sum() / mask.sum().clamp(min=1)


class SpeculativeTask(LanguageModelTask):
    """The language-model task for both members, the draft optionally distilled from the target
    (`distill_weight`); the sample times plain against speculative decoding."""

    name = "speculative"

    def __init__(self, gamma: int, distill_weight: float, engine: str, **lm_knobs):
        super().__init__(**lm_knobs)
        if gamma < 1:
            raise ValueError(f"gamma={gamma} must be at least 1: set task.gamma")
        self.gamma = gamma
        self.distill_weight = distill_weight
        self.engine = getattr(engine, "value", engine)  # resolved for the device in setup
        self._target_logits = None  # (batch, the target's detached logits on it)

    def loss(self, member: Member, batch):
        """The language-model loss; the target's logits are kept for the draft's distillation term,
        KL(target || draft) per position averaged over the positions with a target: the draft
        learns to put its mass where the target does, which is what acceptance counts. The target
        runs first on each micro-batch (it is the first member), so its logits are reused, not
        recomputed."""
        if self.distill_weight == 0:
            return super().loss(member, batch)
        loss, logits = self.loss_and_logits(member, batch)
        if member is self.ctx.members[0]:
            self._target_logits = (batch, logits.detach())
            return loss, {}
        inputs, targets = batch
        kept, target_logits = self._target_logits or (None, None)
        if kept is not batch:  # not after the target's loss on this batch: compute its logits
            with torch.no_grad():
                target_logits = self.ctx.members[0].model(inputs)
        self._target_logits = None
        kl = distillation_kl(logits, target_logits, targets != IGNORE)
        return loss + self.distill_weight * kl, {"distill_kl": kl.item()}

    def check_parts(self, nets, data_kind, data_name):
        if "draft_" not in nets:
            raise UserError("task=speculative needs a draft model: add `- /model@draft: transformer` to the "
                            "defaults (as conf/experiment/speculative.yaml does) or use experiment=speculative")
        super().check_parts(nets, data_kind, data_name)

    def setup(self, nets):
        try:
            self.engine = choose_engine(self.engine, self.ctx.backend.device, self.temperature)
        except ValueError as e:
            raise UserError(f"task.{e}") from None
        return super().setup(nets)

    @torch.no_grad()
    def sample(self, step: int) -> None:
        ctx = self.ctx
        target, draft = (m.model.eval() for m in ctx.members)
        prime = ctx.data.prime(self.prime_length).to(ctx.backend.device)[None]
        with ctx.backend.autocast():
            result = compare_decoding(target, draft, prime, self.generate_length, self.gamma, self.temperature,
                                      self.top_k, seed=ctx.trainer.seed + step, engine=self.engine)
        figures = {k: v for k, v in result.items() if k not in ("plain", "speculative")}
        ctx.run.log_metrics({"step": step, **figures})
        ctx.tracker.log(figures, step)
        ctx.run.update_summary(**figures)
        decode = ctx.data.decode
        text = (f"=== prime\n{decode(prime[0])}\n=== plain decoding ({figures['base_tokens_per_s']} tokens/s)\n"
                f"{decode(result['plain'][0])}\n=== speculative decoding, gamma {self.gamma} "
                f"({figures['spec_tokens_per_s']} tokens/s, {figures['speedup']}x, "
                f"{figures['accepted_per_step']} accepted per step)\n{decode(result['speculative'][0])}\n")
        ctx.run.write_sample(f"step_{step:07d}.txt", text)
        ctx.tracker.log_text("samples", text, step)
