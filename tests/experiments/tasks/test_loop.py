"""The loop's own policies that test_train.py's end-to-end runs do not reach."""

import torch

from experiments.runtime import checkpoint
import math
import resource
from types import SimpleNamespace
import pytest
from experiments.config.schema import Device, Precision
from experiments.runtime.backends import LocalBackend
from experiments.tasks import loop as loop_module
from experiments.tasks.loop import Loop
from experiments.tasks.task import Member
from tests.helpers.runs import losses, read_metrics, read_summary, train, trainer_section

# module paths of the tasks, data and schedules before experiments/ was split into subpackages
_MOVED = {"experiments.tasks.lm.": "experiments.language_model.", "experiments.data.text.": "experiments.data.",
          "experiments.runtime.schedule.": "experiments.schedule."}


def test_a_checkpoint_written_before_the_modules_moved_continues(tmp_path):
    run = tmp_path / "run"
    train(run, "trainer.max_steps=2", "schedule=constant")
    path = checkpoint.latest(run / "checkpoints")
    state = torch.load(path, weights_only=True)
    for new, old in _MOVED.items():
        assert new in state["config"]
        state["config"] = state["config"].replace(new, old)
    torch.save(state, path)

    result = train(run, "trainer.max_steps=4", "schedule=constant")
    assert "resumed from" in result.stderr + result.stdout
    straight = tmp_path / "straight"
    train(straight, "trainer.max_steps=4", "schedule=constant")
    assert losses(run) == losses(straight)


def test_a_resumed_summary_keeps_the_earlier_figures_and_names_the_machine_that_went_on(tmp_path):
    run, steps = tmp_path / "run", ["schedule=constant", "trainer.validate_every=1"]
    train(run, "trainer.max_steps=2", *steps)
    train(run, "trainer.max_steps=3", "trainer.threads=2", *steps)  # threads may change on a resume
    summary = read_summary(run)
    assert summary["step"] == 3 and summary["threads"] == 2
    assert summary["best_val_loss"] == min(row["val_loss"] for row in read_metrics(run) if "val_loss" in row)


class _Linear(torch.nn.Linear):
    def after_optimizer_step(self):
        pass


class _Task:
    def __init__(self, batches):
        self.batches = batches

    def micro_batch(self, step, micro):
        return self.batches[micro]

    def loss(self, member, batch):
        return member.trainee.forward(batch).square().mean(), {}


def _one_step(batches, grad_accum, clip):
    backend = LocalBackend()
    backend.setup(trainer_section(device=Device.cpu, precision=Precision.fp32))
    model = _Linear(3, 1, bias=False)
    torch.nn.init.constant_(model.weight, 1.0)
    trainee = backend.prepare("", model, lambda params: torch.optim.SGD(params, lr=1.0))
    member = Member(trainee, torch.optim.lr_scheduler.LambdaLR(trainee.optimizer, lambda s: 1.0))
    loop = Loop.__new__(Loop)
    loop.trainer = SimpleNamespace(grad_accum=grad_accum, clip_grad_norm=clip)
    loop.backend, loop.task = backend, _Task(batches)
    totals = loop._train_step(0, [member])
    return totals, model.weight.detach().clone()


def test_accumulated_micro_batches_step_as_their_mean_and_log_their_mean_loss():
    torch.manual_seed(0)
    batches = [torch.randn(2, 3) for _ in range(2)]
    whole = torch.cat(batches)
    w = torch.ones(1, 3, requires_grad=True)
    loss = (whole @ w.T).square().mean()
    (grad,) = torch.autograd.grad(loss, w)
    totals, weight = _one_step(batches, grad_accum=2, clip=None)
    torch.testing.assert_close(weight, (w - grad).detach())  # the mean gradient, not the sum
    assert totals["loss"] == pytest.approx(loss.item(), rel=1e-6)  # the mean loss, not the sum


def test_clip_grad_norm_bounds_the_step():
    torch.manual_seed(0)
    batches = [10 * torch.randn(4, 3)]
    _, weight = _one_step(batches, grad_accum=1, clip=1e-3)
    assert (weight - 1.0).norm().item() == pytest.approx(1e-3, rel=1e-4)


PEAK = 1e9


def test_throughput_mfu_checkpoint_cadence_and_summary_figures(tmp_path, monkeypatch):
    ticks = iter(range(1, 10**6))
    monkeypatch.setattr(loop_module, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    monkeypatch.setattr(loop_module, "matmul_peak_flops", lambda device, dtype: PEAK)
    run = tmp_path / "run"
    train(run, "trainer.max_steps=5", "trainer.grad_accum=2", "trainer.log_every=2", "trainer.checkpoint_every=2",
          "trainer.keep_checkpoints=5", "trainer.validate_every=1", "trainer.generate_every=0")
    summary = read_summary(run)
    rows = [r for r in read_metrics(run) if "loss" in r]
    # each window takes one tick of the clock: tokens/s = batch 2 x accumulation 2 x 32 tokens x its steps
    assert [(r["step"], r["tokens_per_s"]) for r in rows] == [(2, 256), (4, 256), (5, 128)]
    f = summary["flops_per_token"]
    for r in rows:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * f / PEAK, rel=1e-3, abs=1e-4)
    # the summary: windows after the first, weighted by their steps
    assert summary["tokens_per_s"] == pytest.approx((256 * 2 + 128) / 3, abs=0.1)
    assert summary["mfu"] == pytest.approx(summary["tokens_per_s"] * f / PEAK, rel=1e-3, abs=1e-4)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_0000002.pt", "step_0000004.pt", "step_0000005.pt"]
    state = torch.load(run / "checkpoints" / "step_0000005.pt", weights_only=True)
    assert summary["params"] == sum(t.numel() for t in state["model"].values())
    assert 0 < summary["peak_mem_mb"] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 + 1
    val = [r for r in read_metrics(run) if "val_loss" in r]
    assert summary["best_val_loss"] == pytest.approx(min(r["val_loss"] for r in val), abs=1e-5)
    assert summary["best_val_bpc"] == pytest.approx(summary["best_val_loss"] / math.log(2), abs=1e-5)


def test_the_best_validation_figures_are_the_lowest_so_far_not_the_latest():
    summary = {}
    run = SimpleNamespace(summary=summary, update_summary=summary.update, log_metrics=lambda row: None,
                          wall_s=lambda: 0.0)
    figures = iter([2.0, 1.0, 1.5])
    loop = Loop.__new__(Loop)
    loop.run, loop.tracker = run, SimpleNamespace(log=lambda row, step: None)
    loop.task = SimpleNamespace(validation_metrics=lambda m: {"val_loss": (v := next(figures)),
                                                              "val_bpc": v / math.log(2)})
    member = SimpleNamespace(prefix="", model=torch.nn.Linear(1, 1))
    for step in (1, 2, 3):
        loop._validate(step, [member])
    assert summary["val_loss"] == 1.5 and summary["best_val_loss"] == 1.0
    assert summary["best_val_bpc"] == pytest.approx(1.0 / math.log(2), abs=1e-5)
