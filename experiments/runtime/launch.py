"""What a launcher hands a process, made ready before Hydra reads the command line.

torchrun and the `deepspeed` launcher start one process per rank with RANK, LOCAL_RANK and
WORLD_SIZE in the environment; the `deepspeed` launcher also appends `--local_rank=N`, which
Hydra would reject as an override. `prepare_argv` removes that argument (the value goes to
LOCAL_RANK). `claim_output_dir` makes the timestamped run directory, so that two launches in the
same second get two, and every rank of one launch uses rank 0's: it is shared through a
key-value store (torchrun's own, or one rank 0 hosts at MASTER_PORT), so ranks whose clocks read
different seconds do not each create their own. Ranks other than 0 write no .hydra/ files and log
to train.rank<k>.log.

The store is kept for the backends' process group, and for a failing rank to leave its error
where rank 0 finds it.

`srun --ntasks=N python train.py backend=ddp` starts N processes with no torchrun variables: inside
such a job step (SLURM_STEP_ID set, more than one task in the step) `from_slurm` exports RANK,
WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE from SLURM_PROCID, SLURM_STEP_NUM_TASKS and SLURM_LOCALID,
MASTER_ADDR as the step's first host and MASTER_PORT from the job and step ids, so every part that
reads torchrun's variables (this module, torch.distributed, DeepSpeed) sees one job of N ranks. A
batch script (no step) or a step of one task (a submitit job array element) changes nothing, and
torchrun's own variables always win.

Only the standard library is imported at module level: `train.py --help` stays fast.
"""

import os
import sys
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Optional

_store = None  # the job's key-value store, once a multi-process launch has made it
_PREFIX = "sparse_attention/"


def rank() -> int:
    from_slurm()
    return int(os.environ.get("RANK", 0))


def local_rank() -> int:
    from_slurm()
    return int(os.environ.get("LOCAL_RANK", 0))


def world_size() -> int:
    from_slurm()
    return int(os.environ.get("WORLD_SIZE", 1))


def from_slurm(environ: Optional[dict] = None) -> bool:
    """Inside an `srun` step of several tasks with no torchrun variables, export the rank, world
    size, local rank and master address and port SLURM's environment implies (see the module's
    docstring); True when it did. Called again, it changes nothing."""
    env = os.environ if environ is None else environ
    if any(k in env for k in ("RANK", "WORLD_SIZE")) or "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return False
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
    if tasks <= 1:
        return False
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], str(tasks)
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    per_node = _first_count(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "")
    if per_node:
        env["LOCAL_WORLD_SIZE"] = str(per_node)
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    env.setdefault("MASTER_ADDR", first_host(nodes) or "127.0.0.1")
    # one port per job step, the same on every rank: 20000-49999, clear of the ephemeral range
    job, step = int(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or 0), int(env.get("SLURM_STEP_ID") or 0)
    env.setdefault("MASTER_PORT", str(20000 + (job * 16 + step) % 30000))
    return True


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `gpu[03-05,07],cpu1` -> `gpu03`."""
    head = ""
    depth = 0
    for ch in nodelist:  # the first entry: up to a comma outside brackets
        if ch == "," and depth == 0:
            break
        depth += {"[": 1, "]": -1}.get(ch, 0)
        head += ch
    if "[" not in head:
        return head
    prefix, ranges = head.split("[", 1)
    first = ranges.rstrip("]").split(",")[0].split("-")[0]
    return prefix + first + head[head.index("]") + 1:] if "]" in head else prefix + first


def _first_count(tasks_per_node: str) -> int:
    """`2(x3),1` -> 2: the tasks on the first node."""
    head = tasks_per_node.split(",")[0].split("(")[0]
    return int(head) if head.isdigit() else 0


def prepare_argv(argv: list[str]) -> list[str]:
    """argv without `--local_rank`."""
    return _without_local_rank(argv)


# conf/config.yaml's hydra.run.dir and hydra.sweep.dir, as time.strftime formats
RUN_DIR_FORMAT, SWEEP_DIR_FORMAT = "outputs/%Y-%m-%d/%H-%M-%S", "outputs/multirun/%Y-%m-%d/%H-%M-%S"


def as_launched(argv: list[str]) -> list[str]:
    """`train.py hydra.run.dir=X` alone, X a run: X's own overrides (its .hydra/overrides.yaml) before
    the directory, so that naming a run resumes it as it was launched; argv as it is otherwise (other
    overrides are this launch's config, which the run compares with its checkpoint's)."""
    if len(argv) != 1 or not argv[0].startswith("hydra.run.dir="):
        return argv
    saved = os.path.join(argv[0].split("=", 1)[1], ".hydra", "overrides.yaml")
    if not os.path.isfile(saved):
        return argv
    import yaml  # Hydra writes the list as YAML

    with open(saved) as f:
        earlier = [str(o) for o in yaml.safe_load(f) or []]
    if earlier and rank() == 0:
        print(f"resuming {argv[0].split('=', 1)[1]} as it was launched: {' '.join(earlier)}", file=sys.stderr)
    return [*earlier, argv[0]]


def claim_output_dir(argv: list[str]) -> list[str]:
    """argv naming a run (or, with -m, a sweep) directory that no other launch has. The timestamped
    default is made here with mkdir, which only one of two launches in the same second gets (the
    other takes <time>-1, then -2, ...): two array tasks or two shells never train into one
    directory. Every rank gets rank 0's. A directory named on the command line is kept: naming one
    again resumes it. Called once the config is checked, so that a refused launch makes none. Raises
    ValueError (one line) where the named directory cannot be made: a system's own folder (/proc)
    that os.access calls writable, say."""
    multirun = any(a in ("-m", "--multirun") for a in argv)
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    run_dir = next((a.split("=", 1)[1] for a in argv if a.startswith(key + "=")), None)
    if run_dir is not None and rank() == 0:
        _check_makeable(run_dir, key)
    if run_dir is None:
        shared = _PREFIX + "run_dir/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if rank() == 0:
            run_dir = _make_fresh_dir(time.strftime(SWEEP_DIR_FORMAT if multirun else RUN_DIR_FORMAT))
            if world_size() > 1:
                store().set(shared, run_dir)
        else:
            run_dir = store().get(shared).decode()
        argv = [*argv, f"{key}={run_dir}"]
    if rank() != 0 and not multirun:
        argv = [*argv, "hydra.output_subdir=null", "hydra.job_logging.root.handlers=[file]",
                f"hydra.job_logging.handlers.file.filename={run_dir}/train.rank{rank()}.log"]
    return argv


def stop_workers_with_this_process() -> None:
    """A parallel sweep's parent (joblib's local launcher), stopped by SIGTERM or Ctrl-C, passes a
    SIGTERM to its workers and leaves at once: each running job then checkpoints at the end of its
    step and records "interrupted", and no queued job starts. Without it a SIGTERM to the parent
    alone left the workers training to the end, and Ctrl-C had joblib end them, a job possibly
    before its checkpoint. (Linux: the workers are read from /proc.)"""
    import signal

    def stop(signum, frame):
        for pid in _children():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        print(f"{signal.Signals(signum).name} received: each running job checkpoints and records "
              "interrupted; the same command resumes the sweep", file=sys.stderr, flush=True)
        os._exit(128 + signum)  # not joblib's abort, which ends the workers mid-step

    if sys.platform.startswith("linux"):
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)


def end_optuna_sweep_without_a_best() -> None:
    """An Optuna sweep whose every trial failed ends as any sweep with failed jobs does (train.py's
    line naming them, exit 1), not in the sweeper's traceback: after its last trial it asks the study
    for its best ("No trials are completed yet"), and there is none to write."""
    from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl

    sweep = OptunaSweeperImpl.sweep

    def sweep_to_the_end(self, arguments):
        try:
            return sweep(self, arguments)
        except ValueError as error:
            if "No trials are completed yet" not in str(error):
                raise

    OptunaSweeperImpl.sweep = sweep_to_the_end


def _children() -> list[int]:
    """This process's child processes, from every thread's /proc children list."""
    from pathlib import Path

    pids = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += [int(pid) for pid in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


def _check_makeable(path: str, key: str) -> None:
    """Raise ValueError (one line) where `path` cannot be made; leave the file system as it was (what
    this check makes it removes: a sweep the SLURM preflight refuses later leaves no directory)."""
    missing, up = [], os.path.abspath(path)
    while not os.path.exists(up):
        missing.append(up)  # deepest first
        up = os.path.dirname(up)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{key}={path} cannot be made ({e.strerror}): choose a {key} where you can write") from None
    finally:
        for made in missing:
            try:
                os.rmdir(made)
            except OSError:  # not made, or not empty: another process's by now
                pass


@contextmanager
def no_directory_left_by_a_refusal(path: str, existed: bool):
    """Around a sweep's launch into `path`: a refusal before any job (SystemExit: the SLURM preflight, a
    Hydra callback that runs once the directory is claimed) leaves no directory that was not there
    before (the timestamped one claim_output_dir made), where nothing was written into it."""
    try:
        yield
    except SystemExit:
        if not existed:
            try:
                os.rmdir(path)
            except OSError:  # gone, or written to: a job ran
                pass
        raise


def _make_fresh_dir(path: str) -> str:
    """path, or path-1, path-2, ...: the first that this call creates (mkdir fails where it exists)."""
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    for n in range(10_000):
        candidate = path if n == 0 else f"{path}-{n}"
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"no free directory next to {path}")


def log_to_rank_file(run_dir) -> None:
    """A rank other than 0 logs to train.rank<k>.log, not rank 0's train.log. `claim_output_dir` sees to
    it for torchrun and srun; a launcher that runs the task in its own process (submitit with
    tasks_per_node > 1) has set Hydra's train.log up for every rank, so it is swapped here."""
    import logging
    from pathlib import Path

    if rank() == 0:
        return
    target = Path(run_dir) / f"train.rank{rank()}.log"
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename) != target:
            replacement = logging.FileHandler(target)
            replacement.setFormatter(handler.formatter)
            replacement.setLevel(handler.level)
            root.removeHandler(handler)
            handler.close()
            root.addHandler(replacement)


def output_dir_error(overrides: list[str]) -> Optional[str]:
    """Why the run directory (with -m, the sweep directory) an override names cannot be one (a file
    is in the way, no permission to create it), as one line; None when Hydra can create and write it."""
    from pathlib import Path

    key = "hydra.sweep.dir" if any(a in ("-m", "--multirun") for a in overrides) else "hydra.run.dir"
    given = next((a.split("=", 1)[1] for a in overrides if a.startswith(key + "=")), None)
    path = Path(given if given is not None else "outputs")
    named = f"{key}={given}" if given is not None else "the working directory"
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if ancestor.exists() and not ancestor.is_dir():
        return f"{named}: {ancestor} is a file, not a directory: choose another {key}"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{named}: {ancestor} is not writable: choose a {key} where you can write"
    return None


def _without_local_rank(argv: list[str]) -> list[str]:
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            os.environ["LOCAL_RANK"] = arg.split("=", 1)[1]
        elif arg in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            os.environ["LOCAL_RANK"] = argv[i + 1]
            skip = True
        else:
            out.append(arg)
    return out


def store(timeout_s: float = 300.0):
    """The job's TCPStore: torchrun's agent store when there is one, else hosted by rank 0."""
    global _store
    if _store is None:
        from torch.distributed import TCPStore

        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        _store = TCPStore(
            os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", 29500)),
            world_size(), is_master=rank() == 0 and not agent, timeout=timedelta(seconds=timeout_s),
        )
    return _store


def init_process_group(backend: str, timeout_s: float) -> None:
    """One process group over every rank (a single process gets a group of one, as DeepSpeed
    needs), with collectives that give up after timeout_s instead of hanging on a dead rank."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    if world_size() == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    dist.init_process_group(backend, store=dist.PrefixStore(_PREFIX + "pg", store()), rank=rank(),
                            world_size=world_size(), timeout=timeout)


def report_failure(message: str) -> None:
    """Record the first failing rank's error for rank 0's summary (no-op in one process)."""
    if world_size() > 1 and _store is not None:
        try:
            _store.compare_set(_PREFIX + "failure", "", f"rank {rank()}: {message}")
        except Exception:  # the store died with rank 0: the error is still in this rank's log
            pass


def first_failure() -> Optional[str]:
    """The error a rank recorded first, if any."""
    if world_size() == 1 or _store is None:
        return None
    try:
        if _store.check([_PREFIX + "failure"]):
            return _store.get(_PREFIX + "failure").decode()
    except Exception:
        pass
    return None
