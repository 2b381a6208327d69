"""The kill trials' judge: what it finds wrong in a resumed run against an uninterrupted one."""

import json
import shutil
from pathlib import Path

import pytest

from experiments.runtime.kill_trials import problems
from experiments.runtime import checkpoint

ROWS = [{"step": 1, "loss": 3.5}, {"step": 2, "loss": 3.25}, {"step": 2, "val_loss": 3.0},
        {"step": 3, "loss": 3.125}, {"step": 4, "loss": 3.0}, {"step": 4, "val_loss": 2.875}]


def write_run(run_dir: Path, rows: list[dict], status: str = "completed") -> Path:
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "summary.json").write_text(json.dumps({"status": status, "val_loss": rows[-1].get("val_loss")}))
    checkpoint.save({"step": 4, "model": {}}, run_dir / "checkpoints")
    return run_dir


@pytest.fixture
def reference(tmp_path: Path) -> Path:
    return write_run(tmp_path / "reference", ROWS)


def test_an_exact_resume_has_no_problem(tmp_path: Path, reference: Path):
    assert problems(write_run(tmp_path / "trial", ROWS), reference) == []


@pytest.mark.parametrize("rows, expected", [
    (ROWS[:4] + [{"step": 3, "loss": 3.125}] + ROWS[4:], "training steps repeated: [3]"),
    (ROWS[:3] + ROWS[4:], "training steps missing: [3]"),
    (ROWS[:2] + ROWS[3:], "validation steps [4], reference [2, 4]"),
    ([*ROWS[:3], {"step": 3, "loss": 3.1250001}, *ROWS[4:]], "1 figures differ, first loss at step 3"),
])
def test_metrics_that_differ_are_named(tmp_path: Path, reference: Path, rows: list[dict], expected: str):
    found = problems(write_run(tmp_path / "trial", rows), reference)
    assert len(found) == 1 and found[0].startswith(expected), found


def test_leftovers_corrupt_checkpoints_and_an_unfinished_summary_are_named(tmp_path: Path, reference: Path):
    trial = write_run(tmp_path / "trial", ROWS, status="interrupted")
    (trial / "checkpoints" / ".step_0000008.pt.abc.tmp").write_bytes(b"half")
    shutil.copy(trial / "checkpoints" / "step_0000004.pt", trial / "checkpoints" / "step_0000008.pt")
    with open(trial / "checkpoints" / "step_0000008.pt", "r+b") as f:
        f.truncate(100)
    found = problems(trial, reference)
    assert found[0] == "temporary files left: ['.step_0000008.pt.abc.tmp']"
    assert found[1].startswith("corrupt checkpoint: checkpoint ") and "step_0000008.pt" in found[1]
    assert found[2] == "summary status 'interrupted'"
    assert len(found) == 3
