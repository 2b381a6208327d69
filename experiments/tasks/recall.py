"""task=recall: a language model trained and scored on its answers alone (data=mqar, data=passkey).

The loss covers the answer positions only; validation reports `val_accuracy`: the share of answer
tokens predicted right (MQAR), or of sequences with every answer token right (passkey: under
teacher forcing that is exactly what greedy decoding would answer), and per depth bin for data
with needles (`val_accuracy_depth<i>`).

    python train.py experiment=mqar
    python train.py experiment=passkey model=nsa
"""

import torch
import torch.nn.functional as F

from experiments.runtime.errors import UserError
from experiments.runtime.throughput import training_flops_per_token
from experiments.tasks.task import Member, Task
from models.transformer import IGNORE, TransformerLM


class RecallTask(Task):
    name = "recall"

    def __init__(self, num_samples: int):
        self.num_samples = num_samples

    def setup(self, nets):
        data = self.ctx.data
        if not hasattr(data, "per_sequence"):
            raise UserError("task=recall reads recall data: use data=mqar or data=passkey (experiment=mqar, passkey)")
        for prefix, net in nets.items():
            if not isinstance(net, TransformerLM):
                raise UserError("task=recall trains language models: use model=transformer, nsa, sinkhorn or routing")
            if net.num_tokens < data.vocab_size:
                raise UserError(f"model.num_tokens={net.num_tokens} is smaller than the data's vocabulary "
                                f"({data.vocab_size}): set model.num_tokens={data.vocab_size}")
        return nets

    def tokens_per_sample(self, prefix: str) -> int:
        return self.ctx.data.seq_len

    def flops_per_token(self, prefix, net) -> float:
        return training_flops_per_token(net, self.ctx.data.seq_len, self.ctx.backend.device)

    def micro_batch(self, step: int, micro: int):
        tr, backend = self.ctx.trainer, self.ctx.backend
        inputs, targets, _ = self.ctx.data.train_batch(tr.batch_size, seed=tr.seed, step=step, micro=micro,
                                                       rank=backend.rank, world_size=backend.world_size)
        return inputs.to(backend.device, non_blocking=True), targets.to(backend.device, non_blocking=True)

    def loss(self, member: Member, batch):
        inputs, targets = batch
        logits = member.trainee.forward(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)
        return loss + member.model.aux_loss(), {}

    def validation_metrics(self, member: Member) -> dict[str, float]:
        tr, backend, data = self.ctx.trainer, self.ctx.backend, self.ctx.data
        loss_sum = answers = 0.0
        right = torch.zeros(data.depth_bins)
        count = torch.zeros(data.depth_bins)
        for batch in data.val_batches(tr.val_batches, tr.batch_size * backend.world_size):
            inputs, targets, depth = (t.to(backend.device) for t in self.val_shard(batch))
            with backend.autocast():
                logits = member.model(inputs)
            loss_sum += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE,
                                        reduction="sum").item()
            answers += (targets != IGNORE).sum().item()
            scored, units = answer_accuracy(logits, targets, data.per_sequence)
            right.index_add_(0, depth.cpu(), scored.float().cpu())
            count.index_add_(0, depth.cpu(), units.float().cpu())
        figures = {"val_loss": loss_sum / max(answers, 1), "val_accuracy": (right.sum() / count.sum()).item()}
        if data.depth_bins > 1:
            figures |= {f"val_accuracy_depth{i}": (right[i] / count[i]).item() for i in range(data.depth_bins)}
        return {k: backend.all_reduce_mean(v) for k, v in figures.items()}

    @torch.no_grad()
    def sample(self, step: int) -> None:
        """A few validation items: each answer expected against the model's."""
        ctx = self.ctx
        model = ctx.members[0].model.eval()
        inputs, targets, depth = next(ctx.data.val_batches(1, self.num_samples))
        with ctx.backend.autocast():
            predicted = model(inputs.to(ctx.backend.device)).argmax(-1).cpu()
        lines = []
        for i in range(len(inputs)):
            at = (targets[i] != IGNORE).nonzero()[:, 0]
            expected, got = targets[i, at].tolist(), predicted[i, at].tolist()
            mark = "right" if expected == got else "WRONG"
            lines.append(f"item {i} (depth bin {int(depth[i])}): expected {expected}, predicted {got}: {mark}")
        text = "\n".join(lines) + "\n"
        ctx.run.write_sample(f"step_{step:07d}.txt", text)
        ctx.tracker.log_text("samples", text, step)


def answer_accuracy(logits: torch.Tensor, targets: torch.Tensor, per_sequence: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [b, n, vocab], targets [b, n] (IGNORE but at answers) -> (right [b], answers counted [b]):
    per answer token, or per sequence (1 when every answer token of the row is right)."""
    answer = targets != IGNORE
    correct = (logits.argmax(-1) == targets) & answer
    if per_sequence:
        has = answer.any(1)
        return ((correct.sum(1) == answer.sum(1)) & has).long(), has.long()
    return correct.sum(1), answer.sum(1)
