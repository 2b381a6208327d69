"""Each branch's and each layer's work (FLOPs, bytes moved) from the setting's knobs, and the time a
GPU's limits allow it: a roofline estimate, for lengths no interpreter can count.

    work = branch_work(setting, n, element)            # {"compressed": (FLOPs, bytes), ...} forward
    est = estimate("nsa", setting, n, backward=True, launches=63, glue_over_io=6.6)
    est.seconds                                        # max(device time, host time)

A part (a branch, the projections, the compressor, the glue between kernels) takes
max(FLOPs / peak rate, bytes / bandwidth): the slower of its compute and its memory traffic at the
device's peaks. The device runs the parts one after another; the host issues one launch per kernel,
asynchronously, so a layer takes the longer of the two: the parts' sum, or launches x host cost.
FLOPs and bytes come from formulas (kernels/flops.py), so they extend to any length; the launches
and the glue (as a multiple of q, k, v and out) come from a counted run (experiments/bench/counts.py),
since neither grows with the length: launches are fixed per layer, glue is elementwise work on
tensors of n rows. Where the estimate is optimistic: docs/nsa.md, "Counters".
"""

from dataclasses import dataclass

import torch

from experiments.bench.counts import PHASES, io_bytes
from kernels.flops import attention_flops, linear_flops
from kernels.nsa_attention.blocks import compressed_blocks, keeps_branch_outputs


@dataclass(frozen=True)
class Device:
    name: str
    flops: float  # matrix-product FLOP/s
    bandwidth: float  # memory bytes/s
    launch_s: float  # host seconds per kernel launch


# NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense bf16 on the tensor cores (1,979 with 2:4 sparsity),
# 3.35 TB/s HBM3. Host: ~5 us per launch, PyTorch eager's dispatch plus cudaLaunchKernel when the
# host is the bottleneck (docs/nsa.md measured 6.9 us per cudaLaunchKernel on the H200's host, under
# torch.profiler, which adds its own)
H100_SXM = Device("H100 SXM", flops=989e12, bandwidth=3.35e12, launch_s=5e-6)
ELEMENT = 2  # bf16: the dtype the H100 figures are for
BACKWARD_BYTES = 2  # a backward reads what its forward read and wrote (and the output's gradient), and
# writes a gradient of each input: twice the forward's bytes


def visible_pairs(n: int, window: int = 0, block: int = 0, stride: int = 1) -> int:
    """(query, key) pairs of n queries from position 0 that a causal mask lets through: over the
    window's last `window` keys, or (block > 0) over the compressed blocks of `block` every `stride`
    complete by each query (query t sees (t - block + 1) // stride + 1 of them)."""
    t = torch.arange(n, dtype=torch.int64)
    if block:
        return int(((t - block + 1).div(stride, rounding_mode="floor") + 1).clamp(min=0).sum())
    return int(torch.minimum(t + 1, torch.tensor(window)).sum())


def forced_pairs(n: int, fine: int, forced: int = 3) -> int:
    """(query, key) pairs of the selected branch's forced blocks over n queries from position 0: the
    query's own fine block up to itself, the initial block (forced >= 2) and the previous one
    (forced >= 3) where they are not its own."""
    t = torch.arange(n, dtype=torch.int64)
    own = t.div(fine, rounding_mode="floor")
    pairs = t - own * fine + 1
    if forced >= 2:
        pairs = pairs + (own > 0) * fine
    if forced >= 3:
        pairs = pairs + (own > 1) * fine
    return int(pairs.sum())


def branch_pairs(setting: dict, n: int) -> dict[str, int]:
    """(query, key) pairs each NSA branch computes per head at n tokens (batch 1): the selected
    branch's forced blocks, and its freely chosen ones whole, as the kernel computes them."""
    selected, fine = setting["num_fine_selected"], setting["fine_block_size"]
    free = max(0, selected - 3)
    return {"compressed": visible_pairs(n, block=setting["compress_block_size"], stride=setting["compress_stride"]),
            "selected": forced_pairs(n, fine, min(3, selected)) + n * free * fine,
            "window": visible_pairs(n, window=setting["sliding_window_size"])}


def branch_work(setting: dict, n: int, element: int) -> dict[str, tuple[float, float]]:
    """Per branch, forward (FLOPs, fewest bytes) of one layer at n tokens (batch 1), and their sum
    under "fused": the kernels compute the branches together."""
    h, kv, d = setting["heads"], setting["kv_heads"], setting["dim_head"]
    block, stride = setting["compress_block_size"], setting["compress_stride"]
    free = max(0, setting["num_fine_selected"] - 3)
    blocks = compressed_blocks(n, block, stride)
    q_bytes, out_bytes = n * h * d * element, n * h * d * element
    pairs = branch_pairs(setting, n)
    work = {
        # attention (q.k, p.v) and selection (q.k again, one product) over the compressed blocks; q,
        # kc, vc read, the output, its log-sum-exp and the chosen blocks written
        "compressed": (attention_flops(pairs["compressed"], h, d) * 3 / 2,
                       q_bytes + 2 * blocks * kv * d * element + out_bytes + n * h * 4 + n * kv * free * 12),
        "selected": (attention_flops(pairs["selected"], h, d),
                     q_bytes + 2 * n * kv * d * element + out_bytes + n * kv * free * 9),
        "window": (attention_flops(pairs["window"], h, d), q_bytes + 2 * n * kv * d * element + out_bytes),
    }
    work["fused"] = (sum(f for f, _ in work.values()), sum(b for _, b in work.values()) - 2 * q_bytes)
    return work


@dataclass(frozen=True)
class Part:
    name: str
    flops: float
    bytes: float

    def seconds(self, device: Device) -> float:
        return max(self.flops / device.flops, self.bytes / device.bandwidth)

    def bound(self, device: Device) -> str:
        if not (self.flops or self.bytes):
            return "-"
        return "compute" if self.flops / device.flops >= self.bytes / device.bandwidth else "memory"


@dataclass(frozen=True)
class Estimate:
    parts: tuple[Part, ...]
    launches: int
    device: Device = H100_SXM

    @property
    def device_s(self) -> float:
        return sum(part.seconds(self.device) for part in self.parts)

    @property
    def host_s(self) -> float:
        return self.launches * self.device.launch_s

    @property
    def seconds(self) -> float:
        """The host's launches overlap the device's work: the longer of the two."""
        return max(self.device_s, self.host_s)

    @property
    def bound(self) -> str:
        return "host" if self.host_s > self.device_s else "device"

    def part(self, name: str) -> Part:
        return next(part for part in self.parts if part.name == name)


def _linears(shapes: list[tuple[int, int]], n: int, element: int, backward: bool) -> Part:
    """Linear layers (fan_in, fan_out) over n rows: each input, weight and output moved once
    (forward), BACKWARD_BYTES times that more with the backward."""
    flops = sum(linear_flops(n, i, o) + (linear_flops(n, i, o, backward=True) if backward else 0) for i, o in shapes)
    moved = sum(n * i + i * o + n * o for i, o in shapes) * element
    return Part("projections", flops, moved * (1 + BACKWARD_BYTES if backward else 1))


def dense_parts(setting: dict, n: int, backward: bool, glue_over_io: float, element: int = ELEMENT) -> tuple[Part, ...]:
    """The dense GQA layer (experiments/bench/layers.DenseLayer): its three projections, causal
    attention over n (n + 1) / 2 pairs (q, k, v and out moved once), and the glue."""
    dim, h, kv, d = setting["dim"], setting["heads"], setting["kv_heads"], setting["dim_head"]
    pairs = visible_pairs(n, window=n)
    io = io_bytes(setting, n, element, 1)
    flops = attention_flops(pairs, h, d) + (attention_flops(pairs, h, d, backward=True) if backward else 0)
    scale = 1 + BACKWARD_BYTES if backward else 1
    return (_linears([(dim, h * d), (dim, 2 * kv * d), (h * d, dim)], n, element, backward),
            Part("attention", flops, io * scale), Part("glue", 0.0, glue_over_io * io))


def nsa_parts(setting: dict, n: int, backward: bool, glue_over_io: float, element: int = ELEMENT,
              branches: int = 3) -> tuple[Part, ...]:
    """NSA (models/attention/nsa.py on its fused kernels): the query, key/value (one pair a branch),
    gate and output projections; the two block compressors (an MLP per KV head from a block of
    keys to one, hidden dim_head x compress_hidden_mult); each branch (branch_work; its backward
    is attention's 5 products over the same pairs, 7 where it recomputes rowsum(dO * O), selection
    has none); and the glue."""
    dim, h, kv, d = setting["dim"], setting["heads"], setting["kv_heads"], setting["dim_head"]
    block, stride = setting["compress_block_size"], setting["compress_stride"]
    hidden = max(1, int(d * setting.get("compress_hidden_mult", 1.0)))
    blocks = compressed_blocks(n, block, stride)
    scale = 1 + BACKWARD_BYTES if backward else 1
    projections = _linears([(dim, h * d), (dim, branches * 2 * kv * d), (dim, branches * h), (h * d, dim)], n,
                           element, backward)
    mlp = [(block * d, hidden), (hidden, d)]  # per KV head, over its blocks; two compressors (keys, values)
    compressor_flops = 2 * kv * sum(linear_flops(blocks, i, o) + (linear_flops(blocks, i, o, backward=True)
                                                                   if backward else 0) for i, o in mlp)
    # the keys read once (the blocks overlap, the product does not copy them), the hidden layer
    # written and read, the compressed keys written, the weights read
    compressor_bytes = 2 * kv * (n * d + 2 * blocks * hidden + blocks * d + block * d * hidden + hidden * d) * element
    parts = [projections, Part("compressor", compressor_flops, compressor_bytes * scale)]
    work, pairs = branch_work(setting, n, element), branch_pairs(setting, n)
    # where the branches' outputs outweigh the kernels' inputs, the backward recomputes rowsum(dO * O):
    # q.k and dp once more over the same pairs
    kept = keeps_branch_outputs(h * d * n, h * d * n + branches * 2 * kv * d * n + 2 * kv * blocks * d)
    for name in ("compressed", "selected", "window"):
        flops, moved = work[name]
        flops += attention_flops(pairs[name], h, d, backward=True) * (1 if kept else 7 / 5) if backward else 0
        parts.append(Part(name, flops, moved * scale))
    parts.append(Part("glue", 0.0, glue_over_io * io_bytes(setting, n, element, branches)))
    return tuple(parts)


def estimate(layer: str, setting: dict, n: int, backward: bool, launches: int, glue_over_io: float,
             device: Device = H100_SXM, element: int = ELEMENT) -> Estimate:
    """layer "dense" or "nsa" at n tokens (batch 1), one forward (and backward), with `launches`
    kernel launches and glue bytes `glue_over_io` x its q, k, v and out (both from a count)."""
    parts = (dense_parts if layer == "dense" else nsa_parts)(setting, n, backward, glue_over_io, element)
    return Estimate(parts, launches, device)


Counted = dict[tuple[str, str], tuple[int, float]]  # (layer, phase) -> (launches, glue / q, k, v, out)


def estimates(setting: dict, n: int, counted: Counted, device: Device = H100_SXM) -> dict[tuple[str, str], Estimate]:
    """Both layers' estimates in both phases, {(layer, phase): Estimate}."""
    return {(layer, phase): estimate(layer, setting, n, phase == "fwd+bwd", *counted[(layer, phase)], device)
            for layer in ("dense", "nsa") for phase in PHASES}


def _fig(x: float) -> str:
    """Three significant figures, whole numbers with thousands separated from 100 on."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def estimate_table(setting: dict, n: int, counted: Counted, device: Device = H100_SXM) -> str:
    """One row a part of each layer, then its device time, host time and predicted time; one
    column group a phase (GFLOP, MB, us, what bounds it); the last row NSA's time over dense's."""
    est = estimates(setting, n, counted, device)
    cells = {}  # (layer, row) -> [four cells a phase]
    for (layer, phase), e in est.items():
        for part in e.parts:
            cells.setdefault((layer, part.name), []).extend(
                [_fig(part.flops / 1e9), _fig(part.bytes / 1e6), _fig(part.seconds(device) * 1e6), part.bound(device)])
        cells.setdefault((layer, "device"), []).extend(["", "", _fig(e.device_s * 1e6), ""])
        cells.setdefault((layer, "host"), []).extend(["", "", _fig(e.host_s * 1e6), f"{e.launches} launches"])
        cells.setdefault((layer, "predicted"), []).extend(["", "", _fig(e.seconds * 1e6), e.bound])
    for phase in PHASES:
        cells.setdefault(("nsa/dense", ""), []).extend(
            ["", "", f"{est[('nsa', phase)].seconds / est[('dense', phase)].seconds:.2f}x", ""])
    widths = (10, 10, 10, 13)
    lines = [f"{'':<22}" + "".join(f"{phase:^{sum(widths)}}" for phase in PHASES),
             f"{'layer':<10}{'part':<12}" + "".join(f"{title:>{w}}" for _ in PHASES
                                                     for title, w in zip(("GFLOP", "MB", "us", "bound"), widths))]
    for (layer, row), values in cells.items():
        lines.append(f"{layer:<10}{row:<12}" + "".join(f"{v:>{widths[i % 4]}}" for i, v in enumerate(values)))
    return "\n".join(lines)


def lengths_table(setting: dict, lengths: list[int], counted: Counted, device: Device = H100_SXM) -> str:
    """Per length and phase: dense's and NSA's predicted times, their ratio, and NSA's branches."""
    lines = [f"{'tokens':>7} {'phase':<12} {'dense us':>10} {'nsa us':>10} {'nsa/dense':>9} {'compressed':>10} "
             f"{'selected':>10} {'window':>10}  nsa bound"]
    for n in lengths:
        est = estimates(setting, n, counted, device)
        for phase in PHASES:
            dense, nsa = est[("dense", phase)], est[("nsa", phase)]
            branches = "".join(f"{_fig(nsa.part(name).seconds(device) * 1e6):>11}"
                               for name in ("compressed", "selected", "window"))
            lines.append(f"{n:>7,} {phase:<12} {_fig(dense.seconds * 1e6):>10} {_fig(nsa.seconds * 1e6):>10} "
                         f"{nsa.seconds / dense.seconds:>8.2f}x{branches}  {nsa.bound}")
    return "\n".join(lines)
