"""The run directory (DESIGN.md section 4) and the life of one run inside it.

`Run` owns metrics.jsonl, summary.json, samples/ and checkpoints/ of one Hydra job directory.
Used as a context manager it records how the run ended: "completed", "failed" (with the error)
or "interrupted" (SIGTERM or Ctrl-C: the loop checkpoints at the next step boundary). In a sweep a
failed job is recorded and the sweep goes on, and the sweep exits non-zero at its end, naming the
jobs that failed (`sweep_failures`); a single run exits non-zero with one clear message. An
interrupted run or sweep exits 128 + the signal's number (a launcher that runs each job in its own
process, such as submitit, goes on with the other jobs).

A directory that already holds a run is not touched until the loop accepts this session (`accept`:
the config fits, the checkpoint loads). A session refused or failing before that leaves every file
of the earlier run as it was (train.log, which Hydra appends to, grows by the refusal).
"""

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from experiments.runtime import launch
from experiments.runtime.errors import TrainingError, UserError, storage_problem
from experiments.runtime.files import atomic_write, atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)

# what a run directory holds (DESIGN.md section 4); experiments/review/runs.py reads runs by these names
METRICS, SUMMARY, CHECKPOINTS, SAMPLES, HYDRA = "metrics.jsonl", "summary.json", "checkpoints", "samples", ".hydra"
OVERRIDES = f"{HYDRA}/overrides.yaml"

_failed_here: list[tuple[float, str]] = []  # this process's sweep jobs that failed or were refused: (when, name)
_accepted_here: list[float] = []  # when this process's runs were taken on by the loop


class Run:
    def __init__(
        self,
        directory: Path,
        *,
        name: str = "",
        group: Optional[str] = None,
        choices: Optional[dict] = None,
        multirun: bool = False,
        is_main: bool = True,
    ):
        self.dir = Path(directory)
        self.name = name or self.dir.name
        self.group = group
        self.choices = choices or {}
        self.multirun = multirun
        self.is_main = is_main  # only the main rank writes files
        self.summary: dict[str, Any] = {}
        self.result: Optional[float] = None
        self.stop_requested = False
        self.stop_signal: Optional[int] = None
        self.earlier = False  # the directory held a run before this session
        self.accepted = False  # the loop took this session on: its files may change now
        self._summary_stands = False  # a completed run run again: its summary is not rewritten
        self._start = time.time()
        self._wall_before = 0.0  # wall time of earlier sessions of a resumed run
        self._handlers: dict = {}
        self._requeue: Optional[tuple] = None  # (signal, submitit's handler) in a submitit job

    @property
    def dir_setting(self) -> str:
        """The setting that names where this run lives: a sweep job's directory is its sweep's."""
        return "hydra.sweep.dir" if self.multirun else "hydra.run.dir"

    @classmethod
    def from_hydra(cls, is_main: bool = True) -> "Run":
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        multirun = hc.mode == RunMode.MULTIRUN
        out = Path(hc.runtime.output_dir)
        return cls(
            out,
            # a sweep job is named by its swept values (its path in the sweep), a run by its time
            name=os.path.relpath(out, hc.sweep.dir) if multirun else out.name,
            group="/".join(Path(hc.sweep.dir).parts[-2:]) if multirun else None,  # <date>/<time>
            choices={k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra/")},
            multirun=multirun,
            is_main=is_main,
        )

    # ---- paths -------------------------------------------------------------------------------

    @property
    def metrics_path(self) -> Path:
        return self.dir / METRICS

    @property
    def summary_path(self) -> Path:
        return self.dir / SUMMARY

    @property
    def checkpoint_dir(self) -> Path:
        return self.dir / CHECKPOINTS

    @property
    def samples_dir(self) -> Path:
        return self.dir / SAMPLES

    # ---- records -----------------------------------------------------------------------------

    def log_metrics(self, row: dict) -> None:
        """Append one JSON object (it must hold "step") to metrics.jsonl."""
        if self.is_main:
            try:
                with open(self.metrics_path, "a") as f:
                    f.write(json.dumps(row, default=float) + "\n")
            except OSError as e:  # a full disk, say: name the file (a cut row is dropped on resume)
                raise OSError(e.errno, e.strerror, str(self.metrics_path)) from None

    def truncate_metrics(self, step: int) -> None:
        """Keep only rows up to `step`: a resumed run appends from there without repeating steps."""
        if not (self.is_main and self.metrics_path.exists()):
            return
        lines = self.metrics_path.read_text().splitlines()
        kept = [line for line in lines if (s := _row_step(line)) is not None and s <= step]
        if len(kept) != len(lines):
            atomic_write_text(self.metrics_path, "".join(line + "\n" for line in kept))

    def write_sample(self, name: str, text: str) -> Path:
        path = self.samples_dir / name
        if self.is_main:
            self.samples_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, text)
        return path

    def accept(self, start: int) -> None:
        """The loop takes this session on, from step `start` (0: a fresh start). Clears what a killed
        earlier session left: metrics rows past `start`, temporary files of interrupted writes."""
        self.accepted = True
        _accepted_here.append(time.time())
        if not self.is_main:
            return
        self._keep_hydra_files()  # this session's config is the run's now: kept aside from Hydra's rewrites
        self.truncate_metrics(start)
        for folder in (self.dir, self.checkpoint_dir, self.samples_dir):
            for leftover in folder.glob(".*.tmp"):
                leftover.unlink(missing_ok=True)

    def _keep_hydra_files(self) -> None:
        """Copy this session's .hydra/*.yaml aside: Hydra rewrites them on every start, even for a
        resume that is then refused, which puts back those of the last session accepted (or of the
        directory's first session, where none was)."""
        hydra_dir, original = self.dir / HYDRA, self.dir / HYDRA / "original"
        if hydra_dir.is_dir():
            original.mkdir(exist_ok=True)
            for path in hydra_dir.glob("*.yaml"):
                shutil.copy2(path, original / path.name)

    def restore_hydra_files(self) -> None:
        original = self.dir / HYDRA / "original"
        if self.is_main and original.is_dir():
            for path in original.glob("*.yaml"):
                shutil.copy2(path, self.dir / HYDRA / path.name)

    def update_summary(self, **fields: Any) -> None:
        self.summary.update(fields)

    def wall_s(self) -> float:
        return self._wall_before + time.time() - self._start

    def continue_wall_clock(self, seconds: float) -> None:
        self._wall_before = seconds

    def completed_before(self) -> bool:
        """Whether summary.json records the run as completed (not killed after its last checkpoint)."""
        try:
            return json.loads(self.summary_path.read_text()).get("status") == "completed"
        except (OSError, ValueError, AttributeError):
            return False

    def leave_summary(self) -> None:
        """This session changes nothing the summary records (a completed run with nothing to train)."""
        self._summary_stands = True

    def write_summary(self, status: str, force: bool = False) -> None:
        if (self.earlier and not self.accepted) or self._summary_stands:  # the earlier run's summary stands
            return
        if self.is_main or force:
            self.summary.update(status=status, wall_s=round(self.wall_s(), 2))
            self.summary.setdefault("error", None)
            atomic_write_json(self.summary_path, self.summary)

    # ---- life ----------------------------------------------------------------------------------

    def _request_stop(self, signum, frame) -> None:
        if self.stop_requested and signum == self.stop_signal:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        if self.stop_requested:  # another signal asking the same (Ctrl-C, then a sweep's parent's SIGTERM)
            return
        log.warning("%s received: checkpointing at the end of this step", signal.Signals(signum).name)
        self.stop_requested = True
        self.stop_signal = signum

    def __enter__(self) -> "Run":
        self.dir.mkdir(parents=True, exist_ok=True)
        self.earlier = any(p.exists() for p in (self.summary_path, self.metrics_path, self.checkpoint_dir))
        if self.is_main and not self.earlier:  # the directory's first session: its config is kept aside
            self._keep_hydra_files()  # now, so that a refused rerun puts it back even if this one never trains
        if self.is_main:  # until the end says otherwise: "running", with who runs it (for review)
            self.summary.update(pid=os.getpid(), host=socket.gethostname())
            self.write_summary("running")
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._handlers[sig] = signal.signal(sig, self._request_stop)
            except ValueError:  # not the main thread (a launcher's worker): keep the defaults
                pass
        self._take_over_submitit_requeue()
        return self

    def _take_over_submitit_requeue(self) -> None:
        """In a submitit job (hydra/launcher=slurm), the signal SLURM sends before a time limit (USR2)
        makes submitit requeue the job and exit at once, losing the steps since the last checkpoint.
        Here it stops the run like SIGTERM (a checkpoint at the end of the step); submitit's handler
        then requeues the job (`__exit__`)."""
        sig = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)
        current = signal.getsignal(sig) if sig is not None else None
        if getattr(current, "__name__", "") == "checkpoint_and_try_requeue":
            try:
                self._handlers[sig] = signal.signal(sig, self._request_stop)
                self._requeue = (sig, current)
            except ValueError:
                pass

    def __exit__(self, exc_type, exc, tb) -> bool:
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        if exc_type is None:
            if failure := launch.first_failure():  # another rank failed: so did the job
                self.summary["error"] = failure
                self.write_summary("failed")
                return self._exit(1)
            if self.stop_requested:  # the whole process stops, a sweep too: its later jobs do not start
                self.write_summary("interrupted")
                if self._requeue is not None and self.stop_signal == self._requeue[0]:
                    log.info("checkpointed: submitit requeues the job")
                    self._requeue[1](self.stop_signal, None)  # requeues and exits (rank 0 only)
                sys.exit(128 + (self.stop_signal or signal.SIGTERM))
            self.write_summary("completed")
            return False
        if issubclass(exc_type, KeyboardInterrupt):  # a second Ctrl-C
            self.summary["error"] = "interrupted by the user"
            self.write_summary("interrupted")
            sys.exit(128 + signal.SIGINT)
        if issubclass(exc_type, SystemExit):
            return False
        storage = storage_problem(exc)
        known = issubclass(exc_type, (UserError, TrainingError)) or storage is not None
        message = storage or (str(exc) if known else f"{exc_type.__name__}: {exc}")
        launch.report_failure(message)
        if self.earlier and not self.accepted:  # refused: the earlier run stays as it was
            self.restore_hydra_files()
            message += f" (the run in {self.dir} was left as it was; its train.log notes this refusal)"
        # the first failing rank's error, not a collective's timeout on the ranks that waited for it
        self.summary["error"] = launch.first_failure() or message
        try:
            self.write_summary("failed", force=True)  # a failing rank records why even if rank 0 cannot
        except OSError as e:  # the disk that failed the run may refuse this too: say so, in the same line
            message += f" (summary.json could not record it: {e.strerror})"
        if known:  # train.log records it; the console gets the one line below, not the log's copy too
            _to_log_file(logging.ERROR, message)
        else:  # a bug: the traceback goes to the log once (the console shows the log), Hydra adds none
            log.error("run failed:\n%s", "".join(traceback.format_exception(exc_type, exc, tb)))
        self.result = None  # a sweeper (Optuna) records a trial without a value as failed
        return self._exit(f"error: {message}" if known else f"error: {message} (the traceback is above and in "
                          f"{self.dir / 'train.log'})")

    def _exit(self, status) -> bool:
        """A single run exits with `status`; in a sweep the job's summary records it, the console gets
        its line, and the sweep goes on."""
        if self.multirun:
            if isinstance(status, str):
                print(f"{status} (job {self.name})", file=sys.stderr)
            _failed_here.append((time.time(), self.name))
            return True
        sys.exit(status)


def _to_log_file(level: int, message: str) -> None:
    """A record for the log files only (Hydra's train.log), not the console handler."""
    record = log.makeRecord(log.name, level, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _row_step(line: str) -> Optional[int]:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a line torn by a kill: dropped


def sweep_failures(sweep_dir: Path, since: float, elsewhere: bool = True) -> list[str]:
    """The jobs of the sweep in `sweep_dir` that failed in a launch begun at time `since`, by name:
    those this process ran (a refused rerun too, which leaves its directory as it was) and, where
    the jobs ran `elsewhere` (a parallel or SLURM launcher's processes), those whose summary.json,
    written since, records "failed" (read only then: another launch into the same directory writes
    summaries too)."""
    failed = [name for when, name in _failed_here if when >= since]
    for path in sorted(Path(sweep_dir).rglob(SUMMARY)) if elsewhere and Path(sweep_dir).is_dir() else []:
        try:
            # 2 s of slack: a file system may keep whole seconds; no earlier launch ends so close to this one
            if path.stat().st_mtime >= since - 2.0 and json.loads(path.read_text()).get("status") == "failed":
                failed.append(str(path.parent.relative_to(sweep_dir)))
        except (OSError, ValueError):  # a summary being replaced, or not a run's
            continue
    return list(dict.fromkeys(failed))


@contextlib.contextmanager
def sweep_record_kept_if_no_job_runs(sweep_dir: Path, elsewhere: bool):
    """Around a sweep's launch into a directory that holds one: where no job of the launch was taken
    on (each refused, as another config, or failed before its first step), the sweep's multirun.yaml,
    which Hydra rewrites at every launch, is put back as it was, as a refused run's .hydra/ is. Not
    where the jobs run `elsewhere` (joblib's workers, SLURM), which this process cannot see."""
    record = Path(sweep_dir) / "multirun.yaml"
    before = record.read_bytes() if not elsewhere and record.is_file() else None
    started = time.time()
    try:
        yield
    finally:
        if before is not None and not any(when >= started for when in _accepted_here):
            atomic_write(record, lambda f: f.write(before))
