"""The ddp and deepspeed backends on the CPU (gloo): equal losses to the local backend, one run
directory for every rank, resume, the deepspeed launcher's argument, a failing rank; on one GPU (the
gpu tier): ZeRO 0-3 against the local backend, half precision on every backend."""

import socket
import subprocess
import sys
import time

import pytest

from tests.helpers.runs import ROOT, TINY, run_env, kill_after_first_checkpoint, losses, read_metrics, read_summary, train

pytestmark = pytest.mark.slow

STEPS = ["trainer.max_steps=4", "trainer.validate_every=2", "schedule=constant", "trainer.clip_grad_norm=null"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(cwd, *args, nproc=2, script="train.py", timeout=240, env=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(ROOT / script), *TINY, "model=transformer", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**run_env(), **(env or {})})


@pytest.mark.parametrize("device,stage", [*(("cpu", stage) for stage in (0, 1, 2)),
                                          *(pytest.param("cuda", stage, marks=pytest.mark.gpu) for stage in range(4))])
def test_deepspeed_zero_stages_give_the_local_losses(tmp_path, device, stage):
    """fp32, same seed: the same losses to 1e-5 relative on the CPU (summation order differs), to 1e-4
    on one GPU (CUDA's atomics too)."""
    train(tmp_path / "local", *STEPS, f"trainer.device={device}")
    train(tmp_path / "ds", *STEPS, f"trainer.device={device}", "backend=deepspeed", f"backend.zero_stage={stage}")
    local, ds = losses(tmp_path / "local"), losses(tmp_path / "ds")
    assert local.keys() == ds.keys() == {1, 2, 3, 4}
    assert ds == pytest.approx(local, rel=1e-5 if device == "cpu" else 1e-4)
    assert (tmp_path / "ds" / "checkpoints" / "step_0000004" / "model").is_dir()
    summary = read_summary(tmp_path / "ds")
    assert summary["status"] == "completed" and summary["device"].startswith(device)


def test_deepspeed_checkpoint_loads_into_the_local_backend(tmp_path):
    train(tmp_path / "ds", *STEPS, "backend=deepspeed", "backend.zero_stage=2")
    train(tmp_path / "local", *STEPS, f"trainer.resume={tmp_path / 'ds'}")  # its weights, a new run
    assert "initialised the model from" in (tmp_path / "local" / "train.log").read_text()


@pytest.mark.parametrize("accum", [1, 2], ids=["no-accumulation", "accumulation2"])
def test_two_ddp_ranks_of_batch_b_equal_one_process_of_batch_2b(tmp_path, accum):
    torchrun(tmp_path, *STEPS, "backend=ddp", "trainer.batch_size=2", f"trainer.grad_accum={accum}", "hydra.run.dir=ddp")
    train(tmp_path / "one", *STEPS, "trainer.batch_size=4", f"trainer.grad_accum={accum}")
    assert losses(tmp_path / "ddp") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    val = [r["val_loss"] for r in read_metrics(tmp_path / "ddp") if "val_loss" in r]
    assert val == pytest.approx([r["val_loss"] for r in read_metrics(tmp_path / "one") if "val_loss" in r], rel=1e-5)


@pytest.mark.parametrize("backend", ["ddp", "deepspeed"])
def test_two_ranks_share_one_default_run_directory(tmp_path, backend):
    """... and DeepSpeed on the CPU compiles no extension (its shared-memory all-reduce, which only
    inference calls, took ~1.5 min of C++ on a run's first use)."""
    extensions = tmp_path / "torch_extensions"
    result = torchrun(tmp_path, *STEPS, f"backend={backend}", env={"TORCH_EXTENSIONS_DIR": str(extensions)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert not extensions.exists(), list(extensions.rglob("*"))
    runs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(runs) == 1, runs
    run = runs[0]
    steps = [r["step"] for r in read_metrics(run) if "loss" in r]
    assert steps == [1, 2, 3, 4]
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "train.rank1.log").is_file()
    assert read_summary(run)["status"] == "completed"


def test_the_deepspeed_launchers_local_rank_argument_is_accepted(tmp_path):
    train(tmp_path / "run", "--local_rank=0", "trainer.max_steps=2", "backend=deepspeed")
    assert read_summary(tmp_path / "run")["status"] == "completed"


def test_a_failing_rank_fails_the_job_with_its_error(tmp_path):
    t0 = time.time()
    result = torchrun(tmp_path, *STEPS, "backend=ddp", "backend.timeout_s=10", "hydra.run.dir=run",
                      script="tests/helpers/rank_one.py", timeout=180, env={"RANK_ONE": "fail"})
    assert result.returncode != 0
    assert time.time() - t0 < 120
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "failed"
    assert "rank 1" in summary["error"] and "injected failure on rank 1" in summary["error"]


@pytest.mark.parametrize("backend", ["ddp", "deepspeed"])
def test_a_stop_seen_by_one_rank_stops_every_rank_at_the_same_step(tmp_path, backend):
    """SIGTERM may reach the ranks at different steps: they agree, checkpoint together, and
    the run is recorded as interrupted, not hung."""
    result = torchrun(tmp_path, *STEPS, f"backend={backend}", "backend.timeout_s=20", "trainer.checkpoint_every=0",
                      "hydra.run.dir=run", script="tests/helpers/rank_one.py", timeout=180, env={"RANK_ONE": "stop"})
    assert result.returncode != 0  # interrupted: every rank exits 128 + SIGTERM, so the launcher fails
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "interrupted" and summary["step"] == 2
    assert [p.name for p in (tmp_path / "run" / "checkpoints").glob("*.pt")] == ["step_0000002.pt"]


def test_deepspeed_resume_after_sigkill_equals_an_uninterrupted_run(tmp_path):
    steps = ["trainer.max_steps=30", "trainer.checkpoint_every=5", "trainer.validate_every=0", "backend=deepspeed",
             "backend.zero_stage=1"]
    train(tmp_path / "whole", *steps)
    kill_after_first_checkpoint(tmp_path / "killed", *steps)
    train(tmp_path / "killed", *steps)
    whole, resumed = losses(tmp_path / "whole"), losses(tmp_path / "killed")
    assert resumed.keys() == whole.keys()
    assert resumed == pytest.approx(whole, rel=1e-6)
    assert not list((tmp_path / "killed" / "checkpoints").glob("*.partial"))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["local", "ddp", "deepspeed"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_a_gpu(tmp_path, backend, precision):
    """Half-precision training on one GPU: finite losses that fall, for every backend."""
    run = tmp_path / "run"
    if backend == "ddp":
        result = torchrun(tmp_path, "trainer.max_steps=20", f"trainer.precision={precision}", "backend=ddp",
                          "hydra.run.dir=run", nproc=1)
        assert result.returncode == 0, result.stderr[-3000:]
    else:
        train(run, "trainer.max_steps=20", f"trainer.precision={precision}", f"backend={backend}")
    steps = losses(run)
    assert all(v == v and v < 10 for v in steps.values()) and steps[20] < steps[1]
    assert read_summary(run)["precision"] == precision
