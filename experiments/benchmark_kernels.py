"""One NSA attention layer (all three branches, gates and projections) against a dense GQA layer
(projections and SDPA), forward and forward + backward, with peak memory; the reference packages'
layers beside them where installed; then each branch's counted work (FLOPs and the fewest bytes
it must move) against the time its kernels take, so the gap to the device's limits shows.

    python -m experiments.benchmark_kernels                       # GPU: both settings, 8k..64k, bf16
    python -m experiments.benchmark_kernels --setting small --lengths 32768
    python -m experiments.benchmark_kernels --device cpu --setting tiny --lengths 256 --dtype fp32
    python -m experiments.benchmark_kernels --count           # what one layer launches (a CPU can count it)

Settings: `paper` is the NSA paper's kernel setting (dim 1024; 64 query heads over 4 KV heads,
dim_head 128; compressed blocks of 32 every 16; 16 selected blocks of 64; window 512); `small` the
seed's shape (dim 512; 8 query heads over 4 KV heads, dim_head 64; the same NSA knobs); `tiny` a
shape for checking the script itself on a CPU; `count` and `count16` the shapes --count runs
(below). Batch 1, one layer in --dtype (parameters and
activations). Timings are medians of CUDA events after warm-up (a host clock on the CPU); every
ratio is against the dense layer of the same run. The device's ceilings are measured first: a
large matrix product and a large copy.

Reference rows (CUDA only; never imported elsewhere; `pip install -e .[reference]`):
`ref:fla` is fla-core's `parallel_nsa` (compressed and selected branches, Triton; it needs a GQA
group of 16 or more) with its sliding window through compiled `flex_attention` and a window mask,
since its own window calls flash-attn; `ref:nsa-seed` is native-sparse-attention-pytorch's
`SparseAttention` with its Triton kernel, as the NSA seed script trains it.

Branches (kernels alone, on random inputs of the layer's shapes; CUDA, or the CPU under
TRITON_INTERPRET=1): compressed = attention over the compressed blocks + block selection,
selected = the freely chosen blocks (the forced ones, tiled attention in torch, not included),
window = the sliding window. FLOPs count 2 per multiply-add, the backward 2.5x the forward (q.k
recomputed, dp, dq, dk, dv); bytes are each input read once and each output written once.

--count runs one layer forward + backward, then its no-grad forward, on the CUDA code path (NSA
with kernel=triton; on a CPU the Triton kernels run in Triton's interpreter, TRITON_INTERPRET=1,
set here) and prints what a GPU would be asked to do (experiments/runtime/op_counts.py): launches
(aten ops and Triton kernels), host syncs, glue bytes (elementwise, copy and reduction traffic
between kernels) against the bytes of q, k, v and the output, matrix-product bytes, the largest
intermediate tensor against q, and each Triton launch's grid, tile and visited/needed (query, key)
pairs as its launch site reports them (kernels/counters.py). Nothing is timed: the figures are the
same on any machine, and tests/kernels/test_nsa_budgets.py holds NSA's to budgets. `count` has
the seed's GQA group of 2, `count16` the paper's group of 16 and dim_head 128, at 512 tokens
(Triton's interpreter takes minutes beyond): fine blocks of 64 as the paper's, 8 of them selected,
compressed blocks of 8 every 4 and a window of 256, so that 512 tokens hold 127 compressed blocks
(as 2,048 do at the paper's 32 every 16) and a window of four 64-key tiles: the ragged edges of
the masks, which tiles cannot follow, then cost a well-tiled kernel under 1.3x the pairs it needs,
as at the paper's lengths.
"""

import argparse
import inspect
import sys
import textwrap
import time
from typing import Callable, Iterator, Optional

import torch

from experiments.runtime.op_counts import OpCounts, count_ops, interpret_triton_here

if __name__ == "__main__" and "--count" in sys.argv[1:]:
    interpret_triton_here()  # before the imports below import triton (main() says so if it could not)

import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from experiments.config.checks import flag_error  # noqa: E402
from experiments.runtime.backends import DTYPES  # noqa: E402

NSA_KNOBS = dict(compress_block_size=32, compress_stride=16, fine_block_size=64, num_fine_selected=16,
                 sliding_window_size=512)
SETTINGS = {
    "paper": dict(dim=1024, heads=64, kv_heads=4, dim_head=128, **NSA_KNOBS),
    "small": dict(dim=512, heads=8, kv_heads=4, dim_head=64, **NSA_KNOBS),
    "tiny": dict(dim=64, heads=4, kv_heads=2, dim_head=16, compress_block_size=8, compress_stride=4,
                 fine_block_size=16, num_fine_selected=4, sliding_window_size=32),
}
COUNT_KNOBS = dict(compress_block_size=8, compress_stride=4, fine_block_size=64, num_fine_selected=8,
                   sliding_window_size=256)
SETTINGS["count"] = dict(dim=128, heads=2, kv_heads=1, dim_head=64, **COUNT_KNOBS)
SETTINGS["count16"] = dict(dim=256, heads=16, kv_heads=1, dim_head=128, **COUNT_KNOBS)
COUNT_TOKENS = 512
TIMED_TOKENS = [8192, 16384, 32768, 65536]


REPEATS = 10  # timings per median; --repeats sets it


def timed(fn: Callable, device: torch.device, repeats: Optional[int] = None) -> float:
    """Median milliseconds of fn(), after warm-up (CUDA events on a GPU, a host clock on the CPU)."""
    repeats = repeats or REPEATS
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def peak_mb(fn: Callable, device: torch.device) -> Optional[float]:
    """Device memory fn() adds at its peak over what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def ceilings(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(matrix-product FLOP/s, memory bytes/s) measured here: a square product and a large copy."""
    size = 8192 if device.type == "cuda" else 1024
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    rate = 2 * size**3 / (timed(lambda: a @ b, device) / 1e3)
    src = torch.empty(2**28 if device.type == "cuda" else 2**25, device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() / (timed(lambda: dst.copy_(src), device) / 1e3)  # bytes read + written
    return rate, bandwidth


# ---- layers -------------------------------------------------------------------------------------


class DenseLayer(nn.Module):
    """Dense causal GQA attention with its projections: x [batch, seq, dim] -> [batch, seq, dim]."""

    def __init__(self, dim: int, heads: int, kv_heads: int, dim_head: int, **_):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, 2 * kv_heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        q = self.to_q(x).unflatten(-1, (self.heads, -1)).transpose(1, 2)
        k, v = self.to_kv(x).unflatten(-1, (2, self.kv_heads, -1)).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.to_out(out.transpose(1, 2).flatten(2))


def nsa_layer(kernel: str, setting: dict) -> nn.Module:
    from models.attention.nsa import NativeSparseAttention

    return NativeSparseAttention(**setting, kernel=kernel)


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
            rows.append((name, timed(forward, device), timed(both, device), peak_mb(both, device), ""))
        except Exception as error:
            rows.append((name, None, None, None, f"{type(error).__name__}: {str(error).splitlines()[0][:90]}"))
        del layer
    return rows


# ---- branches -----------------------------------------------------------------------------------


def visible_pairs(n: int, window: int = 0, block: int = 0, stride: int = 1) -> int:
    """(query, key) pairs of n queries from position 0 that a causal mask lets through: over the
    window's last `window` keys, or (block > 0) over the compressed blocks of `block` every `stride`
    complete by each query (query t sees (t - block + 1) // stride + 1 of them)."""
    t = torch.arange(n, dtype=torch.int64)
    if block:
        return int(((t - block + 1).div(stride, rounding_mode="floor") + 1).clamp(min=0).sum())
    return int(torch.minimum(t + 1, torch.tensor(window)).sum())


def branch_work(setting: dict, n: int, element: int) -> dict[str, tuple[float, float]]:
    """Per branch, forward (FLOPs, fewest bytes) of one layer at n tokens (batch 1), and their sum
    under "fused": the kernels compute the branches together."""
    h, kv, d = setting["heads"], setting["kv_heads"], setting["dim_head"]
    block, stride, fine = setting["compress_block_size"], setting["compress_stride"], setting["fine_block_size"]
    free = max(0, setting["num_fine_selected"] - 3)
    blocks = max(0, (n - block) // stride + 1)
    q_bytes, out_bytes = n * h * d * element, n * h * d * element
    compressed_pairs = visible_pairs(n, block=block, stride=stride)
    window_pairs = visible_pairs(n, window=setting["sliding_window_size"])
    selected_pairs = n * free * fine  # whole blocks, as the kernel computes them
    work = {
        # attention (q.k, p.v) and selection (q.k again) over the compressed blocks; q, kc, vc read,
        # the output, its log-sum-exp and the chosen blocks written
        "compressed": (2 * compressed_pairs * h * d * 3, q_bytes + 2 * blocks * kv * d * element + out_bytes
                       + n * h * 4 + n * kv * free * 12),
        "selected": (4 * selected_pairs * h * d, q_bytes + 2 * n * kv * d * element + out_bytes + n * kv * free * 9),
        "window": (4 * window_pairs * h * d, q_bytes + 2 * n * kv * d * element + out_bytes),
    }
    work["fused"] = (sum(f for f, _ in work.values()), sum(b for _, b in work.values()) - 2 * q_bytes)
    return work


def branch_times(setting: dict, n: int, dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    """(forward ms, forward + backward ms) of the three branches on the fused Triton kernels
    (kernels/nsa_attention) on random inputs: q, the compressed keys and the gates given, so that
    the compressor and the projections are not timed."""
    from kernels.nsa_attention.fused import nsa_attention
    from kernels.nsa_attention.triton import Knobs
    from models.rotary import Rotary

    h, kv, d = setting["heads"], setting["kv_heads"], setting["dim_head"]
    block, stride, fine = setting["compress_block_size"], setting["compress_stride"], setting["fine_block_size"]
    blocks = max(0, (n - block) // stride + 1)
    knobs = Knobs(block, stride, fine, min(3, setting["num_fine_selected"]),
                  min(max(0, setting["num_fine_selected"] - 3), max(0, -(-n // fine) - 3)),
                  setting["sliding_window_size"])
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype).requires_grad_()

    inputs = (rand(1, n, h, d), rand(1, kv, blocks, d), rand(1, kv, blocks, d),
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


def io_bytes(setting: dict, n: int, element: int, kv_pairs: int) -> int:
    """Bytes of one layer's attention inputs and output at n tokens (batch 1): q, its `kv_pairs`
    key/value pairs (NSA: one per branch) and the output."""
    h, kv, d = setting["heads"], setting["kv_heads"], setting["dim_head"]
    return n * element * (2 * h * d + 2 * kv_pairs * kv * d)


def count_layer(layer: nn.Module, n: int, dtype: torch.dtype, device: torch.device) -> dict[str, OpCounts]:
    """What one layer launches at n tokens (batch 1): {"fwd+bwd": one forward and backward,
    "no-grad fwd": a forward without gradient (validation, inference)}."""
    return dict(count_phases(layer, n, dtype, device))


def count_phases(layer: nn.Module, n: int, dtype: torch.dtype, device: torch.device) -> Iterator[tuple[str, OpCounts]]:
    """count_layer's phases one at a time, so that a phase that fails leaves the others counted. A
    step as every step after the first: one uncounted forward first builds what a layer caches (the
    rotary table, compiled kernels)."""
    gen = torch.Generator().manual_seed(0)
    dim = layer.to_q.in_features
    x = torch.randn(1, n, dim, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(1, n, dim, generator=gen).to(device, dtype)
    with torch.no_grad():
        layer(x)
    with count_ops() as both:
        layer(x).backward(grad)
    yield "fwd+bwd", both
    with torch.no_grad(), count_ops() as forward:
        layer(x)
    yield "no-grad fwd", forward


def print_counts(setting: dict, n: int, dtype: torch.dtype, device: torch.device) -> None:
    """The counts of the dense layer and of NSA on its Triton kernels at n tokens."""
    from models.attention.nsa import BRANCHES

    element = torch.finfo(dtype).bits // 8
    q_bytes = n * setting["heads"] * setting["dim_head"] * element
    for name, build, kv_pairs in (("dense (SDPA)", lambda: DenseLayer(**setting), 1),
                                  ("nsa kernel=triton", lambda: nsa_layer("triton", setting), BRANCHES)):
        torch.manual_seed(0)
        phases = count_phases(build().to(device, dtype), n, dtype, device)
        for phase in ("fwd+bwd", "no-grad fwd"):
            try:
                counts = next(phases)[1]
            except Exception as error:  # say why, go on with the next layer
                print(f"{n:,} tokens, {name}, {phase} failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
                break
            print(f"{n:,} tokens, {name}, {phase}:")
            print(textwrap.indent(counts.format(io_bytes(setting, n, element, kv_pairs), q_bytes), "  "))


# ---- report -------------------------------------------------------------------------------------


def describe(name: str, setting: dict) -> str:
    return (f"{name}: dim {setting['dim']}, {setting['heads']} query heads over {setting['kv_heads']} KV heads, "
            f"dim_head {setting['dim_head']}; compressed blocks of {setting['compress_block_size']} every "
            f"{setting['compress_stride']}, {setting['num_fine_selected']} selected blocks of "
            f"{setting['fine_block_size']}, window {setting['sliding_window_size']}")



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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    from kernels import triton_interpreting

    rate, bandwidth = ceilings(device, dtype)
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
            print_counts(SETTINGS[name], n, DTYPES[args.dtype], device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
