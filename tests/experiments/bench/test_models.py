"""The training-step benchmark measures what it names, in the precision it is asked for."""

import argparse

import pytest
import torch

from experiments.bench import models as benchmark
from experiments.runtime import throughput
from types import SimpleNamespace

TINY = ["model.dim=32", "model.depth=1", "model.heads=2", "model.dim_head=16"]


@pytest.fixture(autouse=True)
def no_peak_measurement(monkeypatch):
    monkeypatch.setattr(throughput, "matmul_peak_flops", lambda device, dtype=None: 1e12)  # MFU is not under test


@pytest.mark.parametrize("model", ["transformer", "nsa"])
def test_kept_activations_are_counted_in_the_steps_precision(model):
    fp32, bf16 = (benchmark.measure(model, seq=64, batch=2, steps=1, threads=1, extra=TINY, precision=precision)
                  for precision in ("fp32", "bf16"))
    assert fp32["mode"] == bf16["mode"] == "train" and fp32["params"] == bf16["params"]
    assert 0 < bf16["activation_mb"] < fp32["activation_mb"]


def test_tensor_peak_holds_the_optimizer_state_and_all_the_forward_keeps():
    """At the start of the backward both Adam moments and every tensor kept for it are live, so the
    peak of live tensors is at least that: weights * 2 + what the forward keeps (weights it saves
    included there). Resident memory, libraries and all, lies above it."""
    row = benchmark.measure("transformer", seq=512, batch=4, steps=1, threads=1, extra=TINY, tensor_peak=True)
    weights_mb = row["params"] * 4 / 2**20
    assert row["activation_mb"] > weights_mb  # the peak is not the weights and moments alone
    assert 2 * weights_mb + row["activation_mb"] <= row["tensor_peak_mb"] < row["peak_mem_mb"]
    assert benchmark.measure("transformer", seq=64, batch=2, steps=1, threads=1, extra=TINY)["tensor_peak_mb"] is None


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["transformer", "nsa"])
def test_a_gpu_measurement_runs_on_the_device_and_reads_its_memory(model):
    row = benchmark.measure(model, seq=256, batch=2, steps=1, threads=1, extra=TINY, precision="bf16", device="cuda")
    assert row["device"] == "cuda" and row["step_s"] > 0
    assert 0 < row["peak_mem_mb"] < 4096  # the device's tensors, not the process's resident memory


def test_dsa_is_measured_in_its_sparse_stage():
    """A fresh DSA attends densely for its warm-up; the benchmark measures the sparse stage."""
    _, model, forward = benchmark.build("dsa", 64, 1, TINY)
    assert not any(block.attn.warming_up for block in model.blocks)
    logits, aux = forward(torch.randint(0, 256, (1, 64)))
    assert logits.shape == (1, 64, 256) and aux > 0  # the indexer's KL over its chosen tokens


def test_a_counted_step_launches_its_optimizer_in_a_few_ops_whatever_the_depth():
    """AdamW counts as on CUDA, where torch picks its foreach path: the optimizer's launches do not
    grow with the parameters, the forward's and backward's do."""
    shallow, deep = (benchmark.count_step("transformer", seq=32, batch=1, threads=1,
                                          extra=[*TINY[:1], f"model.depth={depth}", *TINY[2:]])
                     for depth in (1, 2))
    assert 0 < shallow["optimizer"].launches == deep["optimizer"].launches < 20
    assert 0 < shallow["forward"].launches < deep["forward"].launches
    assert shallow["forward"].launches < shallow["backward"].launches < deep["backward"].launches
    assert not any(part.triton for part in shallow.values())


@pytest.mark.triton
def test_the_step_count_prints_each_part_and_nsas_triton_launches(capsys):
    args = argparse.Namespace(precision="fp32", batch=1, threads=1, override=TINY)
    benchmark.print_step_counts(["transformer", "nsa"], [32], args, "cuda" if torch.cuda.is_available() else "cpu")
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[3:5]}
    for name, (seq, forward, backward, optimizer, total, triton, syncs) in rows.items():
        assert seq == "32" and int(forward) + int(backward) + int(optimizer) == int(total)
        assert (int(triton) > 0) == (name == "nsa")


def test_model_table_x_dense_is_tokens_per_s_over_the_transformers(capsys):
    from experiments.bench.models import print_table

    rows = [dict(model=m, seq=64, batch=1, tokens_per_s=t, step_s=0.1, prompt_s=0.1, peak_mem_mb=100.0,
                 cpu_allocator="system") for m, t in (("transformer", 100.0), ("nsa", 250.0))]
    args = SimpleNamespace(decode=True, precision="fp32", threads=1, steps=3, repeat=1, tensor_peak=False)
    print_table(rows, args)
    nsa = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("nsa")).split()
    assert nsa[5] == "2.50"


def test_a_failed_measurement_fails_the_command_after_the_others(monkeypatch, capsys):
    from experiments.bench import measure

    def measure_in_child(module, args):
        raise RuntimeError(f"No module named 'x' ({args[1]})")

    monkeypatch.setattr(measure, "measure_in_child", measure_in_child)
    assert benchmark.main(["--models", "transformer", "nsa", "--seq", "64", "--repeat", "1"]) == 1
    out = capsys.readouterr().out
    assert "transformer        64 failed: No module named 'x' (transformer)" in out and "(nsa)" in out
    assert "tokens/s" not in out  # no empty table
