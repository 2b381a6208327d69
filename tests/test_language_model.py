"""The language-model task's own pieces (the loop itself is exercised end to end in test_train)."""

from types import SimpleNamespace

import torch

from experiments.language_model import IGNORE, LanguageModelTask


def test_random_truncation_ignores_each_rows_tail_reproducibly():
    task = LanguageModelTask(randomly_truncate_sequence=True)
    task.trainer, task.backend = SimpleNamespace(seed=0), SimpleNamespace(rank=0)
    targets = torch.arange(4 * 25).view(4, 25) % 7
    cut = task._truncated(targets, step=3, micro=0)
    kept = (cut != IGNORE).sum(1)
    assert torch.equal(cut == IGNORE, torch.arange(25)[None, :] >= kept[:, None])  # a prefix kept per row
    assert kept.min() >= 1 and len(set(kept.tolist())) > 1  # rows get their own lengths
    assert torch.equal(task._truncated(targets, step=3, micro=0), cut)  # the same at resume
    assert not torch.equal(task._truncated(targets, step=4, micro=0), cut)
    assert torch.equal(cut[cut != IGNORE], targets[cut != IGNORE])
