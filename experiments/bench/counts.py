"""What one layer launches at n tokens, counted on the CUDA code path (experiments/runtime/op_counts.py;
on a CPU the Triton kernels run in Triton's interpreter), and the table that sets dense beside NSA.

    counts = count_layer(layer, n, dtype, device)    # {"fwd+bwd": OpCounts, "no-grad fwd": OpCounts}
    print(count_table(n, columns))                    # rows: the figures; columns: layer x phase
"""

from typing import Iterator, Union

import torch
from torch import nn

from experiments.runtime.op_counts import OpCounts, count_ops

PHASES = ("fwd+bwd", "no-grad fwd")


def io_bytes(setting: dict, n: int, element: int, kv_pairs: int) -> int:
    """Bytes of one layer's attention inputs and output at n tokens (batch 1): q, its `kv_pairs`
    key/value pairs (NSA: one per branch) and the output."""
    h, kv, d = setting["heads"], setting["kv_heads"], setting["dim_head"]
    return n * element * (2 * h * d + 2 * kv_pairs * kv * d)


def q_bytes(setting: dict, n: int, element: int) -> int:
    return n * setting["heads"] * setting["dim_head"] * element


def build_caches(layer: nn.Module, n: int, device: torch.device) -> None:
    """Build, without a forward, what a layer caches on its first call at n tokens, so that a
    counted first step counts what every later step does: the rotary (cos, sin) table of positions
    [0, n) that NSA's fused kernels read (models/rotary.py, Rotary.phases; 7 launches when a step
    builds it). Nothing else is cached on the counted path: the Triton kernels' compilation
    launches nothing, and an autotuner's trials are not counted (op_counts). A forward would build
    it too, at the cost of a whole uncounted forward (in Triton's interpreter, a third of the count)."""
    from models.rotary import Rotary

    for module in layer.modules():
        if isinstance(module, Rotary):
            module.phases(n, device)


def count_layer(layer: nn.Module, n: int, dtype: torch.dtype, device: torch.device,
                phases: tuple[str, ...] = PHASES) -> dict[str, OpCounts]:
    """What one layer launches at n tokens (batch 1): {"fwd+bwd": one forward and backward,
    "no-grad fwd": a forward without gradient (validation, inference)}, of the phases asked for."""
    return dict(count_phases(layer, n, dtype, device, phases))


def count_phases(layer: nn.Module, n: int, dtype: torch.dtype, device: torch.device,
                 phases: tuple[str, ...] = PHASES) -> Iterator[tuple[str, OpCounts]]:
    """count_layer's phases one at a time, so that a phase that fails leaves the others counted. A
    step as every step after the first: its caches are built first (build_caches), uncounted, and
    its parameters hold no gradient (as after an optimizer's zero_grad), so none is added to."""
    gen = torch.Generator().manual_seed(0)
    dim = layer.to_q.in_features
    x = torch.randn(1, n, dim, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(1, n, dim, generator=gen).to(device, dtype)
    build_caches(layer, n, device)
    if "fwd+bwd" in phases:
        layer.zero_grad(set_to_none=True)
        with count_ops() as both:
            layer(x).backward(grad)
        yield "fwd+bwd", both
    if "no-grad fwd" in phases:
        with torch.no_grad(), count_ops() as forward:
            layer(x)
        yield "no-grad fwd", forward


Column = tuple[str, Union[OpCounts, str], int, int]  # (title, counts or why it failed, io bytes, q bytes)


def count_table(columns: list[Column]) -> str:
    """Dense and NSA side by side: one row a figure, one column a (layer, phase); a column whose
    count failed says why in its launches row."""
    mib = 2**20
    rows = {name: [] for name in ("launches (Triton)", "host syncs", "glue MiB", "glue / q, k, v, out", "matmul MiB",
                                  "largest / q", "largest op", "visited/needed", "rows a program")}
    for _, counts, io, q in columns:
        if isinstance(counts, str):
            for name, cells in rows.items():
                cells.append(counts[:24] if name == "launches (Triton)" else "-")
            continue
        attention = [launch for launch in counts.reported if launch.needed]
        ratios = [launch.visited / launch.needed for launch in attention]
        rows["launches (Triton)"].append(f"{counts.launches} ({len(counts.triton)})")
        rows["host syncs"].append(f"{sum(counts.syncs.values())}")
        rows["glue MiB"].append(f"{counts.glue_bytes / mib:.2f}")
        rows["glue / q, k, v, out"].append(f"{counts.glue_bytes / io:.2f}")
        rows["matmul MiB"].append(f"{counts.matmul_bytes / mib:.2f}")
        largest = counts.largest
        rows["largest / q"].append(f"{largest.bytes / q:.2f}" if largest else "-")
        rows["largest op"].append(f"{largest.op} {'x'.join(map(str, largest.shape))}" if largest else "-")
        rows["visited/needed"].append(f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-")
        rows["rows a program"].append(f"{min(launch.rows for launch in counts.reported)}" if counts.reported else "-")
    width = max(14, *(len(cell) + 1 for cells in rows.values() for cell in cells), *(len(c[0]) + 1 for c in columns))
    lines = [f"{'':<20}" + "".join(f"{title:>{width}}" for title, *_ in columns)]
    lines += [f"{name:<20}" + "".join(f"{cell:>{width}}" for cell in cells) for name, cells in rows.items()]
    return "\n".join(lines)
