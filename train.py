"""Compose the config, instantiate its parts, hand them to the training loop.

    python train.py                                   # NSA LM on the built-in corpus
    python train.py model=transformer trainer.max_steps=50
    python train.py -m model.num_fine_selected=2,4,8  # a sweep: one run directory per job
    torchrun --nproc_per_node=2 train.py backend=ddp  # every rank, one run directory

Heavy imports (torch, the models) happen inside main, so `--help` stays fast.
"""

import os
import signal
import sys


def _stop_while_not_training(signum, frame):
    """Ctrl-C while no run trains (the imports, the checks, between a sweep's jobs): one line and
    exit 130, not a traceback. At once (os._exit), not by an exception: one raised mid-way through
    OmegaConf's code was replaced by an error of its cleanup, which Hydra then reported. A run takes
    the signal over while it trains (experiments/runtime/run.py)."""
    sys.stdout.flush()
    print("interrupted: no run was training", file=sys.stderr, flush=True)
    os._exit(128 + signum)


if __name__ == "__main__":  # first, before the imports that take a second or two
    signal.signal(signal.SIGINT, _stop_while_not_training)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from experiments.config import register  # noqa: E402

register()  # the config schemas, before Hydra composes


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from experiments.config.checks import check_config
    from experiments.runtime import launch
    from experiments.runtime.build import build
    from experiments.runtime.run import Run
    from experiments.tasks.loop import Loop

    run = Run.from_hydra(is_main=launch.rank() == 0)
    launch.log_to_rank_file(run.dir)  # rank k > 0 of a submitit job with tasks_per_node > 1
    with run:
        check_config(cfg)
        backend = build(cfg.backend, "backend")
        backend.setup(cfg.trainer)  # device, seeds, threads: before anything is built
        task = build(cfg.task, "task")
        data = build(cfg.data, "data")
        # the model, and a draft (speculative decoding) or a VAE (DALL-E) where the config has one
        models = {slot: build(cfg[slot], slot) for slot in ("model", "draft", "vae") if cfg[slot] is not None}
        loop = Loop(task, run=run, cfg=cfg, backend=backend, data=data, optimizer=build(cfg.optimizer, "optimizer"),
                    schedule=build(cfg.schedule, "schedule"), tracker=build(cfg.tracker, "tracker"), models=models)
        run.result = loop.train()
    return run.result


def claimed_output_dir(overrides: list[str]) -> list[str]:
    """launch.claim_output_dir, its refusal as one line."""
    from experiments.runtime.launch import claim_output_dir

    try:
        return claim_output_dir(overrides)
    except ValueError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    import time
    from contextlib import nullcontext
    from pathlib import Path

    from experiments.config.checks import (composition_error, failures_tolerated, runs_jobs_elsewhere,
                                          runs_jobs_in_parallel, searches_with_optuna, sweep_error,
                                          sweep_hydra_config)
    from experiments.config.resolvers import export_swept_keys
    from experiments.runtime.launch import (as_launched, end_optuna_sweep_without_a_best,
                                            no_directory_left_by_a_refusal, output_dir_error, prepare_argv,
                                            stop_workers_with_this_process)
    from experiments.runtime.run import sweep_failures, sweep_record_kept_if_no_job_runs

    sys.argv = [sys.argv[0], *prepare_argv(sys.argv[1:])]  # a launcher's --local_rank, before Hydra parses argv
    overrides = sys.argv[1:]
    export_swept_keys(overrides)  # a sweep job's directory names what is swept, wherever it runs
    conf = str(Path(__file__).resolve().parent / "conf")
    sweep_dir, existed, tolerated, elsewhere = None, False, 0.0, False
    if not any(a.startswith("-") for a in overrides):  # a single run: Hydra's complaints as one line, first
        overrides = as_launched(overrides)  # `train.py hydra.run.dir=X` resumes X with X's overrides
        if error := composition_error(conf, overrides) or output_dir_error(overrides):
            sys.exit(f"error: {error}")
        sys.argv = [sys.argv[0], *claimed_output_dir(overrides)]  # its own directory, one for every rank
    # a sweep: every job's config (its launcher's options too) composed and checked, before any job starts
    elif {"-m", "--multirun"} & set(overrides) and all(a in ("-m", "--multirun") or not a.startswith("-")
                                                       for a in overrides):
        jobs = [a for a in overrides if not a.startswith("-")]
        if error := sweep_error(conf, jobs) or output_dir_error(overrides):
            sys.exit(f"error: {error}")
        named = [a.split("=", 1)[1] for a in overrides if a.startswith("hydra.sweep.dir=")]
        existed = bool(named) and Path(named[-1]).is_dir()
        sys.argv = [sys.argv[0], *claimed_output_dir(overrides)]
        sweep_dir = [a.split("=", 1)[1] for a in sys.argv if a.startswith("hydra.sweep.dir=")][-1]  # Hydra's: the last
        sweep_hydra = sweep_hydra_config(conf, jobs)
        if runs_jobs_in_parallel(sweep_hydra):
            stop_workers_with_this_process()  # a stop reaches the workers; joblib's abort does not end them
        if searches_with_optuna(sweep_hydra):
            end_optuna_sweep_without_a_best()
        tolerated, elsewhere = failures_tolerated(sweep_hydra), runs_jobs_elsewhere(sweep_hydra)
    started = time.time()
    with (no_directory_left_by_a_refusal(sweep_dir, existed) if sweep_dir else nullcontext(),
          sweep_record_kept_if_no_job_runs(Path(sweep_dir), elsewhere) if sweep_dir else nullcontext()):
        main()
    # a sweep goes on past a failed job, then says so in its exit status (a script, a SLURM dependency)
    if sweep_dir and len(failed := sweep_failures(Path(sweep_dir), started, elsewhere)) > tolerated:
        sys.exit(f"error: {len(failed)} job(s) of the sweep failed: {', '.join(failed)}; each one's summary.json "
                 f"and train.log say why (a refused rerun: its train.log), the jobs that completed stand ({sweep_dir})")
