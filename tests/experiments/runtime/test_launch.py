"""experiments/runtime/launch.py's run directory: a launch that names none gets the timestamped one
of conf/config.yaml, made for it alone, so two launches in the same second (two array tasks, two
shells) never train into one directory; a directory named on the command line is kept, since
naming it again resumes it. (Every rank of one launch sharing rank 0's: test_distributed.py.)"""

import pytest
import yaml

from experiments.runtime import launch
from tests.helpers.runs import ROOT

NOW = {launch.RUN_DIR_FORMAT: "outputs/2026-11-28/12-00-00",
       launch.SWEEP_DIR_FORMAT: "outputs/multirun/2026-11-28/12-00-00"}


@pytest.fixture
def one_second(monkeypatch, tmp_path):
    """Every launch in tmp_path, at the same second."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch.time, "strftime", NOW.__getitem__)
    for variable in ("RANK", "WORLD_SIZE", "SLURM_STEP_ID"):
        monkeypatch.delenv(variable, raising=False)
    return tmp_path


def test_launches_in_the_same_second_get_directories_of_their_own(one_second):
    first, second, third = (launch.claim_output_dir(["trainer.seed=0"]) for _ in range(3))
    assert first == ["trainer.seed=0", "hydra.run.dir=outputs/2026-11-28/12-00-00"]
    assert second[-1] == "hydra.run.dir=outputs/2026-11-28/12-00-00-1"
    assert third[-1] == "hydra.run.dir=outputs/2026-11-28/12-00-00-2"
    assert sorted(p.name for p in (one_second / "outputs" / "2026-11-28").iterdir()) == \
        ["12-00-00", "12-00-00-1", "12-00-00-2"]


def test_sweeps_in_the_same_second_get_sweep_directories_of_their_own(one_second):
    first, second = (launch.claim_output_dir(["-m", "trainer.seed=0,1"]) for _ in range(2))
    assert first[-1] == "hydra.sweep.dir=outputs/multirun/2026-11-28/12-00-00"
    assert second[-1] == "hydra.sweep.dir=outputs/multirun/2026-11-28/12-00-00-1"


def test_a_directory_named_on_the_command_line_is_kept(one_second):
    for argv in (["hydra.run.dir=mine"], ["-m", "hydra.sweep.dir=ours", "trainer.seed=0,1"]):
        assert launch.claim_output_dir(argv) == argv
    assert not (one_second / "outputs").exists()


def test_the_formats_are_the_configs_defaults():
    hydra = yaml.safe_load((ROOT / "conf" / "config.yaml").read_text())["hydra"]
    as_format = lambda d: d.replace("${now:", "").replace("}", "")  # noqa: E731
    assert as_format(hydra["run"]["dir"]) == launch.RUN_DIR_FORMAT
    assert as_format(hydra["sweep"]["dir"]) == launch.SWEEP_DIR_FORMAT


@pytest.mark.parametrize("argv", [["--local_rank", "3", "trainer.seed=0"], ["--local_rank=3", "trainer.seed=0"],
                                  ["trainer.seed=0", "--local-rank", "3"]])
def test_the_deepspeed_launchers_local_rank_is_taken_out_of_argv_into_the_environment(monkeypatch, argv):
    monkeypatch.setenv("LOCAL_RANK", "0")  # restored (here: removed) after the test
    assert launch.prepare_argv(argv) == ["trainer.seed=0"]
    assert launch.os.environ["LOCAL_RANK"] == "3"
