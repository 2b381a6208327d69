"""train.py end to end, as a user runs it: the run directory, resume, signals, sweeps, bad input."""

import signal
import subprocess
import sys

import pytest
import torch

from tests.helpers.runs import (ROOT, TINY, TINY_NSA, kill_after_first_checkpoint, losses, read_metrics, read_summary,
                                run_env, start_long_train, start_train, train, train_py)


def test_a_few_steps_write_every_file_of_the_run_directory(tmp_path):
    run = tmp_path / "run"
    train(run, "trainer.max_steps=6", "trainer.validate_every=3", "trainer.generate_every=3")
    for name in (".hydra/config.yaml", ".hydra/overrides.yaml", ".hydra/hydra.yaml", "train.log", "metrics.jsonl",
                 "summary.json", "samples/step_0000003.txt", "samples/step_0000006.txt"):
        assert (run / name).is_file(), name
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_0000006.pt"]
    rows = read_metrics(run)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["tokens_per_s"] > 0 and r["lr"] > 0 for r in train_rows)
    val_rows = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in val_rows] == [3, 6]
    assert val_rows[-1]["val_bpc"] == pytest.approx(val_rows[-1]["val_loss"] / 0.6931471805599453, rel=1e-4)
    summary = read_summary(run)
    assert summary["status"] == "completed" and summary["error"] is None
    assert summary["task"] == "lm" and summary["model"] == "transformer" and summary["step"] == 6
    for key in ("val_loss", "val_bpc", "tokens_per_s", "peak_mem_mb", "params", "wall_s", "mfu", "data_fingerprint"):
        assert summary[key], key
    assert "=== generated" in (run / "samples/step_0000006.txt").read_text()
    # loss by position at every validation; the summary holds the last
    assert all(r["val_bpc_by_position"]["edges"] == [0, 16, 32] for r in val_rows)
    assert summary["val_bpc_by_position"] == val_rows[-1]["val_bpc_by_position"]


@pytest.mark.slow
def test_resume_after_sigkill_equals_an_uninterrupted_run(tmp_path):
    """Dropout too: the resumed steps draw the masks the uninterrupted run drew (the RNG's state
    is in the checkpoint; the batches are functions of seed and step alone), to the bit, samples
    written between them (decoding times its products once a process, on inputs of its own)."""
    steps = ["trainer.max_steps=60", "trainer.checkpoint_every=5", "trainer.validate_every=0",
             "trainer.generate_every=4", "model.attn_dropout=0.1", "model.ff_dropout=0.1"]
    train(tmp_path / "whole", *steps)
    kill_after_first_checkpoint(tmp_path / "killed", *steps)
    killed_at = len(losses(tmp_path / "killed"))
    # the same command, the same directory, a new process as a user's rerun: resumes
    rerun = start_train(tmp_path / "killed", *steps)
    _, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err[-3000:]
    whole, resumed = losses(tmp_path / "whole"), losses(tmp_path / "killed")
    assert killed_at < 60, "the run finished before it could be killed"
    assert sorted(resumed) == list(range(1, 61))  # every step once
    steps_logged = [r["step"] for r in read_metrics(tmp_path / "killed") if "loss" in r]
    assert len(steps_logged) == len(set(steps_logged))
    assert resumed == whole
    assert read_summary(tmp_path / "killed")["status"] == "completed"


@pytest.mark.slow
def test_sigterm_checkpoints_and_records_interrupted(tmp_path):
    run = tmp_path / "run"
    proc = start_long_train(run, 3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM  # a scheduler sees it did not complete
    summary = read_summary(run)
    assert summary["status"] == "interrupted"
    saved = list((run / "checkpoints").glob("step_*.pt"))
    assert len(saved) == 1 and int(saved[0].stem.split("_")[1]) == summary["step"] >= 3


def test_naming_a_run_alone_resumes_it_with_its_own_overrides(tmp_path):
    run = tmp_path / "run"
    train(run, "trainer.max_steps=2", "trainer.checkpoint_every=2")
    before = read_summary(run)
    result = train_py(f"hydra.run.dir={run}")  # the README's resume command: no overrides
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming {run} as it was launched: " in result.stderr and "trainer.max_steps=2" in result.stderr
    assert read_summary(run)["status"] == "completed" and read_summary(run)["step"] == before["step"] == 2
    # with an override, the command line is this launch's config: another config is refused, as before
    changed = train_py(f"hydra.run.dir={run}", "model.depth=2")
    assert changed.returncode == 1 and "was trained with a different config" in changed.stderr


@pytest.mark.slow
def test_sweep_records_a_failing_job_and_goes_on(tmp_path):
    sweep = tmp_path / "sweep"
    # a vocabulary the data does not have: what only the job's data can tell (the pre-check passes it)
    result = train_py("-m", f"hydra.sweep.dir={sweep}", *TINY_NSA, "trainer.max_steps=2", "model.num_tokens=256,128")
    # the sweep ran both jobs, then its exit status and last line say one failed
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: 1 job(s) of the sweep failed: model.num_tokens=128/seed=0; each one's summary.json and train.log "
        f"say why (a refused rerun: its train.log), the jobs that completed stand ({sweep})")
    good, bad = sweep / "model.num_tokens=256" / "seed=0", sweep / "model.num_tokens=128" / "seed=0"
    assert read_summary(good)["status"] == "completed"
    failed = read_summary(bad)
    assert failed["status"] == "failed" and "does not match the data's vocabulary" in failed["error"]


@pytest.mark.slow
def test_optuna_sweep_whose_every_trial_fails_ends_in_one_line(tmp_path):
    sweep = tmp_path / "sweep"
    result = train_py("-m", f"hydra.sweep.dir={sweep}", "experiment=nsa_optuna", "hydra.sweeper.n_trials=2",
                      *TINY_NSA, "trainer.max_steps=2", "model.num_tokens=128")
    # the study has no best trial to write: the sweeper's traceback used to end the sweep
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 2 job(s) of the sweep failed: trial=0,") and ", trial=1," in last, last
    assert [read_summary(p.parent)["status"] for p in sorted(sweep.rglob("summary.json"))] == ["failed", "failed"]


@pytest.mark.slow
def test_two_job_sweep_of_the_issue_leaves_two_directories(tmp_path):
    sweep = tmp_path / "sweep"
    result = train_py("-m", f"hydra.sweep.dir={sweep}", *TINY, "model=transformer", "trainer.max_steps=2",
                      "model.depth=1,2", "trainer.seed=0,1")
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = sorted(str(p.parent.relative_to(sweep)) for p in sweep.rglob("summary.json"))
    assert jobs == ["model.depth=1/seed=0", "model.depth=1/seed=1", "model.depth=2/seed=0", "model.depth=2/seed=1"]


@pytest.mark.slow
def test_a_local_parallel_sweep_shares_the_cpus_between_its_jobs(tmp_path, capsys):
    """hydra/launcher=local_gpus hydra.launcher.n_jobs=2 on a CPU machine: two worker processes, each
    job in its own directory with an equal share of the CPUs as its threads (trainer.threads=null);
    `python -m experiments.review <sweep>` reads it, one row per job with its metrics."""
    import json
    import os

    from experiments.review.runs import main as review

    sweep = tmp_path / "sweep"
    tiny = [o for o in TINY if not o.startswith("trainer.threads")]
    cmd = [sys.executable, "train.py", "-m", f"hydra.sweep.dir={sweep}", "hydra/launcher=local_gpus",
           "hydra.launcher.n_jobs=2", *tiny, "model=transformer", "trainer.max_steps=2", "model.depth=1,2"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=run_env())
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = [read_summary(sweep / f"model.depth={d}" / "seed=0") for d in (1, 2)]
    assert all(s["status"] == "completed" for s in summaries)
    assert len({s["pid"] for s in summaries}) == 2  # two workers, not one after the other in one process
    assert [s["threads"] for s in summaries] == [max(1, len(os.sched_getaffinity(0)) // 2)] * 2

    assert review([str(sweep), "--format", "json", "--no-plots"]) == 0
    [rows] = json.loads(capsys.readouterr().out)["groups"].values()  # one corpus
    rows = sorted(rows, key=lambda r: r["path"])
    assert [r["path"] for r in rows] == [str(sweep / f"model.depth={d}" / "seed=0") for d in (1, 2)]
    for row, summary in zip(rows, summaries):
        assert row["status"] == "completed" and row["step"] == 2
        assert (row["final"], row["best"], row["params"]) == (summary["val_bpc"], summary["best_val_bpc"],
                                                              summary["params"])
        assert row["tokens_per_s"] > 0


def _fails(run, *overrides):
    result = train(run, *overrides, check=False)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr


# one train.py per stage that refuses: composition here, a part that reads a file here, the config's checks in
# tests/experiments/runtime/test_backends.py (a bad backend key); every message of each stage is checked in
# process by tests/test_bad_input.py, against the functions train.py calls
@pytest.mark.parametrize("override,message", [
    ("model=nope", "Could not find 'model/nope'"),
    ("data.path=/nonexistent/corpus.txt", "data.path=/nonexistent/corpus.txt: no such file"),
])
def test_bad_input_gets_one_clear_message(tmp_path, override, message):
    assert message in _fails(tmp_path / "run", override)


def test_corrupt_checkpoint_is_reported_and_kept(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step_0000005.pt").write_bytes(b"garbage")
    error = _fails(run, "trainer.max_steps=6")
    assert "cannot be read" in error and "delete it to resume from an older checkpoint" in error
    assert (run / "checkpoints" / "step_0000005.pt").read_bytes() == b"garbage"


def test_a_completed_run_run_again_changes_nothing(tmp_path):
    """Nothing to train: its summary.json (wall time included) and metrics.jsonl stay as they were."""
    run = tmp_path / "run"
    train(run, "trainer.max_steps=2")
    before = {name: (run / name).read_bytes() for name in ("summary.json", "metrics.jsonl")}
    result = train(run, "trainer.max_steps=2")
    assert "nothing to train" in result.stdout + result.stderr
    assert {name: (run / name).read_bytes() for name in before} == before


def test_foreign_checkpoint_is_refused(tmp_path):
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.ones(1)}, foreign)
    assert "not written by this project" in _fails(tmp_path / "run", f"trainer.resume={foreign}")


def test_a_file_that_is_no_checkpoint_named_by_resume_is_not_to_be_deleted(tmp_path):
    """Deleting it is advice for a run's own cut checkpoint, and torch's (load it unsafely) is none."""
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    error = _fails(tmp_path / "run", f"trainer.resume={tmp_path / 'notes.txt'}")
    assert error.strip().endswith("it is corrupt, truncated or not a checkpoint: point trainer.resume at a run "
                                  "directory or at one of its checkpoints/step_*.pt")
    assert "weights_only" not in error


def test_a_checkpoint_of_another_model_is_named_as_such(tmp_path):
    train(tmp_path / "dense", "trainer.max_steps=1")
    error = _fails(tmp_path / "run", f"trainer.resume={tmp_path / 'dense'}", "model=nsa", "model.kv_heads=1")
    assert "its model is not this run's model (missing: " in error and "trainer.init_from" in error


@pytest.mark.slow
def test_a_run_started_from_other_weights_resumes_its_own_checkpoints_after_a_kill(tmp_path):
    train(tmp_path / "short", "trainer.max_steps=2")  # weights to start from, at another seq_len
    steps = [f"trainer.resume={tmp_path / 'short'}", "data.seq_len=16", "trainer.max_steps=40",
             "trainer.checkpoint_every=5", "trainer.validate_every=0"]
    train(tmp_path / "whole", *steps)
    kill_after_first_checkpoint(tmp_path / "killed", *steps)
    killed_at = len(losses(tmp_path / "killed"))
    result = train(tmp_path / "killed", *steps)  # the same command: its own checkpoints, not the start weights
    assert killed_at < 40, "the run finished before it could be killed"
    assert "continuing them" in (tmp_path / "killed" / "train.log").read_text(), result.stderr
    whole, resumed = losses(tmp_path / "whole"), losses(tmp_path / "killed")
    assert [r["step"] for r in read_metrics(tmp_path / "killed") if "loss" in r] == list(range(1, 41))
    for step in whole:
        assert resumed[step] == pytest.approx(whole[step], rel=1e-6, abs=1e-7), step


def test_non_finite_loss_stops_with_advice_and_keeps_the_last_checkpoint(tmp_path):
    run = tmp_path / "run"
    err = _fails(run, "trainer.max_steps=50", "trainer.checkpoint_every=1", "optimizer.lr=1e30",
                 "trainer.clip_grad_norm=null", "schedule=constant")
    assert "the training loss is nan" in err.lower() or "the training loss is inf" in err.lower()
    summary = read_summary(run)
    assert summary["status"] == "failed" and "Lower optimizer.lr" in summary["error"]
    assert list((run / "checkpoints").glob("step_*.pt"))


def test_wandb_offline_run_lands_in_the_run_directory(tmp_path):
    run = tmp_path / "run"
    train(run, "trainer.max_steps=2", "tracker=wandb")
    assert list((run / "wandb").glob("offline-run-*")), "no offline wandb run"


def test_help_lists_the_groups_and_neither_it_nor_a_local_run_imports_deepspeed(tmp_path):
    """`train.py --help` lists the groups a user picks from and no schemas; neither it nor a local run
    imports DeepSpeed."""
    probe = (
        "import runpy, sys; sys.argv = sys.argv[1:]; "
        "exec('try:\\n runpy.run_path(\"train.py\", run_name=\"__main__\")\\nexcept SystemExit: pass'); "
        "print('deepspeed' in sys.modules)"
    )
    for args in (["train.py", "--help"], ["train.py", f"hydra.run.dir={tmp_path / 'run'}", *TINY,
                                          "model=transformer", "trainer.max_steps=1"]):
        out = subprocess.run([sys.executable, "-c", probe, *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=300, env=run_env())
        assert out.stdout.strip().splitlines()[-1] == "False", out.stderr
        if "--help" in args:
            groups = out.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
            listed = {line.split(":")[0] for line in groups.splitlines() if ": " in line}
            assert listed == {"backend", "data", "experiment", "model", "optimizer", "schedule", "task", "tracker"}
            assert "schema" not in out.stdout
