"""experiments/runtime/cluster.py's check of a SLURM sweep, against a made-up `sinfo` (no cluster
needed): the partition a null one takes, which nodes have GPUs, and how the launcher's defaults are
fitted to the partition's nodes (on a real test cluster: test_slurm.py)."""

import pytest
from omegaconf import OmegaConf

from experiments.runtime import cluster


@pytest.fixture
def sinfo(monkeypatch):
    """Set `.nodes` to the lines `sinfo -N -o %P|%c|%m|%G` prints; the scheduler accepts every job."""
    fake = type("Sinfo", (), {"nodes": ""})()
    monkeypatch.setattr(cluster.shutil, "which", lambda command: f"/usr/bin/{command}")
    monkeypatch.setattr(cluster, "_sinfo", lambda *args: (fake.nodes, ""))
    monkeypatch.setattr(cluster, "scheduler_refusal", lambda launcher: None)
    return fake


def checked(given=(), **launcher):
    """The launcher (slurm.yaml's defaults, then `launcher`) after check_launcher, with `given` the
    keys set on the command line."""
    conf = OmegaConf.create({"partition": None, "tasks_per_node": 1, "gpus_per_node": 1, "cpus_per_task": 8,
                             "mem_gb": 64, **launcher})
    assert cluster.check_launcher(conf, frozenset(given)) is None
    return conf


def test_a_null_partition_is_the_default_one_wherever_sinfo_lists_it(sinfo):
    sinfo.nodes = "cpu|8|16384|(null)\ngpu*|8|16384|gpu:2\n"
    assert next(iter(cluster.partitions()[0])) == "gpu"
    assert checked().gpus_per_node == 1  # the GPU partition's: kept


@pytest.mark.parametrize("gres,gpus", [("gpu:2", True), ("gpu:a100:4(S:0-1)", True), ("license:x", False),
                                       ("(null)", False)])
def test_only_a_gpu_gres_counts_as_gpus(sinfo, gres, gpus):
    sinfo.nodes = f"part*|8|16384|{gres}\n"
    assert (checked().gpus_per_node is not None) == gpus


def test_the_cpus_per_task_are_fitted_to_the_tasks_a_node_runs(sinfo):
    sinfo.nodes = "cpu*|8|16384|(null)\n"
    assert checked(tasks_per_node=2, cpus_per_task=8).cpus_per_task == 4


def test_resources_given_on_the_command_line_are_left_unchanged(sinfo):
    sinfo.nodes = "cpu*|8|16384|(null)\n"
    launcher = checked(given={"mem_gb", "cpus_per_task"}, mem_gb=64, cpus_per_task=16)
    assert (launcher.mem_gb, launcher.cpus_per_task) == (64, 16)
    assert checked(mem_gb=64).mem_gb == 16  # a default: fitted
