"""Timing and measuring, shared by every benchmark in experiments/bench/: medians of timed calls,
peaks of memory, the device's ceilings, and rounds of measurements each in a fresh process."""

import json
import subprocess
import sys
import time
from typing import Callable, Optional

import torch

from experiments.runtime.throughput import measure_matmul_flops, sync


def median_seconds(step: Callable, steps: int, device: Optional[torch.device] = None, warmups: int = 1) -> float:
    """The median time of `steps` calls of step() after `warmups` calls (first-call allocations); the
    median resists a noisy neighbour. With a CUDA device, timed by CUDA events (the device's work);
    otherwise a host clock around each call (a CUDA step must then wait for its device itself: synced)."""
    for _ in range(warmups):
        step()
    times = []
    for _ in range(steps):
        if device is not None and device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def synced(step: Callable, device) -> Callable:
    """step, waiting for the device to finish it: a host clock around it then times the work."""

    def run():
        step()
        sync(torch.device(device))

    return run


def added_peak_mb(fn: Callable, device: torch.device) -> Optional[float]:
    """Device memory fn() adds at its peak over what was allocated before it (CUDA only; None elsewhere)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def ceilings(device: torch.device, dtype: torch.dtype, repeats: int = 10) -> tuple[float, float]:
    """(matrix-product FLOP/s, memory bytes/s) measured here: the fastest square product (as MFU's
    peak is read) and the median of a large copy."""
    rate = measure_matmul_flops(device, dtype)
    src = torch.empty(2**28 if device.type == "cuda" else 2**25, device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() / median_seconds(lambda: dst.copy_(src), repeats, device, warmups=2)  # read + written
    return rate, bandwidth


def settled_peak_mb(step, read_peak, step_s: float, held: int = 3, most: int = 12,
                    budget_s: float = 60.0) -> tuple[float, int, bool]:
    """More calls of step() until read_peak() holds (rises by under 0.5%) for `held` calls in a row:
    a training step's resident high-water mark goes on growing for several steps after the first
    (freed blocks of the C heap stop fitting later requests: at 8k tokens NSA's grew for 5 steps),
    so a peak read after two or three steps is not yet what a run holds. At most `most` calls, and
    none that would end past `budget_s` at `step_s` a call (a 32k step on a CPU takes a minute).
    -> (the peak, the calls made, whether it held)."""
    peak, calls, unchanged, started = read_peak(), 0, 0, time.perf_counter()
    while unchanged < held and calls < most and time.perf_counter() - started + step_s <= budget_s:
        step()
        calls += 1
        now = read_peak()
        unchanged = unchanged + 1 if now < peak * 1.005 else 0
        peak = max(peak, now)
    return peak, calls, unchanged >= held


def cuda_launches(call: Callable) -> tuple[int, int]:
    """(the host's launch calls, the kernels the GPU ran) in one call of call(), by torch.profiler;
    a replayed CUDA graph is one launch call for all its kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    events = prof.events()
    launches = sum(1 for e in events if "LaunchKernel" in e.name or "GraphLaunch" in e.name)
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return launches, kernels


# ---- rounds: each measurement in a fresh process, rounds interleaved, the median kept


def measure_in_child(module: str, args: list[str]) -> tuple[dict, list[str]]:
    """`python -m module --one *args` in a fresh process (no allocator or cache state carried over)
    -> (the JSON row it prints last, the lines it printed before). Raises RuntimeError with its last
    line of stderr when it fails (a setting's refusal as its message alone)."""
    out = subprocess.run([sys.executable, "-m", module, "--one", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError((out.stderr.strip().splitlines() or ["?"])[-1].removeprefix(
            "experiments.runtime.errors.UserError: "))
    *before, last = out.stdout.strip().splitlines()
    return json.loads(last), before


def median_row(rows: list[dict], key: str) -> dict:
    """The median round of interleaved rounds by `key`."""
    return sorted(rows, key=lambda row: row[key])[len(rows) // 2]
