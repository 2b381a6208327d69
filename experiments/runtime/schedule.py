"""Learning-rate schedules, as partials of the optimizer (conf/schedule/)."""

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau


def warmup_cosine(optimizer: Optimizer, *, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> LambdaLR:
    """Linear warm-up over warmup_steps, then cosine decay to min_lr_ratio at total_steps."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def constant(optimizer: Optimizer, *, warmup_steps: int = 0) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0)


class LossPlateau(ReduceLROnPlateau):
    """The seed's `lr_decay`: ReduceLROnPlateau on the training loss. The seed steps it once per
    epoch; here an "epoch" is `window` optimizer steps (the data is sampled, not iterated), and the
    plateau is judged on the window's mean loss. Its state (the window's losses included) is the
    scheduler's own `__dict__`, so a resumed run continues the window."""

    needs_loss = True  # the loop passes the step's training loss

    def __init__(self, optimizer: Optimizer, *, window: int = 100, factor: float = 0.5, patience: int = 10,
                 cooldown: int = 10, min_lr: float = 1e-6):
        if window < 1:
            raise ValueError(f"window={window} must be at least 1 step")
        super().__init__(optimizer, mode="min", factor=factor, patience=patience, cooldown=cooldown, min_lr=min_lr)
        # plain numbers, not a list: the state dict is a shallow copy of __dict__
        self.window, self._window_sum, self._window_count = window, 0.0, 0

    def step(self, loss: float) -> None:  # type: ignore[override]
        self._window_sum += float(loss)
        self._window_count += 1
        if self._window_count == self.window:
            super().step(self._window_sum / self.window)
            self._window_sum, self._window_count = 0.0, 0


def plateau(optimizer: Optimizer, **kwargs) -> LossPlateau:
    return LossPlateau(optimizer, **kwargs)
