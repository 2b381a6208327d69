"""trainer.init_from: a new run that starts from another run's weights (dense -> sparse conversion).

    python train.py model=nsa trainer.init_from=outputs/2026-11-27/08-00-00      # a run: its latest checkpoint
    python train.py model=dsa trainer.init_from=<run>/checkpoints/step_0000100.pt  # or one checkpoint

Unlike resuming, the run is new: its own directory, step 0, a fresh optimizer and schedule. Every
weight whose name and shape match is loaded; a dense attention's projections are translated to a
sparse attention's names first (models/convert.py). A name both models have with different shapes
is refused in one line naming it, unless trainer.init_strict=false, which drops it (the new model
keeps its own initialisation there). What was loaded, what is new and what was dropped go to the
log and to summary.json's "init_from", with the source's path, step and fingerprint.

The source is read once, when the run starts: a rerun that finds the run's own checkpoints resumes
them and never reads the source again (experiments/tasks/loop.py).
"""

import hashlib
import re

from omegaconf import OmegaConf
from torch import nn

from experiments.runtime import checkpoint
from experiments.runtime.errors import UserError
from models.convert import from_dense

KEY = "trainer.init_from"
# buffers that count a run's progress, not what it learnt (DSA's optimizer steps, which decide its
# stage): a new run starts them afresh
RUN_STATE = ("steps",)


def initialise(nets: dict[str, nn.Module], spec: str, model_cfg: dict, strict: bool = True) -> dict:
    """Load the source's matching weights into each net (by prefix, "" the model) -> the report that
    summary.json records. model_cfg: {prefix: this run's config of that net}, to refuse a source of
    another kind (a dVAE into a language model) before any weight is touched."""
    path = checkpoint.resolve(spec, key=KEY)
    state = checkpoint.load(path, map_location="cpu", key=KEY)
    source_cfg = OmegaConf.create(state.get("config") or "")
    report = {"path": str(path), "step": int(state.get("step", 0)), "fingerprint": fingerprint(state),
              "model": (state.get("summary") or {}).get("model"), "data_fingerprint": state.get("data_fingerprint"),
              "strict": strict}
    slots = {"": "model", "draft_": "draft", "vae_": "vae"}
    loads = {}
    for prefix, net in nets.items():
        ours = _family(model_cfg.get(prefix))
        theirs = _family(OmegaConf.select(source_cfg, slots.get(prefix, "model")))
        if f"{prefix}model" not in state or ours != theirs:
            if prefix:  # a second member the source does not have: it starts afresh
                continue
            task = (state.get("summary") or {}).get("task") or "?"
            raise UserError(f"{KEY}={spec}: {path} is a checkpoint of a {theirs or 'different model'} (task {task}) "
                            f"and this run trains a {ours}: point it at a run of the same kind of model")
        loads[prefix] = _matched(net, state[f"{prefix}model"], strict, spec)
    for prefix, (entries, _) in loads.items():  # every check passed: now the weights change
        nets[prefix].load_state_dict(entries, strict=False)
    for prefix, (_, figures) in loads.items():
        report.update({f"{prefix}{k}": v for k, v in figures.items()})
    return report


def _matched(net: nn.Module, source: dict, strict: bool, spec: str) -> tuple[dict, dict]:
    """The entries of net's state dict the source gives, and the report's figures: loaded, converted,
    new and dropped names (grouped over layers), and the parameters loaded and new."""
    own = net.state_dict()
    converted, origins = from_dense(source, net)
    offered = {**{k: v for k, v in source.items() if k not in origins.values()}, **converted}
    entries = {}
    dropped = [name for name in offered if name not in own]
    for name in own:  # in the model's order: a refusal names its first misfit
        tensor = offered.get(name)
        if tensor is None or name.rsplit(".", 1)[-1] in RUN_STATE:
            continue
        if tensor.shape != own[name].shape:
            where = f"{name} (from {origins[name]})" if name in origins else name
            if strict:
                raise UserError(f"{KEY}={spec}: {where} is {list(tensor.shape)} there and {list(own[name].shape)} "
                                "here: the models differ in shape (trainer.init_strict=false drops such weights, "
                                "which then start afresh)")
            dropped.append(name)
            continue
        entries[name] = tensor
    used_sources = {origins[name] for name in entries if name in origins and not origins[name].startswith("(")}
    dropped += [name for name in set(origins.values()) - used_sources if not name.startswith("(")]
    new = [name for name in own if name not in entries]
    params = dict(net.named_parameters())
    return entries, {
        "loaded": _grouped(entries), "converted": _grouped([n for n in entries if n in origins]),
        "new": _grouped(new), "dropped": _grouped(dropped),
        "loaded_params": sum(params[n].numel() for n in entries if n in params),
        "new_params": sum(p.numel() for n, p in params.items() if n not in entries),
    }


def _family(model_cfg) -> str:
    """What kind of model a config builds: its builder's module (models.lm, models.dvae, models.dalle)."""
    target = (model_cfg or {}).get("_target_") or ""
    families = {"models.lm": "language model", "models.dvae": "dVAE", "models.dalle": "DALL-E model"}
    return families.get(target.rsplit(".", 1)[0], target or "unknown")


def fingerprint(state: dict) -> str:
    """The source run's configuration and step as 16 hex digits: runs started from the same weights share it."""
    text = f"{state.get('config', '')}\n{state.get('data_fingerprint', '')}\n{state.get('step', '')}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _grouped(names) -> list[str]:
    """Names with their layer numbers folded: blocks.0.attn.x, blocks.1.attn.x -> "blocks.*.attn.x (x2)"."""
    counts: dict[str, int] = {}
    for name in names:
        key = re.sub(r"\.\d+\.", ".*.", name)
        counts[key] = counts.get(key, 0) + 1
    return [f"{key} (x{n})" if n > 1 else key for key, n in sorted(counts.items())]


def describe(report: dict) -> list[str]:
    """The report as log lines."""
    lines = [f"initialised from {report['path']} (step {report['step']}, model {report['model']}, fingerprint "
             f"{report['fingerprint']}): {report['loaded_params']:,} parameters loaded, {report['new_params']:,} new"]
    for what in ("converted", "new", "dropped"):
        lines.append(f"  {what}: {', '.join(report[what]) or 'nothing'}")
    return lines
