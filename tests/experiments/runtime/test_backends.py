"""Backends: device and precision checks, seeding, peak memory per run, the DeepSpeed config and its checks;
on CUDA (the gpu tier): trainer.deterministic repeats and resumes to the bit, and without it how far
two runs drift."""

import pytest
import torch

from experiments.config.schema import Device, Precision
from experiments.runtime import allocator
from experiments.runtime.backends import LocalBackend, parallel_job_slot, peak_memory_mb, reset_peak_memory
from experiments.runtime.errors import UserError
from tests.helpers.runs import (TINY_LM, TINY_NSA, kill_after_first_checkpoint, losses, read_metrics,
                                read_summary, train, trainer_section)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a CPU-only machine gives")
def test_cuda_without_a_gpu_says_what_to_use():
    with pytest.raises(UserError, match="trainer.device=cuda but no CUDA device"):
        LocalBackend().setup(trainer_section(device=Device.cuda))


def test_fp16_needs_cuda():
    with pytest.raises(UserError, match="trainer.precision=fp16 needs a CUDA device"):
        LocalBackend().setup(trainer_section(device=Device.cpu, precision=Precision.fp16))


def test_setup_seeds_every_generator():
    backend = LocalBackend()
    backend.setup(trainer_section(device=Device.cpu, seed=7))
    first = torch.rand(3)
    backend.setup(trainer_section(device=Device.cpu, seed=7))
    assert torch.equal(first, torch.rand(3))


@pytest.mark.parametrize("mode", allocator.MODES)
def test_the_cpu_allocator_the_trainer_names_is_the_one_set_up(monkeypatch, mode):
    used = []
    monkeypatch.setattr(allocator, "use", lambda m: used.append(m) or True)
    LocalBackend().setup(trainer_section(device=Device.cpu, cpu_allocator=mode))
    assert used == [mode]


def scaled(precision="fp16", scale=2.0**10) -> LocalBackend:
    """A CPU backend that computes as backend=local with `precision` on a GPU: trainer.precision=fp16
    needs CUDA, so its loss scaler is a CPU one here."""
    backend = LocalBackend()
    backend.setup(trainer_section(device=Device.cpu))
    backend.precision, backend.scaler = precision, torch.amp.GradScaler("cpu", init_scale=scale)
    return backend


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_computes_in_the_trainers_precision(precision, dtype):
    with scaled(precision).autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == dtype


def test_gradients_are_clipped_unscaled():
    backend = scaled()
    trainee = backend.prepare("", torch.nn.Linear(2, 1, bias=False), lambda params: torch.optim.SGD(params, lr=1.0))
    torch.nn.init.zeros_(trainee.module.weight)
    backend.backward(trainee.module(torch.tensor([3.0, 4.0])).sum(), trainee)  # gradient (3, 4): norm 5
    backend.step([trainee], clip_grad_norm=1.0)
    torch.testing.assert_close(trainee.module.weight.detach(), -torch.tensor([[0.6, 0.8]]))


def linear(backend: LocalBackend):
    return backend.prepare("", torch.nn.Linear(2, 1), lambda params: torch.optim.SGD(params, lr=1.0))


def test_a_resumed_run_continues_with_its_checkpoints_loss_scale(tmp_path):
    backend = scaled(scale=2.0**10)
    state = backend.checkpoint_state([linear(backend)], tmp_path, "step")
    resumed = scaled(scale=2.0**16)
    resumed.load_checkpoint_state([linear(resumed)], state, tmp_path / "step.pt")
    assert resumed.scaler.get_scale() == 2.0**10


def test_peak_memory_is_reset_per_run():
    cpu = torch.device("cpu")
    big = torch.ones(100_000_000)  # 400 MB
    del big
    before = peak_memory_mb(cpu)
    reset_peak_memory(cpu)
    assert peak_memory_mb(cpu) < before - 300


def test_no_parallel_slot_outside_a_parallel_launcher():
    assert parallel_job_slot() is None


@pytest.mark.parametrize("knobs, message", [
    (dict(zero_stage=5), "zero_stage must be 0, 1, 2 or 3"),
    (dict(offload_param="cpu"), "offload_param=cpu needs zero_stage=3"),
    (dict(offload_optimizer="cpu"), "offload_optimizer needs zero_stage >= 1"),
    (dict(config_file="missing.json"), "config_file=missing.json: no such file"),
])
def test_bad_deepspeed_knobs_are_refused_before_any_work(knobs, message):
    from experiments.runtime.backends import DeepSpeedBackend

    with pytest.raises(ValueError, match=message):
        DeepSpeedBackend(**knobs)


def test_deepspeed_config_comes_from_the_trainer_section(tmp_path):
    from experiments.runtime.backends import DeepSpeedBackend

    user = tmp_path / "ds.json"
    user.write_text('{"train_micro_batch_size_per_gpu": 99, '
                    '"zero_optimization": {"reduce_bucket_size": 1000, "stage": 3}}')  # the stage: backend.zero_stage's
    backend = DeepSpeedBackend(zero_stage=2, offload_optimizer="cpu", initial_loss_scale_power=12,
                               config_file=str(user))
    backend.precision = "bf16"
    config = backend.deepspeed_config(trainer_section(batch_size=3, grad_accum=4, clip_grad_norm=0.5))
    assert config["train_micro_batch_size_per_gpu"] == 3 and config["gradient_accumulation_steps"] == 4
    assert config["train_batch_size"] == 12 and config["gradient_clipping"] == 0.5
    assert config["bf16"] == {"enabled": True} and config["fp16"]["enabled"] is False
    assert config["fp16"]["initial_scale_power"] == 12
    assert config["zero_optimization"] == {"reduce_bucket_size": 1000, "stage": 2, "offload_optimizer": {"device": "cpu"}}


def test_a_bad_backend_key_is_refused_in_one_message_before_the_run_starts(tmp_path):
    from tests.helpers.runs import train

    result = train(tmp_path / "run", "backend=deepspeed", "backend.zero_stage=5", check=False)
    assert result.returncode != 0
    assert "error: backend.zero_stage=5 must be 0, 1, 2 or 3" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_trainer_compile_names_torch_compiles_mode():
    from experiments.runtime.backends import compile_mode

    assert [compile_mode(v) for v in (False, True, "default", "reduce-overhead")] == \
        [None, "default", "default", "reduce-overhead"]
    backend = LocalBackend()
    backend.setup(trainer_section(device=Device.cpu, compile=True))
    assert backend.compile == "default"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a CPU-only machine gives")
def test_cuda_graphs_on_the_cpu_are_refused_in_one_line():
    with pytest.raises(UserError, match="trainer.compile=reduce-overhead replays CUDA graphs and needs a CUDA device"):
        LocalBackend().setup(trainer_section(device=Device.cpu, compile="reduce-overhead"))


def test_the_local_backend_in_a_launch_of_several_processes_is_refused_in_one_line(monkeypatch):
    """srun --ntasks=2 (or torchrun) with backend=local: each process would train the same run alone."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(UserError, match="backend=local trains in one process, and this launch started 2 .*use "
                                        "backend=ddp or backend=deepspeed"):
        LocalBackend().setup(trainer_section(device=Device.cpu))


def test_compile_with_deepspeed_is_refused_in_one_line():
    from experiments.runtime.backends import DeepSpeedBackend

    with pytest.raises(UserError, match="trainer.compile=default is for backend=local or ddp"):
        DeepSpeedBackend().setup(trainer_section(device=Device.cpu, compile=True))


# NSA with two query heads per key head (kv_heads=2): its CPU kernels' training step
TINY_NSA_GQA = [*TINY_NSA, "model.heads=4", "model.kv_heads=2"]


@pytest.mark.parametrize("base,runs", [(TINY_LM, ("compiled",)), (TINY_NSA_GQA, ("compiled", "cached"))],
                         ids=["transformer", "nsa"])
def test_a_compiled_run_trains_as_the_uncompiled_one(tmp_path, base, runs):
    """trainer.compile: the same losses (to fp32 round-off: the compiler fuses and reorders), the
    compiling step's time logged as compile_s and left out of tokens/s; and for NSA again in a second
    process, which finds the first one's graphs in the compiler's caches. (With NSA's C kernels
    outside the graph, torch 2.13's AOTAutograd cache replayed the aliases the broken graphs
    returned with garbage sizes: a run crashed whenever the cache held its graphs. The dense LM's
    graphs hold PyTorch's operators alone, which the cache's own tests cover.)"""
    steps = ["trainer.max_steps=3", "trainer.validate_every=0"]
    train(tmp_path / "eager", *steps, base=base)
    for run in runs:
        train(tmp_path / run, *steps, "trainer.compile=true", base=base, timeout=900)  # a cold compile: minutes
        assert losses(tmp_path / run) == pytest.approx(losses(tmp_path / "eager"), rel=1e-5)
    summary = read_summary(tmp_path / "compiled")
    assert summary["status"] == "completed" and summary["compile_s"] > 0 and summary["tokens_per_s"] > 0
    assert summary["compile_mode"] == "default"
    first, *rest = [row for row in read_metrics(tmp_path / "compiled") if "loss" in row]
    assert "tokens_per_s" not in first and all(row["tokens_per_s"] > 0 for row in rest)
    assert "compiled the training forward and backward in" in (tmp_path / "compiled" / "train.log").read_text()


def test_deterministic_switches_torch_to_deterministic_algorithms_and_back():
    backend = LocalBackend()
    try:
        backend.setup(trainer_section(device=Device.cpu, deterministic=True))
        assert torch.are_deterministic_algorithms_enabled()
        backend.setup(trainer_section(device=Device.cpu))  # the next job of a sweep, in the same process
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_deterministic_nsa_run_trains_as_the_default_one(tmp_path):
    """No operator of the NSA LM's step refuses deterministic mode; on the CPU the losses are the bits
    of the default run's."""
    steps = ["trainer.max_steps=3", "trainer.validate_every=0"]
    train(tmp_path / "default", *steps, base=TINY_NSA)
    train(tmp_path / "deterministic", *steps, "trainer.deterministic=true", base=TINY_NSA)
    assert losses(tmp_path / "deterministic") == losses(tmp_path / "default")


# on CUDA, with a checkpoint and a validation every 5 steps
GPU_STEPS = ["trainer.device=cuda", "trainer.max_steps=30", "trainer.checkpoint_every=5", "trainer.validate_every=5"]
TINY_RUNS = {"transformer": TINY_LM, "nsa": TINY_NSA}


def figures(run) -> dict[tuple[int, str], float]:
    """(step, name) -> each loss metrics.jsonl holds (written as repr: every bit of the float)."""
    return {(row["step"], key): row[key] for row in read_metrics(run) for key in ("loss", "val_loss") if key in row}


@pytest.mark.gpu
@pytest.mark.parametrize("model", TINY_RUNS)
def test_a_deterministic_gpu_run_repeats_and_resumes_to_the_bit(tmp_path, model):
    steps, base = [*GPU_STEPS, "trainer.deterministic=true"], TINY_RUNS[model]
    train(tmp_path / "first", *steps, base=base)
    train(tmp_path / "again", *steps, base=base)
    kill_after_first_checkpoint(tmp_path / "killed", *steps, base=base)
    killed_at = len(losses(tmp_path / "killed"))
    train(tmp_path / "killed", *steps, base=base)  # the same command: resumes from its checkpoint
    assert killed_at < 30, "the run finished before it could be killed"
    first = figures(tmp_path / "first")
    assert len(first) == 30 + 6  # a loss per step, a validation every 5
    assert figures(tmp_path / "again") == first
    assert figures(tmp_path / "killed") == first


@pytest.mark.gpu
@pytest.mark.parametrize("model", TINY_RUNS)
def test_without_deterministic_two_gpu_runs_differ_by_little(tmp_path, model):
    """How far CUDA's atomics (in the backward of embeddings and scatters) move two runs of one
    command in 30 steps: printed for the README (pytest -rP), and bounded loosely."""
    train(tmp_path / "first", *GPU_STEPS, base=TINY_RUNS[model])
    train(tmp_path / "again", *GPU_STEPS, base=TINY_RUNS[model])
    first, again = figures(tmp_path / "first"), figures(tmp_path / "again")
    assert first.keys() == again.keys() and len(first) == 30 + 6
    drift = max(abs(again[key] - value) / value for key, value in first.items())
    print(f"trainer.deterministic=false, two CUDA runs of the tiny {model} LM: losses differ by up to "
          f"{drift:.2e} relative over 30 steps")
    assert drift < 1e-3
