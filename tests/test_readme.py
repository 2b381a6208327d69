"""Every command in the README parses: train.py's overrides compose against the schema and pass the
config's checks (Hydra's compose API, as train.py composes), and each `python -m` tool exists and
accepts its flags (its argparse parser, stopped once it has parsed). Nothing is trained or run."""

import argparse
import re
import shlex

import pytest
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser

from experiments.config.checks import check_config
from tests.helpers.runs import ROOT
from tests.helpers.tool_flags import parsed_flags


def readme_commands() -> list[list[str]]:
    """The commands of the README's code: its indented blocks and its table's `code` cells, as argv lists."""
    text = (ROOT / "README.md").read_text()
    lines = [line[4:] for line in text.splitlines() if line.startswith("    ") and not line.startswith("     ")]
    lines += re.findall(r"^\| `([^`]+)` \|", text, flags=re.M)
    return [shlex.split(line, comments=True) for line in lines if line.split()[:1] in (["python"], ["torchrun"],
                                                                                       ["pytest"], ["pip"])]


COMMANDS = readme_commands()
TRAIN = [c[c.index("train.py") + 1:] for c in COMMANDS if "train.py" in c and "--help" not in c]
TOOLS = [c[2:] for c in COMMANDS if c[:2] == ["python", "-m"]]


def test_the_readme_has_the_commands_this_test_reads():
    assert len(TRAIN) >= 10 and len(TOOLS) >= 10
    assert ["pytest", "-n", "auto"] in COMMANDS  # the test command .ci/run runs
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\npytest -n auto\n" in ci and 'pip install -q -e ".[dev]"' in ci


def first_job(overrides: list[str]) -> list[str]:
    """A sweep's first job (the overrides one job gets), or the overrides of a single run."""
    parsed = OverridesParser.create().parse_overrides([o for o in overrides if o != "-m"])
    return BasicSweeper.split_arguments(parsed, max_batch_size=None)[0][0]


@pytest.mark.parametrize("overrides", TRAIN, ids=[" ".join(o) or "(none)" for o in TRAIN])
def test_train_commands_compose_and_pass_the_checks(compose, overrides):
    cfg = compose(*[o for o in first_job(overrides) if not o.startswith("hydra")])
    check_config(cfg)


@pytest.mark.parametrize("argv", TOOLS, ids=[" ".join(a) for a in TOOLS])
def test_tool_commands_exist_and_accept_their_flags(argv, monkeypatch):
    module, *flags = argv
    assert isinstance(parsed_flags(module, flags, monkeypatch), argparse.Namespace)
