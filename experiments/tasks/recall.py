"""task=recall: a language model trained and scored on its answers alone (data=mqar, data=passkey).

The loss covers the answer positions only; validation reports `val_accuracy`: the share of answer
tokens predicted right (MQAR), or of sequences with every answer token right (passkey: under
teacher forcing that is exactly what greedy decoding would answer), and per depth bin for data
with needles (`val_accuracy_depth<i>`). For NSA it also reports whether selection found what each
answer needs: `val_selection_hit`, the share of (answer, layer, KV head) whose selected blocks hold
the token the answer copies, and `val_selection_free_hit`, the same among answers whose token no
forced block (own, initial, previous) holds: what the choice by importance found by itself; and,
where two or more branches are open, `val_accuracy_without_<branch>` per branch: the accuracy with
that branch's gate held at 0 and the rest as trained, which shows what the recall rests on (an NSA
that answers through its compressed branch alone loses nearly every answer without it and none
without its window).

    python train.py experiment=mqar
    python train.py experiment=passkey model=nsa
"""

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from experiments.runtime.errors import UserError
from experiments.tasks.task import Member, Task
from models.attention.nsa import Selection, branch_closed, open_branches, recording_selection
from models.transformer import IGNORE, TransformerLM


class RecallTask(Task):
    name = "recall"

    def __init__(self, num_samples: int, context_weight: float):
        self.num_samples = num_samples
        self.context_weight = context_weight

    def check_parts(self, nets, data_kind, data_name):
        if data_kind != "recall":
            raise UserError(f"task=recall reads recall data, and data={data_name} is not: use data=mqar or "
                            "data=passkey (experiment=mqar, passkey)")
        if not all(isinstance(net, TransformerLM) for net in nets.values()):
            raise UserError("task=recall trains language models: use model=transformer, nsa, sinkhorn or routing")

    def setup(self, nets):
        self.check_run_parts(nets)
        data = self.ctx.data
        for prefix, net in nets.items():
            if net.num_tokens < data.vocab_size:
                raise UserError(f"model.num_tokens={net.num_tokens} is smaller than the data's vocabulary "
                                f"({data.vocab_size}): set model.num_tokens={data.vocab_size}")
        return nets

    def train_seq_lens(self):
        return self.ctx.data.train_seq_lens

    def train_seq_len(self, step: int):  # shorter during a length curriculum (data=passkey)
        return self.ctx.data.train_seq_len(step)

    def micro_batch(self, step: int, micro: int):
        tr, backend = self.ctx.trainer, self.ctx.backend
        inputs, targets, _ = self.ctx.data.train_batch(tr.batch_size, seed=tr.seed, step=step, micro=micro,
                                                       rank=backend.rank, world_size=backend.world_size)
        return inputs.to(backend.device, non_blocking=True), targets.to(backend.device, non_blocking=True)

    def loss(self, member: Member, batch):
        inputs, targets = batch
        answer = targets != IGNORE
        if not self.context_weight:
            logits = member.trainee.forward(inputs, at=answer)  # [answers, vocab]: the output layer nowhere else
            return F.cross_entropy(logits.float(), targets[answer]) + member.model.aux_loss(), {}
        # every position predicts its next token; the answers' targets are the data's own
        logits = member.trainee.forward(inputs).float()
        following = torch.cat((inputs[:, 1:], targets[:, -1:]), dim=1)
        answer_loss = F.cross_entropy(logits[answer], targets[answer])
        context_loss = F.cross_entropy(logits[~answer], following[~answer])
        loss = answer_loss + self.context_weight * context_loss + member.model.aux_loss()  # this forward's
        return loss, {"context_loss": context_loss.item()}

    def validation_metrics(self, member: Member) -> dict[str, float]:
        figures = self._validate(member)
        # NSA: how much of the recall rests on each branch, its gate held at 0 and the others as trained
        branches = open_branches(member.model)
        for name in branches if len(branches) > 1 else ():
            with branch_closed(member.model, name):
                figures[f"val_accuracy_without_{name}"] = self._validate(member, record=False)["val_accuracy"]
        return {k: self.ctx.backend.all_reduce_mean(v) for k, v in figures.items()}

    def _validate(self, member: Member, record: bool = True) -> dict[str, float]:
        """This rank's loss and accuracy over the validation items; with `record`, NSA's selection hits."""
        tr, backend, data = self.ctx.trainer, self.ctx.backend, self.ctx.data
        loss_sum = answers = 0.0
        right = torch.zeros(data.depth_bins)
        count = torch.zeros(data.depth_bins)
        hits = torch.zeros(4)  # selected, of (answer, layer, head); free, of those no forced block holds
        for batch in data.val_batches(tr.val_batches, tr.batch_size * backend.world_size):
            inputs, targets, depth = (t.to(backend.device) for t in self.val_shard(batch))
            answer = targets != IGNORE
            with backend.autocast(), recording_selection(member.model) if record else nullcontext([]) as selections:
                logits = member.model(inputs, at=answer)
            if selections:
                hits += selection_hits(selections, data.needles(inputs, targets))
            loss_sum += F.cross_entropy(logits.float(), targets[answer], reduction="sum").item()
            answers += answer.sum().item()
            scored, units = answer_accuracy(logits.argmax(-1), targets, data.per_sequence)
            right.index_add_(0, depth.cpu(), scored.float().cpu())
            count.index_add_(0, depth.cpu(), units.float().cpu())
        figures = {"val_loss": loss_sum / max(answers, 1), "val_accuracy": (right.sum() / count.sum()).item()}
        if data.depth_bins > 1:
            # a bin no validation item fell in (fewer items than bins) has no figure, not NaN
            figures |= {f"val_accuracy_depth{i}": (right[i] / count[i]).item() for i in range(data.depth_bins)
                        if count[i] > 0}
        if hits[1]:
            figures["val_selection_hit"] = (hits[0] / hits[1]).item()
        if hits[3]:
            figures["val_selection_free_hit"] = (hits[2] / hits[3]).item()
        return figures

    @torch.no_grad()
    def sample(self, step: int) -> None:
        """A few validation items: each answer expected against the model's."""
        ctx = self.ctx
        model = ctx.members[0].model.eval()
        inputs, targets, depth = next(ctx.data.val_batches(1, self.num_samples))
        answer = targets != IGNORE
        with ctx.backend.autocast():
            predicted = targets.clone()
            predicted[answer] = model(inputs.to(ctx.backend.device), at=answer.to(ctx.backend.device)).argmax(-1).cpu()
        lines = []
        for i in range(len(inputs)):
            expected, got = targets[i, answer[i]].tolist(), predicted[i, answer[i]].tolist()
            mark = "right" if expected == got else "WRONG"
            lines.append(f"item {i} (depth bin {int(depth[i])}): expected {expected}, predicted {got}: {mark}")
        text = "\n".join(lines) + "\n"
        ctx.run.write_sample(f"step_{step:07d}.txt", text)
        ctx.tracker.log_text("samples", text, step)


def selection_hits(selections: list[Selection], needles: torch.Tensor) -> torch.Tensor:
    """Recorded selections (one per NSA layer) and needles [b, n] (-1 but at answers) -> counts
    (held by a selected block, answers x layers x heads, held by a free block, those no forced
    block holds)."""
    counts = torch.zeros(4)
    asked = (needles >= 0)[:, None]  # [b, 1, n]
    for selection in selections:
        selected, forced = selection.holds(needles)
        beyond = asked & ~forced
        counts += torch.stack([(selected & asked).sum(), asked.expand_as(selected).sum(),
                               (selected & beyond).sum(), beyond.sum()]).float().cpu()
    return counts


def answer_accuracy(predicted: torch.Tensor, targets: torch.Tensor, per_sequence: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """predicted [answers] (the tokens predicted at the answer positions, row by row), targets [b, n]
    (IGNORE but at answers) -> (right [b], answers counted [b]): per answer token, or per sequence (1 when
    every answer token of the row is right)."""
    answer = targets != IGNORE
    correct = torch.zeros_like(answer)
    correct[answer] = predicted == targets[answer]
    if per_sequence:
        has = answer.any(1)
        return ((correct.sum(1) == answer.sum(1)) & has).long(), has.long()
    return correct.sum(1), answer.sum(1)
