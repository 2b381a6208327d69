"""train.py with a fault injected: rank 1 raises at its second training step (for the test that
a failing rank fails the whole job, with its own error in summary.json)."""

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments import launch  # noqa: E402
from experiments.language_model import LanguageModelTask  # noqa: E402

_train_step = LanguageModelTask._train_step


def _failing_train_step(self, step):
    if step == 1 and launch.rank() == 1:
        raise RuntimeError("injected failure on rank 1")
    return _train_step(self, step)


LanguageModelTask._train_step = _failing_train_step
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
