"""Backends: where the model runs and how a step is taken. `local` is one process, the CPU or
one GPU, with autocast from trainer.precision."""

import contextlib
import logging
import random

import torch
from torch import Tensor, nn

from experiments.errors import UserError

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class LocalBackend:
    rank = 0
    world_size = 1
    is_main = True

    def setup(self, trainer) -> None:
        """Pick the device, seed every generator, set CPU threads. Runs before the model is built."""
        requested = trainer.device.value
        if requested == "cuda" and not torch.cuda.is_available():
            raise UserError("trainer.device=cuda but no CUDA device is visible: use trainer.device=auto or cpu")
        if requested == "auto":
            requested = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(requested)
        slot = parallel_job_slot()
        if self.device.type == "cuda" and slot is not None:  # one GPU per parallel sweep job
            self.device = torch.device("cuda", slot % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
            log.info("parallel sweep job: running on %s", self.device)
        self.precision = trainer.precision.value
        if self.precision == "fp16" and self.device.type != "cuda":
            raise UserError("trainer.precision=fp16 needs a CUDA device: use bf16 or fp32 on the CPU")
        if trainer.threads:
            torch.set_num_threads(trainer.threads)
        random.seed(trainer.seed)
        torch.manual_seed(trainer.seed)
        reset_peak_memory(self.device)  # sweep jobs share a process: each measures its own peak
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.precision == "fp16")

    def prepare(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.precision])

    def backward(self, loss: Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, groups, clip_grad_norm) -> None:
        """For each (optimizer, parameters): unscale, clip (if asked), step, zero the gradients.
        The loss scale is updated once for the whole step."""
        for optimizer, parameters in groups:
            self.scaler.unscale_(optimizer)
            if clip_grad_norm:
                torch.nn.utils.clip_grad_norm_([p for p in parameters if p.grad is not None], clip_grad_norm)
            self.scaler.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
        self.scaler.update()

    def all_reduce_mean(self, value: float) -> float:
        return value

    def peak_memory_mb(self) -> float:
        return peak_memory_mb(self.device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: "5" resets the process's peak resident set size (VmHWM)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # elsewhere the peak is the process's since its start


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def parallel_job_slot():
    """The job number modulo the number of parallel jobs, when a parallel launcher (joblib) runs
    this sweep job; None otherwise."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
    except (ImportError, ValueError):
        return None
    launcher = hc.launcher.get("_target_", "") if hc.launcher else ""
    if "joblib" not in launcher.lower():
        return None
    n_jobs = int(hc.launcher.get("n_jobs", 1) or 1)
    return int(hc.job.num) % max(1, n_jobs)
