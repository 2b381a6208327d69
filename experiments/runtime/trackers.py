"""Experiment trackers. metrics.jsonl is written whatever the tracker; these only mirror it."""

import logging
import os
from typing import Optional

from experiments.runtime.errors import UserError

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
    """One wandb run per job, in the run directory; offline by default (no prompt, no network).

    Its id is the run directory's, so every session of a resumed run (a requeued SLURM job) is one
    wandb run. SLURM's SIGTERM reaches wandb's service process too, which then stops at once, with
    what it had not written yet: the run goes on to its checkpoint without it. Offline, wandb cannot
    append to an earlier session's files, so each session logs the rows of metrics.jsonl up to where
    it resumes, then its own, and removes the earlier sessions' copies: the run directory holds one
    offline run with every step once."""

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

        try:
            self.wandb_run = self._init(wandb, run, config)
        except (wandb.errors.UsageError, wandb.errors.CommError, wandb.errors.AuthenticationError) as e:
            # not logged in, or no network: one line, as any setting that cannot work
            raise UserError(f"tracker.mode={self.mode}: wandb refused to start ({str(e).splitlines()[0]}): run "
                            "`wandb login` (or set WANDB_API_KEY) where the network reaches wandb, or use "
                            "tracker.mode=offline") from None
        if self.mode == "offline":
            self._replay(run)

    def _init(self, wandb, run, config: dict):
        return wandb.init(
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

    def _replay(self, run) -> None:
        """The rows of metrics.jsonl before this session (only those up to its checkpoint are left),
        logged again; then the earlier sessions' offline runs of this id are removed."""
        import json
        import shutil
        from pathlib import Path

        from experiments.tasks.positions import scalars

        if run.metrics_path.is_file():
            for line in run.metrics_path.read_text().splitlines():
                row = json.loads(line)
                self.log(scalars(row), row["step"])
        if self.wandb_run is None:  # its service stopped while replaying: nothing of this session to keep
            return
        this = Path(self.wandb_run.dir).parent  # <run dir>/wandb/offline-run-<time>-<id>/files
        for earlier in this.parent.glob(f"offline-run-*-{self.wandb_run.id}"):
            if earlier != this:
                shutil.rmtree(earlier, ignore_errors=True)

    def log(self, metrics: dict, step: int) -> None:
        if self.wandb_run is not None:
            try:
                self.wandb_run.log(metrics, step=step)
            except Exception as e:  # its service stopped (SLURM's SIGTERM reaches it too)
                self._lost(e)

    def log_text(self, key: str, text: str, step: int) -> None:
        if self.wandb_run is not None:
            import wandb

            self.log({key: wandb.Html(f"<pre>{_escape(text)}</pre>")}, step)

    def log_images(self, key: str, images, captions: list[str], step: int) -> None:
        if self.wandb_run is not None:
            import wandb

            arrays = (images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).astype("uint8")
            self.log({key: [wandb.Image(a, caption=c) for a, c in zip(arrays, captions)]}, step)

    def finish(self, status: str) -> None:
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish(exit_code=0 if status == "completed" else 1)
            except Exception as e:
                self._lost(e)
            self.wandb_run = None

    def _lost(self, error: Exception) -> None:
        log.warning("wandb stopped (%s: %s); metrics.jsonl has every row, and a resumed session logs "
                    "them to wandb again", type(error).__name__, error)
        self.wandb_run = None


def _run_id(directory) -> str:
    """A stable id per run directory, so a resumed run continues its wandb run."""
    import hashlib

    return hashlib.sha1(str(os.path.abspath(directory)).encode()).hexdigest()[:12]


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
