"""Counted training FLOPs: attention included on the CPU, causal attention counted as the half it is."""

import torch
import torch.nn.functional as F

from experiments.runtime import throughput
from experiments.runtime.throughput import counted_flops


def _count(fn, *leaves):
    model = torch.nn.Module()  # counted_flops switches a module to eval mode and back
    return counted_flops(model, lambda: fn(*leaves).sum())


def test_fused_attention_on_the_cpu_is_counted_with_its_causal_half():
    b, h, n, d = 1, 2, 64, 16
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    full = _count(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v)
    causal = _count(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v)
    # q.k and p.v forward; q.k again, dp, dv, dq, dk backward: 7 products of d multiply-adds a pair
    assert full == 14 * b * h * n * n * d
    assert causal == 14 * b * h * (n * (n + 1) // 2) * d  # query i sees keys 0..i


def test_a_longer_sequence_counts_more_attention_per_token():
    x = torch.randn(1, 2, 128, 16, requires_grad=True)
    attend = lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True)  # noqa: E731
    short, long = _count(attend, x[:, :, :64].detach().requires_grad_()), _count(attend, x)
    assert long / 128 > short / 64


def test_the_matmul_peak_is_the_best_reading_this_machine_has_had(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    readings = iter([100e9, 50e9, 150e9])  # a reading disturbed by another process, then a better one
    monkeypatch.setattr(throughput, "measure_matmul_flops", lambda device, dtype: next(readings))
    cpu = torch.device("cpu")
    assert [throughput.matmul_peak_flops(cpu) for _ in range(3)] == [100e9, 100e9, 150e9]
    assert not list(tmp_path.rglob("*.tmp"))  # nothing half-written left behind


def test_an_unwritable_cache_still_gives_this_reading(tmp_path, monkeypatch):
    (tmp_path / "sparse-attention-experiments").write_text("a file where the folder should be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(throughput, "measure_matmul_flops", lambda device, dtype: 42e9)
    assert throughput.matmul_peak_flops(torch.device("cpu")) == 42e9


def test_a_matmul_peak_reading_leaves_the_global_random_state_alone():
    state = torch.random.get_rng_state()
    assert throughput.measure_matmul_flops(torch.device("cpu"), torch.float32, size=64, seconds=0.01) > 0
    assert torch.equal(torch.random.get_rng_state(), state)
