"""The value rules of experiments/config/checks.py at their edges: for every key of every rule, the
last value each side of each bound. (tests/test_bad_input.py checks the one-line refusals of
composed configs; values far outside a range pass a rule whose bound is off by one.)"""

import math

import pytest

from experiments.config import checks
from tests.helpers.runs import ROOT

# rule's keys -> (values on the edge that pass, values just past it that are refused)
EDGES = {
    "_AT_LEAST_1": ([1, 2], [0, -1, 0.5]),
    "_AT_LEAST_0": ([0, 0.0, 1e-9], [-1, -1e-9]),
    "_STEPS": ([0, 1], [-1]),
    "_POSITIVE": ([1e-12, 1], [0, 0.0, -1e-12]),
    "_FRACTION": ([0, 0.0, 0.999999], [1, 1.0, -1e-9]),
    "_OPEN_FRACTION": ([1e-9, 0.999999], [0, 0.0, 1, 1.0]),
}


@pytest.mark.parametrize("rule", EDGES)
def test_every_key_of_a_rule_holds_its_bounds(rule):
    passing, refused = EDGES[rule]
    for key in getattr(checks, rule):
        for value in passing:
            assert checks._rule(key, value) is None, (key, value)
        for value in refused:
            assert checks._rule(key, value) is not None, (key, value)


@pytest.mark.parametrize("key,section,passing,refused", [
    ("clip_grad_norm", "trainer", [None, 1e-6, 1.0], [0, 0.0, -1, math.nan]),
    ("betas", "optimizer", [[0, 0], [0.9, 0.999999]], [[0.9, 1.0], [1.0, 0.9], [-1e-9, 0.9], [0.9], [0.9, 0.9, 0.9]]),
    ("min_lr_ratio", "schedule", [0, 0.0, 1, 1.0], [-1e-9, 1.000001]),
    ("resize_ratio", "data", [1e-9, 1, 1.0], [0, 0.0, 1.000001]),
    ("top_k", "model", [1], [0, None]),  # what a sparse attention keeps
    ("top_k", "task", [None, 1], [0]),  # sampling's: null for the full distribution
    ("emb_dim", "model", [None, 1], [0]),
    ("threads", "trainer", [None, 1], [0]),
    ("zero_stage", "backend", [0, 3], [-1, 4]),
])
def test_the_keys_with_rules_of_their_own_hold_their_bounds(key, section, passing, refused):
    for value in passing:
        assert checks._rule(key, value, section) is None, value
    for value in refused:
        assert checks._rule(key, value, section) is not None, value


def test_values_that_are_not_finite_numbers_are_refused_by_every_range():
    for rule in EDGES:
        for key in getattr(checks, rule):
            for value in (math.nan, math.inf, -math.inf, True, "1"):
                assert checks._rule(key, value) is not None, (key, value)


def test_a_sweep_tolerates_failed_jobs_only_as_optunas_max_failure_rate_allows():
    """The hydra section composed for a sweep: Optuna's share of n_trials, none for the grid sweeper."""
    root = str(ROOT / "conf")
    assert checks.failures_tolerated(checks.sweep_hydra_config(root, ["model.depth=1,2"])) < 1
    optuna = checks.sweep_hydra_config(root, ["experiment=nsa_optuna", "hydra.sweeper.n_trials=8"])
    assert checks.failures_tolerated(optuna) < 1  # Optuna's default: no trial may fail
    optuna = checks.sweep_hydra_config(root, ["experiment=nsa_optuna", "hydra.sweeper.n_trials=8",
                                              "hydra.sweeper.max_failure_rate=0.25"])
    assert checks.failures_tolerated(optuna) == pytest.approx(2)
    optuna = checks.sweep_hydra_config(root, ["experiment=nsa_optuna", "hydra.sweeper.n_trials=100",
                                              "hydra.sweeper.max_failure_rate=0.29"])
    assert 29 <= checks.failures_tolerated(optuna) < 30  # as Optuna's failures / n_trials > rate has it
    assert checks.failures_tolerated(None) < 1  # a sweep whose hydra section does not compose


def test_jobs_run_elsewhere_under_the_parallel_and_slurm_launchers_alone():
    root = str(ROOT / "conf")
    assert not checks.runs_jobs_elsewhere(checks.sweep_hydra_config(root, ["model.depth=1,2"]))
    for launcher in ("local_gpus", "slurm"):
        assert checks.runs_jobs_elsewhere(checks.sweep_hydra_config(root, [f"hydra/launcher={launcher}"]))
