"""kernels.nsa_attention.path: the one place that decides how an NSA layer runs."""

import torch

from kernels.nsa_attention import cpu_kernels_available, path, triton_supported


def test_the_path_follows_the_knob_the_device_and_the_dtype():
    x = torch.zeros(1, 4, 8)
    cpu = "cpu" if cpu_kernels_available() else "torch"
    assert path(x, "torch", 2, 64, 64) == "torch"
    assert path(x, "auto", 2, 64, 64) == cpu  # no CUDA tensor: the C kernels where they build
    assert path(x, "cpu", 2, 64, 64) == cpu
    assert path(x.double(), "auto", 2, 64, 64) == "torch"  # the C kernels compute in fp32: float64 stays exact
    assert path(x, "triton", 2, 64, 64) == "triton"  # anywhere Triton runs (its interpreter on a CPU)
    assert path(x, "triton", 2, 64, 64, exact=True) == "torch"  # differentiable selection, dropout


def test_shapes_the_fused_kernels_do_not_take_run_in_torch_and_say_why():
    x = torch.zeros(1, 4, 8)
    for group, dim_head, fine, word in ((3, 64, 64, "group"), (2, 24, 64, "dim_head"), (2, 64, 256, "fine_block")):
        assert word in triton_supported(group, dim_head, fine)
        assert path(x, "triton", group, dim_head, fine) == "torch"
    assert triton_supported(16, 128, 64) is None
