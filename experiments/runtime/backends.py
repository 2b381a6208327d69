"""Backends: where the models run and how a step is taken.

- `local`: one process, the CPU or one GPU, autocast from trainer.precision.
- `ddp`: torch DistributedDataParallel over every rank (gloo on the CPU, NCCL on GPUs).
- `deepspeed`: a DeepSpeed engine per model (ZeRO 0-3, fp16/bf16, offload), its config built from
  the trainer section (batch size, gradient accumulation, clipping, precision) and this group.

The task asks a backend to `prepare` each model with its optimizer and gets back a `Trainee`:
the model itself (evaluation, generation, auxiliary losses), what the training forward calls (the
model, its DDP wrapper or its DeepSpeed engine) and the optimizer the schedule drives. Losses go
through `backward(loss, trainee)`, and `step(trainees, clip)` ends an optimizer step.
Checkpoints: `checkpoint_state` gives the model and optimizer entries of a checkpoint (called on
every rank: DeepSpeed writes its engine state collectively), `load_checkpoint_state` restores them.
"""

import contextlib
import json
import logging
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from experiments.runtime import allocator, launch
from experiments.runtime.throughput import peak_memory_mb, reset_peak_memory
from experiments.runtime.errors import UserError
from models.transformer import parameters_trained_alone, trains_part_alone

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device_type: str):
    """The forward's context for trainer.precision: fp32 as it is, bf16 and fp16 under autocast."""
    return contextlib.nullcontext() if precision == "fp32" else torch.autocast(device_type, dtype=DTYPES[precision])


@dataclass
class Trainee:
    prefix: str  # of the model's checkpoint entries: "" for the model, "draft_" for the draft
    module: nn.Module  # the model: evaluation, generation, state, auxiliary losses
    forward: nn.Module  # what the training forward calls: the model, its DDP wrapper or DeepSpeed engine
    optimizer: torch.optim.Optimizer  # the torch optimizer (schedules set its learning rate)


class LocalBackend:
    rank = 0
    world_size = 1
    distributed = False  # trains in one process

    def setup(self, trainer) -> None:
        """Pick the device, seed every generator, set CPU threads and what the C allocator does with
        freed memory. Runs before the model is built."""
        if not self.distributed and (processes := launch.world_size()) > 1:
            raise UserError(f"backend=local trains in one process, and this launch started {processes} (torchrun, "
                            "srun --ntasks, tasks_per_node): each would train the same run alone; use backend=ddp "
                            "or backend=deepspeed, or launch one process")
        self.device = self._device(trainer.device.value)
        self.precision = trainer.precision.value
        if self.precision == "fp16" and self.device.type != "cuda":
            raise UserError("trainer.precision=fp16 needs a CUDA device: use bf16 or fp32 on the CPU")
        if threads := trainer.threads or default_threads():
            torch.set_num_threads(threads)
        if not allocator.use(trainer.cpu_allocator.value):
            log.info(f"trainer.cpu_allocator={trainer.cpu_allocator.value}: {allocator.FALLBACK[trainer.cpu_allocator.value]}")
        if trainer.deterministic:  # cuBLAS reads it when it first starts: before the model is built
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(trainer.deterministic)  # set either way: sweep jobs share a process
        torch.backends.cudnn.benchmark = False
        random.seed(trainer.seed)
        torch.manual_seed(trainer.seed)
        self.compile = compile_mode(trainer.compile)
        if self.compile == "reduce-overhead" and self.device.type != "cuda":
            # refused rather than run without graphs: the run's figures would not be what it says it measured
            raise UserError("trainer.compile=reduce-overhead replays CUDA graphs and needs a CUDA device: use "
                            "trainer.compile=default on the CPU")
        if self.compile and self.device.type == "cpu" and not (shutil.which(os.environ.get("CXX", "c++"))
                                                               or shutil.which("g++")):
            raise UserError(f"trainer.compile={self.compile} on the CPU needs a C++ compiler (c++, g++ or $CXX) for "
                            "torch.compile's kernels: install one, or set trainer.compile=false")
        reset_peak_memory(self.device)  # sweep jobs share a process: each measures its own peak
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.precision == "fp16")

    def _device(self, requested: str) -> torch.device:
        if requested == "cuda" and not torch.cuda.is_available():
            raise UserError("trainer.device=cuda but no CUDA device is visible: use trainer.device=auto or cpu")
        if requested == "auto":
            requested = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(requested)
        slot = parallel_job_slot()
        if device.type == "cuda" and slot is not None:  # one GPU per parallel sweep job
            device = torch.device("cuda", slot % torch.cuda.device_count())
            torch.cuda.set_device(device)
            log.info("parallel sweep job: running on %s", device)
        return device

    def prepare(self, prefix: str, model: nn.Module, make_optimizer: Callable) -> Trainee:
        model = model.to(self.device)
        return Trainee(prefix, model, self._compiled(model), make_optimizer(model.parameters()))

    def _compiled(self, forward: nn.Module) -> nn.Module:
        """The training forward, compiled in trainer.compile's mode (lazily: the first call compiles)."""
        return torch.compile(forward, mode=self.compile) if self.compile else forward

    def autocast(self):
        return autocast(self.precision, self.device.type)

    def accumulating(self, trainee: Trainee, last: bool):
        """Context for one micro-batch's forward and backward; `last`: the step's final one."""
        return contextlib.nullcontext()

    def backward(self, loss: Tensor, trainee: Trainee) -> None:
        self.scaler.scale(loss).backward()

    def step(self, trainees: list[Trainee], clip_grad_norm: Optional[float]) -> None:
        """For each model: unscale, clip (if asked), step, zero the gradients. The loss scale is
        updated once for the whole step."""
        for t in trainees:
            self.scaler.unscale_(t.optimizer)
            if clip_grad_norm:
                torch.nn.utils.clip_grad_norm_([p for p in t.module.parameters() if p.grad is not None], clip_grad_norm)
            self.scaler.step(t.optimizer)
            t.optimizer.zero_grad(set_to_none=True)
        self.scaler.update()

    def all_reduce_mean(self, value: float) -> float:
        return value

    def checkpoint_state(self, trainees: list[Trainee], directory: Path, name: str) -> dict:
        state = {"scaler": self.scaler.state_dict()}
        for t in trainees:
            state[f"{t.prefix}model"] = t.module.state_dict()
            state[f"{t.prefix}optimizer"] = t.optimizer.state_dict()
        return state

    def load_checkpoint_state(self, trainees: list[Trainee], state: dict, path: Path) -> None:
        """Optimizer and loss-scale state (the weights are loaded before `prepare`)."""
        if "scaler" not in state:
            raise UserError(f"{path} holds DeepSpeed engine state, not this backend's: continue it with "
                            "backend=deepspeed, or start a new run from its weights (trainer.resume=<file> "
                            "in a new hydra.run.dir)")
        for t in trainees:
            t.optimizer.load_state_dict(state[f"{t.prefix}optimizer"])
        self.scaler.load_state_dict(state["scaler"])

    def peak_memory_mb(self) -> float:
        return peak_memory_mb(self.device)


class DDPBackend(LocalBackend):
    """DistributedDataParallel over every rank: gradients are averaged in the backward pass.
    Rank 0 writes the checkpoints, every rank loads them."""

    distributed = True

    def __init__(self, timeout_s: float = 600.0, find_unused_parameters: bool = False):
        self.timeout_s = timeout_s
        self.find_unused_parameters = find_unused_parameters
        self.rank, self.world_size = launch.rank(), launch.world_size()

    def setup(self, trainer) -> None:
        super().setup(trainer)
        launch.init_process_group("nccl" if self.device.type == "cuda" else "gloo", self.timeout_s)

    def _device(self, requested: str) -> torch.device:
        device = super()._device(requested)
        if device.type == "cuda":  # one GPU per rank on each node
            device = torch.device("cuda", launch.local_rank())
            torch.cuda.set_device(device)
        return device

    def prepare(self, prefix: str, model: nn.Module, make_optimizer: Callable) -> Trainee:
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(self.device)
        wrapped = DistributedDataParallel(model, device_ids=[self.device] if self.device.type == "cuda" else None,
                                          find_unused_parameters=self.find_unused_parameters)
        return Trainee(prefix, model, self._compiled(wrapped), make_optimizer(model.parameters()))

    def accumulating(self, trainee: Trainee, last: bool):
        """Gradients are averaged over the ranks once per optimizer step, in the last micro-batch's
        backward, not after every micro-batch. A step that trains a part of the model alone (DSA's
        indexer warm-up: the rest runs without gradient) runs outside DDP's averaging, which expects
        every parameter's gradient (and, finding unused ones from the output, would miss the part:
        its loss is not in the output); `step` averages the gradients that part has."""
        return contextlib.nullcontext() if last and not trains_part_alone(trainee.module) else trainee.forward.no_sync()

    def step(self, trainees: list[Trainee], clip_grad_norm: Optional[float]) -> None:
        for t in trainees:
            if trains_part_alone(t.module):
                self._average_gradients(t.module)
        super().step(trainees, clip_grad_norm)

    def _average_gradients(self, module: nn.Module) -> None:
        """The mean over the ranks of every gradient the step produced, in one all-reduce (every rank
        trains the same part, so the same parameters have gradients on each)."""
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world_size
        for g, mean in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(mean.view_as(g))

    def all_reduce_mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item() / self.world_size


class DeepSpeedBackend(DDPBackend):
    """A DeepSpeed engine per model. The DeepSpeed config is built from the trainer section and
    this group's keys (`config_file` may add to it; the trainer's keys win, so there is one place to
    set batch size, accumulation, clipping and precision)."""

    def __init__(self, zero_stage: int = 0, offload_optimizer: str = "none", offload_param: str = "none",
                 initial_loss_scale_power: int = 16, config_file: Optional[str] = None, timeout_s: float = 600.0):
        super().__init__(timeout_s=timeout_s)
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
        if offload_param != "none" and zero_stage != 3:
            raise ValueError(f"offload_param={offload_param} needs zero_stage=3 (got {zero_stage})")
        if offload_optimizer != "none" and zero_stage == 0:
            raise ValueError("offload_optimizer needs zero_stage >= 1")
        if config_file is not None and not Path(config_file).is_file():
            raise ValueError(f"config_file={config_file}: no such file")
        self.zero_stage, self.offload_optimizer, self.offload_param = zero_stage, offload_optimizer, offload_param
        self.initial_loss_scale_power, self.config_file = initial_loss_scale_power, config_file

    def setup(self, trainer) -> None:
        if compile_mode(trainer.compile):
            raise UserError(f"trainer.compile={compile_mode(trainer.compile)} is for backend=local or ddp: a DeepSpeed engine "
                            "compiles its own way; set trainer.compile=false")
        for key, value in (("RANK", self.rank), ("LOCAL_RANK", launch.local_rank()), ("WORLD_SIZE", self.world_size)):
            os.environ.setdefault(key, str(value))  # DeepSpeed reads them even in one plain process
        super().setup(trainer)
        self.config = self.deepspeed_config(trainer)

    def deepspeed_config(self, trainer) -> dict:
        config = _json_file(self.config_file, "backend.config_file") if self.config_file else {}
        zero = {"stage": self.zero_stage}
        if self.offload_optimizer != "none":
            zero["offload_optimizer"] = {"device": self.offload_optimizer}
        if self.offload_param != "none":
            zero["offload_param"] = {"device": self.offload_param}
        config.update(
            train_micro_batch_size_per_gpu=trainer.batch_size,
            gradient_accumulation_steps=trainer.grad_accum,
            train_batch_size=trainer.batch_size * trainer.grad_accum * self.world_size,
            gradient_clipping=trainer.clip_grad_norm or 0.0,
            zero_optimization={**config.get("zero_optimization", {}), **zero},
            fp16={"enabled": self.precision == "fp16", "loss_scale": 0,  # 0: dynamic loss scaling
                  "initial_scale_power": self.initial_loss_scale_power},
            bf16={"enabled": self.precision == "bf16"},
            steps_per_print=10**12,  # the task logs
            wall_clock_breakdown=False,
        )
        return config

    def prepare(self, prefix: str, model: nn.Module, make_optimizer: Callable) -> Trainee:
        import deepspeed

        if self.device.type == "cpu":
            skip_shared_memory_all_reduce(deepspeed)
        model = model.to(self.device)
        params = list(model.parameters())
        if alone := {id(p) for p in parameters_trained_alone(model)}:  # the rest: a group held still meanwhile
            params = [{"params": [p for p in params if id(p) in alone]},
                      {"params": [p for p in params if id(p) not in alone], _HELD: True}]
        optimizer = make_optimizer(params)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.config,
                                               dist_init_required=False)
        return Trainee(prefix, engine.module, engine, optimizer)

    def autocast(self):
        return contextlib.nullcontext()  # the engine holds the model in the training precision

    def accumulating(self, trainee: Trainee, last: bool):
        return contextlib.nullcontext()  # the engine knows its accumulation boundary

    def backward(self, loss: Tensor, trainee: Trainee) -> None:
        """The task has divided the loss by the accumulation steps already; the engine's step
        after every micro-batch counts them and steps the optimizer at the boundary."""
        trainee.forward.backward(loss, scale_wrt_gas=False)
        with _held_still(trainee.optimizer) if trains_part_alone(trainee.module) else contextlib.nullcontext():
            trainee.forward.step()

    def step(self, trainees: list[Trainee], clip_grad_norm: Optional[float]) -> None:
        pass  # the engines stepped, clipped and zeroed at the accumulation boundary

    def checkpoint_state(self, trainees: list[Trainee], directory: Path, name: str) -> dict:
        """Every rank writes its engine state to <name>.partial/, which rank 0 renames to <name>/
        once all have finished (a rename is atomic: a crash leaves the previous checkpoint whole).
        Returns consolidated fp32 weights, which backend=local and generation load."""
        partial = directory / f"{name}.partial"
        state = {}
        for t in trainees:
            tag = t.prefix or "model"
            t.forward.save_checkpoint(str(partial), tag=tag, save_latest=False)
            state[f"{t.prefix}model"] = self._fp32_weights(t, partial, tag)
        dist.barrier()
        if self.rank == 0:
            final = directory / name
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial, final)
            for stale in directory.glob("*.partial"):  # left by a run killed while writing
                shutil.rmtree(stale, ignore_errors=True)
        return state

    def _fp32_weights(self, trainee: Trainee, directory: Path, tag: str) -> dict:
        if self.zero_stage < 3:  # every rank holds whole parameters
            return {k: v.detach().float().cpu() if v.is_floating_point() else v.cpu()
                    for k, v in trainee.module.state_dict().items()}
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        dist.barrier()  # every partition on disk
        return get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=tag) if self.rank == 0 else {}

    def load_checkpoint_state(self, trainees: list[Trainee], state: dict, path: Path) -> None:
        engine_dir = path.with_suffix("")
        if not engine_dir.is_dir():
            raise UserError(f"{path} has no DeepSpeed engine state beside it ({engine_dir}): it was not written "
                            "by backend=deepspeed. Resume it with the backend that wrote it")
        for t in trainees:
            t.forward.load_checkpoint(str(engine_dir), tag=t.prefix or "model", load_lr_scheduler_states=False)


_HELD = "held_while_a_part_trains_alone"  # marks the optimizer group of the parameters such a step freezes


@contextlib.contextmanager
def _held_still(optimizer: torch.optim.Optimizer):
    """A DeepSpeed step that trains a part of the model alone (DSA's indexer warm-up) leaves the rest
    unchanged to the bit. DeepSpeed gives every parameter without a gradient a zero one and steps it,
    so the rest's group takes the step at learning rate 0 (weight decay moves nothing), and the state
    the step gave it is dropped (its moments and step count start with its first real step, as on
    the local backend, whose optimizer skips parameters without a gradient). Under ZeRO the group's
    parameter is its flat partition, and the state is keyed by that."""
    groups = [g for g in optimizer.param_groups if g.get(_HELD)]
    rates = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = 0.0
    try:
        yield
    finally:
        for g, lr in zip(groups, rates):
            g["lr"] = lr
            for p in g["params"]:
                optimizer.state.pop(p, None)


def compile_mode(value) -> Optional[str]:
    """trainer.compile as torch.compile's mode: None (false), "default" (true or default) or
    "reduce-overhead"."""
    if value is True:
        return "default"
    return None if value is False else value


def default_threads() -> Optional[int]:
    """CPU threads where trainer.threads is null: SLURM's CPUs per task inside a SLURM job that set
    them, an equal share of this process's CPUs for each of a parallel sweep's jobs (local_gpus:
    n_jobs jobs at once on a CPU machine, each with its own threads, none oversubscribed); None
    elsewhere (torch's default)."""
    if (cpus := os.environ.get("SLURM_CPUS_PER_TASK", "")).isdigit() and int(cpus) > 0:
        return int(cpus)
    if (jobs := parallel_jobs()) > 1:
        return max(1, len(os.sched_getaffinity(0)) // jobs)
    return None


def parallel_jobs() -> int:
    """How many jobs a parallel launcher (joblib) runs at once for this sweep job; 1 otherwise."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
    except (ImportError, ValueError):
        return 1
    launcher = hc.launcher.get("_target_", "") if hc.launcher else ""
    return max(1, int(hc.launcher.get("n_jobs", 1) or 1)) if "joblib" in launcher.lower() else 1


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


def _json_file(path: str, key: str) -> dict:
    """A JSON object from `path`, or one line naming the key, the file and what is wrong."""
    try:
        config = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{key}={path} is not valid JSON ({e}): fix the file, or leave {key} unset") from None
    if not isinstance(config, dict):
        raise UserError(f"{key}={path} holds a JSON {type(config).__name__}, not an object of DeepSpeed settings")
    return config


def skip_shared_memory_all_reduce(deepspeed) -> None:
    """DeepSpeed's CPU backend compiles a shared-memory all-reduce (the deepspeed_shm_comm op: C++
    built on the run's first use, ~1.5 min on 2 cores) that only its inference all-reduce calls;
    training's collectives go through gloo. Marked incompatible here, it is not built. A DeepSpeed
    without this registry builds it as before."""
    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False
