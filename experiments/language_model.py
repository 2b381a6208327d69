"""The language-modelling task: next-byte prediction with validation, samples and checkpoints.

It trains one model, or several on the same batches (a speculative-decoding pair, see
experiments.speculative); the loop, checkpoints and resume are experiments.training's.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F

from experiments.errors import UserError
from experiments.throughput import training_flops_per_token
from experiments.training import Member, TrainingTask
from models.sampling import generate
from models.transformer import TransformerLM

IGNORE = -100  # target value that cross_entropy skips


class LanguageModelTask(TrainingTask):
    task_name = "lm"
    result_key = "val_bpc"

    def __init__(self, prime_length: int = 64, generate_length: int = 256, num_samples: int = 1,
                 temperature: float = 1.0, top_k: Optional[int] = None, randomly_truncate_sequence: bool = False):
        self.randomly_truncate_sequence = randomly_truncate_sequence
        self.prime_length = prime_length
        self.generate_length = generate_length
        self.num_samples = num_samples
        self.temperature = temperature
        self.top_k = top_k

    def setup(self, nets):
        for prefix, net in nets.items():
            if not isinstance(net, TransformerLM):
                raise UserError(f"task={self.task_name} trains language models, and the {prefix or 'model'} config "
                                "builds something else: use experiment=dvae or experiment=dalle for image models")
        if self.prime_length >= self.data.seq_len:
            raise UserError(f"task.prime_length={self.prime_length} must be shorter than data.seq_len={self.data.seq_len}")
        return nets

    def tokens_per_sample(self, prefix: str) -> int:
        return self.data.seq_len

    def flops_per_token(self, prefix, net) -> float:
        return training_flops_per_token(net, self.data.seq_len, self.backend.device)

    def micro_batch(self, step: int, micro: int):
        tr = self.trainer
        batch = self.data.train_batch(tr.batch_size, seed=tr.seed, step=step, micro=micro, rank=self.backend.rank,
                                      world_size=self.backend.world_size)
        batch = batch.to(self.backend.device, non_blocking=True)
        targets = batch[:, 1:]
        if self.randomly_truncate_sequence:
            targets = self._truncated(targets, step, micro)
        return batch[:, :-1], targets

    def loss(self, member: Member, batch):
        inputs, targets = batch
        logits = member.trainee.forward(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)
        return loss + member.model.aux_loss(), {}

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

    def validation_metrics(self, member: Member) -> dict[str, float]:
        losses = []
        # the global batches of every rank together, shared out by rows as in training
        for batch in self.data.val_batches(self.trainer.val_batches, self.trainer.batch_size * self.backend.world_size):
            batch = self.val_shard(batch).to(self.backend.device)
            with self.backend.autocast():
                logits = member.model(batch[:, :-1])
            losses.append(F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).item())
        val_loss = self.backend.all_reduce_mean(sum(losses) / len(losses))
        return {"val_loss": val_loss, "val_bpc": val_loss / math.log(2)}

    @torch.no_grad()
    def sample(self, step: int) -> None:
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
