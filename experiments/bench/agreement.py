"""One first training step on two devices, compared: the check that a model computes the same on
a GPU as on the CPU (the gpu_report's devices stage, the CUDA tier's tests, the models' own tests on
one device)."""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn


@dataclass
class Agreement:
    """One first training step on two devices: each one's loss, and the parameter whose gradient
    differs most, relative to its norm on the first device (||g_b - g_a|| / ||g_a||)."""

    losses: tuple[float, float]
    gradient: float
    parameter: str

    @property
    def loss(self) -> float:
        """|loss_b - loss_a| / |loss_a|."""
        return abs(self.losses[1] - self.losses[0]) / abs(self.losses[0])


def first_step_agreement(build: Callable[[str], "nn.Module"], loss: Callable[["nn.Module", "torch.device"], "Tensor"],
                         devices: Sequence[str] = ("cpu", "cuda"), train: bool = True) -> Agreement:
    """Forward, loss and backward of the model build(device) returns on each device, from the same
    weights: build runs under seed 0 on the CPU each time (checked), then the model moves. `loss`
    draws its inputs from its own seed. fp32 as the CPU computes it: TF32 off for CUDA's matrix
    products and convolutions. `train=False` evaluates a model that draws random numbers in training
    (Gumbel noise), since each device draws from its own generator."""
    import torch

    results, weights = [], None
    cuda = torch.backends.cuda.matmul, torch.backends.cudnn
    tf32 = [backend.allow_tf32 for backend in cuda]
    try:
        for backend in cuda:
            backend.allow_tf32 = False
        for device in devices:
            torch.manual_seed(0)
            model = build(device).train(train)
            state = {name: t.clone() for name, t in model.state_dict().items()}
            if weights is not None and (state.keys() != weights.keys()
                                        or any(not torch.equal(t, weights[n]) for n, t in state.items())):
                raise ValueError(f"build gave other weights for {device}: it must draw them from torch's seed alone")
            weights = state
            model = model.to(device)
            value = loss(model, torch.device(device))
            value.backward()
            results.append((value.item(), {name: torch.zeros(p.shape) if p.grad is None else p.grad.float().cpu()
                                           for name, p in model.named_parameters()}))
    finally:
        for backend, allowed in zip(cuda, tf32):
            backend.allow_tf32 = allowed
    (loss_a, grads_a), (loss_b, grads_b) = results
    worst = max((_relative(grads_b[name], g), name) for name, g in grads_a.items())
    return Agreement((loss_a, loss_b), *worst)


def _relative(got: "Tensor", expected: "Tensor") -> float:
    difference = float((got - expected).norm())
    return 0.0 if difference == 0 else difference / float(expected.norm())  # inf: a gradient that should be 0


def lm_loss(vocab: int, length: int, batch: int = 2) -> Callable[["nn.Module", "torch.device"], "Tensor"]:
    """Next-token cross-entropy of an LM on `batch` random sequences [batch, length + 1] (seed 0)."""
    import torch
    import torch.nn.functional as F

    tokens = torch.randint(0, vocab, (batch, length + 1), generator=torch.Generator().manual_seed(0))

    def loss(model, device):
        x = tokens.to(device)
        return F.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())

    return loss
