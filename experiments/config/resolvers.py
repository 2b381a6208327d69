"""Resolvers the config names: `${job_subdir:...}` (conf/config.yaml's hydra.sweep.subdir) and
`${from_dense:...}` (a model default that differs for a run started from trained weights)."""

import hashlib
import os
import sys
from typing import Any, Optional

# the swept keys, as train.py read them from its command line: a launcher runs a job where sys.argv is
# its own (submitit's `python -m submitit.core._submit <folder>` on a SLURM node, a joblib worker), so
# train.py exports them for the job's process, which inherits the environment
SWEPT_KEYS_ENV = "SPARSE_ATTENTION_SWEPT_KEYS"


def export_swept_keys(args: list[str]) -> None:
    """Record the keys `args` sweeps for the jobs' processes (nothing when it cannot be parsed)."""
    swept = _swept_keys(args)
    if swept is None:
        os.environ.pop(SWEPT_KEYS_ENV, None)
    else:
        os.environ[SWEPT_KEYS_ENV] = ",".join(sorted(swept))


def swept_keys() -> Optional[set[str]]:
    exported = os.environ.get(SWEPT_KEYS_ENV)
    if exported is not None:
        return {k for k in exported.split(",") if k}
    return _swept_keys(sys.argv[1:])


def job_subdir(task_overrides: Any, seed: Any, sweeper_params: Any = None, job_num: Any = None) -> str:
    """A sweep job's directory: the values of the swept keys (not every override on the command
    line), then the seed as its own last level, e.g. `model.num_fine_selected=4/seed=1`. A sweeper
    that picks values itself (Optuna) may pick the same ones twice, so its jobs lead with
    `trial=<job number>`."""
    swept = swept_keys()
    if swept is not None and sweeper_params:
        swept |= set(sweeper_params)
    parts = sorted(
        o.replace("%", "%25").replace("/", "%2F") for o in task_overrides  # a path's / escaped one way only
        if (key := o.split("=", 1)[0].lstrip("+~")) != "trainer.seed" and (swept is None or key in swept)
    )
    if sweeper_params:
        parts.insert(0, f"trial={job_num}")
    name = _fitted(",".join(parts))
    return f"{name}/seed={seed}" if name else f"seed={seed}"


NAME_MAX = 255  # bytes of one directory name (Linux, macOS)


def _fitted(name: str) -> str:
    """name, or where it is longer than a directory name may be, its start and a hash of the whole
    (a sampler's floats, a long path): the job's .hydra/overrides.yaml holds every value."""
    raw = name.encode()
    if len(raw) <= NAME_MAX:
        return name
    digest = hashlib.sha256(raw).hexdigest()[:16]
    return f"{raw[: NAME_MAX - len(digest) - 1].decode(errors='ignore')}~{digest}"


def _swept_keys(args: list[str]) -> Optional[set[str]]:
    """Keys given several values on the command line (None if it cannot be parsed)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        overrides = OverridesParser.create().parse_overrides([a for a in args if not a.startswith("-")])
    except Exception:
        return None
    return {o.key_or_group for o in overrides if o.is_sweep_override()}


def from_dense(converted: Any, scratch: Any, *, _root_: Any) -> Any:
    """`${from_dense:a,b}`: a where trainer.init_from names weights the run starts from, else b (DSA's
    warm-up trains the indexer alone from a trained dense model, everything from scratch)."""
    from omegaconf import OmegaConf

    return converted if OmegaConf.select(_root_, "trainer.init_from", default=None) else scratch
