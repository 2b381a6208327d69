"""The CPU report names the CPU it ran on (the kind and its ISAs), runs each stage's commands in
turn into the stage's log, and says in one line where a stage does not apply to this CPU."""

import sys
from pathlib import Path

import pytest

from experiments.bench import cpu_report
from experiments.bench.models import config_problem
from tests.helpers.tool_flags import parsed_flags

# /proc/cpuinfo's first processor, as the three kinds the figures come from print it (flags cut short)
ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx fma avx2 bmi2

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: something else
"""
ZEN4 = ZEN3.replace("model\t\t: 1\n", "model\t\t: 17\n").replace("avx2 bmi2", "avx2 bmi2 avx512f avx512_bf16")
XEON = ("vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Intel(R) Xeon(R) Processor\n"
        "flags\t\t: avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile\n")


def test_each_kind_is_named_with_its_isas():
    assert cpu_report.describe(cpu_report.cpu_identity(ZEN3)) == \
        "AMD EPYC (AuthenticAMD family 25 model 1): AVX2; no AVX-512; no AMX"
    assert cpu_report.describe(cpu_report.cpu_identity(ZEN4)) == \
        "AMD EPYC (AuthenticAMD family 25 model 17): AVX2; AVX-512 (avx512f, avx512_bf16); no AMX"
    assert cpu_report.describe(cpu_report.cpu_identity(XEON)) == (
        "Intel(R) Xeon(R) Processor (GenuineIntel family 6 model 143): AVX2; "
        "AVX-512 (avx512f, avx512_bf16, avx512_vnni); AMX (amx_tile, amx_bf16)")


def test_the_avx2_build_is_compared_only_where_the_native_one_is_another_isa(tmp_path, monkeypatch):
    zen3, zen4 = cpu_report.cpu_identity(ZEN3), cpu_report.cpu_identity(ZEN4)
    assert cpu_report.cannot_run("nsa8k-avx2", zen4) is None
    assert cpu_report.cannot_run("nsa8k", zen3) is None
    monkeypatch.setitem(cpu_report.STAGES, "nsa8k-avx2", [({}, [sys.executable, "-c", "raise SystemExit(3)"])])
    assert cpu_report.run_stage("nsa8k-avx2", tmp_path, zen3) == 0
    log = (tmp_path / "nsa8k-avx2.log").read_text().splitlines()
    assert log[0].startswith("AMD EPYC (AuthenticAMD family 25 model 1): AVX2; no AVX-512; no AMX; ")
    assert log[1] == ("not run: nsa8k-avx2 compares an AVX2 build with an AVX-512 one: this CPU's native build is "
                      "AVX2 already: nsa8k measures it")
    assert log[2].startswith("[nsa8k-avx2: exit 0, ")


def test_a_stage_runs_its_commands_in_turn_with_their_settings_and_stops_at_a_failure(tmp_path, monkeypatch):
    show = "import os; print('march', os.environ.get('SPARSE_ATTENTION_MARCH'))"
    monkeypatch.setitem(cpu_report.STAGES, "dsa", [
        ({"SPARSE_ATTENTION_MARCH": "x86-64-v3"}, [sys.executable, "-c", show]),
        ({}, [sys.executable, "-c", "raise SystemExit(3)"]),
        ({}, [sys.executable, "-c", "print('never')"])])
    assert cpu_report.run_stage("dsa", tmp_path, cpu_report.cpu_identity(ZEN4)) == 3
    log = (tmp_path / "dsa.log").read_text()
    assert f"$ SPARSE_ATTENTION_MARCH=x86-64-v3 {sys.executable} -c {show}\nmarch x86-64-v3\n" in log
    assert "never" not in log and log.rstrip().splitlines()[-1].startswith("[dsa: exit 3, ")


CPUINFO = Path("/proc/cpuinfo")


@pytest.mark.skipif(not CPUINFO.exists() or "avx2" not in cpu_report.cpu_identity(CPUINFO.read_text())["flags"],
                    reason="the AVX2 stage's settings need a Linux CPU with AVX2")
def test_the_avx2_stage_holds_pytorch_to_avx2_as_well_as_the_c_kernels(tmp_path, monkeypatch):
    """Dense runs on PyTorch's ops and MKL: an AVX2 comparison that left them on AVX-512 would time
    NSA's kernels on one ISA against dense on another."""
    ((env, _),) = cpu_report.STAGES["nsa8k-avx2"]
    show = ("import torch, os; from kernels import native; "
            "print(torch.backends.cpu.get_cpu_capability(), native.isa(), os.environ['MKL_ENABLE_INSTRUCTIONS'])")
    monkeypatch.setitem(cpu_report.STAGES, "nsa8k-avx2", [(env, [sys.executable, "-c", show])])
    zen4 = cpu_report.cpu_identity(ZEN4)
    assert cpu_report.run_stage("nsa8k-avx2", tmp_path, zen4) == 0
    log = (tmp_path / "nsa8k-avx2.log").read_text()
    assert log.splitlines()[0].endswith("; C kernels AVX2 (x86-64-v3)") and "\nAVX2 AVX2 (x86-64-v3) AVX2\n" in log


def test_the_speculative_stage_benchmarks_the_run_it_trained():
    (_, train), (_, bench) = cpu_report.stage_commands("speculative", cpu_report.ROOT / "some_run")
    assert train[1:3] == ["train.py", "experiment=speculative"] and train[-1] == f"hydra.run.dir={cpu_report.ROOT / 'some_run'}"
    assert bench[-2:] == ["--run", str(cpu_report.ROOT / "some_run")]


def test_an_unknown_stage_is_refused_before_anything_is_written(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        cpu_report.main([str(tmp_path / "logs"), "nsa64k"])
    assert exit.value.code == 2 and "invalid choice: 'nsa64k'" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("stage", list(cpu_report.STAGES))
def test_every_stage_names_tools_that_accept_its_flags_and_models_that_compose(stage, monkeypatch):
    """Each command's flags parse, and each benchmark's models compose with its overrides (what the
    benchmark checks before it starts a child): a stage that fails an hour in costs that hour.
    (The bf16 stage's PyTorch path, given for NSA and dense alike, failed this: dense has no kernel.)"""
    for _, command in cpu_report.stage_commands(stage, cpu_report.ROOT / "run"):
        if command[1] == "train.py":
            continue  # the preset's composition is test_readme's and test_train's
        module, flags = command[2], command[3:]
        parsed = parsed_flags(module, flags, monkeypatch)
        if module == "experiments.bench.models":
            assert config_problem(parsed.models, parsed.override) is None, command
