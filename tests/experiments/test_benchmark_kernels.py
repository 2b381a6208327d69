"""The layer and branch benchmark runs its own code on a CPU (tiny setting; the Triton kernels in
the interpreter): every row is measured, and the ratios are against the dense layer of the run;
--count counts what each layer launches."""

import os
import subprocess
import sys

import pytest
import torch

import kernels
from experiments import benchmark_kernels
from tests.helpers.runs import ROOT

TINY_CPU = ["--device", "cpu", "--setting", "tiny", "--lengths", "32", "--dtype", "fp32", "--repeats", "1"]


def tiny_cpu_run(capsys) -> list[str]:
    """The lines `--device cpu` prints with Triton's interpreter on: in this process where it is on
    (tests/conftest.py turns it on without CUDA), else in a child process that turns it on, since
    triton reads it when first imported."""
    if kernels.triton_interpreting():
        assert benchmark_kernels.main(TINY_CPU) == 0
        return capsys.readouterr().out.splitlines()
    child = subprocess.run([sys.executable, "-m", "experiments.benchmark_kernels", *TINY_CPU], cwd=ROOT,
                           capture_output=True, text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert child.returncode == 0, child.stderr[-3000:]
    return child.stdout.splitlines()


def rows_at_32_tokens(lines: list[str]) -> dict[str, list[str]]:
    return {line.split()[1]: line.split() for line in lines if line.split()[:1] == ["32"]}


@pytest.mark.triton
def test_tiny_setting_times_every_layer_and_branch_on_the_cpu(capsys):
    lines = tiny_cpu_run(capsys)
    assert "measured ceilings: matrix product" in lines[0]
    rows = rows_at_32_tokens(lines)
    assert set(rows) == {"dense", "nsa", "compressed", "selected", "window", "fused"}
    assert rows["dense"][5:7] == ["1.00x", "1.00x"]  # the baseline against itself
    for name in ("compressed", "selected", "window"):  # each branch's work and floor
        gflop, mib, floor = map(float, rows[name][2:5])
        assert gflop > 0 and mib > 0 and 0 < floor
    gflop, mib, floor, forward = map(float, rows["fused"][2:6])  # the three in the fused kernels, timed
    assert gflop == pytest.approx(sum(float(rows[name][2]) for name in ("compressed", "selected", "window")), rel=0.02)
    assert floor > 0 and forward > 0


def test_without_the_interpreter_the_cpu_run_times_the_layers_and_says_why_not_the_branches(capsys, monkeypatch):
    monkeypatch.setattr(kernels, "triton_interpreting", lambda: False)  # as on a CUDA machine, where it is off
    assert benchmark_kernels.main(TINY_CPU) == 0
    lines = capsys.readouterr().out.splitlines()
    assert set(rows_at_32_tokens(lines)) == {"dense", "nsa"}
    assert lines[-1] == ("branches: skipped: on the CPU the Triton kernels run only in Triton's interpreter "
                         "(TRITON_INTERPRET=1 in the environment)")


def test_branch_work_counts_the_pairs_each_branch_visits():
    setting = dict(benchmark_kernels.SETTINGS["tiny"], heads=1, kv_heads=1, dim_head=1)
    work = benchmark_kernels.branch_work(setting, 64, 4)
    # window 32: queries 0..31 see t + 1 keys, 32..63 see 32; 4 FLOPs a pair at one head of dim 1
    assert work["window"][0] == 4 * (sum(range(1, 33)) + 32 * 32)
    # one free block of 16 per query (4 selected, 3 forced)
    assert work["selected"][0] == 4 * 64 * 16
    # blocks of 8 every 4 complete at t = 7, 11, ...: query t sees (t - 7) // 4 + 1 of them
    assert work["compressed"][0] == 6 * sum((t - 7) // 4 + 1 for t in range(7, 64))


def count_blocks(out: str) -> dict[tuple[str, str], list[str]]:
    """--count's output -> {(layer, phase): its lines}."""
    blocks, lines = {}, None
    for line in out.splitlines():
        if line.endswith(":") and " tokens, " in line:
            _, layer, phase = line[:-1].split(", ")
            lines = blocks[(layer, phase)] = []
        elif lines is not None and line.startswith("  "):
            lines.append(line.strip())
    return blocks


@pytest.mark.triton
def test_count_prints_each_layers_launches_bytes_and_triton_kernels(capsys):
    assert benchmark_kernels.main(["--count", "--setting", "tiny", "--lengths", "16", "--dtype", "fp32"]) == 0
    blocks = count_blocks(capsys.readouterr().out)
    layers = ("dense (SDPA)", "nsa kernel=triton")
    assert set(blocks) == {(layer, phase) for layer in layers for phase in ("fwd+bwd", "no-grad fwd")}
    for (layer, phase), lines in blocks.items():
        launches, aten, triton = (int(word.strip("(,);")) for word in lines[0].split()[1:6:2])
        assert launches == aten + triton > 0
        assert lines[1].startswith("glue ") and "x q, k, v, out" in lines[1]
        assert lines[2].startswith("largest intermediate ") and "x q)" in lines[2]
        # one line per Triton launch, whether its launch site reports it or not
        assert triton == sum(line.startswith("triton ") for line in lines)
        assert (triton > 0) == (layer == "nsa kernel=triton")
    assert "_scaled_dot_product" in " ".join(blocks[("dense (SDPA)", "fwd+bwd")])


def test_the_dense_layers_forward_launches_its_three_projections_and_attention():
    setting = benchmark_kernels.SETTINGS["tiny"]
    counts = benchmark_kernels.count_layer(benchmark_kernels.DenseLayer(**setting), 32, torch.float32,
                                           torch.device("cpu"))["no-grad fwd"]
    assert counts.aten["mm"] == 3 and counts.launches == 4 and counts.glue_bytes == 0
    assert counts.matmul_bytes > 0 and counts.attention_bytes > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts on the GPU there")
def test_count_on_a_cpu_without_the_interpreter_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET")  # triton is imported already: too late to switch it on here
    with pytest.raises(SystemExit):
        benchmark_kernels.main(["--count"])
    assert "set TRITON_INTERPRET=1" in capsys.readouterr().err
