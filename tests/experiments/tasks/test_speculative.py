"""task=speculative: both members trained on the same batches, the draft optionally distilled
from the target, and the end-of-run sample timing plain against speculative decoding; on CUDA (the
gpu tier): the pair in each precision, and the preset."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from experiments.runtime.errors import UserError
from experiments.tasks.speculative import SpeculativeTask, compare_decoding, distillation_kl
from models.lm import transformer_lm
from models.transformer import IGNORE
from tests.helpers.gpu import PRECISIONS, assert_loss_falls, train_on_cuda
from tests.helpers.runs import TINY, read_metrics, read_summary, train, train_py


def test_distillation_kl_is_the_kl_from_the_target_over_kept_positions():
    torch.manual_seed(0)
    logits, target_logits = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    p, log_q = target_logits.softmax(-1), logits.log_softmax(-1)
    per_position = (p * (p.log() - log_q)).sum(-1)
    expected = per_position[mask].mean()
    assert torch.allclose(distillation_kl(logits, target_logits, mask), expected)
    assert distillation_kl(target_logits, target_logits, mask).abs() < 1e-6  # the same distributions
    # the dropped positions do not count, whatever they hold
    changed = logits.clone()
    changed[0, 2] += 100
    assert torch.allclose(distillation_kl(changed, target_logits, mask), expected)


def _pair_task(distill_weight):
    torch.manual_seed(0)
    target = transformer_lm(num_tokens=16, dim=16, depth=1, heads=2, dim_head=8)
    draft = transformer_lm(num_tokens=16, dim=16, depth=1, heads=2, dim_head=8)
    task = SpeculativeTask(gamma=2, distill_weight=distill_weight, engine="auto", prime_length=2, generate_length=2,
                           num_samples=1, temperature=0.0, top_k=None, randomly_truncate_sequence=False)
    members = [SimpleNamespace(trainee=SimpleNamespace(forward=m), model=m) for m in (target, draft)]
    task.attach(SimpleNamespace(members=members))
    tokens = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(1))
    targets = tokens[:, 1:].clone()
    targets[1, 5:] = IGNORE
    return task, members, (tokens[:, :-1], targets)


def test_distill_weight_adds_the_kl_to_the_target_to_the_drafts_loss_alone():
    task, (target, draft), batch = _pair_task(0.5)
    inputs, targets = batch
    target_loss, target_extras = task.loss(target, batch)
    draft_loss, draft_extras = task.loss(draft, batch)
    ce = lambda m: F.cross_entropy(m.model(inputs).flatten(0, 1), targets.flatten(), ignore_index=IGNORE)  # noqa: E731
    kl = distillation_kl(draft.model(inputs), target.model(inputs), targets != IGNORE)
    assert torch.allclose(target_loss, ce(target)) and target_extras == {}
    assert torch.allclose(draft_loss, ce(draft) + 0.5 * kl)
    assert draft_extras["distill_kl"] == pytest.approx(kl.item())
    # the target's logits are a constant of the draft's loss: the target learns from the data alone
    draft_loss.backward()
    assert all(p.grad is None for p in target.model.parameters())
    assert all(p.grad is not None for p in draft.model.parameters())
    # without the target's loss on this batch first, its logits are computed: the same loss
    task2, (_, draft2), _ = _pair_task(0.5)
    assert torch.allclose(task2.loss(draft2, batch)[0], draft_loss)


def test_without_distillation_the_draft_learns_from_the_data_alone():
    task, (target, draft), batch = _pair_task(0.0)
    inputs, targets = batch
    task.loss(target, batch)
    loss, extras = task.loss(draft, batch)
    ce = F.cross_entropy(draft.model(inputs).flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    assert torch.allclose(loss, ce) and extras == {}


def test_the_static_engines_decode_the_growing_caches_tokens():
    """compare_decoding on static-cache engines (eager, as on the CPU): the plain and speculative
    outputs of the growing cache's greedy decoding, and figures for both."""
    torch.manual_seed(0)
    target = transformer_lm(num_tokens=16, dim=16, depth=2, heads=2, dim_head=8).eval()
    draft = transformer_lm(num_tokens=16, dim=16, depth=1, heads=2, dim_head=8).eval()
    prompt = torch.randint(0, 16, (1, 5), generator=torch.Generator().manual_seed(2))
    growing = compare_decoding(target, draft, prompt, 12, 3, 0.0, None)
    static = compare_decoding(target, draft, prompt, 12, 3, 0.0, None, engine="static")
    assert torch.equal(static["plain"], growing["plain"]) and torch.equal(static["speculative"], growing["plain"])
    assert static["same_output"] and static["speedup"] > 0 and static["accepted_per_step"] >= 0


@pytest.mark.parametrize("engine,temperature,message", [
    ("static", 0.7, "task.engine=static decodes greedily: set temperature 0"),
    ("graphs", 0.0, "task.engine=graphs replays CUDA graphs: on the CPU use engine static, compiled or cache"),
])
def test_an_engine_that_cannot_serve_is_refused_at_setup(engine, temperature, message):
    if engine == "graphs" and torch.cuda.is_available():
        pytest.skip("checks the message a CPU-only machine gives")
    task = SpeculativeTask(gamma=2, distill_weight=0.0, engine=engine, prime_length=2, generate_length=2,
                           num_samples=1, temperature=temperature, top_k=None, randomly_truncate_sequence=False)
    task.attach(SimpleNamespace(backend=SimpleNamespace(device=torch.device("cpu"))))
    with pytest.raises(UserError, match=message):
        task.setup({"": None, "draft_": None})


SPEC_TINY = ["experiment=speculative", "model.depth=2", "draft.depth=1", "model.dim=32", "draft.dim=32",
             "model.heads=2", "draft.heads=2", "model.dim_head=16", "draft.dim_head=16", "data.seq_len=32",
             "trainer.batch_size=2", "trainer.val_batches=2", "trainer.progress=false", "trainer.threads=1",
             "tracker=none", "task.prime_length=8", "task.generate_length=12"]


def test_speculative_task_trains_both_and_times_both_decoders(tmp_path, capsys):
    run = tmp_path / "run"
    result = train_py(f"hydra.run.dir={run}", *SPEC_TINY, "trainer.max_steps=4", "trainer.checkpoint_every=2",
                      "task.distill_weight=0.5")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(run)
    assert summary["task"] == "speculative" and summary["status"] == "completed"
    for key in ("val_bpc", "draft_val_bpc", "params", "draft_params", "speedup", "acceptance_rate",
                "base_tokens_per_s", "spec_tokens_per_s", "accepted_per_step"):
        assert summary[key] is not None, key
    assert summary["same_output"] is True  # greedy by default: the same tokens
    # loss by position for each member, the draft's under its own prefix
    by_target, by_draft = summary["val_bpc_by_position"], summary["draft_val_bpc_by_position"]
    assert by_target["edges"] == by_draft["edges"] == [0, 16, 32] and by_target["values"] != by_draft["values"]
    rows = read_metrics(run)
    assert all("draft_loss" in r and r["draft_distill_kl"] >= 0 for r in rows if "loss" in r)
    sample = (run / "samples" / "step_0000004.txt").read_text()
    assert "=== speculative decoding" in sample
    # the timed plain decoding is the target's (not the draft's) greedy continuation of the prime
    from experiments.generate.speculative import load_pair
    from models.sampling import generate

    from hydra.utils import instantiate

    target, draft, cfg = load_pair(run)
    prime = instantiate(cfg.data).prime(8)[None]  # the prime the task took
    plain = sample.split(" tokens/s)\n", 1)[1].split("\n=== speculative", 1)[0]
    assert plain == bytes(generate(target, prime, 12, 0.0)[0].tolist()).decode("utf-8", errors="replace")
    assert plain != bytes(generate(draft, prime, 12, 0.0)[0].tolist()).decode("utf-8", errors="replace")

    # decoding from the run's checkpoint
    from experiments.bench import speculative as bench_speculative
    from experiments.generate import speculative as generate_speculative

    capsys.readouterr()
    assert generate_speculative.main([str(run), "--prompt", "def f(", "--length", "16", "--gamma", "3"]) == 0
    out = capsys.readouterr().out
    assert "speedup" in out and "of 3 draft tokens" in out

    # the benchmark's calls on the static engine (measured in its child process), its greedy tokens those of the
    # growing cache
    assert bench_speculative.main(["--models", "--run", str(run), "--engine", "static", "--primes", "1", "--repeat",
                                   "1", "--length", "12", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "greedy output equal to plain decoding's: True" in out
    assert "plain greedy output equal to the growing cache's (eager): True" in out
    assert "verification of 6 tokens" in out and "engine static" in out


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_pair_trains_on_cuda_and_decodes_both_ways(tmp_path, precision):
    rows = train_on_cuda(tmp_path, precision, "trainer.log_every=1", base=SPEC_TINY)
    assert_loss_falls(rows)
    assert_loss_falls(rows, "draft_loss")
    summary = read_summary(tmp_path)
    assert summary["base_tokens_per_s"] > 0 and summary["spec_tokens_per_s"] > 0
    assert 0 <= summary["acceptance_rate"] <= 1


@pytest.mark.gpu
def test_the_preset_runs_a_few_steps_on_cuda(tmp_path):
    """experiment=speculative as the README runs it (a 6-layer target, a 1-layer draft, seq 256), five
    steps, then its validation and both timed decoders."""
    train(tmp_path, "experiment=speculative", "trainer.max_steps=5", "trainer.device=cuda", "tracker=none",
          "trainer.progress=false", base=[])
    summary = read_summary(tmp_path)
    assert summary["status"] == "completed" and summary["device"].startswith("cuda") and summary["step"] == 5
    for key in ("val_bpc", "draft_val_bpc", "speedup", "acceptance_rate", "base_tokens_per_s", "spec_tokens_per_s"):
        assert summary[key] is not None and summary[key] >= 0, key
    assert "=== speculative decoding" in (tmp_path / "samples" / "step_0000005.txt").read_text()


def test_speculative_task_without_a_draft_says_how_to_add_one(tmp_path):
    out = train_py(f"hydra.run.dir={tmp_path}", *TINY, "model=transformer", "task=speculative")
    assert out.returncode != 0 and "needs a draft model" in out.stderr
