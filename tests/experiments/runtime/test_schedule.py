"""Learning-rate schedules: warm-up and cosine, and the plateau schedule on the training loss."""

import pytest
import torch

from experiments.runtime.schedule import LossPlateau, constant, warmup_cosine


def optimizer(lr=1.0):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_warmup_then_cosine_to_the_floor():
    opt = optimizer()
    schedule = warmup_cosine(opt, warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    lrs = [schedule.get_last_lr()[0]]
    for _ in range(12):
        opt.step()
        schedule.step()
        lrs.append(schedule.get_last_lr()[0])
    assert lrs[:3] == [0.5, 1.0, 1.0] and lrs[-1] == pytest.approx(0.1)
    assert lrs[6] == pytest.approx(0.55) and lrs[10] == pytest.approx(0.1)  # the cosine spans the 8 steps after warm-up
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    assert constant(optimizer(), warmup_steps=0).get_last_lr() == [1.0]


def test_plateau_halves_the_lr_when_the_window_mean_stops_falling_and_resumes_mid_window():
    opt = optimizer()
    schedule = LossPlateau(opt, window=3, factor=0.5, patience=1, cooldown=0, min_lr=0.2)
    for loss in [3, 3, 3, 2, 2, 2]:  # two windows, the second better: no change
        schedule.step(loss)
    assert opt.param_groups[0]["lr"] == 1.0
    for loss in [2, 2, 2, 2, 2]:  # a flat window: one bad window is within patience; then mid-window
        schedule.step(loss)
    state = schedule.state_dict()
    resumed_opt = optimizer()
    resumed = LossPlateau(resumed_opt, window=3, factor=0.5, patience=1, cooldown=0, min_lr=0.2)
    resumed.load_state_dict(state)
    for s, o in ((schedule, opt), (resumed, resumed_opt)):
        s.step(2)  # completes the second flat window: patience exceeded
        assert o.param_groups[0]["lr"] == 0.5
    for _ in range(30):
        schedule.step(2)
    assert opt.param_groups[0]["lr"] == 0.2  # never below min_lr
    with pytest.raises(ValueError, match="window"):
        LossPlateau(optimizer(), window=0)


def test_plateau_judges_the_window_mean_not_its_last_loss():
    opt = optimizer()
    schedule = LossPlateau(opt, window=2, factor=0.5, patience=0, cooldown=0, min_lr=0.01)
    for loss in [3, 3, 1, 4]:  # window means 3 then 2.5: better, though its last loss is worse
        schedule.step(loss)
    assert opt.param_groups[0]["lr"] == 1.0
