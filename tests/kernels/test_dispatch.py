"""kernels/dispatch.py: the one rule that picks how every kernel package runs."""

import pytest
import torch

import kernels.nsa_attention as nsa
from kernels import dispatch


def test_the_rule_follows_the_knob_the_device_and_the_dtype():
    x = torch.zeros(1, 4, 8)
    cpu = "cpu" if nsa.cpu_built() else "torch"
    choose = lambda x, kernel: dispatch.choose(x, kernel, nsa.triton_problem(2, 64, 64), nsa.cpu_built)  # noqa: E731
    assert choose(x, "torch") == "torch"
    assert choose(x, "auto") == cpu  # no CUDA tensor: the C kernels where they build
    assert choose(x, "cpu") == cpu
    assert choose(x.double(), "auto") == "torch"  # the C kernels compute in fp32: float64 stays exact
    assert choose(x, "triton") == "triton"  # anywhere Triton runs (its interpreter on a CPU)
    assert dispatch.choose(x, "auto", nsa.triton_problem(2, 64, 64)) == "torch"  # a package without a C kernel


def test_kernel_torch_means_torch_whatever_runs_here():
    x = torch.zeros(1, 4, 8)
    assert dispatch.choose(x, "torch", None, nsa.cpu_built) == "torch"
    if torch.cuda.is_available():
        assert dispatch.choose(x.cuda(), "torch", None, nsa.cpu_built) == "torch"


def test_shapes_the_triton_kernels_do_not_take_run_in_torch_under_auto_and_are_refused_when_asked_for():
    x = torch.zeros(1, 4, 8, device="cuda" if torch.cuda.is_available() else "cpu")
    for group, dim_head, fine, word in ((3, 64, 64, "group"), (2, 24, 64, "dim_head"), (2, 64, 256, "fine_block")):
        problem = nsa.triton_problem(group, dim_head, fine)
        assert word in problem
        assert dispatch.choose(x, "auto", problem) == "torch"
        with pytest.raises(ValueError, match=f"kernel=triton needs .*{word}.*use model.kernel=auto or torch"):
            dispatch.choose(x, "triton", problem)
    assert nsa.triton_problem(16, 128, 64) is None


def test_a_knob_that_cannot_run_is_refused_in_one_line():
    with pytest.raises(ValueError, match="kernel=cpu: Sinkhorn has no C kernel"):
        dispatch.check("cpu", "Sinkhorn")
    with pytest.raises(ValueError, match="kernel='fast' must be one of auto, torch, cpu, triton"):
        dispatch.check("fast", "NSA")


def test_the_constant_mark_is_torchs_own():
    """dispatch.constant_result sets what torch.compiler.assume_constant_result sets, without
    importing Dynamo (so a torch upgrade that changes the mark shows here)."""
    ours, torchs = dispatch.constant_result(lambda: True), torch.compiler.assume_constant_result(lambda: True)
    assert vars(ours) == vars(torchs) and vars(ours)


def test_a_tile_side_is_a_power_of_two_within_both_bounds_inclusive():
    assert [v for v in range(1, 300) if dispatch.power_of_two("side", v, 256, low=16) is None] == [16, 32, 64, 128, 256]
    assert [v for v in range(-2, 70) if dispatch.power_of_two("side", v, 64) is None] == [1, 2, 4, 8, 16, 32, 64]
    assert dispatch.power_of_two("side", 512, 256, low=16) == "side=512 to be a power of two from 16 to 256"


@pytest.mark.skipif(not dispatch.TRITON_INSTALLED, reason="Triton is not installed: the refusal would name that too")
def test_a_triton_kernel_refuses_a_shape_by_its_packages_rule_in_one_line(monkeypatch):
    """A Triton kernel reached directly, not through its package's operator, refuses by the operator's
    rule, phrased as what it needs."""
    from kernels.selected_attention import triton_problem

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError) as refused:
        dispatch.refuse("selected-attention", torch.zeros(1), triton_problem(group=128, dim_head=24, block=8))
    assert str(refused.value) == ("the Triton selected-attention kernel needs dim_head=24 to be a power of two up to "
                                  "256: use model.kernel=torch")
    assert dispatch.group_at_most(128) == "the GQA group (heads / kv_heads = 128) to be at most 64"
    dispatch.refuse("selected-attention", torch.zeros(1), triton_problem(group=64, dim_head=16, block=8))  # takes it
