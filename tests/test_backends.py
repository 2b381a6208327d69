"""The local backend: device and precision checks, seeding, peak memory per run."""

import pytest
import torch
from omegaconf import OmegaConf

from experiments.backends import LocalBackend, parallel_job_slot, peak_memory_mb, reset_peak_memory
from experiments.errors import UserError
from experiments.schema import Device, Precision, TrainerConfig


def trainer(**kw):
    return OmegaConf.structured(TrainerConfig(**kw))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a CPU-only machine gives")
def test_cuda_without_a_gpu_says_what_to_use():
    with pytest.raises(UserError, match="trainer.device=cuda but no CUDA device"):
        LocalBackend().setup(trainer(device=Device.cuda))


def test_fp16_needs_cuda():
    with pytest.raises(UserError, match="trainer.precision=fp16 needs a CUDA device"):
        LocalBackend().setup(trainer(device=Device.cpu, precision=Precision.fp16))


def test_setup_seeds_every_generator():
    backend = LocalBackend()
    backend.setup(trainer(device=Device.cpu, seed=7))
    first = torch.rand(3)
    backend.setup(trainer(device=Device.cpu, seed=7))
    assert torch.equal(first, torch.rand(3))


def test_peak_memory_is_reset_per_run():
    cpu = torch.device("cpu")
    big = torch.ones(100_000_000)  # 400 MB
    del big
    before = peak_memory_mb(cpu)
    reset_peak_memory(cpu)
    assert peak_memory_mb(cpu) < before - 300


def test_no_parallel_slot_outside_a_parallel_launcher():
    assert parallel_job_slot() is None
