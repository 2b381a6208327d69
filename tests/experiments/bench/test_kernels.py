"""The layer and branch benchmark (experiments/bench/kernels.py, through its main) runs its own
code on a CPU (tiny setting; the Triton kernels in the interpreter): every row is measured, and
the ratios are against the dense layer of the run; --count counts what each layer launches and
estimates both layers' time on an H100. Its library (experiments/bench/) is tested directly: the
work formulas, the roofline's arithmetic, and a counted step that is every step."""

import contextlib
import io
import os
import subprocess
import sys

import pytest
import torch

from experiments.bench.counts import count_layer
from experiments.bench.kernels import main
from experiments.bench.layers import PAPER_TOKENS, SETTINGS, DenseLayer, nsa_layer
from experiments.bench.roofline import Device, Part, branch_work, dense_parts, estimate, nsa_parts
from experiments.runtime.op_counts import count_ops
from kernels.dispatch import triton_interpreting
from tests.helpers.kernel_checks import TRITON_DEVICE
from tests.helpers.runs import ROOT

TINY_CPU = ["--device", "cpu", "--setting", "tiny", "--lengths", "32", "--dtype", "fp32", "--repeats", "1"]


def command(args: list[str], interpret: bool = True) -> str:
    """What `python -m experiments.bench.kernels args` prints: through its main(argv) in this process
    where this process runs Triton as asked (triton reads TRITON_INTERPRET when first imported), else
    in a child process, as a user runs it."""
    if interpret == triton_interpreting():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(args) == 0
        return out.getvalue()
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    child = subprocess.run([sys.executable, "-m", "experiments.bench.kernels", *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=600, env=env)
    assert child.returncode == 0, child.stderr[-3000:]
    return child.stdout


def rows_at_32_tokens(lines: list[str]) -> dict[str, list[str]]:
    return {line.split()[1]: line.split() for line in lines if line.split()[:1] == ["32"]}


# the command's own run in Triton's interpreter, as a CPU machine runs it (a GPU machine's tier runs
# the same tool on the GPU: gpu_report's kernels stage)
on_a_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the command in Triton's interpreter on a CPU")


@on_a_cpu
@pytest.mark.triton
def test_tiny_setting_times_every_layer_and_branch_on_the_cpu():
    lines = command(TINY_CPU).splitlines()
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine times on the GPU")
def test_without_the_interpreter_the_cpu_run_times_the_layers_and_says_why_not_the_branches():
    lines = command(TINY_CPU, interpret=False).splitlines()
    assert set(rows_at_32_tokens(lines)) == {"dense", "nsa"}
    assert lines[-1] == ("branches: skipped: on the CPU the Triton kernels run only in Triton's interpreter "
                         "(TRITON_INTERPRET=1 in the environment)")


def test_branch_work_counts_the_pairs_each_branch_visits():
    setting = dict(SETTINGS["tiny"], heads=1, kv_heads=1, dim_head=1)
    work = branch_work(setting, 64, 4)
    # window 32: queries 0..31 see t + 1 keys, 32..63 see 32; 4 FLOPs a pair at one head of dim 1
    assert work["window"][0] == 4 * (sum(range(1, 33)) + 32 * 32)
    # fine blocks of 16, 4 selected: 3 forced (each query's own block up to itself: 4 x (1 + ... + 16);
    # the initial block for the 48 queries past it, the previous one for the 32 past two blocks), 1 free
    assert work["selected"][0] == 4 * (4 * 136 + 48 * 16 + 32 * 16 + 64 * 16)
    # blocks of 8 every 4 complete at t = 7, 11, ...: query t sees (t - 7) // 4 + 1 of them
    assert work["compressed"][0] == 6 * sum((t - 7) // 4 + 1 for t in range(7, 64))


UNIT = Device("unit", flops=1.0, bandwidth=1.0, launch_s=1.0)  # a part's seconds = max(its FLOPs, its bytes)


def test_the_roofline_sums_each_parts_slower_limit_against_the_launches_host_time():
    setting = dict(dim=2, heads=1, kv_heads=1, dim_head=2)
    parts = {part.name: part for part in dense_parts(setting, 4, backward=False, glue_over_io=0.5, element=1)}
    # projections q [2 -> 2], kv [2 -> 4], out [2 -> 2] over 4 rows: 2 x 4 x (4 + 8 + 4) FLOPs;
    # bytes 1 an element: (8 + 4 + 8) + (8 + 8 + 16) + (8 + 4 + 8) inputs, weights and outputs
    assert parts["projections"] == Part("projections", 128, 72)
    # causal attention over 4 + 3 + 2 + 1 pairs: 4 FLOPs a pair at dim_head 2 over 2, q, k, v, out 4 x 2 each
    assert parts["attention"] == Part("attention", 80, 32)
    assert parts["glue"] == Part("glue", 0, 16)  # half of q, k, v, out
    device_bound = estimate("dense", setting, 4, False, launches=100, glue_over_io=0.5, device=UNIT, element=1)
    assert (device_bound.device_s, device_bound.host_s, device_bound.seconds) == (128 + 80 + 16, 100, 224)
    host_bound = estimate("dense", setting, 4, False, launches=300, glue_over_io=0.5, device=UNIT, element=1)
    assert (host_bound.seconds, host_bound.bound) == (300, "host")
    # the backward: attention's 5 products a pair (10 x 10 x 2 FLOPs), twice the forward's bytes more
    both = {part.name: part for part in dense_parts(setting, 4, backward=True, glue_over_io=0.5, element=1)}
    assert both["attention"] == Part("attention", 80 + 200, 3 * 32)
    assert both["projections"].flops == 3 * 128


def test_nsas_roofline_holds_each_branchs_work_and_its_backward():
    setting = SETTINGS["paper"]
    work = branch_work(setting, 4096, 2)
    forward = {part.name: part for part in nsa_parts(setting, 4096, backward=False, glue_over_io=0.0)}
    both = {part.name: part for part in nsa_parts(setting, 4096, backward=True, glue_over_io=0.0)}
    for name in ("compressed", "selected", "window"):
        assert (forward[name].flops, forward[name].bytes) == work[name]
    # selection (q.k over the compressed blocks) has no backward: 3 products forward, 5 more backward,
    # and 2 more at the paper's group of 16, whose backward recomputes rowsum(dO * O) (keeps_outputs)
    assert both["compressed"].flops == pytest.approx(forward["compressed"].flops * (3 + 7) / 3)
    assert both["window"].flops == pytest.approx(forward["window"].flops * (2 + 7) / 2)
    forward, both = ({part.name: part for part in nsa_parts(SETTINGS["count"], 4096, backward, 0.0)}
                     for backward in (False, True))  # group 2: the outputs kept
    assert both["window"].flops == pytest.approx(forward["window"].flops * (2 + 5) / 2)
    # at the paper's lengths the sparse layer's attention grows as n, the dense layer's as n^2
    ratios = [estimate("nsa", setting, n, True, 60, 2.0).seconds / estimate("dense", setting, n, True, 14, 0.4).seconds
              for n in PAPER_TOKENS]
    assert ratios == sorted(ratios, reverse=True) and ratios[-1] < 1


@pytest.mark.triton
def test_a_counted_first_step_is_every_step_once_the_caches_are_built():
    setting = SETTINGS["tiny"]
    torch.manual_seed(0)
    layer = nsa_layer("triton", setting).to(TRITON_DEVICE)
    step = ("fwd+bwd",)
    first = count_layer(layer, 32, torch.float32, TRITON_DEVICE, step)["fwd+bwd"]  # builds the caches first
    later = count_layer(layer, 32, torch.float32, TRITON_DEVICE, step)["fwd+bwd"]
    assert (first.aten, first.glue_bytes, len(first.triton)) == (later.aten, later.glue_bytes, len(later.triton))
    # without them the first step builds the rotary table: more launches than any later step
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 32, setting["dim"], generator=gen).to(TRITON_DEVICE)
    with torch.no_grad(), count_ops() as unbuilt:
        nsa_layer("triton", setting).to(TRITON_DEVICE)(x)
    with torch.no_grad(), count_ops() as built:
        layer(x)
    assert unbuilt.launches > built.launches


def count_blocks(out: str) -> dict[tuple[str, str], list[str]]:
    """--count's detail blocks -> {(layer, phase): their lines}."""
    blocks, lines = {}, None
    for line in out.splitlines():
        if line.endswith(":") and " tokens, " in line:
            _, layer, phase = line[:-1].split(", ")
            lines = blocks[(layer, phase)] = []
        elif lines is not None and line.startswith("  "):
            lines.append(line.strip())
        else:
            lines = None
    return blocks


def table_rows(out: str, first: str, last: str) -> dict[str, list[str]]:
    """The rows of the table from the line starting `first` to the one starting `last`, by their
    first 20 (count table) characters."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith(last))
    return {line[:20].strip(): line[20:].split() for line in lines[start:end + 1]}


@on_a_cpu
@pytest.mark.triton
def test_count_prints_dense_beside_nsa_and_both_layers_roofline():
    out = command(["--count", "--setting", "tiny", "--lengths", "16", "--dtype", "fp32"])
    layers, phases = ("dense (SDPA)", "nsa kernel=triton"), ("fwd+bwd", "no-grad fwd")
    blocks = count_blocks(out)
    assert set(blocks) == {(layer, phase) for layer in layers for phase in phases}
    for (layer, phase), lines in blocks.items():
        launches, aten, triton = (int(word.strip("(,);")) for word in lines[0].split()[1:6:2])
        assert launches == aten + triton > 0
        assert lines[1].startswith("glue ") and "x q, k, v, out" in lines[1]
        assert lines[2].startswith("largest intermediate ") and "x q)" in lines[2]
        # one line per Triton launch, whether its launch site reports it or not
        assert triton == sum(line.startswith("triton ") for line in lines)
        assert (triton > 0) == (layer == "nsa kernel=triton")
    assert "_scaled_dot_product" in " ".join(blocks[("dense (SDPA)", "fwd+bwd")])

    # one table, dense beside NSA in each phase, its figures those of the detail blocks
    table = table_rows(out, "launches (Triton)", "rows a program")
    columns = [(layer, phase) for phase in phases for layer in layers]
    for (layer, phase), cell in zip(columns, table["launches (Triton)"][::2]):
        assert int(cell) == int(blocks[(layer, phase)][0].split()[1])
    assert table["host syncs"] == ["0"] * 4 and len(table["glue / q, k, v, out"]) == 4

    # the roofline: both layers, both phases, their host time from the launches counted above
    roofline = out[out.index("roofline estimate"):]
    rows = {" ".join(line[:22].split()): line[22:].split() for line in roofline.splitlines()
            if line[:1].isalpha() and not line.startswith("roofline")}
    for layer in ("dense", "nsa"):
        launches = [int(cell) for cell in table["launches (Triton)"][::2]][layers.index(
            "dense (SDPA)" if layer == "dense" else "nsa kernel=triton")::2]
        host = [cell for cell in rows[f"{layer} host"] if cell != "launches"]
        assert [float(cell) for cell in host[::2]] == pytest.approx([5.0 * n for n in launches], rel=1e-3)
        assert [int(cell) for cell in host[1::2]] == launches
        predicted = [float(cell.replace(",", "")) for cell in rows[f"{layer} predicted"][::2]]
        assert len(predicted) == 2 and all(p >= h for p, h in zip(predicted, map(float, host[::2])))
    ratio = [float(cell.rstrip("x")) for cell in rows["nsa/dense"]]
    dense, nsa = ([float(c.replace(",", "")) for c in rows[f"{layer} predicted"][::2]] for layer in ("dense", "nsa"))
    assert ratio == pytest.approx([n / d for n, d in zip(nsa, dense)], abs=0.01)
    # and at the paper's lengths, from formulas: a row a length and phase, dense and NSA each
    labels = [f"{n:,}" for n in PAPER_TOKENS]
    lengths = [line.replace("no-grad fwd", "no-grad").split() for line in roofline.splitlines()
               if line.split()[:1] and line.split()[0] in labels]
    assert [row[:2] for row in lengths] == [[label, phase] for label in labels for phase in ("fwd+bwd", "no-grad")]
    for row in lengths:  # dense us, nsa us, their ratio
        dense_us, nsa_us = (float(cell.replace(",", "")) for cell in row[2:4])
        assert float(row[4].rstrip("x")) == pytest.approx(nsa_us / dense_us, abs=0.01)


def test_the_dense_layers_forward_launches_its_three_projections_and_attention():
    setting = SETTINGS["tiny"]
    counts = count_layer(DenseLayer(**setting), 32, torch.float32, torch.device("cpu"))["no-grad fwd"]
    assert counts.aten["mm"] == 3 and counts.launches == 4 and counts.glue_bytes == 0
    assert counts.matmul_bytes > 0 and counts.attention_bytes > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts on the GPU there")
def test_count_where_triton_is_imported_without_the_interpreter_says_how_to_get_it():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    code = ("import sys, runpy, triton; sys.argv = ['kernels.py', '--count']; "
            "runpy.run_module('experiments.bench.kernels', run_name='__main__')")
    child = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert child.returncode == 2 and "set TRITON_INTERPRET=1" in child.stderr


def test_kernel_table_x_dense_is_dense_time_over_the_layers(capsys):
    from experiments.bench.kernels import print_layers

    print_layers([("dense", 2.0, 8.0, None, ""), ("nsa", 1.0, 2.0, None, "")], 64)
    nsa = next(line for line in capsys.readouterr().out.splitlines() if " nsa " in line).split()
    assert nsa[4:6] == ["2.00x", "4.00x"]
