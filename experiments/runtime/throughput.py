"""Figures for MFU: the device's measured matmul peak, and the FLOPs of one training step."""

import contextlib
import json
import os
import platform
import time

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from experiments.runtime import allocator
from kernels import flops as kernel_flops
from kernels.native import cache_root


def matmul_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a square matmul on this device and dtype: the peak that MFU is measured against.

    The best rate ever measured on this machine (processor, CPU threads, dtype) is kept in the
    cache and used where this reading is lower: a reading taken while another process held a core
    once read half the rate and put a run's MFU above 1, and runs on one machine share one peak."""
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    key = f"{device_name(device)} | {device.type} | threads {threads} | {dtype}"
    path = cache_root() / "matmul_peak.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    measured = measure_matmul_flops(device, dtype)
    if measured > known.get(key, 0.0):
        known[key] = measured
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:  # atomic: the runs of a sweep read and write it side by side
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(json.dumps(known, indent=1))
            os.replace(temporary, path)
        except OSError:  # a cache we cannot write: this reading serves this run alone
            with contextlib.suppress(OSError):
                temporary.unlink()
    return known[key]


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 0, seconds: float = 0.3) -> float:
    """One reading: the fastest of the square matmuls run in `seconds` (size 0: 1024 on a CPU, 8192
    on a GPU, whose rate a small product does not reach)."""
    size = size or (8192 if device.type == "cuda" else 1024)
    gen = torch.Generator(device=device).manual_seed(0)  # the run's random state is the run's alone
    a, b = (torch.randn(size, size, device=device, dtype=dtype, generator=gen) for _ in range(2))
    best = float("inf")
    deadline = time.perf_counter() + seconds
    for _ in range(3):  # warm-up
        a @ b
    while time.perf_counter() < deadline or best == float("inf"):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def training_flops_per_token(model: nn.Module, seq_len: int, device: torch.device) -> float:
    """Counted FLOPs of forward + backward on one sequence, per token (what the model computes,
    sparse attention's savings included)."""
    # its own generator and eval mode (no dropout): counting leaves the run's random state alone
    tokens = torch.randint(0, model.num_tokens, (1, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    was_reversible = getattr(model, "reversible", False)
    # a reversible model's recomputation is not useful work (as with activation checkpointing),
    # and the counter's module hooks cannot follow a backward that calls autograd itself
    model.reversible = False
    try:
        return counted_flops(model, lambda: model(tokens).float().logsumexp(-1).mean()) / seq_len
    finally:
        model.reversible = was_reversible


def counted_flops(model: nn.Module, loss_fn) -> float:
    """FLOPs of loss_fn() and its backward, in eval mode (no dropout); gradients are dropped after.
    PyTorch's counter, taught the CPU's fused attention, plus what our own kernels report."""
    was_training = model.training
    model.eval()
    counter = FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION_FLOPS)
    try:
        with counter, kernel_flops.counting() as kernels:
            loss_fn().backward()
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return counter.get_total_flops() + kernels.total


def _causal_share(s_q: int, s_k: int, is_causal: bool) -> float:
    """The share of (query, key) pairs causal attention computes: query i sees keys 0..i (PyTorch's
    is_causal); fused attention skips the rest, and so does this count."""
    if not is_causal:
        return 1.0
    both = min(s_q, s_k)  # sum over i of min(i + 1, s_k)
    return (both * (both + 1) / 2 + max(s_q - s_k, 0) * s_k) / (s_q * s_k)


def _cpu_attention(query, key, value, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs) -> float:
    causal = is_causal and kwargs.get("attn_mask") is None
    return sdpa_flop_count(query, key, value) * _causal_share(query[2], key[2], causal)


def _cpu_attention_backward(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, *args,
                            out_shape=None, **kwargs) -> float:
    causal = is_causal and kwargs.get("attn_mask") is None
    return sdpa_backward_flop_count(grad_out, query, key, value) * _causal_share(query[2], key[2], causal)


# PyTorch's counter knows fused attention on CUDA only: on the CPU, dense attention counted nothing
_CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}


def device_name(device: torch.device) -> str:
    """The processor a figure was measured on: the GPU's name, or the CPU model as lscpu prints it."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as info:
            names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else (platform.processor() or platform.machine())


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), set())
    except OSError:
        return set()


def bf16_matrix_units() -> bool:
    """Whether the CPU multiplies bf16 matrices in dedicated units (Intel AMX), where bf16 products
    run several times faster than fp32's; bf16 instructions alone (avx512_bf16) give far less."""
    return "amx_bf16" in cpu_flags()


def peak_memory_mb(device: torch.device) -> float:
    """The most memory this process has held since it started or since reset_peak_memory: the
    GPU's allocations on CUDA, the resident set elsewhere."""
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


def reset_peak_memory(device: torch.device) -> None:
    """Start peak_memory_mb afresh from what is held now (Linux and CUDA; a no-op elsewhere). On the
    CPU the C allocator first returns the free memory it keeps (a caching heap's, say): what an
    earlier job of the same process freed is not this job's."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    allocator.release_free_memory()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the resident set's high-water mark
    except OSError:
        pass


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
