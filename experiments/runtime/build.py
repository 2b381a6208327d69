"""Instantiate one config group, turning a constructor's complaint into one message naming it."""

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from experiments.runtime.errors import UserError


def build(node: DictConfig, group: str):
    try:
        return instantiate(node)
    except InstantiationException as e:
        cause = e.__cause__ if e.__cause__ is not None else e
        if isinstance(cause, UserError):
            raise cause from None
        if isinstance(cause, (ValueError, TypeError)):
            raise UserError(f"{group}: {cause}") from None
        raise
