"""Sweeps and multi-process training on a real one-node SLURM cluster (tests/helpers/slurm.py starts
it; skipped where slurm is not installed, failed instead under CI=true): srun ranks equal torchrun's,
a sweep is one job array reviewed exactly as a local sweep, a preempted job resumes with the same
losses and one wandb run, the Optuna preset names its best trial, and a sweep the cluster cannot run
is refused in one line before anything is submitted."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.runtime import launch
from tests.helpers.runs import (RANK_STEPS, ROOT, TINY, losses, read_metrics, read_summary, run_env, train, train_py,
                                two_ddp_ranks, wandb_records)  # noqa: F401 (the fixture)
from tests.helpers.slurm import slurm_cluster  # noqa: F401  (the fixture)

LM = [*TINY, "model=transformer"]
STEPS = RANK_STEPS
# a job's CPUs on the 2-CPU test node: two jobs run at once
ONE_CPU = "hydra.launcher.cpus_per_task=1"


def sweep(cluster, sweep_dir: Path, *overrides: str, timeout: float = 240,
          env: dict | None = None) -> subprocess.CompletedProcess:
    """`python train.py -m hydra/launcher=slurm <overrides>`, submitting to `cluster` (None: none)."""
    cmd = [sys.executable, "train.py", "-m", f"hydra.sweep.dir={sweep_dir}", "hydra/launcher=slurm", *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**run_env(), **(cluster.env if cluster else {}), **(env or {})})


def array_jobs(sweep_dir: Path) -> list[str]:
    """The ids (`<array>_<task>`) of the jobs submitit submitted for a sweep: its log folders."""
    return sorted(p.name for p in (sweep_dir / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name))


def refused(result: subprocess.CompletedProcess) -> str:
    """The one line a refused sweep prints: no traceback, nothing else after it."""
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip().splitlines()[-1]


# ---- rank, world size and master address from SLURM's environment (no cluster needed) -----------

def test_an_srun_step_of_two_tasks_gives_torchruns_variables():
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2",
           "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_JOB_ID": "123",
           "SLURM_STEP_NODELIST": "gpu[07-08,11]", "SLURM_JOB_NODELIST": "gpu[07-08,11]"}
    assert launch.from_slurm(env)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "gpu07"}
    assert env["MASTER_PORT"] == str(20000 + 123 * 16)
    assert not launch.from_slurm(env)  # once: torchrun's variables are there now


def srun_step(**more) -> dict:
    """Rank 3 (second task on the second node) of step 1 of a job of two nodes x two tasks, on
    two nodes of the job's six."""
    return {"SLURM_STEP_ID": "1", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
            "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "3(x2)",
            "SLURM_JOB_ID": "123", "SLURM_STEP_NODELIST": "n[5-6]", "SLURM_JOB_NODELIST": "n[1-6]", **more}


def test_a_rank_on_a_second_node_gets_its_local_rank_and_its_nodes_task_count():
    env = srun_step()
    assert launch.from_slurm(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("3", "4", "1", "2")


def test_the_master_is_the_steps_first_node_not_the_jobs():
    env = srun_step()
    launch.from_slurm(env)
    assert env["MASTER_ADDR"] == "n5"


def test_a_master_address_the_user_set_is_kept():
    env = srun_step(MASTER_ADDR="login7")
    launch.from_slurm(env)
    assert env["MASTER_ADDR"] == "login7"


def test_two_steps_of_one_job_get_different_master_ports():
    first, second = srun_step(SLURM_STEP_ID="0"), srun_step(SLURM_STEP_ID="1")
    for env in (first, second):
        launch.from_slurm(env)
    assert first["MASTER_PORT"] != second["MASTER_PORT"]


@pytest.mark.parametrize("env", [
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1"},  # batch script
    {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1",
     "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1"},  # a submitit job array element: one task
    {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "5",
     "SLURM_JOB_NODELIST": "n1", "RANK": "3", "WORLD_SIZE": "4"},  # torchrun inside srun: torchrun's win
], ids=["sbatch-script", "one-task-step", "torchrun-in-srun"])
def test_elsewhere_slurms_environment_changes_nothing(env):
    before = dict(env)
    assert not launch.from_slurm(env)
    assert env == before


@pytest.mark.parametrize("nodelist,first", [("vm", "vm"), ("a1,b2", "a1"), ("n[3-5]", "n3"),
                                            ("gpu[010,012]-ib,cpu1", "gpu010-ib")])
def test_the_first_host_of_a_node_list(nodelist, first):
    assert launch.first_host(nodelist) == first


def test_a_slurm_sweep_without_sbatch_is_one_line(tmp_path):
    """No cluster needed: a PATH without SLURM's commands."""
    bare = tmp_path / "bin"
    bare.mkdir()
    result = sweep(None, tmp_path / "sweep", *LM, "trainer.max_steps=1", env={"PATH": str(bare)}, timeout=60)
    line = refused(result)
    assert line.startswith("error: hydra/launcher=slurm") and "sbatch" in line and "not installed" in line
    assert not (tmp_path / "sweep").exists()


def test_a_refused_slurm_sweep_leaves_no_timestamped_directory(tmp_path):
    """The default sweep directory is claimed (made) before Hydra's SLURM preflight refuses the sweep:
    the refusal removes it again, as a refused launch makes none."""
    bare = tmp_path / "bin"
    bare.mkdir()
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "-m", "hydra/launcher=slurm", *LM,
                             "trainer.max_steps=1"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env={**run_env(), "PATH": str(bare)})
    assert "not installed" in refused(result)
    assert list(tmp_path.glob("outputs/multirun/*/*")) == []


def test_a_job_on_a_node_names_its_directory_by_what_train_py_swept(monkeypatch):
    """A submitit job's sys.argv is submitit's (`-m submitit.core._submit <folder>`): the swept keys
    come from what the submitting train.py exported, not from every override of the job."""
    from experiments.config.resolvers import SWEPT_KEYS_ENV, export_swept_keys, job_subdir

    monkeypatch.delenv(SWEPT_KEYS_ENV, raising=False)
    export_swept_keys(["hydra/launcher=slurm", "model.dim=32", "model.num_fine_selected=2,4", "trainer.seed=0,1"])
    monkeypatch.setattr(sys, "argv", ["-m", "/sweep/.submitit/7_0"])
    try:
        assert job_subdir(["model.dim=32", "model.num_fine_selected=4", "trainer.seed=1"], 1) == \
            "model.num_fine_selected=4/seed=1"
    finally:
        os.environ.pop(SWEPT_KEYS_ENV, None)


@pytest.mark.parametrize("option,message", [
    ("hydra.launcher.cpus_per_task=abc", "error: Error merging override hydra.launcher.cpus_per_task=abc; Value 'abc' "
     "of type 'str' could not be converted to Integer"),
    ("hydra.launcher.partiton=gpu", "error: Could not override 'hydra.launcher.partiton'. Key 'partiton' not in "
     "'SlurmQueueConf'"),
], ids=["wrong-type", "misspelt"])
def test_a_bad_launcher_option_is_one_line(tmp_path, option, message):
    """Refused while composing, before the cluster is asked: no cluster needed."""
    line = refused(sweep(None, tmp_path / "sweep", *LM, option, "trainer.max_steps=1", timeout=60))
    assert line.startswith(message), line
    assert not (tmp_path / "sweep").exists()


# ---- on the test cluster -------------------------------------------------------------------------

def test_an_unknown_partition_is_refused_naming_the_key(slurm_cluster, tmp_path):
    before = slurm_cluster.run("scontrol", "show", "jobs", "-o").stdout
    line = refused(sweep(slurm_cluster, tmp_path / "sweep", *LM, "hydra.launcher.partition=nope", ONE_CPU,
                         "trainer.max_steps=1"))
    assert line == ("error: hydra.launcher.partition=nope: the SLURM cluster has no partition nope "
                    f"(it has: {slurm_cluster.partition}; null takes the default, {slurm_cluster.partition})")
    assert not (tmp_path / "sweep").exists()
    assert slurm_cluster.run("scontrol", "show", "jobs", "-o").stdout == before  # nothing submitted


def test_a_request_no_node_can_hold_is_refused_with_the_schedulers_reason(slurm_cluster, tmp_path):
    line = refused(sweep(slurm_cluster, tmp_path / "sweep", *LM, "trainer.max_steps=1",
                         f"hydra.launcher.cpus_per_task={slurm_cluster.cpus + 1}"))
    assert line.startswith("error: the SLURM cluster refuses the sweep's jobs: "), line
    assert "Requested node configuration is not available" in line  # sbatch's own words
    assert f"cpus_per_task={slurm_cluster.cpus + 1}" in line
    assert not (tmp_path / "sweep").exists()


def test_gpus_asked_for_on_the_command_line_are_refused_where_there_are_none(slurm_cluster, tmp_path):
    """The default GPU is dropped on a node without GPUs (the array test shows it); one asked for
    explicitly is not: the scheduler's reason, in one line."""
    line = refused(sweep(slurm_cluster, tmp_path / "sweep", *LM, "trainer.max_steps=1", ONE_CPU,
                         "hydra.launcher.gpus_per_node=1"))
    assert line.startswith("error: the SLURM cluster refuses the sweep's jobs: "), line
    assert "gpus_per_node=1" in line
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_srun_two_tasks_train_one_run_as_torchrun_does(slurm_cluster, two_ddp_ranks, tmp_path):
    """`srun --ntasks=2 python train.py backend=ddp` (and backend=deepspeed), no torchrun: one run
    directory, rank 1's log beside rank 0's, the losses of torchrun --nproc_per_node=2 of the same
    config (ddp; DeepSpeed's ZeRO 0 averages the same gradients)."""
    for backend in ("ddp", "deepspeed"):
        cmd = ["srun", "--ntasks=2", "--cpus-per-task=1", sys.executable, "train.py", *LM, *STEPS, f"backend={backend}",
               f"hydra.run.dir={tmp_path / backend}"]
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                                env={**run_env(), **slurm_cluster.env})
        assert result.returncode == 0, result.stderr[-3000:]
    for backend in ("ddp", "deepspeed"):
        run = tmp_path / backend
        assert (run / "train.log").is_file() and (run / "train.rank1.log").is_file()
        assert (run / ".hydra" / "config.yaml").is_file()
        assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3, 4]  # once each, not twice
        assert losses(run) == pytest.approx(losses(two_ddp_ranks), rel=1e-6)
        summary = read_summary(run)
        assert summary["status"] == "completed" and summary["step"] == 4
    assert sorted(p.name for p in (tmp_path / "ddp").iterdir()) == sorted(p.name for p in two_ddp_ranks.iterdir())
    assert losses(tmp_path / "ddp") == losses(two_ddp_ranks)  # to the bit
    assert (tmp_path / "deepspeed" / "checkpoints" / "step_0000004" / "model").is_dir()  # an engine's checkpoint


@pytest.mark.slow
def test_a_sweep_job_of_two_tasks_trains_as_two_ranks(slurm_cluster, tmp_path):
    """hydra.launcher.tasks_per_node=2 backend=ddp: each job of the sweep is one run of two ranks
    (rank 1 logging to train.rank1.log), which trains as one process of twice the batch."""
    result = sweep(slurm_cluster, tmp_path / "sweep", *LM, *STEPS, "backend=ddp", "trainer.batch_size=2",
                   "trainer.seed=0", "hydra.launcher.tasks_per_node=2", ONE_CPU)
    assert result.returncode == 0, result.stderr[-3000:]
    train(tmp_path / "one", *STEPS, "trainer.batch_size=4")
    job = tmp_path / "sweep" / "seed=0"
    assert "step 4" in (job / "train.rank1.log").read_text()
    assert (job / "train.log").read_text().count("parameters on cpu") == 1  # rank 0's lines only
    assert [r["step"] for r in read_metrics(job) if "loss" in r] == [1, 2, 3, 4]
    assert losses(job) == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    assert read_summary(job)["status"] == "completed"


def _review(capsys, sweep_dir: Path) -> list[dict]:
    from experiments.review.runs import main

    assert main([str(sweep_dir), "--format", "json", "--no-plots"]) == 0
    groups = json.loads(capsys.readouterr().out)["groups"]
    timing = ("path", "wall_s", "tokens_per_s", "peak_mem_mb")
    return [{k: v for k, v in row.items() if k not in timing} for rows in groups.values() for row in rows]


@pytest.mark.slow
def test_a_sweep_is_one_job_array_reviewed_as_a_local_sweep(slurm_cluster, tmp_path, capsys):
    """The launcher's defaults on a node without GPUs (GPU dropped, memory fitted; one CPU a job so
    two run at once): one job array, every job `completed` in <swept>/seed=<s>/, and the review's
    rows and metrics those of a local sweep of the same overrides, to the bit."""
    overrides = [*TINY, "model=nsa", "model.kv_heads=1", "model.sliding_window_size=8",
                 "model.compress_block_size=4", "model.compress_stride=2", "model.fine_block_size=4",
                 "data.seq_len=64", "trainer.max_steps=3", "trainer.validate_every=0",
                 "model.num_fine_selected=2,4", "trainer.seed=0"]
    on_slurm = sweep(slurm_cluster, tmp_path / "slurm", *overrides, ONE_CPU)
    assert on_slurm.returncode == 0, on_slurm.stderr[-3000:]
    assert "has no GPUs" in on_slurm.stderr and "hydra.launcher.gpus_per_node=1 -> None" in on_slurm.stderr
    local = train_py("-m", f"hydra.sweep.dir={tmp_path / 'local'}", *overrides)
    assert local.returncode == 0, local.stderr[-3000:]

    jobs = sorted(str(p.parent.relative_to(tmp_path / "slurm")) for p in (tmp_path / "slurm").rglob("summary.json"))
    assert jobs == [f"model.num_fine_selected={k}/seed=0" for k in (2, 4)]
    assert all(read_summary(tmp_path / "slurm" / job)["status"] == "completed" for job in jobs)
    # one array of two tasks, which the scheduler ran (it knows finished jobs for MinJobAge)
    array_ids = {job.split("_")[0] for job in array_jobs(tmp_path / "slurm")}
    assert len(array_ids) == 1
    array = array_ids.pop()
    states = slurm_cluster.run("squeue", "-h", "-t", "all", "-j", array, "-o", "%i %T").stdout.split("\n")
    assert sorted(filter(None, states)) == [f"{array}_{i} COMPLETED" for i in range(2)]

    slurm_rows, local_rows = _review(capsys, tmp_path / "slurm"), _review(capsys, tmp_path / "local")
    assert len(slurm_rows) == 2 and all(r["status"] == "completed" for r in slurm_rows)
    assert slurm_rows == local_rows


def test_a_sweep_whose_array_task_failed_exits_1_naming_it(slurm_cluster, tmp_path):
    """The job failed in SLURM's process, not the submitting one: its summary says so, and the
    submitting process reads it once the array is done."""
    result = sweep(slurm_cluster, tmp_path, *LM, "trainer.max_steps=1", "trainer.validate_every=0",
                   "model.num_tokens=256,128", ONE_CPU)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: 1 job(s) of the sweep failed: model.num_tokens=128/seed=0; ")
    assert read_summary(tmp_path / "model.num_tokens=256" / "seed=0")["status"] == "completed"


def _release_when_requeued(cluster, job: str, restarts: int, timeout: float = 120) -> None:
    """SLURM holds a requeued job for 120 s (its BeginTime): let it start again soon, and wait
    until it has. Not in the second its last run was killed: slurmd refuses a job whose credential
    was revoked within the same second ("Job credential revoked": the job then fails)."""
    deadline, held_since = time.time() + timeout, None
    while time.time() < deadline:
        fields = dict(f.split("=", 1) for f in cluster.run("scontrol", "show", "job", "-o", job).stdout.split()
                      if "=" in f)
        if int(fields.get("Restarts", 0)) >= restarts and fields.get("JobState") in ("RUNNING", "COMPLETED"):
            return  # (COMPLETING is also the first run's end, before the job is pending again)
        if fields.get("JobState") == "PENDING" and fields.get("Reason") == "BeginTime":
            held_since = held_since or time.time()
            if time.time() - held_since >= 1.5:
                cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
        time.sleep(0.2)
    raise AssertionError(f"job {job} was not requeued: {cluster.run('scontrol', 'show', 'job', job).stdout}")


def _checkpointed_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*.pt"))


def _resumed_steps(run_dir: Path) -> list[int]:
    log = run_dir / "train.log"
    return [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", log.read_text())] if log.is_file() else []


@pytest.mark.slow
def test_a_preempted_job_resumes_in_its_directory_with_the_same_losses(slurm_cluster, tmp_path):
    """One job preempted twice: `scontrol requeue`, as SLURM preempts a job (SIGTERM: the run
    checkpoints at the end of its step and exits), then SIGUSR2, the signal submitit asks for before
    a time limit (the run checkpoints at the end of its step, then submitit's handler requeues the
    job). Each time the job starts again in its own
    directory and resumes from its last checkpoint; it ends with the losses of an uninterrupted run,
    every step once in metrics.jsonl, one summary, and one wandb run (tracker=wandb, offline)."""
    steps = ["trainer.max_steps=300", "trainer.checkpoint_every=20", "trainer.validate_every=0",
             "trainer.generate_every=0", "schedule=constant"]
    cmd = [sys.executable, "train.py", "-m", "hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path / 'sweep'}",
           ONE_CPU, *(o for o in LM if o != "tracker=none"), "tracker=wandb", *steps, "trainer.seed=0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**run_env(), **slurm_cluster.env})
    job_dir = tmp_path / "sweep" / "seed=0"

    def wait_for(condition, what: str) -> None:
        deadline = time.time() + 150
        while not condition():
            assert time.time() < deadline and proc.poll() is None, f"{what} did not come"
            time.sleep(0.05)

    try:
        wait_for(lambda: _checkpointed_steps(job_dir), "a first checkpoint")
        [job] = slurm_cluster.job_ids()  # the sweep's one job (not an array)
        slurm_cluster.run("scontrol", "requeue", job)
        _release_when_requeued(slurm_cluster, job, restarts=1)
        wait_for(lambda: (r := _resumed_steps(job_dir)) and any(s > r[-1] for s in _checkpointed_steps(job_dir)),
                 "a checkpoint after the first resume")
        slurm_cluster.run("scancel", "--signal=USR2", job)
        _release_when_requeued(slurm_cluster, job, restarts=2)
        output, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output[-3000:]
    train(tmp_path / "whole", *steps)  # the uninterrupted run

    log = (job_dir / "train.log").read_text()
    assert len(_resumed_steps(job_dir)) == 2, log[-3000:]
    # both times the run checkpointed where it stopped, so no step was lost: SIGTERM's, then USR2's
    # (which submitit's handler alone would have answered by requeueing at once, from the last
    # periodic checkpoint)
    assert "SIGTERM received: checkpointing" in log and "SIGUSR2 received: checkpointing" in log, log[-3000:]
    stopped = [int(s) for s in re.findall(r"checkpoint \S+step_(\d+)\.pt", log)]
    assert all(resumed in stopped for resumed in _resumed_steps(job_dir))
    rows = [r["step"] for r in read_metrics(job_dir) if "loss" in r]
    assert rows == list(range(1, 301))  # no step twice
    assert losses(job_dir) == losses(tmp_path / "whole")
    summary = read_summary(job_dir)
    assert summary["status"] == "completed" and summary["step"] == 300
    assert sorted(p.name for p in job_dir.glob("summary*")) == ["summary.json"]
    assert "Restarts=2" in slurm_cluster.run("scontrol", "show", "job", "-o", job).stdout

    # One wandb run across the restarts (its id the job directory's): SLURM's SIGTERM stops wandb's
    # service too, losing what it had not written, and offline wandb cannot append to a closed run
    # file, so each session logs metrics.jsonl's rows up to its checkpoint again and removes the
    # earlier sessions' runs. One offline run is left: every step once, ending the run.
    [session] = (job_dir / "wandb").glob("offline-run-*")
    run_id = session.name.rsplit("-", 1)[1]
    records = wandb_records(session / f"run-{run_id}.wandb")
    assert [r.run.run_id for r in records if r.HasField("run")] == [run_id]
    assert [r.history.step.num for r in records if r.HasField("history")] == rows
    assert [r.exit.exit_code for r in records if r.HasField("exit")] == [0]


@pytest.mark.slow
def test_the_optuna_preset_runs_its_trials_as_job_arrays_and_names_the_best(slurm_cluster, tmp_path):
    """experiment=nsa_optuna hydra/launcher=slurm: each batch of n_jobs trials is one job array, every
    trial lands in its own trial=<n>,<its values>/seed=0/, and the sweep ends naming the best trial,
    the one of least val_bpc."""
    import yaml

    result = sweep(slurm_cluster, tmp_path / "sweep", "experiment=nsa_optuna", "hydra.sweeper.n_trials=4",
                   "hydra.sweeper.n_jobs=2", *TINY, "model.kv_heads=1", "trainer.max_steps=2", ONE_CPU)
    assert result.returncode == 0, result.stderr[-3000:]
    trials = {p.parent.parent.name: read_summary(p.parent) for p in (tmp_path / "sweep").rglob("summary.json")}
    assert sorted(name.split(",")[0] for name in trials) == [f"trial={n}" for n in range(4)]
    assert all(s["status"] == "completed" for s in trials.values())
    # two arrays of two tasks, one after the other (the sampler reads the first batch's values)
    assert sorted(j.split("_")[1] for j in array_jobs(tmp_path / "sweep")) == ["0", "0", "1", "1"]

    best = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    assert best["best_value"] == min(s["val_bpc"] for s in trials.values())
    best_values = {f"{k}={v}" for k, v in best["best_params"].items()}
    named = [name for name in trials if set(name.split(",")[1:]) == best_values]
    assert named and all(trials[name]["val_bpc"] == best["best_value"] for name in named)
    assert f"Best parameters: {best['best_params']}" in result.stdout + result.stderr
