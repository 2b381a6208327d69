"""The ddp and deepspeed backends on the CPU (gloo): equal losses to the local backend, one run
directory for every rank, resume, the deepspeed launcher's argument, a failing rank; on one GPU (the
gpu tier): ZeRO 0-3 against the local backend, half precision on every backend."""

import time

import pytest

from tests.helpers.runs import (RANK_STEPS, TINY_LM, kill_after_first_checkpoint, losses, read_metrics, read_summary,
                                the_one_default_run, torchrun, train, train_py, two_ddp_ranks)  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slow

STEPS = RANK_STEPS


@pytest.mark.parametrize("device,stages", [("cpu", (0, 1, 2)),
                                           pytest.param("cuda", (0, 1, 2, 3), marks=pytest.mark.gpu)],
                         ids=["cpu", "cuda"])
def test_deepspeed_zero_stages_give_the_local_losses(tmp_path, device, stages):
    """fp32, same seed: the same losses to 1e-5 relative on the CPU (summation order differs), to 1e-4
    on one GPU (CUDA's atomics too). The stages run as a user compares them, one sweep in one
    process; the last stage's checkpoint then loads into the local backend."""
    train(tmp_path / "local", *STEPS, f"trainer.device={device}")
    sweep = tmp_path / "sweep"
    result = train_py("-m", f"hydra.sweep.dir={sweep}", *TINY_LM, *STEPS, f"trainer.device={device}",
                      "backend=deepspeed", f"backend.zero_stage={','.join(map(str, stages))}")
    assert result.returncode == 0, result.stderr[-3000:]
    local = losses(tmp_path / "local")
    assert local.keys() == {1, 2, 3, 4}
    for stage in stages:
        ds = sweep / f"backend.zero_stage={stage}" / "seed=0"
        assert losses(ds) == pytest.approx(local, rel=1e-5 if device == "cpu" else 1e-4), f"zero stage {stage}"
        assert (ds / "checkpoints" / "step_0000004" / "model").is_dir()
        summary = read_summary(ds)
        assert summary["status"] == "completed" and summary["device"].startswith(device)
    # its weights, a new run (the path quoted: it holds "=")
    train(tmp_path / "from_ds", *STEPS, f"trainer.device={device}", f"trainer.resume='{ds}'")
    assert "initialised the model from" in (tmp_path / "from_ds" / "train.log").read_text()


@pytest.mark.parametrize("accum", [1, 2], ids=["no-accumulation", "accumulation2"])
def test_two_ddp_ranks_of_batch_b_equal_one_process_of_batch_2b(tmp_path, request, accum):
    """Without accumulation the ranks also share the default run directory (no hydra.run.dir), as
    the deepspeed ranks do below."""
    if accum == 1:
        ddp = request.getfixturevalue("two_ddp_ranks")
    else:
        result = torchrun(tmp_path, *STEPS, "backend=ddp", "trainer.batch_size=2", "trainer.grad_accum=2",
                          "hydra.run.dir=ddp")
        assert result.returncode == 0, result.stderr[-3000:]
        ddp = tmp_path / "ddp"
    train(tmp_path / "one", *STEPS, "trainer.batch_size=4", f"trainer.grad_accum={accum}")
    assert losses(ddp) == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    val = [r["val_loss"] for r in read_metrics(ddp) if "val_loss" in r]
    assert val == pytest.approx([r["val_loss"] for r in read_metrics(tmp_path / "one") if "val_loss" in r], rel=1e-5)


def test_two_deepspeed_ranks_share_one_default_run_directory(tmp_path):
    """... and DeepSpeed on the CPU compiles no extension (its shared-memory all-reduce, which only
    inference calls, took ~1.5 min of C++ on a run's first use)."""
    extensions = tmp_path / "torch_extensions"
    result = torchrun(tmp_path, *STEPS, "backend=deepspeed", env={"TORCH_EXTENSIONS_DIR": str(extensions)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert not extensions.exists(), list(extensions.rglob("*"))
    the_one_default_run(tmp_path)


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
