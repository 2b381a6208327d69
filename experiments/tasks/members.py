"""Rebuilding a run's trained models from one of its checkpoints: what the decoding and generation
tools, benchmarks and `task.vae_path` use.

A checkpoint keeps each member's weights under `<prefix>model` ("" the model, "draft_" the draft,
"vae_" the VAE) and what rebuilding it needs: the run's config, and for DALL-E (built by its task
from the data and the VAE) `dalle_hparams` and `vae_config`.
"""

import yaml
from omegaconf import OmegaConf
from torch import nn

from experiments.runtime import checkpoint
from experiments.runtime.errors import UserError

_SECTIONS = {"": "model", "draft_": "draft", "vae_": "vae"}  # each member's config section


def load_members(spec, prefixes: tuple[str, ...] = ("",), *, key: str = "run",
                 device: str = "cpu") -> tuple[dict[str, nn.Module], dict]:
    """The members of the run directory or checkpoint `spec` (named by the config key `key` in
    messages), in eval mode on `device` -> ({prefix: model}, the checkpoint's state)."""
    path = checkpoint.resolve(spec, key=key)
    state = checkpoint.load(path, map_location=device, key=key)
    return {prefix: build_member(state, prefix, path, key).to(device).eval() for prefix in prefixes}, state


def build_member(state: dict, prefix: str, path, key: str = "run") -> nn.Module:
    """The member `prefix` of a loaded checkpoint (read from `path`), with its trained weights."""
    from hydra.utils import instantiate

    from experiments.config import register

    if f"{prefix}model" not in state:
        raise UserError(f"{key}: {path} holds no {_SECTIONS[prefix]} (its run did not train one)")
    register()  # the resolvers a saved config may name
    if prefix == "" and "dalle_hparams" in state:
        from models.dalle import DALLE

        model = DALLE(**yaml.safe_load(state["dalle_hparams"]))
    elif prefix == "vae_" and "vae_config" in state:
        model = instantiate(OmegaConf.create(state["vae_config"]))
    else:
        model = instantiate(OmegaConf.create(state["config"])[_SECTIONS[prefix]])
    checkpoint.load_weights(model, state, f"{prefix}model", path)
    return model
