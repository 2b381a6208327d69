"""The GPU report's device comparison computes what it names: on one device twice, the first
step's loss and gradients agree to the bit (so a CPU/CUDA difference it prints is the devices')."""

import pytest
import torch

from experiments import gpu_report


def test_the_same_device_twice_gives_the_same_first_step():
    (line,) = gpu_report.compare_devices(kernels=("torch",), devices=("cpu", "cpu"))
    assert line.startswith("kernel=torch: loss cpu 5.") and "(diff +0.00e+00)" in line
    assert "difference 0.00e+00" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a CPU-only machine gives")
def test_without_cuda_it_says_so_in_one_line(tmp_path, capsys):
    assert gpu_report.main([str(tmp_path / "logs"), "all"]) == 2
    assert capsys.readouterr().err.strip() == "gpu_report: error: no CUDA device here: these stages measure a GPU"
    assert not (tmp_path / "logs").exists()
