"""The recall task: accuracy over answers on hand-made predictions, and a whole run that reports it."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from experiments.tasks.recall import RecallTask, answer_accuracy
from models.transformer import IGNORE
from tests.helpers.runs import read_metrics, read_summary, train

I = IGNORE


def test_accuracy_counts_answer_tokens_or_whole_sequences():
    targets = torch.tensor([[I, 5, I, 6], [I, I, 7, 8], [I, I, I, 9]])
    predicted = torch.tensor([5, 0, 7, 8, 1])  # row 0: right, wrong; row 1: right, right; row 2: wrong
    right, units = answer_accuracy(predicted, targets, per_sequence=False)
    assert right.tolist() == [1, 2, 0] and units.tolist() == [2, 2, 1]
    right, units = answer_accuracy(predicted, targets, per_sequence=True)
    assert right.tolist() == [0, 1, 0] and units.tolist() == [1, 1, 1]


def test_an_mqar_run_reports_val_accuracy(tmp_path):
    run = tmp_path / "run"
    train(run, "experiment=mqar", "data.vocab_size=64", "data.seq_len=32", "model.dim=32", "trainer.max_steps=3",
          "trainer.batch_size=4", "trainer.val_batches=2", "trainer.validate_every=0", base=[
              "trainer.log_every=1", "trainer.progress=false", "trainer.threads=1", "tracker=none"])
    validation = [row for row in read_metrics(run) if "val_accuracy" in row]
    summary = read_summary(run)
    assert len(validation) == 1 and 0 <= validation[0]["val_accuracy"] <= 1
    assert summary["val_accuracy"] == validation[0]["val_accuracy"] and summary["task"] == "recall"
    assert not [k for k in summary if k.startswith("val_accuracy_without")]  # dense attention: no branches
    assert "expected" in next((run / "samples").glob("*.txt")).read_text()


def test_an_nsa_mqar_run_reports_how_often_selection_held_the_needle(tmp_path):
    run = tmp_path / "run"  # 8 pairs fill fine blocks 0 and 1: queries beyond block 2 must choose block 1
    train(run, "experiment=mqar", "model=nsa", "data.vocab_size=64", "data.seq_len=64", "data.num_kv_pairs=8",
          "model.dim=32", "model.sliding_window_size=8", "model.compress_block_size=8", "model.compress_stride=4",
          "model.fine_block_size=8", "model.num_fine_selected=4", "trainer.max_steps=2", "trainer.batch_size=4",
          "trainer.val_batches=2", "trainer.validate_every=0", base=[
              "trainer.log_every=1", "trainer.progress=false", "trainer.threads=1", "tracker=none"])
    summary = read_summary(run)
    assert 0 < summary["val_selection_free_hit"] < 1  # the one free block sometimes holds the pair, not always
    assert summary["val_selection_free_hit"] < summary["val_selection_hit"] <= 1  # the initial block holds half
    validation = [row for row in read_metrics(run) if "val_accuracy" in row][-1]
    for branch in ("compressed", "selected", "window"):  # the knock-outs, beside what they knock out
        assert 0 <= summary[f"val_accuracy_without_{branch}"] <= 1
        assert validation[f"val_accuracy_without_{branch}"] == summary[f"val_accuracy_without_{branch}"]


def test_knock_outs_name_the_open_branches_only(tmp_path):
    """An NSA with two branches reports each one's knock-out and no other (dense attention: none, above)."""
    run = tmp_path / "run"
    train(run, "experiment=mqar", "model=nsa", "model.branches=[selected,window]", "data.vocab_size=64",
          "data.seq_len=32", "model.dim=32", "trainer.max_steps=1", "trainer.batch_size=4", "trainer.val_batches=1",
          "trainer.validate_every=0", base=["trainer.log_every=1", "trainer.progress=false", "trainer.threads=1",
                                            "tracker=none"])
    knock_outs = sorted(k for k in read_summary(run) if k.startswith("val_accuracy_without"))
    assert knock_outs == ["val_accuracy_without_selected", "val_accuracy_without_window"]


def test_a_passkey_run_reports_accuracy_per_depth(tmp_path):
    run = tmp_path / "run"  # one step on the curriculum's short items, one at full length
    train(run, "experiment=passkey", "data.seq_len=256", "data.curriculum_seq_len=128", "data.curriculum_steps=1",
          "data.depth_bins=5", "model=transformer", "model.dim=32",
          "model.depth=1", "trainer.max_steps=2", "trainer.batch_size=2", "trainer.val_batches=2", base=[
              "trainer.log_every=1", "trainer.progress=false", "trainer.threads=1", "tracker=none"])
    summary = read_summary(run)
    # 4 validation items over 5 bins: the last bin has no item, and no figure (it was NaN, not JSON)
    assert {k for k in summary if k.startswith("val_accuracy")} == {"val_accuracy", *(f"val_accuracy_depth{i}"
                                                                                      for i in range(4))}
    assert "NaN" not in (run / "metrics.jsonl").read_text() + (run / "summary.json").read_text()
    # MFU counts each step's FLOPs at its own length: attention over 128 tokens costs less a token
    flops = [row["mfu"] / row["tokens_per_s"] * summary["matmul_peak_gflops"] * 1e9 for row in read_metrics(run)
             if "mfu" in row]
    assert flops[0] < 0.8 * flops[1]
    assert flops[1] == pytest.approx(summary["flops_per_token"], rel=0.02)  # the summary's: at full length


class _Bigram(torch.nn.Module):
    """Logits from the current token alone: a stand-in LM with the `at` argument of ours."""

    def __init__(self, vocab: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab))

    def forward(self, inputs, at=None):
        logits = self.table[inputs]
        self.last_aux = inputs.float().mean()  # an auxiliary loss that tells one forward from another
        return logits if at is None else logits[at]

    def aux_loss(self):
        return self.last_aux


def test_the_context_weight_adds_next_token_loss_on_every_other_position():
    torch.manual_seed(0)
    net = _Bigram(10)
    member = SimpleNamespace(trainee=net, model=net)
    inputs = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    targets = torch.tensor([[I, I, I, 9], [I, 7, I, 0]])  # answers: (0, 3) -> 9, (1, 1) -> 7, (1, 3) -> 0
    answers = F.cross_entropy(net.table[torch.tensor([4, 6, 8])], torch.tensor([9, 7, 0]))
    # the others predict the next input: 1->2, 2->3, 3->4 and 5->6, 7->8
    context = F.cross_entropy(net.table[torch.tensor([1, 2, 3, 5, 7])], torch.tensor([2, 3, 4, 6, 8]))

    aux = inputs.float().mean()
    loss, _ = RecallTask(num_samples=1, context_weight=0.0).loss(member, (inputs, targets))
    assert torch.allclose(loss, answers + aux)
    loss, extras = RecallTask(num_samples=1, context_weight=0.5).loss(member, (inputs, targets))
    assert torch.allclose(loss, answers + 0.5 * context + aux) and extras["context_loss"] == context.item()


def test_the_auxiliary_loss_is_that_of_the_forward_it_joins():
    """Routing's commitment loss belongs to this batch's forward: one read before it is the last
    step's, whose graph is gone (a second backward through it fails)."""
    torch.manual_seed(0)
    net = _Bigram(10)
    member = SimpleNamespace(trainee=net, model=net)
    targets = torch.tensor([[I, 3]])  # position 0 predicts the next input (8), position 1 answers 3
    answer, context = (F.cross_entropy(net.table[8], torch.tensor(t)) for t in (3, 8))
    for weight in (0.0, 1.0):
        task = RecallTask(num_samples=1, context_weight=weight)
        task.loss(member, (torch.tensor([[1, 1]]), targets))  # the step before: auxiliary loss 1
        loss, _ = task.loss(member, (torch.tensor([[8, 8]]), targets))
        assert torch.allclose(loss, answer + weight * context + 8.0)


def test_recall_validation_averages_over_answers_and_each_depth_bin_over_its_own_items():
    from experiments.tasks.recall import RecallTask

    I = IGNORE
    inputs = torch.zeros(2, 4, dtype=torch.long)
    targets = torch.tensor([[I, 5, I, 6], [I, I, 7, I]])
    depth = torch.tensor([0, 1])
    predicted = torch.tensor([5, 0, 7])  # row 0: right, wrong (bin 0); row 1: right (bin 1)
    logits = 3.0 * F.one_hot(predicted, 10).float()
    data = SimpleNamespace(depth_bins=2, per_sequence=False,
                           val_batches=lambda n, size: iter([(inputs, targets, depth)]))
    backend = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"), all_reduce_mean=lambda v: v,
                              autocast=lambda: torch.autocast("cpu", enabled=False))
    task = RecallTask(num_samples=1, context_weight=0.0)
    task.attach(SimpleNamespace(trainer=SimpleNamespace(val_batches=1, batch_size=2), backend=backend, data=data))
    member = SimpleNamespace(model=lambda x, at: logits)
    figures = task._validate(member, record=False)
    assert figures["val_accuracy"] == pytest.approx(2 / 3)
    assert figures["val_accuracy_depth0"] == 0.5 and figures["val_accuracy_depth1"] == 1.0
    assert figures["val_loss"] == pytest.approx(F.cross_entropy(logits, torch.tensor([5, 6, 7])).item())
