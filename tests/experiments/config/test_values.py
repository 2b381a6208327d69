"""Every config value is stated once: the yaml owns values, the schema owns types (conf/config.yaml
says so at its top). A default that reappears in a schema, or differs in the code a yaml builds,
fails here with the place it was stated twice."""

import dataclasses
import inspect

import pytest
from hydra.utils import get_object
from omegaconf import MISSING, OmegaConf

from experiments.config.schema import SCHEMAS, Config, TrainerConfig
from tests.helpers.runs import ROOT

OPTIONS = [(group, name) for group, options in SCHEMAS.items() for name in options]
WIRING = ("_target_", "_partial_")  # which code a section builds: part of its type


def option_yaml(group: str, name: str):
    path = ROOT / "conf" / group / f"{name}.yaml"
    return OmegaConf.load(path), path


def values(schema) -> dict:
    """The schema's fields that carry a default value (none should)."""
    stated = {}
    for f in dataclasses.fields(schema):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if f.name not in WIRING and default is not dataclasses.MISSING and default != MISSING:
            stated[f.name] = default
    return stated


@pytest.mark.parametrize("schema", [TrainerConfig, *(s for options in SCHEMAS.values() for s in options.values())],
                         ids=lambda s: s.__name__)
def test_schemas_state_no_values(schema):
    assert values(schema) == {}, f"{schema.__name__} states values: move them to its yaml in conf/"


def test_the_root_schema_states_only_which_sections_may_be_absent():
    assert values(Config) == {"trainer": TrainerConfig(), "draft": None, "vae": None}


@pytest.mark.parametrize("group,name", OPTIONS)
def test_every_option_states_every_key_of_its_schema(group, name):
    yaml, path = option_yaml(group, name)
    keys = {f.name for f in dataclasses.fields(SCHEMAS[group][name]) if f.name not in WIRING}
    assert keys - set(yaml.keys()) == set(), f"{path} leaves keys to the schema"
    assert set(yaml.keys()) - keys - {"defaults"} == set(), f"{path} states keys its schema lacks"


def test_the_trainer_section_states_every_key():
    trainer = OmegaConf.load(ROOT / "conf" / "config.yaml").trainer
    assert set(trainer.keys()) == {f.name for f in dataclasses.fields(TrainerConfig)}


def _ours(target: str) -> bool:
    return target.startswith(("models.", "experiments."))


def disagreements(target, stated: dict) -> dict:
    """{key: (code default, yaml value)} where `target`'s keyword default is a value other than the yaml's
    (an absent default, or None for "not given", states nothing)."""
    parameters = inspect.signature(target).parameters
    found = {}
    for key, value in stated.items():
        parameter = parameters.get(key)
        if parameter is None or parameter.default in (inspect.Parameter.empty, None):
            continue
        code = parameter.default
        code = list(code) if isinstance(code, tuple) else getattr(code, "value", code)
        if code != value:
            found[key] = (code, value)
    return found


@pytest.mark.parametrize("group,name", [(g, n) for g, n in OPTIONS if _ours(SCHEMAS[g][n]._target_)])
def test_code_defaults_agree_with_the_yaml(group, name):
    yaml, path = option_yaml(group, name)
    stated = {k: v for k, v in OmegaConf.to_container(yaml, resolve=False).items() if k != "defaults"}
    found = disagreements(get_object(SCHEMAS[group][name]._target_), stated)
    assert found == {}, f"{path}: the code's defaults differ from the yaml's (code, yaml): {found}"


def test_the_checks_catch_a_value_stated_twice():
    @dataclasses.dataclass
    class Slipped:
        _target_: str = "models.lm.routing_lm"
        num_clusters: int = 8

    def build(num_clusters: int = 8, ema_decay: float = 0.999, tags=None, attn_types=("full",)):
        return num_clusters, ema_decay, tags, attn_types

    assert values(Slipped) == {"num_clusters": 8}
    stated = {"num_clusters": 8, "ema_decay": 0.99, "tags": [], "attn_types": ["full"]}
    assert disagreements(build, stated) == {"ema_decay": (0.999, 0.99)}
