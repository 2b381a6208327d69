"""The GPU report's device comparison computes what it names: on one device twice, the first
step's loss and gradients agree to the bit (so a CPU/CUDA difference it prints is the devices')."""

import pytest
import torch

from experiments.bench import gpu_report
from experiments.bench.agreement import first_step_agreement


def test_the_same_device_twice_gives_the_same_first_step():
    # one layer of the default NSA LM: what is compared is the same whatever the depth, at a sixth of the time
    (line,) = gpu_report.compare_devices([("model=nsa", "model.kernel=torch", "model.depth=1")], devices=("cpu", "cpu"))
    assert line.startswith("model=nsa model.kernel=torch model.depth=1: loss cpu 5.") and "(diff +0.00e+00)" in line
    assert "difference 0.00e+00" in line


def test_a_gradient_that_differs_is_found_and_named():
    """A second device that computes one parameter's gradient 0.1% off, played by a hook on the CPU."""
    built = []

    def build(device):
        model = torch.nn.Linear(3, 2)
        if built:
            model.weight.register_hook(lambda grad: grad * (1 + 1e-3))
        built.append(device)
        return model

    agreement = first_step_agreement(build, lambda model, device: model(torch.ones(4, 3)).square().sum(),
                                                devices=("cpu", "cpu"))
    assert agreement.parameter == "weight" and agreement.gradient == pytest.approx(1e-3, rel=1e-3)
    assert agreement.losses[0] == agreement.losses[1] and agreement.loss == 0


def test_models_built_from_other_weights_are_refused():
    calls = []

    def build(device):
        calls.append(device)
        torch.rand(len(calls))  # a draw that differs between the calls: other weights follow
        return torch.nn.Linear(3, 2)

    with pytest.raises(ValueError, match="build gave other weights for cpu"):
        first_step_agreement(build, lambda model, device: model(torch.ones(1, 3)).sum(),
                                        devices=("cpu", "cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a CPU-only machine gives")
def test_without_cuda_it_says_so_in_one_line(tmp_path, capsys):
    assert gpu_report.main([str(tmp_path / "logs"), "all"]) == 2
    assert capsys.readouterr().err.strip() == ("python -m experiments.bench.gpu_report: error: no CUDA device here: "
                                               "these stages measure a GPU")
    assert not (tmp_path / "logs").exists()
