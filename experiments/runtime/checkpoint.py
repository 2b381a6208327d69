"""Checkpoints: atomic writes, loaded with weights_only=True, found by step.

A checkpoint is a plain dict of tensors, numbers and strings:
    {"format": FORMAT, "step", "model", "optimizer", "schedule", "rng", "config" (yaml),
     "data_fingerprint", "wall_s", ...task extras}
"""

import pickle
import re
import shutil
from pathlib import Path
from typing import Optional

import torch

from experiments.runtime.errors import UserError
from experiments.runtime.files import atomic_write

FORMAT = "sparse-attention-checkpoint/1"
_NAME = re.compile(r"^step_(\d+)\.pt$")


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"step_{step:07d}.pt"


def list_checkpoints(directory: Path) -> list[Path]:
    """Finished checkpoints in `directory`, oldest first (temporary files are ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def save(state: dict, directory: Path, keep: int = 1) -> Path:
    """Write state as checkpoints/step_<step>.pt atomically, then drop all but the `keep` newest."""
    path = checkpoint_path(directory, state["step"])
    atomic_write(path, lambda f: torch.save({"format": FORMAT, **state}, f))
    for old in list_checkpoints(directory)[: -max(keep, 1)]:
        old.unlink(missing_ok=True)
        shutil.rmtree(old.with_suffix(""), ignore_errors=True)  # its engine state (DeepSpeed), if any
    return path


def resolve(spec: str | Path, key: str = "trainer.resume") -> Path:
    """A checkpoint file, or a run directory (its latest checkpoint); `key` names the setting."""
    path = Path(spec)
    if path.is_dir():
        found = list_checkpoints(path / "checkpoints") or list_checkpoints(path)
        if not found:
            raise UserError(f"{key}={spec} is not a run directory (it holds no checkpoints/step_*.pt): point it at "
                            "a run directory that has written a checkpoint, or at a checkpoint file")
        return found[-1]
    if not path.is_file():
        raise UserError(f"{key}={spec}: no such checkpoint file or run directory")
    return path


def load(path: Path, map_location: str | torch.device = "cpu", key: str = "trainer.resume") -> dict:
    """Load a checkpoint safely (weights_only), with one clear message if it is not ours; `key`
    names the setting that pointed at it (the message's advice differs)."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        # torch's own words, cut before its advice (which is to load the file unsafely)
        why = ("torch's safe loader refuses it" if isinstance(e, pickle.UnpicklingError) else
               f"{type(e).__name__}: {str(e).splitlines()[0].split('. ')[0]}")
        if key == "trainer.resume" and _is_run_checkpoint(path):  # a run's own, cut by a kill or a full disk
            advice = ("delete it to resume from an older checkpoint, or start afresh with trainer.resume=never in a "
                      "new hydra.run.dir")
        else:
            advice = f"point {key} at a run directory or at one of its checkpoints/step_*.pt"
        raise UserError(f"checkpoint {path} cannot be read ({why}): it is corrupt, truncated or not a checkpoint: "
                        f"{advice}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(
            f"checkpoint {path} was not written by this project (expected format {FORMAT!r}); "
            f"point {key} at one of this project's checkpoints or run directories"
        )
    return state


def _is_run_checkpoint(path: Path) -> bool:
    """Whether the path is where a run writes its checkpoints (checkpoints/step_<n>.pt)."""
    return path.parent.name == "checkpoints" and path.name.startswith("step_") and path.suffix == ".pt"


def load_weights(module: torch.nn.Module, state: dict, key: str, path: Path,
                 built_from_checkpoint: bool = True) -> None:
    """module.load_state_dict(state[key]), or one message saying which weights do not fit: the module
    was built from the checkpoint's own config (a member of a finished run) or from this run's."""
    if key not in state:
        raise UserError(f"{path} holds no {key}: it is not a checkpoint of this kind of run")
    try:
        result = module.load_state_dict(state[key], strict=False)
        problems = [f"{kind}: {_first(names)}" for kind, names in
                    (("missing", result.missing_keys), ("unexpected", result.unexpected_keys)) if names]
    except RuntimeError as e:  # tensors whose shapes differ
        problems = [line.strip() for line in str(e).splitlines()[1:2]]
    if problems and built_from_checkpoint:
        raise UserError(
            f"{path}: its {key} does not fit the model this code builds from the checkpoint's config "
            f"({'; '.join(problems)}). It was written by another version of the code or for other model "
            "overrides: use the code that wrote it, or train afresh"
        )
    if problems:
        raise UserError(
            f"{path}: its {key} is not this run's model ({'; '.join(problems)}): point trainer.resume at a "
            "checkpoint of this model, or start from the weights that fit with trainer.init_from"
        )


def _first(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def latest(directory: Path) -> Optional[Path]:
    found = list_checkpoints(directory)
    return found[-1] if found else None
