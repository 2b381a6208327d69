"""The loop's own policies that test_train.py's end-to-end runs do not reach."""

import torch

from experiments.runtime import checkpoint
from tests.helpers.runs import losses, train

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
