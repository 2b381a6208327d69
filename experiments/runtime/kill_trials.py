"""Kill trials: train a small run, kill it at random moments, resume it until it completes, and
check what the project promises of an interrupted run.

    python -m experiments.runtime.kill_trials                          # 20 trials of a tiny dense model
    python -m experiments.runtime.kill_trials --trials 30 --seed 1 -- model=nsa backend=deepspeed

One uninterrupted run is the reference. Each trial starts the same run in a fresh directory and
kills it 1 to 3 times, mostly with SIGKILL, sometimes SIGTERM or SIGINT, at a moment drawn
uniformly over the reference's training (three kills in four: steps, validations, checkpoint
writes) or over its start-up; then it reruns the same command until the run completes. A trial passes when:
- metrics.jsonl holds every training step once, none missing, and the same validation steps;
- every loss and validation figure equals the reference's exactly;
- no temporary file is left in the run directory or its checkpoints/;
- every checkpoint left loads (checkpoint.load: weights_only, format checked);
- summary.json says "completed" with the reference's final figures;
- a SIGTERM or SIGINT that reached the training loop exited 128 + the signal with status
  "interrupted".

Overrides after `--` apply to the reference and every trial. Exits 1 when a trial fails.
"""

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.config.checks import flag_error

ROOT = Path(__file__).resolve().parents[2]

# small enough for many trials, long enough (several checkpoints and validations) to be hit mid-way
BASE = [
    "model=transformer", "model.dim=32", "model.depth=1", "model.heads=2", "model.dim_head=16",
    "data.seq_len=32", "trainer.batch_size=2", "trainer.max_steps=200", "trainer.checkpoint_every=4",
    "trainer.keep_checkpoints=2", "trainer.validate_every=20", "trainer.val_batches=2", "trainer.log_every=1",
    "trainer.progress=false", "trainer.threads=1", "task.prime_length=8", "task.generate_length=8", "tracker=none",
]
SIGNALS = [signal.SIGKILL] * 6 + [signal.SIGTERM, signal.SIGINT]  # mostly the kill nothing can catch
FIGURES = ("loss", "val_loss", "val_accuracy", "val_bpc")


def train_command(run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *BASE, *overrides]


def run_to_end(run_dir: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(train_command(run_dir, overrides), cwd=ROOT, capture_output=True, text=True)


def timed_reference(run_dir: Path, overrides: list[str]) -> tuple[float, float]:
    """Run the reference to its end -> (seconds until its first metrics row, seconds in all)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(train_command(run_dir, overrides), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    first_row = None
    while proc.poll() is None:
        if first_row is None and (run_dir / "metrics.jsonl").exists():
            first_row = time.perf_counter() - t0
        time.sleep(0.01)
    if proc.returncode != 0:
        last = (proc.stderr.read().strip().splitlines() or ["(no output)"])[-1].removeprefix("error: ")
        sys.exit(f"error: the uninterrupted reference run failed ({proc.returncode}): {last}")
    wall = time.perf_counter() - t0
    return first_row or wall, wall


def interrupt(run_dir: Path, overrides: list[str], after_s: float, sig: signal.Signals) -> tuple[int, str]:
    """Start the run, send `sig` after `after_s` seconds (unless it ended first) -> (exit code, the
    status this session wrote to summary.json, or "-" where it wrote none)."""
    before = summary_mtime(run_dir)
    proc = subprocess.Popen(train_command(run_dir, overrides), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        proc.wait(timeout=after_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(sig)
        proc.wait()
    if summary_mtime(run_dir) == before:
        return proc.returncode, "-"
    try:
        return proc.returncode, json.loads((run_dir / "summary.json").read_text()).get("status", "?")
    except (OSError, ValueError):
        return proc.returncode, "unreadable"


def summary_mtime(run_dir: Path) -> int:
    try:
        return (run_dir / "summary.json").stat().st_mtime_ns
    except OSError:
        return 0


def rows_by_step(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """metrics.jsonl -> (training rows, validation rows) in file order."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


def problems(run_dir: Path, reference: Path) -> list[str]:
    """What a completed, once-interrupted run does differently from the uninterrupted reference."""
    from experiments.runtime import checkpoint
    from experiments.runtime.errors import UserError

    found = []
    try:
        train, val = rows_by_step(run_dir)
    except (OSError, ValueError) as e:
        return [f"metrics.jsonl unreadable ({e})"]
    ref_train, ref_val = rows_by_step(reference)
    steps, ref_steps = [r["step"] for r in train], [r["step"] for r in ref_train]
    if len(set(steps)) < len(steps):
        found.append(f"training steps repeated: {sorted({s for s in steps if steps.count(s) > 1})}")
    if missing := sorted(set(ref_steps) - set(steps)):
        found.append(f"training steps missing: {missing}")
    if [r["step"] for r in val] != [r["step"] for r in ref_val]:
        found.append(f"validation steps {[r['step'] for r in val]}, reference {[r['step'] for r in ref_val]}")
    ours = {(r["step"], k): r[k] for r in train + val for k in FIGURES if k in r}
    theirs = {(r["step"], k): r[k] for r in ref_train + ref_val for k in FIGURES if k in r}
    if differ := sorted(key for key in theirs if key in ours and ours[key] != theirs[key]):
        step, key = differ[0]
        found.append(f"{len(differ)} figures differ, first {key} at step {step}: {ours[(step, key)]} vs "
                     f"{theirs[(step, key)]}")
    folders = (run_dir, run_dir / "checkpoints", run_dir / "samples")
    if leftovers := sorted(p.name for folder in folders for p in folder.glob(".*.tmp")):
        found.append(f"temporary files left: {leftovers}")
    for path in checkpoint.list_checkpoints(run_dir / "checkpoints"):
        try:
            checkpoint.load(path)
        except UserError as e:
            found.append(f"corrupt checkpoint: {e}")
    summary, ref_summary = (json.loads((d / "summary.json").read_text()) for d in (run_dir, reference))
    if summary.get("status") != "completed":
        found.append(f"summary status {summary.get('status')!r}")
    if differ := [k for k in FIGURES if summary.get(k) != ref_summary.get(k)]:
        found.append(f"summary figures differ: {differ}")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.runtime.kill_trials",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="train.py overrides (after --) for every run")
    args = parser.parse_args(argv)
    if error := flag_error({"--trials": ("count", args.trials)}):
        parser.error(error)

    with tempfile.TemporaryDirectory(prefix="kill-trials-") as tmp:
        reference = Path(tmp) / "reference"
        startup, wall = timed_reference(reference, args.overrides)
        print(f"reference: {len(rows_by_step(reference)[0])} training steps; first row after {startup:.1f} s, "
              f"{wall:.1f} s in all")

        rng, failed, sent, stopped = random.Random(args.seed), 0, 0, 0
        for trial in range(args.trials):
            run_dir = Path(tmp) / f"trial{trial:03d}"
            kills, found = [], []
            for _ in range(rng.randint(1, 3)):
                after_s = rng.uniform(startup, wall) if rng.random() < 0.75 else rng.uniform(0, startup)
                sig = rng.choice(SIGNALS)
                code, status = interrupt(run_dir, args.overrides, after_s, sig)
                kills.append(f"{sig.name}@{after_s:.1f}s->{code}/{status}")
                sent, stopped = sent + 1, stopped + (code != 0)  # 0: the run had ended before the signal
                if sig != signal.SIGKILL and status == "interrupted" and code != 128 + sig:
                    found.append(f"{sig.name} recorded 'interrupted' but exited {code}, not {128 + sig}")
            result = run_to_end(run_dir, args.overrides)
            if result.returncode != 0:
                found.append(f"the resumed run failed ({result.returncode}): {result.stderr.strip().splitlines()[-1:]}")
            else:
                found += problems(run_dir, reference)
            failed += bool(found)
            print(f"trial {trial:3d}  {'FAIL' if found else 'ok  '}  {' '.join(kills)}")
            for line in found:
                print(f"           {line}")
        print(f"{args.trials - failed} of {args.trials} trials resumed exactly; {stopped} of the {sent} signals "
              "stopped a run (the others came after it had ended)")
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
