"""experiments/bench/gpu_compile.py: launches recorded as they run (in Triton's interpreter on a
CPU), compiled for Hopper without a GPU, and their resources read against the chip's limits."""

import pytest
import torch

from experiments.bench.gpu_compile import HOPPER, Launch, Resources, capture, compile_specs, load, save
from tests.helpers.kernel_checks import TRITON_DEVICE
from tests.helpers.tile_kernel import tile_product

pytestmark = pytest.mark.triton


def launch(tile: int, n: int = 16, dtype=torch.float32) -> torch.Tensor:
    a, b = (torch.randn(n, n, generator=torch.Generator().manual_seed(s)).to(TRITON_DEVICE, dtype) for s in (0, 1))
    out = torch.empty_like(a)
    tile_product[(1,)](a, b, out, n, TILE=tile)
    return out


def test_each_distinct_launch_is_recorded_once_with_its_types_and_constants():
    with capture() as launches:
        out = launch(16)
        launch(16)  # the same launch again
        launch(32, n=20)
    torch.testing.assert_close(out.cpu(), launch(16).cpu())  # recording changes nothing it computes
    assert [dict(launch.kwargs)["TILE"] for launch in launches] == [("int", 16), ("int", 32)]
    first = launches[0]
    assert (first.module, first.kernel) == ("tests.helpers.tile_kernel", "tile_product")
    assert first.args == (("tensor", "float32"),) * 3 + (("int", 16),)


def test_launches_compile_for_hopper_and_a_larger_tile_asks_for_more(tmp_path):
    with capture() as launches:
        launch(32, n=32, dtype=torch.bfloat16)
        launch(128, n=128, dtype=torch.bfloat16)
    save(launches, tmp_path / "launches.json")
    assert load(tmp_path / "launches.json") == launches  # what --save writes, --warm reads back
    small, large = compile_specs(launches, jobs=2)
    assert (small.kernel, small.warps) == ("tile_product", 4)
    assert 0 < small.registers <= 255 and 0 < large.registers <= 255
    assert large.shared > small.shared  # the tiles of a and b staged for tl.dot: 16x the elements
    assert not small.refused() and small.programs_per_sm() >= 1


def test_a_program_over_the_chips_shared_memory_is_refused_and_occupancy_follows_the_scarcest():
    def resources(shared, registers, warps):
        return Resources("k", warps, 3, shared, registers, 0, 0.0)

    assert resources(HOPPER["shared_per_program"] + 1, 64, 4).refused()
    assert not resources(HOPPER["shared_per_program"], 64, 4).refused()
    assert resources(100_000, 32, 4).programs_per_sm() == 2  # shared memory: 233,472 // 100,000
    assert resources(0, 255, 8).programs_per_sm() == 1  # registers: 65,536 // (255 * 32 * 8)
    assert resources(0, 16, 4).programs_per_sm() == 16  # warps: 64 // 4


def test_launch_records_refuse_what_they_cannot_describe():
    with pytest.raises(TypeError, match="of type str cannot be recorded"):
        with capture():
            tile_product[(1,)](*(torch.zeros(16, 16, device=TRITON_DEVICE) for _ in range(3)), "16", TILE=16)
    assert Launch("m", "k", (), ()) == Launch("m", "k", (), ())
