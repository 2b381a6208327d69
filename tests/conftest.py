"""Fixtures for every test, and the environment they run in (the run helpers: tests/helpers/runs.py)."""

import os

import pytest
import torch

from tests.helpers.runs import ROOT

# without a GPU, Triton kernels run in its interpreter on CPU tensors (set before triton is imported)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(tryfirst=True)  # before -m selects: the marks it reads are set here
def pytest_collection_modifyitems(config, items):
    """The CUDA tier (`pytest -m gpu`): without CUDA its tests are skipped, at no cost; with CUDA every
    `triton` test, which then runs its kernels on the GPU, belongs to it too."""
    cuda = torch.cuda.is_available()
    for item in items:
        if cuda and item.get_closest_marker("triton"):
            item.add_marker(pytest.mark.gpu)
        elif not cuda and item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


# Tests that share a session fixture, run on one worker under `pytest -n` so that it is built once: the
# test cluster and the torchrun of two ddp ranks (tests/helpers/slurm.py, runs.py), the allocator's
# baseline. Named by path here, not by xdist_group marks: pytest-xdist 3.8 groups marked tests by
# renaming them through a field pytest 9.2 no longer reads, so its marks group nothing.
WORKER_GROUPS = {
    "tests/experiments/runtime/test_slurm.py::": "slurm_cluster",
    "tests/experiments/runtime/test_distributed.py::test_two_ddp_ranks_of_batch_b_equal_one_process_of_batch_2b":
        "slurm_cluster",
    "tests/experiments/runtime/test_allocator.py::": "allocator",
}


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: without it (-p no:xdist), not called
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's load scheduling (`-n`; --dist load, its default), with WORKER_GROUPS each sent
    to one worker as a whole."""
    if config.getvalue("dist") != "load":
        return None  # another --dist asked for: xdist's own
    from xdist.scheduler import LoadGroupScheduling

    class GroupedLoad(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((group for prefix, group in WORKER_GROUPS.items() if nodeid.startswith(prefix)), nodeid)

    return GroupedLoad(config, log)


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
