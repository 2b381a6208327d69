"""task=lm: next-byte prediction, validation loss and bits per byte (also by position in the sequence:
experiments/tasks/positions.py), text samples.

It trains one model, or several on the same batches (a speculative-decoding pair, see
experiments/tasks/speculative.py); the loop (experiments/tasks/loop.py) drives it.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F

from experiments.data.draws import step_generator
from experiments.runtime.errors import UserError
from experiments.tasks.positions import PositionLoss
from experiments.tasks.task import Member, Task
from models.sampling import generate
from models.transformer import IGNORE, TransformerLM


class LanguageModelTask(Task):
    name = "lm"
    result_key = "val_bpc"

    def __init__(self, prime_length: int, generate_length: int, num_samples: int, temperature: float,
                 top_k: Optional[int], randomly_truncate_sequence: bool):
        self.randomly_truncate_sequence = randomly_truncate_sequence
        self.prime_length = prime_length
        self.generate_length = generate_length
        self.num_samples = num_samples
        self.temperature = temperature
        self.top_k = top_k

    def check_parts(self, nets, data_kind, data_name):
        for prefix, net in nets.items():
            if not isinstance(net, TransformerLM):
                raise UserError(f"task={self.name} trains language models, and the {prefix.rstrip('_') or 'model'} "
                                "config builds something else: use experiment=dvae or experiment=dalle for image "
                                "models")
        if data_kind != "text":
            raise UserError(f"task={self.name} trains on text (data=text, stdlib or enwik8), and data={data_name} "
                            "is not: use experiment=mqar or passkey for recall data, experiment=dvae or dalle "
                            "for images")

    def setup(self, nets):
        self.check_run_parts(nets)
        data = self.ctx.data
        for prefix, net in nets.items():
            # fewer tokens: an index error at the first step; more: samples of bytes no decoder reads
            if net.num_tokens != (vocab := data.vocab_size):
                section = "draft" if prefix == "draft_" else "model"
                raise UserError(f"{section}.num_tokens={net.num_tokens} does not match the data's vocabulary of "
                                f"{vocab} tokens: set {section}.num_tokens={vocab}")
        return nets  # task.prime_length < data.seq_len: experiments/config/checks.py

    def micro_batch(self, step: int, micro: int):
        tr, backend = self.ctx.trainer, self.ctx.backend
        batch = self.ctx.data.train_batch(tr.batch_size, seed=tr.seed, step=step, micro=micro, rank=backend.rank,
                                          world_size=backend.world_size)
        batch = batch.to(backend.device, non_blocking=True)
        targets = batch[:, 1:]
        if self.randomly_truncate_sequence:
            targets = self._truncated(targets, step, micro)
        return batch[:, :-1], targets

    def loss(self, member: Member, batch):
        return self.loss_and_logits(member, batch)[0], {}

    def loss_and_logits(self, member: Member, batch):
        """The next-token loss (plus the model's auxiliary loss) and the logits [batch, seq, vocab]."""
        inputs, targets = batch
        logits = member.trainee.forward(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)
        return loss + member.model.aux_loss(), logits

    def _truncated(self, targets: torch.Tensor, step: int, micro: int) -> torch.Tensor:
        """The seed's randomly_truncate_sequence: each row keeps a random length in [1, seq] and
        its later targets are ignored. For a causal model that is training on the truncated row
        (no position sees the ones after it), without reshaping the batch."""
        rank, world = self.ctx.backend.rank, self.ctx.backend.world_size
        gen = step_generator(self.ctx.trainer.seed, step, micro, 1)
        b, n = targets.shape
        # drawn for the global batch, each rank taking its rows, as the crops are
        lengths = torch.randint(1, n + 1, (b * world, 1), generator=gen)[rank * b : (rank + 1) * b]
        beyond = torch.arange(n, device=targets.device)[None, :] >= lengths.to(targets.device)
        return targets.masked_fill(beyond, IGNORE)

    def validation_metrics(self, member: Member) -> dict:
        tr, backend = self.ctx.trainer, self.ctx.backend
        losses, by_position = [], PositionLoss(self.ctx.data.seq_len)
        # the global batches of every rank together, shared out by rows as in training
        for batch in self.ctx.data.val_batches(tr.val_batches, tr.batch_size * backend.world_size):
            batch = self.val_shard(batch).to(backend.device)
            with backend.autocast():
                logits = member.model(batch[:, :-1])
            # F.cross_entropy's own steps, so that the mean is its value to the bit
            log_probs = F.log_softmax(logits.flatten(0, 1).float(), dim=-1)
            targets = batch[:, 1:].flatten()
            losses.append(F.nll_loss(log_probs, targets).item())
            by_position.add(F.nll_loss(log_probs, targets, reduction="none").view(batch.shape[0], -1))
        val_loss = backend.all_reduce_mean(sum(losses) / len(losses))
        return {"val_loss": val_loss, "val_bpc": val_loss / math.log(2),
                "val_bpc_by_position": by_position.buckets(backend.all_reduce_mean)}

    @torch.no_grad()
    def sample(self, step: int) -> None:
        ctx = self.ctx
        model = ctx.members[0].model.eval()
        gen = torch.Generator(device=ctx.backend.device).manual_seed(ctx.trainer.seed + step)
        texts = []
        for i in range(self.num_samples):
            prime = ctx.data.prime(self.prime_length, index=i).to(ctx.backend.device)
            with ctx.backend.autocast():
                out = generate(model, prime[None], self.generate_length, self.temperature, self.top_k, gen)
            texts.append(f"=== prime\n{ctx.data.decode(prime)}\n=== generated\n{ctx.data.decode(out[0])}\n")
        text = "\n".join(texts)
        ctx.run.write_sample(f"step_{step:07d}.txt", text)
        ctx.tracker.log_text("samples", text, step)
