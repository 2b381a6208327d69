"""train.py with something happening to rank 1 alone at its second training step, as
RANK_ONE says: `fail` (it raises) or `stop` (as if only it had received SIGTERM)."""

import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments.runtime import launch  # noqa: E402
from experiments.tasks.loop import Loop  # noqa: E402

_train_step = Loop._train_step


def _train_step_with_event(self, step, active):
    if step == 1 and launch.rank() == 1:
        if os.environ["RANK_ONE"] == "fail":
            raise RuntimeError("injected failure on rank 1")
        self.run.stop_requested = True
    return _train_step(self, step, active)


Loop._train_step = _train_step_with_event
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
