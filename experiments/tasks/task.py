"""What a task says, and what it is given: the hooks the loop (experiments/tasks/loop.py) drives.

A task trains one model or several (a speculative-decoding pair; a VAE and the DALL-E on top of
it). Each is a member of the loop, named by its prefix ("" for the model, "draft_" for the draft,
"vae_" for the VAE): its own optimizer, schedule, metrics and checkpoint entries. A task defines

    setup(nets)                   -> the models by prefix, checked against the data (before any work)
    micro_batch(step, micro)      -> the batch of one micro-step, on the device
    loss(member, batch)           -> (loss, {extra figures}) of one member on it
    validation_metrics(member)    -> {"val_loss": ..., ...} (unprefixed): numbers, or by-position figures
                                     (experiments/tasks/positions.py)
    sample(step)                  -> write samples/ and log them
    tokens_per_sample(prefix)     -> what tokens/s counts while that member trains
    flops_per_token(prefix, net, seq_len)  -> counted training FLOPs per such token (MFU)
    train_seq_lens(), train_seq_len(step)  -> the lengths it trains at, and this step's (None: its one)

and, when it trains in stages, `active`, `total_steps`, `optimizer_for` and `schedule_for`.
"""

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from experiments.runtime.backends import Trainee
from experiments.runtime.errors import UserError
from experiments.runtime.throughput import training_flops_per_token


@dataclass
class Member:
    """One trained model as the loop holds it."""

    trainee: Trainee  # the model as the backend trains it
    schedule: torch.optim.lr_scheduler.LRScheduler

    @property
    def prefix(self) -> str:  # of its metrics and checkpoint entries
        return self.trainee.prefix

    @property
    def model(self) -> nn.Module:
        return self.trainee.module


@dataclass
class Context:
    """What a task reads: given by the loop before setup; `members` is filled once they are built."""

    run: Any  # experiments.runtime.run.Run: summary, metrics, samples/
    cfg: Any  # the composed config
    backend: Any
    data: Any
    tracker: Any
    members: list[Member] = field(default_factory=list)

    @property
    def trainer(self):
        return self.cfg.trainer


class Task:
    name = "task"  # summary.json's "task"
    result_key = "val_loss"  # the summary figure a sweep minimises

    def attach(self, ctx: Context) -> None:
        self.ctx = ctx

    def check_parts(self, nets: dict, data_kind: str, data_name: str) -> None:
        """Refuse, in one line, models this task cannot train (nets: {prefix: model}, built, or on the
        meta device) and data of a kind it does not read (data_kind: the data class's `kind`, text,
        recall or images; data_name: its data= option). The run's setup calls it, and train.py's
        pre-check (experiments/config/checks.py) before any directory is made."""

    def setup(self, nets: dict[str, nn.Module]) -> dict[str, nn.Module]:
        return nets

    def check_run_parts(self, nets: dict) -> None:
        """check_parts on the run's own data."""
        data = self.ctx.data
        name = self.ctx.run.choices.get("data", type(data).__name__)
        if not hasattr(data, "kind"):
            raise UserError(f"data={name}: its class {type(data).__name__} declares no `kind` (text, recall or "
                            "images, what a task checks it trains on): add one")
        self.check_parts(nets, data.kind, name)

    def micro_batch(self, step: int, micro: int):
        raise NotImplementedError

    def loss(self, member: Member, batch) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def validation_metrics(self, member: Member) -> dict[str, float]:
        raise NotImplementedError

    def sample(self, step: int) -> None:
        raise NotImplementedError

    def tokens_per_sample(self, prefix: str) -> int:
        """A sequence task's: every position of data.seq_len (image tasks count otherwise)."""
        return self.ctx.data.seq_len

    def flops_per_token(self, prefix: str, net: nn.Module, seq_len: Optional[int] = None) -> float:
        """A sequence model's training FLOPs per position at seq_len (None: data.seq_len)."""
        return training_flops_per_token(net, seq_len or self.ctx.data.seq_len, self.ctx.backend.device)

    def train_seq_lens(self) -> tuple[Optional[int], ...]:
        """Every length training steps run at, for flops_per_token (None: the task's one length)."""
        return (None,)

    def train_seq_len(self, step: int) -> Optional[int]:
        """The length this step trains at, one of train_seq_lens()."""
        return None

    # ---- stages (a task that trains its members one after another overrides these)

    def active(self, step: int) -> list[Member]:
        """The members that train at this step."""
        return self.ctx.members

    @property
    def total_steps(self) -> int:
        return self.ctx.trainer.max_steps

    def optimizer_for(self, prefix: str, optimizer):
        """The optimizer partial of a member (a stage may have its own)."""
        return optimizer

    def schedule_for(self, prefix: str, schedule):
        return schedule

    def checkpoint_extras(self) -> dict:
        """Entries a task adds to its checkpoints (what rebuilding its models needs)."""
        return {}

    # ---- shared by the tasks

    def val_shard(self, batch):
        """This rank's rows of a global validation batch (shared out by rows, as in training)."""
        b, rank = self.ctx.trainer.batch_size, self.ctx.backend.rank
        if isinstance(batch, (tuple, list)):
            return type(batch)(t[rank * b : (rank + 1) * b] for t in batch)
        return batch[rank * b : (rank + 1) * b]
