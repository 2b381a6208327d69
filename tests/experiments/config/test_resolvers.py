"""experiments/config/resolvers.py's sweep job directories: the swept keys' values, then the seed;
names that never collide and always fit a directory name."""

import os
import sys

from experiments.config.resolvers import NAME_MAX, SWEPT_KEYS_ENV, export_swept_keys, job_subdir


def test_job_directory_names_swept_keys_then_seed(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "-m", "model.depth=2,4", "trainer.max_steps=5", "trainer.seed=0,1"])
    assert job_subdir(["model.depth=4", "trainer.max_steps=5", "trainer.seed=1"], 1) == "model.depth=4/seed=1"
    assert job_subdir(["trainer.max_steps=5", "trainer.seed=1"], 1) == "seed=1"
    optuna = {"model.num_fine_selected": "choice(2, 4)"}
    assert job_subdir(["model.num_fine_selected=4"], 0, optuna, 3) == "trial=3,model.num_fine_selected=4/seed=0"


def test_paths_that_differ_get_directories_that_differ(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "-m", "data.path=a,b"])
    paths = ["/data/q_r.txt", "/data/q/r.txt", "/data/q%2Fr.txt"]  # / written as _ made the first two one
    names = [job_subdir([f"data.path={p}"], 0) for p in paths]
    assert len(set(names)) == len(paths) and all(name.count("/") == 1 for name in names)  # <name>/seed=0
    assert names[1] == "data.path=%2Fdata%2Fq%2Fr.txt/seed=0"


def test_a_name_longer_than_a_directory_name_may_be_is_cut_and_told_apart_by_a_hash(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "-m"])
    sampled = {f"model.key{i}": "interval(0, 1)" for i in range(6)}  # a sampler's floats: 20 digits each
    overrides = [[f"model.key{i}=0.{i}{'3' * 40}{j}" for i in range(6)] for j in range(2)]  # apart at their ends
    names = [job_subdir(o, 0, sampled, 7).split("/") for o in overrides]
    assert all(len(name.encode()) <= NAME_MAX for name, _ in names)
    assert names[0][0] != names[1][0] and names[0][0].startswith("trial=7,model.key0=0.0333")
    short = job_subdir(overrides[0][:1], 0, sampled, 7)
    assert short == f"trial=7,{overrides[0][0]}/seed=0"  # a name that fits is left as it is


def test_long_names_that_differ_only_past_what_a_directory_name_holds_get_directories_that_differ(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "-m", "data.path=a,b"])
    common = "/data/" + "d" * (2 * NAME_MAX)
    names = [job_subdir([f"data.path={common}{end}"], 0) for end in ("x", "y")]
    assert names[0] != names[1] and all(len(name.split("/")[0].encode()) <= NAME_MAX for name in names)


def test_a_command_line_that_cannot_be_parsed_clears_the_swept_keys_an_earlier_one_exported(monkeypatch):
    monkeypatch.setenv(SWEPT_KEYS_ENV, "model.depth")  # a stale export, restored after the test
    export_swept_keys(["model.depth=(2,"])
    assert SWEPT_KEYS_ENV not in os.environ
