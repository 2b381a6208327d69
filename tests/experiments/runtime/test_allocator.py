"""The C allocator's treatment of freed memory: the tensors of a training step, allocated again the
next step, fault their pages in afresh under glibc's defaults and reuse the heap's when caching."""

import subprocess
import sys

import pytest

from experiments.runtime import allocator

# In a fresh process (the test process's allocator stays as it is): ten steps of a layer whose
# activations are 32-64 MB each; prints the page faults of the last five (the heap settles in the
# first few).
STEP_FAULTS = """
import resource, sys, torch
from experiments.runtime import allocator
assert all(allocator.use(mode) for mode in sys.argv[1:])
layer = torch.nn.Linear(512, 2048)
x = torch.randn(8192, 512)
for step in range(10):
    if step == 5:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.nn.functional.gelu(layer(x)).square().sum().backward()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

needs_glibc = pytest.mark.skipif(allocator._glibc() is None, reason="the allocator modes are glibc's knobs")


ACTIVATION_PAGES = 8192 * 2048 * 4 // 4096


def _late_step_faults(*modes: str) -> int:
    out = subprocess.run([sys.executable, "-c", STEP_FAULTS, *modes], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@needs_glibc
def test_caching_reuses_the_pages_of_the_steps_before():
    system = _late_step_faults("system")
    assert system > 5 * ACTIVATION_PAGES  # each large activation mapped afresh, every step
    assert _late_step_faults("caching") < system / 5  # the heap's pages, resident since the first steps


@needs_glibc
def test_system_after_caching_maps_large_blocks_afresh_again():
    assert _late_step_faults("caching", "system") > 5 * ACTIVATION_PAGES


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="expected one of system, caching"):
        allocator.use("jemalloc")


@needs_glibc
def test_the_free_memory_a_caching_heap_keeps_is_released_on_request():
    program = """
import sys, torch
from experiments.runtime import allocator
from experiments.runtime.throughput import peak_memory_mb, reset_peak_memory
allocator.use("caching")
torch.ones(100_000_000)  # 400 MB, freed at once and kept by the heap
before = peak_memory_mb(torch.device("cpu"))
reset_peak_memory(torch.device("cpu"))  # as each job of a sweep starts
print(before - peak_memory_mb(torch.device("cpu")))
"""
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert float(out.stdout.split()[-1]) > 300
