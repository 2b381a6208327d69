"""Running train.py as a user would, on the smallest configs that exercise each feature, and reading
what its runs leave."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# the smallest run that exercises every part of the loop: a "debug model" every feature test uses
TINY = [
    "model.dim=32",
    "model.depth=1",
    "model.heads=2",
    "model.dim_head=16",
    "data.seq_len=32",
    "trainer.batch_size=2",
    "trainer.val_batches=2",
    "trainer.log_every=1",
    "trainer.progress=false",
    "trainer.threads=1",
    "task.prime_length=8",
    "task.generate_length=8",
    "tracker=none",
]
TINY_NSA = TINY + [
    "model=nsa",
    "model.kv_heads=1",
    "model.sliding_window_size=8",
    "model.compress_block_size=4",
    "model.compress_stride=2",
    "model.fine_block_size=4",
    "model.num_fine_selected=3",
]


# the smallest text-to-image run: a VAE stage of 3 steps, then 3 DALL-E steps
TINY_DALLE = [
    "experiment=dalle",
    "model.dim=32",
    "model.depth=2",
    "model.heads=2",
    "model.dim_head=16",
    "vae.num_tokens=16",
    "vae.codebook_dim=16",
    "vae.hidden_dim=16",
    "vae.num_resnet_blocks=0",
    "data.image_size=16",
    "trainer.batch_size=4",
    "trainer.val_batches=1",
    "trainer.log_every=1",
    "trainer.progress=false",
    "trainer.threads=1",
    "trainer.max_steps=3",
    "task.vae_steps=3",
    "task.num_samples=4",
    "tracker=none",
]
TINY_LM = [*TINY, "model=transformer"]
# the VAE of TINY_DALLE trained alone
TINY_DVAE = ["experiment=dvae", *(o.replace("vae.", "model.") for o in TINY_DALLE
                                  if not o.startswith(("model.", "task.", "experiment")))]


def trainer_section(**kw):
    """conf/config.yaml's trainer section, typed by its schema, with `kw` over it (what a backend's
    setup reads)."""
    from omegaconf import OmegaConf

    from experiments.config.schema import TrainerConfig

    yaml = OmegaConf.load(ROOT / "conf" / "config.yaml").trainer
    return OmegaConf.merge(OmegaConf.structured(TrainerConfig), yaml, kw)


def train(run_dir: Path, *overrides: str, check: bool = True, timeout: float = 300,
          base: list[str] = TINY_LM) -> subprocess.CompletedProcess:
    """Run `python train.py` in `run_dir`: the tiny dense model unless `base` says otherwise.

    In this process (train.py's own `__main__`, as a sweep runs its jobs one after another in one
    process), which saves a Python, torch, Dynamo and Hydra start (~7 s of CPU) a run. One process
    of ddp or DeepSpeed is a group of one, which a sweep's jobs share as these runs do. In a process
    of its own where a run changes what a process keeps (OWN_PROCESS: trainer.compile's caches). A
    test of the process itself (a signal, a resource limit, an import, a launcher's ranks) starts
    one: start_train, torchrun, subprocess. `timeout` binds only a run in its own process."""
    result = train_py(f"hydra.run.dir={run_dir}", *base, *overrides, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"train.py failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def train_py(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python train.py args` (a run or a `-m` sweep): in this process unless an override in
    OWN_PROCESS asks for one of its own (train() says why)."""
    if any(a.startswith(OWN_PROCESS) for a in args):
        return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, env=run_env())
    return train_here(list(args))


# overrides whose runs leave state in a process that later runs would see: each runs in one of its own
OWN_PROCESS = ("trainer.compile=",)


def train_here(args: list[str]) -> subprocess.CompletedProcess:
    """train.py's `__main__` with these arguments, in this process: its exit status and what it
    printed, as a subprocess would give them. What a run sets for its process (environment, working
    directory, logging, threads, deterministic algorithms, the CPU allocator, Ctrl-C's handler) is put back
    after."""
    import contextlib
    import io
    import logging
    import runpy
    import signal
    import traceback

    import torch

    from experiments.runtime import allocator

    environ, cwd, argv, sigint = dict(os.environ), os.getcwd(), sys.argv, signal.getsignal(signal.SIGINT)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    threads, deterministic, memory = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), \
        allocator.active()
    out, err, status = io.StringIO(), io.StringIO(), 0
    os.environ.update(run_env())
    os.chdir(ROOT)
    sys.argv = [str(ROOT / "train.py"), *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
            except SystemExit as exit:
                if isinstance(exit.code, str):  # sys.exit("error: ...") prints it, status 1
                    print(exit.code, file=sys.stderr)
                status = exit.code if isinstance(exit.code, int) else 1 if exit.code is not None else 0
            except Exception:
                traceback.print_exc()
                status = 1
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:], root.level = handlers, level
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.argv = argv
        signal.signal(signal.SIGINT, sigint)  # the caller's: train.py sets one of its own for its start
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        allocator.use(memory)
    return subprocess.CompletedProcess(["train.py", *args], status, out.getvalue(), err.getvalue())


def start_train(run_dir: Path, *overrides: str, base: list[str] = TINY_LM) -> subprocess.Popen:
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *base, *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=run_env())


def kill_after_first_checkpoint(run_dir: Path, *overrides: str, timeout: float = 180,
                                base: list[str] = TINY_LM) -> None:
    """Start train.py and SIGKILL it as soon as its first checkpoint is on disk."""
    import signal
    import time

    proc = start_train(run_dir, *overrides, base=base)
    ckpts = Path(run_dir) / "checkpoints"
    deadline = time.time() + timeout
    while time.time() < deadline and not (ckpts.is_dir() and any(ckpts.glob("step_*.pt"))):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


# four steps of the tiny LM as ranks run them: validated at step 2, a constant rate, no clipping
RANK_STEPS = ["trainer.max_steps=4", "trainer.validate_every=2", "schedule=constant", "trainer.clip_grad_norm=null"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(cwd, *args, nproc=2, script="train.py", timeout=240, env=None) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=<nproc> <script>` of the tiny LM in `cwd`, with these overrides."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(ROOT / script), *TINY_LM, *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**run_env(), **(env or {})})


def the_one_default_run(cwd) -> Path:
    """The run directory every rank of a torchrun in cwd wrote to, with no hydra.run.dir: there is one,
    with rank 1's log beside rank 0's, every step of RANK_STEPS once and the run completed."""
    runs = [p for p in (Path(cwd) / "outputs").glob("*/*") if p.is_dir()]
    assert len(runs) == 1, runs
    run = runs[0]
    steps = [r["step"] for r in read_metrics(run) if "loss" in r]
    assert steps == [1, 2, 3, 4]
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "train.rank1.log").is_file()
    assert read_summary(run)["status"] == "completed"
    return run


@pytest.fixture(scope="session")
def two_ddp_ranks(tmp_path_factory) -> Path:
    """`torchrun --nproc_per_node=2 train.py backend=ddp` of RANK_STEPS, batch 2 a rank, in the default
    run directory: that directory. Run once a worker for the tests that compare with it (test_distributed:
    one process of batch 4; test_slurm: srun's two tasks), which one worker runs (tests/conftest.py's
    WORKER_GROUPS), so once a suite."""
    cwd = tmp_path_factory.mktemp("two_ddp_ranks")
    result = torchrun(cwd, *RANK_STEPS, "backend=ddp")
    assert result.returncode == 0, result.stderr[-3000:]
    return the_one_default_run(cwd)


def run_env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "0"}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def read_summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def losses(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(run_dir) if "loss" in row}


def start_long_train(run_dir: Path, logged_steps: int, *overrides: str) -> subprocess.Popen:
    """Start a run that would go on for ever (no checkpoints, no validation) and return once it has
    logged `logged_steps` training steps: ready to be signalled or killed mid-run."""
    import time

    proc = start_train(run_dir, "trainer.max_steps=100000", "trainer.checkpoint_every=0",
                       "trainer.validate_every=0", *overrides)
    deadline = time.time() + 120
    while time.time() < deadline and not ((Path(run_dir) / "metrics.jsonl").is_file()
                                          and len(losses(run_dir)) >= logged_steps):
        time.sleep(0.05)
    return proc


def wandb_records(path: Path) -> list:
    """The records of a wandb run file (`<run>/wandb/offline-run-*/run-<id>.wandb`), as wandb writes
    them: a 7-byte header, then LevelDB's log format (32 KiB blocks; a 7-byte header per piece of a
    record: checksum, length, kind) around each protobuf `Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, header = Path(path).read_bytes(), 32768, 7
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    pos, pending, records = header, b"", []
    while pos + header <= len(data):
        if block - pos % block < header:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + header:pos + header + length]
        pos += header + length
        if kind in (1, 4):  # a whole record, or a record's last piece
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records
