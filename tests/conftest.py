"""Fixtures for every test, and the environment they run in (the run helpers: tests/helpers/runs.py)."""

import os

import pytest
import torch

from tests.helpers.runs import ROOT

# without a GPU, Triton kernels run in its interpreter on CPU tensors (set before triton is imported)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def compose():
    """compose(*overrides) -> the root config, composed exactly as train.py composes it."""
    from experiments.config import register
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()

    def _compose(*overrides: str):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=False)

    yield _compose
    GlobalHydra.instance().clear()
