"""Rules a type cannot express, checked on the composed config before anything is built.

`check_config` reports every problem of the config in one line: keys no schema knows (a `+key=`
override adds them past Hydra's own check), values still missing, and values out of range, by key
name wherever the key appears. Rules that tie one model's knobs together live in its constructor
(NSA: heads % kv_heads, stride <= block, ...) and raise a ValueError naming the knob, also before
training starts.
"""

import difflib
import math
import re
from dataclasses import fields
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from experiments.config.schema import SCHEMAS, Config, TrainerConfig
from experiments.runtime.errors import UserError

_SECTIONS = ("trainer", "model", "draft", "vae", "data", "optimizer", "schedule", "backend", "tracker", "task")

# (rule, what the value must be): each key checked wherever it appears, in every section
_AT_LEAST_1 = {
    "dim", "depth", "heads", "dim_head", "num_tokens", "ff_chunks", "kv_heads", "sliding_window_size",
    "compress_block_size", "compress_stride", "fine_block_size", "num_fine_selected", "bucket_size", "sinkhorn_iter",
    "window_size", "num_clusters", "image_size", "codebook_dim", "num_layers", "hidden_dim", "channels", "seq_len",
    "text_seq_len", "kernel_size", "prime_length", "generate_length", "num_samples", "gamma", "window",
    "total_steps", "train_bytes", "val_bytes", "max_steps", "batch_size", "grad_accum", "val_batches", "log_every",
    "keep_checkpoints", "vocab_size", "num_kv_pairs", "digits", "depth_bins", "curriculum_seq_len",
    "block_size", "index_heads", "index_dim_head",
    "count",  # no config key: what a tool's counting flag (--steps, --repeat, ...) stands for in flag_error
}
_AT_LEAST_0 = {
    "num_resnet_blocks", "warmup_steps", "patience", "cooldown", "vae_steps", "weight_decay", "anneal_rate",
    "kl_weight", "temperature", "temperature_min", "commitment_weight", "loss_img_weight", "min_lr",
    "initial_loss_scale_power", "cond_scale", "distill_weight", "context_weight", "curriculum_steps",
    "seed",  # data draws hash (seed, step, ...), and Python hashes -1 as -2: negative seeds could repeat others
}
_STEPS = {"validate_every", "generate_every", "checkpoint_every"}  # 0: off
_POSITIVE = {"lr", "eps", "ff_mult", "compress_hidden_mult", "vae_lr", "timeout_s", "power_a"}
_FRACTION = {"attn_dropout", "ff_dropout", "cond_drop_prob", "filter_thres", "ema_decay"}  # [0, 1)
_OPEN_FRACTION = {"val_fraction", "factor"}  # (0, 1)
COMPILE_VALUES = (False, True, "default", "reduce-overhead")  # trainer.compile (true: default)
_OPTIONAL_AT_LEAST_1 = {"top_k": "the full distribution", "emb_dim": "dim", "threads": "torch's default"}
_MODEL_SECTIONS = ("model", "draft")  # where top_k is what a sparse attention keeps (MoBA, DSA), not sampling's


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _rule(key: str, value, section: Optional[str] = None) -> Optional[str]:
    """What is wrong with `value` for `key` of `section` (None: nothing, or no rule for the key)."""
    if key == "top_k" and section in _MODEL_SECTIONS:
        return None if _number(value) and value >= 1 else "must be at least 1"
    if key in _OPTIONAL_AT_LEAST_1:
        return None if value is None or (_number(value) and value >= 1) else \
            f"must be at least 1, or null for {_OPTIONAL_AT_LEAST_1[key]}"
    if key == "clip_grad_norm":
        return None if value is None or (_number(value) and value > 0) else "must be positive, or null for no clipping"
    if key == "betas":
        ok = isinstance(value, list) and len(value) == 2 and all(_number(b) and 0 <= b < 1 for b in value)
        return None if ok else "must be two numbers in [0, 1), e.g. [0.9, 0.99]"
    if key == "min_lr_ratio":
        return None if _number(value) and 0 <= value <= 1 else "must lie in [0, 1]"
    if key == "resize_ratio":
        return None if _number(value) and 0 < value <= 1 else "must lie in (0, 1]"
    if key in ("offload_optimizer", "offload_param"):
        return None if value in ("none", "cpu", "nvme") else "must be none, cpu or nvme"
    if key == "compile":
        return None if value in COMPILE_VALUES else "must be false, default or reduce-overhead (true: default)"
    if key == "zero_stage":
        return None if value in (0, 1, 2, 3) else "must be 0, 1, 2 or 3"
    if key == "n_local_attn_heads":
        ok = (isinstance(value, int) and value >= 0) or (isinstance(value, list) and all(
            isinstance(v, int) and v >= 0 for v in value))
        return None if ok else "must be an int >= 0, or one int >= 0 per layer"
    checks: list[tuple[set, Callable[[Any], bool], str]] = [
        (_AT_LEAST_1, lambda v: v >= 1, "must be at least 1"),
        (_AT_LEAST_0, lambda v: v >= 0, "must be 0 or more"),
        (_STEPS, lambda v: v >= 0, "must be 0 (off) or a number of steps"),
        (_POSITIVE, lambda v: v > 0, "must be positive"),
        (_FRACTION, lambda v: 0 <= v < 1, "must lie in [0, 1)"),
        (_OPEN_FRACTION, lambda v: 0 < v < 1, "must lie strictly between 0 and 1"),
    ]
    for keys, fine, what in checks:
        if key in keys:
            return None if _number(value) and math.isfinite(value) and fine(value) else what
    return None


def _schema_of(name: str, section: DictConfig):
    if name == "trainer":
        return TrainerConfig
    target = section.get("_target_")
    return next((schema for options in SCHEMAS.values() for schema in options.values() if schema._target_ == target),
                None)


def _unknown_keys(cfg: DictConfig) -> list[str]:
    problems = []
    known_sections = {f.name for f in fields(Config)}
    for key in cfg:
        if key not in known_sections:
            problems.append(f"{key} is not a config section (sections: {', '.join(_SECTIONS)})")
    for name in _SECTIONS:
        section = cfg.get(name)
        schema = _schema_of(name, section) if isinstance(section, DictConfig) else None
        if schema is None:
            continue
        known = [f.name for f in fields(schema)]
        for key in section:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f": did you mean {name}.{close[0]}?" if close else f": {name} has {', '.join(k for k in known if not k.startswith('_'))}"
                problems.append(f"{name}.{key} is not a key of this {name} config{hint}")
    return problems


def _missing(cfg: DictConfig) -> list[str]:
    hints = {"data.path": "the folder or file to read"}
    try:
        missing = OmegaConf.missing_keys(cfg)
    except InterpolationResolutionError as e:  # ${...} naming what this config lacks, or an unset variable
        if _resolved_in_the_run(e):
            raise
        reason = f"{e.full_key}: {e.msg.splitlines()[0]}"
        if "Environment variable" in e.msg:
            return [f"{reason}: set it, or give {e.full_key} a value"]
        if "data.image_size" in e.msg:
            return [f"{reason}: an image model reads data.image_size: use data=shapes or data=image_folder"]
        return [f"{reason}: the groups chosen do not go together, or set {e.full_key}=<a value>"]
    return [f"{key} has no value: set {key}=<{hints.get(key, 'a value')}>" for key in sorted(missing)]


def _out_of_range(cfg: DictConfig) -> list[str]:
    problems = []
    for name in _SECTIONS:
        section = cfg.get(name)
        if not isinstance(section, DictConfig):
            continue
        for key in section:
            if OmegaConf.is_missing(section, key):
                continue
            value = section[key]
            value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else getattr(value, "value", value)
            if (what := _rule(key, value, name)) is not None:
                problems.append(f"{name}.{key}={value} {what}")
    return problems


def _across_sections(cfg: DictConfig) -> list[str]:
    """Rules between sections: a sample's prime is an excerpt of one validation sequence."""
    prime, seq_len = OmegaConf.select(cfg, "task.prime_length"), OmegaConf.select(cfg, "data.seq_len")
    if _number(prime) and _number(seq_len) and prime >= seq_len:
        return [f"task.prime_length={prime} must be shorter than data.seq_len={seq_len}"]
    return []


def check_config(cfg: DictConfig) -> None:
    """Every problem of the composed config at once, as one line; nothing is built before it passes."""
    problems = _unknown_keys(cfg) + _missing(cfg)
    problems += _out_of_range(cfg) + _across_sections(cfg) if not problems else []
    if problems:
        raise UserError("; ".join(problems))


def parts_error(cfg: DictConfig) -> Optional[str]:
    """What a model's constructor refuses of its knobs (NSA: heads % kv_heads, compress_stride <=
    compress_block_size, ...), what the data's settings alone refuse (its class's check_settings), or
    what the task refuses of the models and the data's kind, as one line: the model, draft and VAE
    built on PyTorch's meta device (no memory, no weights, ~10 ms each), then handed to the task's
    check_parts; None when each passes or fails otherwise (a run says why)."""
    import torch
    from hydra.utils import get_class

    from experiments.config.schema import SCHEMAS
    from experiments.runtime.build import build

    nets, built = {}, True
    for slot, prefix in (("model", ""), ("draft", "draft_"), ("vae", "vae_")):
        if cfg.get(slot) is not None:
            try:
                with torch.device("meta"):
                    nets[prefix] = build(cfg[slot], slot)
            except UserError as e:
                return str(e)
            except Exception:  # not a knob's fault (a constructor that needs real memory): the run will say
                built = False
    target = cfg.data._target_
    data_name = next((name for name, schema in SCHEMAS["data"].items() if schema._target_ == target), target)
    try:
        data_class = get_class(target)
        if hasattr(data_class, "check_settings"):  # what the data's settings alone decide (a passkey's room)
            settings = OmegaConf.to_container(cfg.data, resolve=True)
            data_class.check_settings(**{k: v for k, v in settings.items() if k != "_target_"})
        if built and hasattr(data_class, "kind"):  # a data class of one's own without a kind: its run says so
            build(cfg.task, "task").check_parts(nets, data_class.kind, data_name)
    except UserError as e:
        return str(e)
    except Exception:  # not the parts' fault (a class that does not import here): the run will say
        return None
    return None


def _key_hint(section: str, key: str, schema: str) -> Optional[str]:
    """What to say of `section.key`, which the option chosen (its schema's class name) lacks: the
    options that have it; else the key of that option closest to it (a misspelling); else the
    closest key of another option, naming the options that have that."""
    group = {"draft": "model", "vae": "model"}.get(section, section)
    options = {"": TrainerConfig} if section == "trainer" else SCHEMAS.get(group, {})
    chosen = [name for name, node in options.items() if node.__name__ == schema]
    pick = f"model@{section}" if section in ("draft", "vae") else group  # how an option is chosen

    def keys(*names: str) -> list[str]:
        return sorted({f.name for name in names for f in fields(options[name]) if not f.name.startswith("_")})

    def owners(name: str) -> str:
        return ", ".join(f"{pick}={option}" for option in options if name in keys(option))

    if chosen and owners(key):  # a key of another option, before any near miss (kv_heads is no misspelt heads)
        return (f"{section}.{key} is a key of {owners(key)}, not of {pick}={chosen[0]}: choose such an option, "
                "or leave the key out")
    if close := difflib.get_close_matches(key, keys(*(chosen or options)), n=1):
        return f"did you mean {section}.{close[0]}?"
    if close := difflib.get_close_matches(key, keys(*options), n=1):
        return f"did you mean {section}.{close[0]} (a key of {owners(close[0])})?"
    return None


def composition_error(config_dir: str, overrides: list[str]) -> Optional[str]:
    """Hydra's complaint about composing the config with `overrides` (a misspelt key or option, a value
    of the wrong type), or a rule of check_config or of the models' constructors that it breaks, as one
    line; None when it passes. Hydra would print the first over several lines, and the rest would be
    found in the run directory, made by then."""
    failed = _first_failing(config_dir, [overrides], check=True)
    return failed and failed[1]


# a sweep's jobs composed one by one before any starts, at most this many (past it: each value once)
SWEEP_JOBS_CHECKED = 16  # ~0.1 s each


def sweep_error(config_dir: str, overrides: list[str]) -> Optional[str]:
    """The first job of a sweep (`train.py -m <overrides>`) whose config does not compose or breaks a
    rule of check_config or of its models' constructors, as one line naming its swept values; None
    when every job passes. Hydra would stop the sweep at that job over several lines, and a job
    breaking a rule would be recorded failed after the jobs before it had run. The jobs are every
    combination of the discrete sweeps (a,b, range(), choice()), or past SWEEP_JOBS_CHECKED of them
    each value once beside the others' first; a value a sweeper samples or expands (interval(),
    glob()) is left to it."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra.errors import HydraException

    try:
        fixed, swept = _fixed_and_swept(OverridesParser.create().parse_overrides(overrides))
    except HydraException as e:  # a syntax error
        return _unreadable_override(overrides) or _one_line(e)
    if error := _sweep_options_error(config_dir, overrides):
        return error
    if math.prod(len(values) for values in swept) <= SWEEP_JOBS_CHECKED:
        jobs = [list(job) for job in itertools.product(*swept)]
    else:
        firsts = [values[0] for values in swept]
        jobs = [firsts[:i] + [value] + firsts[i + 1:] for i, values in enumerate(swept) for value in values]
    if not (failed := _first_failing(config_dir, [[*fixed, *job] for job in jobs], check=True)):
        return None
    swept_values, error = failed[0][len(fixed):], failed[1]
    if not swept_values or (_first_failing(config_dir, [fixed], check=True) or (None, None))[1] == error:
        return error  # not the swept values' doing: as a single run says it
    return f"the sweep's job {' '.join(swept_values)}: {error}"


def _fixed_and_swept(parsed: list) -> tuple[list[str], list[list[str]]]:
    """Hydra's parsed overrides -> (the fixed ones, each discrete sweep's `key=value`s); a value a
    sweeper samples or expands (interval(), glob()) is left to it."""
    from hydra.errors import HydraException

    fixed, swept = [], []
    for override in parsed:
        if not override.is_sweep_override():
            fixed.append(override.input_line)
        elif override.is_discrete_sweep():
            try:
                values = list(override.sweep_string_iterator())
            except HydraException:  # glob(): the sweeper expands it against the config
                continue
            swept.append([f"{override.get_key_element()}={value}" for value in values])
    return fixed, swept


def sweep_hydra_config(config_dir: str, overrides: list[str]) -> Optional[DictConfig]:
    """The `hydra` section a sweep's overrides compose (its launcher, its sweeper), each swept key at
    its first value; None when they do not compose (the jobs' own composition says why)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from experiments.config.schema import register

    register()  # the schemas the config names, whoever calls first
    try:
        fixed, swept = _fixed_and_swept(OverridesParser.create().parse_overrides(overrides))
        with initialize_config_dir(config_dir=config_dir, version_base="1.3", job_name="train"):
            return compose(config_name="config", overrides=[*fixed, *(values[0] for values in swept)],
                           return_hydra_config=True).hydra
    except (HydraException, OmegaConfBaseException):
        return None


def runs_jobs_in_parallel(hydra: Optional[DictConfig]) -> bool:
    """Whether the sweep's launcher runs its jobs in worker processes at once (joblib: local_gpus)."""
    return hydra is not None and "joblib" in str(hydra.launcher.get("_target_", ""))


def runs_jobs_elsewhere(hydra: Optional[DictConfig]) -> bool:
    """Whether the sweep's launcher runs its jobs in other processes (joblib's workers, SLURM's tasks),
    whose failures this process learns only from their summaries."""
    return hydra is not None and any(name in str(hydra.launcher.get("_target_", "")) for name in ("joblib", "submitit"))


def failures_tolerated(hydra: Optional[DictConfig]) -> float:
    """How many of a sweep's jobs may fail before it exits 1: Optuna's `max_failure_rate` (0 by
    default) of its `n_trials`; none under any other sweeper."""
    if hydra is None:
        return 0.0
    # plus a hair: 0.29 * 100 is 28.999999999999996 in floats, and Optuna allows 29 failures of 100
    return float(hydra.sweeper.get("max_failure_rate", 0.0)) * hydra.sweeper.get("n_trials", 0) + 1e-9


def searches_with_optuna(hydra: Optional[DictConfig]) -> bool:
    """Whether the sweep's trials are Optuna's (`hydra/sweeper=optuna`), not a grid of overrides."""
    return hydra is not None and "optuna" in str(hydra.sweeper.get("_target_", ""))


def _sweep_options_error(config_dir: str, overrides: list[str]) -> Optional[str]:
    """The parallel launcher's and Optuna's options that would fail the sweep after its directory is
    made (joblib's n_jobs=0, Optuna's n_trials=0 or an unknown direction), as one line. A SLURM
    launcher's options are checked against the cluster by experiments.runtime.cluster."""
    if (hydra := sweep_hydra_config(config_dir, overrides)) is None:
        return None
    launcher, sweeper = hydra.launcher, hydra.sweeper
    if runs_jobs_in_parallel(hydra) and (not isinstance(launcher.get("n_jobs"), int) or launcher.n_jobs == 0):
        return (f"hydra.launcher.n_jobs={launcher.get('n_jobs')} must be the number of jobs at once (1 or more; "
                "-1: one a CPU)")
    if searches_with_optuna(hydra):
        if not (isinstance(sweeper.get("n_trials"), int) and sweeper.n_trials >= 1):
            return f"hydra.sweeper.n_trials={sweeper.get('n_trials')} must be at least 1"
        directions = sweeper.get("direction")
        directions = list(directions) if OmegaConf.is_list(directions) else [directions]
        if not all(str(d).lower() in ("minimize", "maximize") for d in directions):
            return f"hydra.sweeper.direction={sweeper.get('direction')} must be minimize or maximize"
    return None


def _first_failing(config_dir: str, jobs: list[list[str]], check: bool = False) -> Optional[tuple[list[str], str]]:
    """(overrides, one line) of the first job whose config does not compose (or, with check, breaks a
    rule of check_config or of its models' constructors), composing them in one Hydra context; None
    when none fails."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from experiments.config.schema import register

    register()  # the schemas the config names, whoever calls first
    with initialize_config_dir(config_dir=config_dir, version_base="1.3", job_name="train"):
        for overrides in jobs:
            try:
                cfg = compose(config_name="config", overrides=overrides)
                if check:
                    check_config(cfg)
                    if error := parts_error(cfg):
                        return overrides, error
            except (HydraException, OmegaConfBaseException) as e:
                if _resolved_in_the_run(e):  # checked there
                    continue
                return overrides, _unreadable_override(overrides) or _one_line(e)
            except UserError as e:
                return overrides, str(e)
    return None


def _resolved_in_the_run(e: Exception) -> bool:
    """Whether a value failed to resolve because it is a ${hydra:...}: the run's own settings, set once it runs."""
    return "HydraConfig was not set" in str(e)


def _unreadable_override(overrides: list[str]) -> Optional[str]:
    """The first override Hydra's grammar cannot read, with how to quote it; None when each parses."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except HydraException:
            key, _, value = override.partition("=")
            if value.startswith(("[", "{")) or "(" in value:  # a list, dict or sweep written wrong: Hydra's words
                return None
            return (f"{override}: Hydra's override grammar cannot read this value (it reserves ~ = ( ) [ ] {{ }} , "
                    f"and spaces in unquoted values): quote it, as '{key}=\"{value}\"' in the shell")
    return None


def _one_line(e: Exception) -> str:
    """Hydra's multi-line complaint as one line, with a hint for a key the option chosen lacks."""
    text = str(e) + (f"\n{e.__cause__}" if e.__cause__ is not None else "")
    text = re.sub(r"To append to your config use \S+", "", text.split("Config search path:")[0])
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    bad = re.search(r"Could not override '(\w+)\.([\w.]+)'.*?not in '(\w+)'", text, re.S)
    if bad and (hint := _key_hint(*bad.groups())):
        lines.append(hint)
    lines = [line for line in lines if not line.startswith(("full_key:", "object_type=", "reference_type="))]
    return " ".join(line if line.endswith((":", ".")) else line + ";" for line in lines).rstrip(";") + \
        " (python train.py --help lists every group and option, and the keys of those chosen)"


def flag_error(flags: dict[str, tuple[str, Any]]) -> Optional[str]:
    """The command-line tools' flags checked by the config's rules: {flag: (config key it stands for,
    value)} -> one line naming every bad flag, or None."""
    problems = [f"{flag}={value} {what}".replace("or null for", "or leave the flag out for")
                for flag, (key, value) in flags.items() if (what := _rule(key, value))]
    return "; ".join(problems) or None
