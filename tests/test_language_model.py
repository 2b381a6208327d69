"""The language-model task's own pieces (the loop itself is exercised end to end in test_train)."""

from types import SimpleNamespace

import torch

from experiments.language_model import IGNORE, LanguageModelTask


def test_random_truncation_ignores_each_rows_tail_reproducibly():
    task = LanguageModelTask(randomly_truncate_sequence=True)
    task.trainer, task.backend = SimpleNamespace(seed=0), SimpleNamespace(rank=0, world_size=1)
    targets = torch.arange(4 * 25).view(4, 25) % 7
    cut = task._truncated(targets, step=3, micro=0)
    kept = (cut != IGNORE).sum(1)
    assert torch.equal(cut == IGNORE, torch.arange(25)[None, :] >= kept[:, None])  # a prefix kept per row
    assert kept.min() >= 1 and len(set(kept.tolist())) > 1  # rows get their own lengths
    assert torch.equal(task._truncated(targets, step=3, micro=0), cut)  # the same at resume
    assert not torch.equal(task._truncated(targets, step=4, micro=0), cut)
    assert torch.equal(cut[cut != IGNORE], targets[cut != IGNORE])


def test_ranks_truncate_their_rows_of_the_global_batch():
    task = LanguageModelTask(randomly_truncate_sequence=True)
    task.trainer = SimpleNamespace(seed=0)
    targets = torch.zeros(4, 25, dtype=torch.long)
    task.backend = SimpleNamespace(rank=0, world_size=1)
    whole = task._truncated(targets, step=1, micro=0)
    halves = []
    for rank in (0, 1):
        task.backend = SimpleNamespace(rank=rank, world_size=2)
        halves.append(task._truncated(targets[:2], step=1, micro=0))
    assert torch.equal(torch.cat(halves), whole)
