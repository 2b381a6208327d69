"""The language-model task's own pieces (the loop itself is exercised end to end in test_train)."""

from types import SimpleNamespace

import pytest
import torch

from experiments.runtime.errors import UserError
from experiments.tasks.lm import LanguageModelTask
from experiments.tasks.task import Context
from models.transformer import IGNORE


def truncating_task(rank: int = 0, world_size: int = 1) -> LanguageModelTask:
    task = LanguageModelTask(prime_length=8, generate_length=8, num_samples=1, temperature=1.0, top_k=None,
                             randomly_truncate_sequence=True)
    cfg = SimpleNamespace(trainer=SimpleNamespace(seed=0))
    task.attach(Context(run=None, cfg=cfg, backend=SimpleNamespace(rank=rank, world_size=world_size), data=None,
                        tracker=None))
    return task


def test_random_truncation_ignores_each_rows_tail_reproducibly():
    task = truncating_task()
    targets = torch.arange(4 * 25).view(4, 25) % 7
    cut = task._truncated(targets, step=3, micro=0)
    kept = (cut != IGNORE).sum(1)
    assert torch.equal(cut == IGNORE, torch.arange(25)[None, :] >= kept[:, None])  # a prefix kept per row
    assert kept.min() >= 1 and len(set(kept.tolist())) > 1  # rows get their own lengths
    assert torch.equal(task._truncated(targets, step=3, micro=0), cut)  # the same at resume
    assert not torch.equal(task._truncated(targets, step=4, micro=0), cut)
    assert torch.equal(cut[cut != IGNORE], targets[cut != IGNORE])


def test_ranks_truncate_their_rows_of_the_global_batch():
    targets = torch.zeros(4, 25, dtype=torch.long)
    whole = truncating_task()._truncated(targets, step=1, micro=0)
    halves = [truncating_task(rank, world_size=2)._truncated(targets[:2], step=1, micro=0) for rank in (0, 1)]
    assert torch.equal(torch.cat(halves), whole)


@pytest.mark.parametrize("num_tokens", [100, 300])
def test_a_model_whose_vocabulary_is_not_the_datas_bytes_is_refused(num_tokens):
    """Fewer tokens failed with an index error at the first step; more trained every step, then the
    final sample held bytes past 255 and the run died before its last checkpoint."""
    from models.lm import transformer_lm

    task = LanguageModelTask(prime_length=8, generate_length=8, num_samples=1, temperature=1.0, top_k=None,
                             randomly_truncate_sequence=False)
    task.attach(Context(run=SimpleNamespace(choices={"data": "text"}), cfg=None, backend=None,
                        data=SimpleNamespace(kind="text", vocab_size=256, seq_len=32), tracker=None))
    model = transformer_lm(num_tokens=num_tokens, dim=16, depth=1, heads=2, dim_head=8)
    message = f"draft.num_tokens={num_tokens} does not match the data's vocabulary of 256 tokens: set draft.num_tokens"
    with pytest.raises(UserError, match=message):
        task.setup({"": transformer_lm(num_tokens=256, dim=16, depth=1, heads=2, dim_head=8), "draft_": model})


@pytest.mark.parametrize("chosen", ["mqar", "shapes"])
def test_data_that_is_not_text_is_refused_naming_what_fits_it(compose, chosen):
    """Recall data's batches are (tokens, targets, mask) and images have no vocabulary: each failed
    with an AttributeError at the first step or in setup. Now refused by the pre-check, before the
    run's directory is made, by the task's own rule."""
    from experiments.config.checks import parts_error

    assert parts_error(compose(f"data={chosen}", "model=transformer")) == (
        f"task=lm trains on text (data=text, stdlib or enwik8), and data={chosen} is not: use experiment=mqar or "
        "passkey for recall data, experiment=dvae or dalle for images")
