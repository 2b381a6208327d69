"""NSA's layer on its Triton kernels within the budgets that make it fast on a GPU (issue 53),
counted on the CPU with the kernels in Triton's interpreter (experiments/bench/counts.py;
`python -m experiments.bench.kernels --count` prints the same figures).

The layer runs at experiments/bench/layers.py's `count` settings (the seed's GQA group of 2 with
dim_head 64, the paper's group of 16 with dim_head 128; masks scaled to COUNT_TOKENS so that a
well-tiled kernel visits under 1.3x the pairs it needs, as at the paper's lengths: layers.py says
why the scaled masks measure the same tiles) at 256 tokens (bf16 on a GPU): one forward +
backward, and one forward without gradient (validation, inference), which must run the same
kernels; on a CPU in fp32, count16 at dim_head 64 (below). Each setting's phase is counted once,
in one test that checks every budget (no fixture that each `pytest -n` worker would count again).
The budgets are what was measured, each with its reason; lower them as the work around the kernels
shrinks."""

import pytest
import torch

from experiments.bench.counts import count_layer, io_bytes, q_bytes
from experiments.bench.layers import COUNT_TOKENS, SETTINGS, nsa_layer
from experiments.runtime.op_counts import OpCounts
from models.attention.nsa import BRANCHES

# What a fast layer needs (issue 61's targets), as counted: launches at 28 (group 2, 14 of them Triton) and 26
# (group 16) for a forward and backward: one product for the three input projections and one for x's
# gradient, the compressor as one Triton op (1 forward, 2 backward), the compressed keys and values one
# tensor through the attention op, gates inside the kernels; no-grad 11 and 8. At group 2 the product's
# width is padded to a multiple of 16 columns (InputProjection.ALIGN), whose unused gradient one more
# launch fills: 29
LAUNCHES = 30  # per layer forward + backward (dense attention: 14)
FORWARD_LAUNCHES = 12  # per no-grad forward, the same kernels as training (dense: 4)
SYNCS = 0  # host waits for a device value: each stalls the GPU's queue and breaks CUDA graphs
GLUE_OVER_IO = 4.0  # glue bytes (elementwise, copies, reductions) / bytes of q, every branch's k and v, out:
# 2.7 at group 2 and 2.5 at group 16 (dense: 2.3), most of it the projection's gradients gathered into one
# tensor and its weights side by side (a weight-sized copy)
LARGEST = "the projections' output"  # no intermediate larger: at group 16 the fused kernels keep no branch
# output for the backward (3x q against the projections' 1.4x; kernels/nsa_attention/blocks.py keeps_branch_outputs)
VISITED_OVER_NEEDED = 1.3  # per attention kernel launch: (query, key) pairs in the tiles walked / pairs the mask needs
ROWS = 64  # query rows (positions x heads of a GQA group) per program: Hopper's tensor cores need 64

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # on a GPU the counts are the GPU's own
# bf16 on a GPU; fp32 in the interpreter, where bf16 has no tensor-core tiles (triton_tiles.tiles_usable)
# and would count other tile shapes than a GPU runs, at many times the time. Every budget is a ratio
# or a count, the same in either dtype
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32

pytestmark = [pytest.mark.triton, pytest.mark.slow]


def setting_for(name: str) -> dict:
    if name == "count16" and DEVICE.type == "cpu":  # dim_head 64: the interpreter's time halved, the tiles the same
        return dict(SETTINGS["count16"], dim=128, dim_head=64)
    return SETTINGS[name]


def unreported(counts: OpCounts) -> list[str]:
    """Every Triton launch must report a Launch (kernels.counters.record), or its tile is unknown."""
    return [f"{launch.kernel} grid {launch.grid} {dict(launch.meta)}: no Launch reported"
            for launch in counts.unreported()]


def over_budget(counts: OpCounts, phase: str, setting: dict) -> list[str]:
    """What one phase's counts exceed, one line a budget (empty: within every budget)."""
    element = DTYPE.itemsize
    io, q = io_bytes(setting, COUNT_TOKENS, element, BRANCHES), q_bytes(setting, COUNT_TOKENS, element)
    problems = unreported(counts)
    budget = LAUNCHES if phase == "fwd+bwd" else FORWARD_LAUNCHES
    if counts.launches > budget:
        problems.append(f"launches {counts.launches} over {budget}")
    if sum(counts.syncs.values()) > SYNCS:
        problems.append(f"host syncs {dict(counts.syncs)} over {SYNCS}")
    if counts.glue_bytes > GLUE_OVER_IO * io:
        problems.append(f"glue {counts.glue_bytes / io:.2f}x q, k, v, out over {GLUE_OVER_IO}x")
    largest, allowed = counts.largest, projection_bytes(setting, COUNT_TOKENS, element)
    if largest.bytes > allowed:
        problems.append(f"largest intermediate {largest.bytes / q:.2f}x q over {LARGEST} ({allowed / q:.2f}x q): "
                        f"{largest.op} {list(largest.shape)} {largest.dtype}")
    attention = [launch for launch in counts.reported if launch.needed]
    if not attention:
        problems.append("no Triton launch reports the pairs its mask needs")
    problems += [f"{launch.kernel} visited/needed {launch.visited / launch.needed:.2f} over {VISITED_OVER_NEEDED}"
                 for launch in attention if launch.visited > VISITED_OVER_NEEDED * launch.needed]
    problems += [f"{launch.kernel} {launch.rows} query rows a program, under {ROWS}" for launch in counts.reported
                 if (launch.needed or launch.rows) and launch.rows < ROWS]
    return problems


# each (setting, phase) counted once, in one test that checks every budget. count16's are the costly
# ones (its 64 programs a launch walk the chosen blocks a position at a time in the interpreter):
# xdist's load scheduling hands each of 2 workers two consecutive tests, so each gets one of them
CASES = [("count16", "fwd+bwd"), ("count", "no-grad fwd"), ("count16", "no-grad fwd"), ("count", "fwd+bwd")]


@pytest.mark.parametrize("name,phase", CASES, ids=[f"{name}-{phase}" for name, phase in CASES])
def test_the_layer_is_within_every_budget(name, phase):
    setting = setting_for(name)
    torch.manual_seed(0)
    layer = nsa_layer("triton", setting).to(DEVICE, DTYPE)
    counts = count_layer(layer, COUNT_TOKENS, DTYPE, DEVICE, phases=(phase,))[phase]
    problems = over_budget(counts, phase, setting)
    io, q = io_bytes(setting, COUNT_TOKENS, DTYPE.itemsize, BRANCHES), q_bytes(setting, COUNT_TOKENS, DTYPE.itemsize)
    assert not problems, "\n".join(problems) + f"\n{counts.format(io, q)}"


def projection_bytes(setting: dict, n: int, element: int) -> int:
    """Bytes of the layer's input projections' output: q, the six keys and values, the gate logits, as
    one product padded to aligned rows (models/attention/nsa.py's InputProjection)."""
    from models.attention.nsa import InputProjection

    heads, kv_heads, dim_head = setting["heads"], setting["kv_heads"], setting["dim_head"]
    width = heads * dim_head + 2 * BRANCHES * kv_heads * dim_head + BRANCHES * heads
    return n * (width + -width % InputProjection.ALIGN) * element
