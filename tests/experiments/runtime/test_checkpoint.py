"""Checkpoints are atomic, safe to load, and refuse what is not ours."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from experiments.runtime import checkpoint
from experiments.runtime.errors import UserError


def test_save_load_round_trip_and_keep(tmp_path):
    for step in (1, 2, 3):
        checkpoint.save({"step": step, "model": {"w": torch.full((2,), float(step))}}, tmp_path, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_0000002.pt", "step_0000003.pt"]
    state = checkpoint.load(checkpoint.latest(tmp_path))
    assert state["step"] == 3 and torch.equal(state["model"]["w"], torch.full((2,), 3.0))


def test_corrupt_checkpoint_gets_one_clear_message(tmp_path):
    path = tmp_path / "step_0000001.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="cannot be read.*corrupt"):
        checkpoint.load(path)


def test_foreign_checkpoint_is_refused(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"state_dict": {}}, path)
    with pytest.raises(UserError, match="not written by this project"):
        checkpoint.load(path)


def test_weights_that_do_not_fit_get_one_clear_message(tmp_path):
    state = {"model": {"weight": torch.zeros(4, 3)}}  # a Linear(3, 4) with a bias expects "bias" too
    model = torch.nn.Linear(3, 4)
    with pytest.raises(UserError, match=r"ckpt.pt: its model does not fit .*bias"):
        checkpoint.load_weights(model, state, "model", tmp_path / "ckpt.pt")
    with pytest.raises(UserError, match="size mismatch for weight"):
        checkpoint.load_weights(torch.nn.Linear(3, 5, bias=False), state, "model", tmp_path / "ckpt.pt")
    with pytest.raises(UserError, match="holds no draft_model"):
        checkpoint.load_weights(model, state, "draft_model", tmp_path / "ckpt.pt")
    checkpoint.load_weights(torch.nn.Linear(3, 4, bias=False), state, "model", tmp_path / "ckpt.pt")


def test_weights_the_model_has_no_place_for_are_refused_by_name(tmp_path):
    state = {"model": {**torch.nn.Linear(3, 4).state_dict(), "gate.weight": torch.zeros(4)}}
    for built_from_checkpoint in (True, False):
        with pytest.raises(UserError, match=r"unexpected: gate\.weight"):
            checkpoint.load_weights(torch.nn.Linear(3, 4), state, "model", tmp_path / "ckpt.pt",
                                    built_from_checkpoint=built_from_checkpoint)


def test_resolve_finds_the_latest_in_a_run_directory(tmp_path):
    for step in (5, 9, 10):
        checkpoint.save({"step": step}, tmp_path / "checkpoints", keep=3)
    assert checkpoint.resolve(tmp_path).name == "step_0000010.pt"
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="is not a run directory"):
        checkpoint.resolve(tmp_path / "empty")
    with pytest.raises(UserError, match="no such checkpoint file or run directory"):
        checkpoint.resolve(tmp_path / "nothing")


WRITER = """
import sys, torch
from experiments.runtime import checkpoint
checkpoint.save({"step": 2, "model": {"w": torch.randn(64_000_000)}}, sys.argv[1], keep=1)
"""


def test_sigkill_during_a_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    checkpoint.save({"step": 1, "model": {"w": torch.ones(3)}}, tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=os.getcwd())
    deadline = time.time() + 60
    while time.time() < deadline and not list(tmp_path.glob(".step_0000002.pt.*.tmp")):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_0000001.pt"]
    state = checkpoint.load(checkpoint.latest(tmp_path))
    assert state["step"] == 1 and torch.equal(state["model"]["w"], torch.ones(3))
