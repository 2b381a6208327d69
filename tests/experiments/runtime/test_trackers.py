"""experiments/runtime/trackers.py's WandbTracker, against a stand-in for the wandb module: what it
hands wandb.init, wandb.Image and a run's finish (a real offline run: test_positions.py, test_slurm.py)."""

import sys
import types

import numpy as np
import pytest
import torch

from experiments.runtime.run import Run
from experiments.runtime.trackers import WandbTracker


class FakeRun:
    def __init__(self, **init):
        self.init, self.logged, self.exit_code = init, [], None

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def finish(self, exit_code):
        self.exit_code = exit_code


@pytest.fixture
def wandb(monkeypatch):
    """A wandb module whose runs are FakeRuns, listed in `.runs`."""
    fake = types.SimpleNamespace(runs=[], Settings=dict, Image=lambda array, caption: (array, caption))
    fake.init = lambda **init: fake.runs.append(FakeRun(**init)) or fake.runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return fake


def started(tmp_path, **run) -> WandbTracker:
    tracker = WandbTracker("project", mode="online")  # online: no replay of metrics.jsonl; the fake sends nothing
    tracker.start(Run(tmp_path, **run), config={})
    return tracker


def test_only_the_main_rank_starts_a_wandb_run(wandb, tmp_path):
    started(tmp_path, is_main=False)
    assert wandb.runs == []
    started(tmp_path)
    assert len(wandb.runs) == 1


def test_a_sweep_jobs_wandb_group_is_its_sweep(wandb, tmp_path):
    started(tmp_path, group="2026-11-28/12-00-00")
    assert wandb.runs[0].init["group"] == "2026-11-28/12-00-00"


@pytest.mark.parametrize("status,failed", [("completed", False), ("failed", True)])
def test_a_failed_run_finishes_with_a_nonzero_exit_code(wandb, tmp_path, status, failed):
    started(tmp_path).finish(status)
    assert (wandb.runs[0].exit_code != 0) == failed


def test_images_outside_zero_to_one_are_clamped(wandb, tmp_path):
    images = torch.tensor([-0.5, 0.0, 1.0, 1.5]).view(1, 1, 2, 2)
    started(tmp_path).log_images("samples", images, ["a"], step=3)
    [(step, logged)] = wandb.runs[0].logged
    [(array, caption)] = logged["samples"]
    assert step == 3 and caption == "a"
    assert array.reshape(-1).tolist() == [0, 0, 255, 255] and array.dtype == np.uint8


def test_online_without_a_login_is_one_line_saying_what_to_do(tmp_path, monkeypatch):
    """The real wandb, not logged in (no API key, no ~/.netrc): refused before any step."""
    from experiments.runtime.errors import UserError

    for key in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    with pytest.raises(UserError) as refused:
        WandbTracker("project", mode="online").start(Run(tmp_path / "run"), config={})
    assert str(refused.value).startswith("tracker.mode=online: wandb refused to start (")
    assert "\n" not in str(refused.value) and "tracker.mode=offline" in str(refused.value)
