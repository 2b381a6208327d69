"""The run directory's records: metrics.jsonl and summary.json."""

import json

import pytest

from experiments.runtime import run as run_module
from experiments.runtime.errors import UserError
from experiments.runtime.run import Run, sweep_failures


def test_truncate_keeps_rows_up_to_the_step_and_drops_torn_lines(tmp_path):
    run = Run(tmp_path)
    for step in range(1, 6):
        run.log_metrics({"step": step, "loss": 1.0 / step})
    with open(run.metrics_path, "a") as f:
        f.write('{"step": 6, "lo')  # a write torn by SIGKILL
    run.truncate_metrics(3)
    rows = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_summary_records_completion(tmp_path):
    with Run(tmp_path) as run:
        run.update_summary(step=3)
    summary = json.loads(run.summary_path.read_text())
    assert summary["status"] == "completed" and summary["step"] == 3 and summary["error"] is None


def test_a_resumed_runs_wall_time_counts_its_earlier_sessions(tmp_path):
    with Run(tmp_path) as run:
        run.continue_wall_clock(100.0)  # what the checkpoint recorded
        assert 100.0 <= run.wall_s() < 160.0
    assert 100.0 <= json.loads(run.summary_path.read_text())["wall_s"] < 160.0


def test_user_error_in_a_single_run_exits_with_the_message(tmp_path):
    with pytest.raises(SystemExit, match="error: bad value"):
        with Run(tmp_path):
            raise UserError("bad value")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == "bad value"


def test_failure_in_a_sweep_job_is_recorded_and_swallowed(tmp_path):
    import time

    started = time.time()
    with Run(tmp_path, name="model.depth=2/seed=0", multirun=True) as run:
        raise RuntimeError("boom")
    assert run.result is None  # no objective: a sweeper records the trial as failed
    assert json.loads(run.summary_path.read_text())["error"] == "RuntimeError: boom"
    (tmp_path / "summary.json").unlink()  # as a refused rerun leaves none: the process still knows
    assert sweep_failures(tmp_path, started) == ["model.depth=2/seed=0"]  # the sweep's exit status says so


def test_sweep_failures_are_this_launchs_failed_jobs(tmp_path, monkeypatch):
    """Jobs that failed in this process (a refused rerun writes no summary), and those whose summary,
    written since the launch began, says failed (jobs of other processes); not an earlier launch's."""
    import os
    import time

    def job(name, status, age_s=0.0):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "summary.json").write_text(json.dumps({"status": status}))
        os.utime(tmp_path / name / "summary.json", (time.time() - age_s,) * 2)

    started = time.time()
    job("a=1/seed=0", "completed")
    job("a=2/seed=0", "failed")
    job("a=3/seed=0", "failed", age_s=3600)  # an earlier launch of this sweep directory
    job("a=4/seed=0", "interrupted")
    monkeypatch.setattr(run_module, "_failed_here", [(started, "a=5/seed=0"), (started, "a=2/seed=0"),
                                                      (started - 3600, "b=1/seed=0")])  # an earlier sweep's
    assert sweep_failures(tmp_path, started) == ["a=5/seed=0", "a=2/seed=0"]
    monkeypatch.setattr(run_module, "_failed_here", [])
    assert sweep_failures(tmp_path, started) == ["a=2/seed=0"]
    assert sweep_failures(tmp_path / "missing", started) == []
    # jobs run in this process: its own record alone (another launch into the directory writes summaries)
    assert sweep_failures(tmp_path, started, elsewhere=False) == []


def test_a_second_stop_signal_of_the_same_kind_stops_at_once_another_kind_does_not(tmp_path):
    """Ctrl-C, then the parallel sweep parent's SIGTERM: one stop at the next checkpoint, not an
    immediate one; a second Ctrl-C still stops at once."""
    import signal

    run = Run(tmp_path / "run")
    run._request_stop(signal.SIGINT, None)
    run._request_stop(signal.SIGTERM, None)
    assert run.stop_requested and run.stop_signal == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
        run._request_stop(signal.SIGINT, None)
