"""Experiment trackers. metrics.jsonl is written whatever the tracker; these only mirror it."""

import logging
import os
from typing import Optional

log = logging.getLogger(__name__)


class NoTracker:
    def __init__(self, project: str, name: Optional[str] = None, group: Optional[str] = None,
                 tags: Optional[list] = None):
        self.project, self.name, self.group, self.tags = project, name, group, list(tags or [])

    def start(self, run, config: dict) -> None:
        pass

    def log(self, metrics: dict, step: int) -> None:
        pass

    def log_text(self, key: str, text: str, step: int) -> None:
        pass

    def log_images(self, key: str, images, captions: list[str], step: int) -> None:
        """images [batch, channels, h, w] in [0, 1], one caption each."""

    def finish(self, status: str) -> None:
        pass


class WandbTracker(NoTracker):
    """One wandb run per job, in the run directory; offline by default (no prompt, no network)."""

    def __init__(self, project: str, mode, entity: Optional[str] = None, name: Optional[str] = None,
                 group: Optional[str] = None, tags: Optional[list] = None):
        super().__init__(project, name, group, tags)
        self.entity = entity
        self.mode = getattr(mode, "value", mode)
        self.wandb_run = None

    def start(self, run, config: dict) -> None:
        if not run.is_main or self.mode == "disabled":
            return
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self.wandb_run = wandb.init(
            project=self.project,
            entity=self.entity,
            mode=self.mode,
            dir=str(run.dir),
            name=self.name or run.name,
            group=self.group or run.group,
            tags=self.tags,
            config=config,
            resume="allow",
            id=_run_id(run.dir),
            settings=wandb.Settings(console="off"),
        )

    def log(self, metrics: dict, step: int) -> None:
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)

    def log_text(self, key: str, text: str, step: int) -> None:
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.log({key: wandb.Html(f"<pre>{_escape(text)}</pre>")}, step=step)

    def log_images(self, key: str, images, captions: list[str], step: int) -> None:
        if self.wandb_run is not None:
            import wandb

            arrays = (images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).astype("uint8")
            self.wandb_run.log({key: [wandb.Image(a, caption=c) for a, c in zip(arrays, captions)]}, step=step)

    def finish(self, status: str) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=0 if status == "completed" else 1)
            self.wandb_run = None


def _run_id(directory) -> str:
    """A stable id per run directory, so a resumed run continues its wandb run."""
    import hashlib

    return hashlib.sha1(str(os.path.abspath(directory)).encode()).hexdigest()[:12]


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
