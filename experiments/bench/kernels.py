"""One NSA attention layer (all three branches, gates and projections) against a dense GQA layer
(projections and SDPA), forward and forward + backward, with peak memory; the reference packages'
layers beside them where installed; then each branch's counted work (FLOPs and the fewest bytes
it must move) against the time its kernels take, so the gap to the device's limits shows.

    python -m experiments.bench.kernels                       # GPU: both settings, 8k..64k, bf16
    python -m experiments.bench.kernels --setting small --lengths 32768
    python -m experiments.bench.kernels --device cpu --setting tiny --lengths 256 --dtype fp32
    python -m experiments.bench.kernels --count           # what one layer launches (a CPU can count it)

Settings (experiments/bench/layers.py): `paper` is the NSA paper's kernel setting, `small` the
seed's shape, `tiny` a shape for checking the script itself on a CPU, `count` and `count16` the
shapes --count runs (the seed's GQA group of 2, the paper's of 16). Batch 1, one layer in --dtype
(parameters and activations). Timings are medians of CUDA events after warm-up (a host clock on
the CPU); every ratio is against the dense layer of the same run. The device's ceilings are
measured first: a large matrix product and a large copy.

Reference rows (CUDA only; never imported elsewhere; `pip install -e .[reference]`):
`ref:fla` is fla-core's `parallel_nsa` (compressed and selected branches, Triton; it needs a GQA
group of 16 or more) with its sliding window through compiled `flex_attention` and a window mask,
since its own window calls flash-attn; `ref:nsa-seed` is native-sparse-attention-pytorch's
`SparseAttention` with its Triton kernel, as the NSA seed script trains it.

Branches (kernels alone, on random inputs of the layer's shapes; CUDA, or the CPU under
TRITON_INTERPRET=1): compressed = attention over the compressed blocks + block selection,
selected = the forced blocks (own, initial, previous) and the freely chosen ones, window = the
sliding window (experiments/bench/roofline.py, branch_work). FLOPs count 2 per multiply-add, the
backward 2.5x the forward (q.k recomputed, dp, dq, dk, dv); bytes are each input read once and
each output written once.

--count runs one layer forward + backward, then its no-grad forward, on the CUDA code path (NSA
with kernel=triton; on a CPU the Triton kernels run in Triton's interpreter, TRITON_INTERPRET=1,
set here) and prints what a GPU would be asked to do (experiments/bench/counts.py,
experiments/runtime/op_counts.py), dense and NSA side by side: launches (aten ops and Triton
kernels), host syncs, glue bytes (elementwise, copy and reduction traffic between kernels) against
the bytes of q, k, v and the output, matrix-product bytes, the largest intermediate tensor against
q, and each Triton launch's grid, tile and visited/needed (query, key) pairs as its launch site
reports them (kernels/counters.py). Nothing is timed: the figures are the same on any machine, and
tests/kernels/test_nsa_budgets.py holds NSA's to budgets. Then a roofline estimate of both layers
on an H100 SXM (experiments/bench/roofline.py): per part and phase, the FLOPs at its bf16 tensor-core
rate or the bytes at its HBM bandwidth, whichever is slower, summed, against the launches' host time;
at the counted length and, with the `paper` setting, at the paper's lengths, where the launches and
the glue come from the count. The `count` settings run at 256 tokens, with masks scaled so that the
kernels meet the edges they meet at the paper's lengths (experiments/bench/layers.py says how).
"""

import argparse
import inspect
import sys
import textwrap
from typing import Callable

import torch

from experiments.runtime.op_counts import interpret_triton_here

if __name__ == "__main__" and "--count" in sys.argv[1:]:
    interpret_triton_here()  # before the imports below import triton (main() says so if it could not)

from torch import Tensor, nn  # noqa: E402

from experiments.bench.counts import PHASES, count_phases, count_table, io_bytes, q_bytes  # noqa: E402
from experiments.bench.layers import (COUNT_TOKENS, PAPER_TOKENS, SETTINGS, DenseLayer, describe,  # noqa: E402
                                      nsa_layer)
from experiments.bench.measure import added_peak_mb, ceilings, median_seconds  # noqa: E402
from experiments.bench.roofline import H100_SXM, branch_work, estimate_table, lengths_table  # noqa: E402
from experiments.config.checks import flag_error  # noqa: E402
from experiments.runtime.backends import DTYPES  # noqa: E402

TIMED_TOKENS = [8192, 16384, 32768, 65536]


REPEATS = 10  # timings per median; --repeats sets it


def timed(fn: Callable, device: torch.device) -> float:
    """Median milliseconds of fn() after 2 warm-ups (CUDA events on a GPU, a host clock on the CPU)."""
    return 1e3 * median_seconds(fn, REPEATS, device, warmups=2)


# ---- layers -------------------------------------------------------------------------------------


class FlaLayer(nn.Module):
    """fla-core's parallel_nsa with projections and gates (its compressed keys are mean-pooled
    blocks, one key/value set for all branches); the window through compiled flex_attention."""

    def __init__(self, dim, heads, kv_heads, dim_head, fine_block_size, num_fine_selected, sliding_window_size, **_):
        super().__init__()
        from fla.ops.nsa import parallel_nsa
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if heads // kv_heads < 16:
            raise ValueError(f"parallel_nsa needs a GQA group of 16 or more (this setting's is {heads // kv_heads})")
        self.nsa, self.flex, self.block_mask = parallel_nsa, torch.compile(flex_attention), create_block_mask
        self.heads, self.kv_heads, self.block, self.selected = heads, kv_heads, fine_block_size, num_fine_selected
        self.window = sliding_window_size
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, 2 * kv_heads * dim_head, bias=False)
        self.to_gates = nn.Linear(dim, 3 * heads)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)
        self.masks = {}

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        q = self.to_q(x).unflatten(-1, (self.heads, -1))  # [b, n, heads, d]
        k, v = self.to_kv(x).unflatten(-1, (2, self.kv_heads, -1)).unbind(2)
        g_cmp, g_slc, g_swa = torch.sigmoid(self.to_gates(x)).unflatten(-1, (3, self.heads)).unbind(2)
        out = self.nsa(q, k, v, g_cmp, g_slc, None, block_counts=self.selected, block_size=self.block)
        if n not in self.masks:
            w = self.window
            self.masks[n] = self.block_mask(lambda _b, _h, i, j: (j <= i) & (i - j < w), None, None, n, n,
                                            device=x.device)
        window = self.flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=self.masks[n],
                           enable_gqa=True).transpose(1, 2)
        return self.to_out((out + window * g_swa[..., None]).flatten(2))


def seed_layer(setting: dict) -> nn.Module:
    """native-sparse-attention-pytorch's SparseAttention at the setting, with its Triton kernel."""
    from native_sparse_attention_pytorch import SparseAttention

    knobs = dict(dim=setting["dim"], dim_head=setting["dim_head"], heads=setting["heads"],
                 kv_heads=setting["kv_heads"], sliding_window_size=setting["sliding_window_size"],
                 compress_block_size=setting["compress_block_size"],
                 compress_block_sliding_stride=setting["compress_stride"],
                 selection_block_size=setting["fine_block_size"], num_selected_blocks=setting["num_fine_selected"],
                 use_triton_kernel=True)
    accepted = inspect.signature(SparseAttention.__init__).parameters
    return SparseAttention(**{key: value for key, value in knobs.items() if key in accepted})


def layer_table(setting: dict, n: int, dtype: torch.dtype, device: torch.device, with_torch: bool) -> list[tuple]:
    """[(name, forward ms, forward + backward ms, peak MB or None, note)] at n tokens."""
    builders = [("dense (SDPA)", lambda: DenseLayer(**setting)), ("nsa", lambda: nsa_layer("auto", setting))]
    if with_torch:
        builders.append(("nsa kernel=torch", lambda: nsa_layer("torch", setting)))
    if device.type == "cuda":
        builders += [("ref:fla", lambda: FlaLayer(**setting)), ("ref:nsa-seed", lambda: seed_layer(setting))]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, n, setting["dim"], generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(1, n, setting["dim"], generator=gen).to(device, dtype)
    rows = []
    for name, build in builders:
        try:
            torch.manual_seed(0)
            layer = build().to(device, dtype)
        except ImportError as error:
            rows.append((name, None, None, None, f"not installed ({error.name}): pip install -e .[reference]"))
            continue
        except Exception as error:  # a reference package that cannot run this shape: say why, go on
            rows.append((name, None, None, None, f"{type(error).__name__}: {str(error).splitlines()[0][:90]}"))
            continue

        def forward(layer=layer):
            with torch.no_grad():
                layer(x)

        def both(layer=layer):
            layer(x).backward(grad)

        try:
            rows.append((name, timed(forward, device), timed(both, device), added_peak_mb(both, device), ""))
        except Exception as error:
            rows.append((name, None, None, None, f"{type(error).__name__}: {str(error).splitlines()[0][:90]}"))
        del layer
    return rows


# ---- branches -----------------------------------------------------------------------------------


def branch_times(setting: dict, n: int, dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    """(forward ms, forward + backward ms) of the three branches on the fused Triton kernels
    (kernels/nsa_attention) on random inputs: q, the compressed keys and the gates given, so that
    the compressor and the projections are not timed."""
    from kernels.nsa_attention.blocks import compressed_blocks
    from kernels.nsa_attention.fused import run as nsa_attention
    from kernels.nsa_attention.triton import Knobs
    from models.rotary import Rotary

    h, kv, d = setting["heads"], setting["kv_heads"], setting["dim_head"]
    block, stride, fine = setting["compress_block_size"], setting["compress_stride"], setting["fine_block_size"]
    blocks = compressed_blocks(n, block, stride)
    knobs = Knobs(block, stride, fine, min(3, setting["num_fine_selected"]),
                  min(max(0, setting["num_fine_selected"] - 3), max(0, -(-n // fine) - 3)),
                  setting["sliding_window_size"])
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype).requires_grad_()

    inputs = (rand(1, n, h, d), rand(1, blocks, 2 * kv, d),  # q, the compressed keys' and values' heads
              *(rand(1, n, kv, d) for _ in range(4)), rand(1, n, 3, h))
    phases = Rotary(d).phases(n, device)

    def run():
        return nsa_attention(*inputs, phases, 0, knobs)[0]

    grad = torch.randn_like(run())

    def forward():
        with torch.no_grad():
            run()

    return timed(forward, device), timed(lambda: run().backward(grad), device)


# ---- counts -------------------------------------------------------------------------------------


LAYERS = (("dense", "dense (SDPA)", 1), ("nsa", "nsa kernel=triton", None))  # (key, title, key/value pairs)


def print_counts(setting: dict, n: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The counts of the dense layer and of NSA on its Triton kernels at n tokens: one table side by
    side, then each layer's and phase's ops and Triton launches. -> {(layer, phase): (launches,
    glue / q, k, v, out)} for the roofline, for the phases counted."""
    from models.attention.nsa import BRANCHES

    element = torch.finfo(dtype).bits // 8
    columns, details, counted = [], [], {}
    for key, title, kv_pairs in LAYERS:
        kv_pairs = kv_pairs or BRANCHES
        io = io_bytes(setting, n, element, kv_pairs)
        torch.manual_seed(0)
        build = (lambda: DenseLayer(**setting)) if key == "dense" else (lambda: nsa_layer("triton", setting))
        phases = count_phases(build().to(device, dtype), n, dtype, device)
        for phase in PHASES:  # in the order count_phases counts them
            try:
                counts = next(phases)[1]
            except Exception as error:  # say why, go on with the next layer
                why = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                print(f"{n:,} tokens, {title}, {phase} failed: {why}")
                columns.append((f"{key} {phase}", why, io, q_bytes(setting, n, element)))
                break
            columns.append((f"{key} {phase}", counts, io, q_bytes(setting, n, element)))
            details.append(f"{n:,} tokens, {title}, {phase}:\n"
                           + textwrap.indent(counts.format(io, q_bytes(setting, n, element)), "  "))
            counted[(key, phase)] = (counts.launches, counts.glue_bytes / io)
    columns.sort(key=lambda column: PHASES.index(column[0].split(" ", 1)[1]))  # dense beside NSA in each phase
    print(f"{n:,} tokens, {str(dtype).removeprefix('torch.')}")
    print(count_table(columns))
    print("\n".join(details))
    return counted


def print_roofline(name: str, n: int, counted: dict, source: str) -> None:
    """Both layers' roofline estimates on an H100 SXM: at n tokens at the counted setting, then at
    the paper's lengths with the `paper` setting (the launches and the glue from `source`'s count)."""
    device = H100_SXM
    rates = (f"{device.flops / 1e12:,.0f} TFLOP/s bf16 dense, {device.bandwidth / 1e12:.2f} TB/s HBM, "
             f"{device.launch_s * 1e6:.0f} us a launch")
    print(f"\nroofline estimate, {device.name} ({rates}), bf16: {name} at {n:,} tokens")
    print(estimate_table(SETTINGS[name], n, counted, device))
    print(f"\nroofline estimate, {device.name}: the paper's setting at its lengths, launches and glue / "
          f"q, k, v, out as {source} counted them")
    print(lengths_table(SETTINGS["paper"], PAPER_TOKENS, counted, device))


# ---- report -------------------------------------------------------------------------------------


def print_layers(rows: list[tuple], n: int) -> None:
    dense = next(row for row in rows if row[0].startswith("dense"))
    for name, forward, both, peak, note in rows:
        if forward is None:
            print(f"{n:>7} {name:<17} {note}")
            continue
        peak_text = "-" if peak is None else f"{peak:,.0f}"
        print(f"{n:>7} {name:<17} {forward:>10.2f} {both:>11.2f} {dense[1] / forward:>9.2f}x "
              f"{dense[2] / both:>11.2f}x {peak_text:>9}")


def print_branches(setting: dict, n: int, dtype: torch.dtype, device: torch.device, rate: float,
                   bandwidth: float) -> None:
    """Each branch's work and floor, then the fused kernels' times against the three's sum."""
    work = branch_work(setting, n, torch.finfo(dtype).bits // 8)
    forward, both = branch_times(setting, n, dtype, device)
    for name, (flops, bytes_) in work.items():
        floor = max(flops / rate, bytes_ / bandwidth) * 1e3
        timed_text = (f"{forward:>9.3f} {flops / (forward / 1e3) / rate:>8.1%} {both:>10.3f} "
                      f"{3.5 * flops / (both / 1e3) / rate:>9.1%}" if name == "fused" else "")
        print(f"{n:>7} {name:<11} {flops / 1e9:>9.3g} {bytes_ / 2**20:>9.3g} {floor:>9.3g} {timed_text}".rstrip())


def main(argv=None) -> int:
    global REPEATS
    parser = argparse.ArgumentParser(prog="python -m experiments.bench.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=[*SETTINGS, "both"], default="both",
                        help="both: paper and small (with --count: count and count16)")
    parser.add_argument("--lengths", type=int, nargs="+",
                        help=f"tokens (default {TIMED_TOKENS}; with --count {COUNT_TOKENS})")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--with-torch", action="store_true", help="add NSA's plain-torch path (slow on a GPU)")
    parser.add_argument("--no-branches", action="store_true", help="skip the per-branch counted work")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timings per median (after 2 warm-ups)")
    parser.add_argument("--count", action="store_true",
                        help="count what one layer launches instead of timing it (settings count and count16)")
    args = parser.parse_args(argv)
    args.lengths = args.lengths or ([COUNT_TOKENS] if args.count else TIMED_TOKENS)
    if error := flag_error({"--lengths": ("count", min(args.lengths)), "--repeats": ("count", args.repeats)}):
        parser.error(error)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device=cuda: no CUDA device here; use --device cpu (with a small --setting tiny)")
    if args.count:
        return count_main(args, parser)
    if args.device == "auto" and not torch.cuda.is_available():
        print("no CUDA device here: nothing to time at these sizes (the kernels are checked by `pytest -m triton` "
              "in Triton's interpreter; `--device cpu --setting tiny` runs this script's own code)")
        return 0
    device = torch.device("cuda" if args.device in ("auto", "cuda") else "cpu")
    REPEATS = args.repeats
    dtype = DTYPES[args.dtype]
    from experiments.runtime.throughput import device_name
    from kernels.dispatch import triton_interpreting

    rate, bandwidth = ceilings(device, dtype, REPEATS)
    print(f"{device_name(device)}, {args.dtype}, batch 1; measured ceilings: matrix product "
          f"{rate / 1e12:.2f} TFLOP/s, copy {bandwidth / 1e9:.0f} GB/s")
    for name in (("paper", "small") if args.setting == "both" else (args.setting,)):
        setting = SETTINGS[name]
        print(f"\n{describe(name, setting)}")
        print(f"{'tokens':>7} {'layer':<17} {'fwd ms':>10} {'fwd+bwd ms':>11} {'fwd x dense':>10} "
              f"{'fwd+bwd x dense':>12} {'peak MB':>9}")
        for n in args.lengths:
            print_layers(layer_table(setting, n, dtype, device, args.with_torch), n)
        if args.no_branches:
            continue
        if device.type == "cpu" and not triton_interpreting():  # a CUDA machine's CPU too
            print("branches: skipped: on the CPU the Triton kernels run only in Triton's interpreter "
                  "(TRITON_INTERPRET=1 in the environment)")
            continue
        print(f"{'tokens':>7} {'branch':<11} {'fwd GFLOP':>9} {'fwd MiB':>9} {'floor ms':>9} {'fwd ms':>9} "
              f"{'of rate':>8} {'fwd+bwd ms':>10} {'of rate':>9}")
        for n in args.lengths:
            print_branches(setting, n, dtype, device, rate, bandwidth)
    return 0


def count_main(args, parser) -> int:
    """--count: the dense layer's and NSA's launches, bytes and tiles, on the CUDA code path."""
    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    if device.type == "cpu" and (problem := interpret_triton_here()):
        parser.error(problem)
    from experiments.runtime.throughput import device_name

    where = "CUDA" if device.type == "cuda" else "the CPU, Triton kernels in Triton's interpreter"
    print(f"counted on {where} ({device_name(device)}): what a GPU is asked to do; {args.dtype}, batch 1")
    for name in (("count", "count16") if args.setting == "both" else (args.setting,)):
        print(f"\n{describe(name, SETTINGS[name])}")
        for n in args.lengths:
            counted = print_counts(SETTINGS[name], n, DTYPES[args.dtype], device)
            if len(counted) == 2 * len(LAYERS):  # every phase counted: an estimate needs each
                print_roofline(name, n, counted, f"{name} at {n:,} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
