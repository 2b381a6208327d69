"""experiments/runtime/build.py: a constructor's complaint about its arguments is one message
naming the config group; a UserError it raises itself is passed on as it is."""

import pytest
from omegaconf import OmegaConf

from experiments.runtime.build import build
from experiments.runtime.errors import UserError

OWN = UserError("data.path=missing.txt: no such file")


def refuses():
    raise OWN


def test_a_constructors_type_error_is_a_user_error_naming_the_group():
    with pytest.raises(UserError, match=r"^optimizer: .*no_such_argument"):
        build(OmegaConf.create({"_target_": "torch.optim.SGD", "params": [], "no_such_argument": 1}), "optimizer")


def test_a_constructors_own_user_error_is_raised_unchanged():
    with pytest.raises(UserError) as raised:
        build(OmegaConf.create({"_target_": f"{__name__}.refuses"}), "data")
    assert raised.value is OWN
