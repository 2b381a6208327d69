"""Compare run directories: a table, review.md and plots.

    python -m experiments.review outputs/multirun/2026-11-22/10-00-00
    python -m experiments.review outputs/ --metric val_loss --format csv

PATH is a sweep directory, a run directory, or any folder of them (searched recursively). Each
run is named by the overrides that distinguish it from the others (read from
.hydra/overrides.yaml), ranked by its best validation metric, and shown with its status: failed
and interrupted runs with the first line of their error, runs still going with their latest
figures. Runs on different data (their data_fingerprint) are ranked separately, never together.
Language models also show where in the sequence they lose: the final val_bpc of the last bucket of
positions beside val_bpc, every bucket in a table of their own and in bpc_by_position.png.
review.md and the PNG plots are written into the first directory reviewed (a sweep's, a run's: beside
its files), or into --out.
"""

import argparse
import csv
import io
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from experiments.review.plots import BY_POSITION, higher_is_better, plot, position_curves, position_plot, recall_plots
from experiments.runtime.run import HYDRA, METRICS, OVERRIDES, SUMMARY

STALE_S = 600  # a run without a summary and no metrics written for this long was killed

COLUMNS = ["run", "status", "step", "best", "final", "last_bucket", "tokens_per_s", "peak_mem_mb", "params", "wall_s"]
# shown when a run has it: a language model's val_bpc over the last positions of its sequence (the
# longest-range figure); NSA on recall data, the share of answers whose needle its selection held
OPTIONAL = ["last_bucket", "selection_hit"]


@dataclass
class RunRecord:
    path: Path
    overrides: dict
    summary: dict
    metrics: list = field(default_factory=list)
    name: str = ""
    unreadable: Optional[str] = None  # why summary.json could not be read

    @property
    def status(self) -> str:
        status = self.summary.get("status")
        if self.unreadable is not None:
            return "unreadable"  # its summary.json: main() says which and why
        if status == "running" and not _alive(self.summary):
            return "interrupted"  # its process is gone: killed
        if status is None:  # no summary.json: a run killed as it began, or not written by train.py
            fresh = (self.path / METRICS).exists() and time.time() - (self.path / METRICS).stat().st_mtime < STALE_S
            return "running" if fresh else "interrupted"
        return status

    @property
    def summary_is_final(self) -> bool:
        """Whether summary.json holds how the run ended; one that still says "running" (the run goes on,
        or was killed) holds its start's figures, and the metrics rows hold the latest."""
        return self.summary.get("status") not in (None, "running")

    @property
    def fingerprint(self) -> Optional[str]:
        return self.summary.get("data_fingerprint")  # None: it failed before loading its data

    @property
    def error(self) -> Optional[str]:
        error = self.summary.get("error")
        return error.strip().splitlines()[0] if error else None

    def curve(self, metric: str) -> list[tuple[int, float, Optional[float]]]:
        """(step, value, wall_s) of every validation row holding the metric."""
        return [(r["step"], r[metric], r.get("wall_s")) for r in self.metrics if metric in r]

    def best(self, metric: str) -> Optional[float]:
        values = [v for _, v, _ in self.curve(metric)]
        return (max if higher_is_better(metric) else min)(values) if values else None

    def config(self) -> dict:
        """The run's resolved config (.hydra/config.yaml), {} if unreadable."""
        try:
            return yaml.safe_load((self.path / HYDRA / "config.yaml").read_text()) or {}
        except (OSError, yaml.YAMLError):
            return {}

    def final(self, metric: str) -> Optional[float]:
        values = [v for _, v, _ in self.curve(metric)]
        return values[-1] if values else None

    def latest(self, key: str):
        """For a run still going or killed, the newest metrics row that has the figure; else the summary's."""
        rows = [r[key] for r in self.metrics if key in r]
        if not self.summary_is_final and rows:
            return rows[-1]
        return self.summary.get(key, rows[-1] if rows else None)

    def last_bucket(self) -> dict:
        """{"last_bucket": val_bpc over the last positions, "last_bucket_range": "[lo,hi)"}, None without
        a by-position figure (runs from before it, runs of other tasks)."""
        figure = self.latest(BY_POSITION)
        if not figure:
            return {"last_bucket": None, "last_bucket_range": None}
        lo, hi = figure["edges"][-2:]
        return {"last_bucket": figure["values"][-1], "last_bucket_range": f"[{lo},{hi})"}

    def row(self, metric: str) -> dict:
        step = self.summary.get("step") if self.summary_is_final else None
        if step is None:
            steps = [r["step"] for r in self.metrics]
            step = max(steps) if steps else 0
        return {
            "run": self.name,
            "status": self.status,
            "step": step,
            "best": self.best(metric),
            "final": self.final(metric),
            **self.last_bucket(),
            "tokens_per_s": self.latest("tokens_per_s"),
            "peak_mem_mb": self.summary.get("peak_mem_mb"),
            "params": self.summary.get("params"),
            "wall_s": self.summary.get("wall_s") if self.summary_is_final else self.latest("wall_s"),
            "selection_hit": self.final("val_selection_hit"),
            "error": self.error,
            "data": self.fingerprint or "-",
            "path": str(self.path),
        }


def find_runs(paths: list[Path]) -> list[RunRecord]:
    found = {}
    for root in paths:
        candidates = [root] if _is_run(root) else [p.parent.parent for p in root.rglob(OVERRIDES)]
        for path in candidates:
            if _is_run(path):
                found[path.resolve()] = load_run(path)
    runs = sorted(found.values(), key=lambda r: str(r.path))
    name_runs(runs)
    return runs


def _is_run(path: Path) -> bool:
    return (path / OVERRIDES).is_file() and (
        (path / SUMMARY).is_file() or (path / METRICS).is_file()
    )


def load_run(path: Path) -> RunRecord:
    overrides = {}
    for item in yaml.safe_load((path / OVERRIDES).read_text()) or []:
        key, _, value = str(item).partition("=")
        if not key.lstrip("+~").startswith("hydra."):
            overrides[key.lstrip("+~")] = value
    summary, unreadable = {}, None
    if (path / SUMMARY).is_file():
        try:
            summary = json.loads((path / SUMMARY).read_text())
            if not isinstance(summary, dict):
                raise ValueError(f"a JSON {type(summary).__name__}, not an object")
        except (ValueError, UnicodeDecodeError) as e:
            summary, unreadable = {}, str(e)
    metrics = []
    if (path / METRICS).is_file():
        for line in (path / METRICS).read_text().splitlines():
            try:
                metrics.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line torn by a kill
    return RunRecord(path, overrides, summary, metrics, unreadable=unreadable)


def name_runs(runs: list[RunRecord]) -> None:
    """Name each run by the overrides whose values differ across the runs (seed last)."""
    keys = sorted({k for r in runs for k in r.overrides})
    varying = [k for k in keys if len({r.overrides.get(k) for r in runs}) > 1]
    varying.sort(key=lambda k: (k == "trainer.seed", k))
    for r in runs:
        parts = [f"{k}={r.overrides[k]}" for k in varying if k in r.overrides]
        r.name = " ".join(parts) or r.path.name


def configuration(run: RunRecord) -> str:
    """The run's name without its seed: seed repeats share it."""
    return " ".join(p for p in run.name.split(" ") if not p.startswith("trainer.seed=")) or "(all)"


def rank(runs: list[RunRecord], metric: str, sort: str) -> dict[str, list[dict]]:
    """Rows grouped by data fingerprint, each group sorted (missing values last). Runs that never
    loaded data join the only group there is, or a group of their own."""
    known = {r.fingerprint for r in runs if r.fingerprint}
    groups: dict[str, list[dict]] = {}
    for r in runs:
        key = r.fingerprint or (next(iter(known)) if len(known) == 1 else "no data loaded")
        groups.setdefault(key, []).append(r.row(metric))
    descending = sort == "tokens_per_s" or (sort in ("best", "final") and higher_is_better(metric))
    for rows in groups.values():
        rows.sort(key=lambda row: (row[sort] is None, -(row[sort] or 0) if descending else (row[sort] if row[sort] is not None else 0)))
    return groups


def seed_of(run: RunRecord):
    """The run's trainer.seed: its config's, else its overrides'; else its path (a seed of its own)."""
    seed = (run.config().get("trainer") or {}).get("seed", run.overrides.get("trainer.seed"))
    return str(run.path) if seed is None else str(seed)


def seed_statistics(runs: list[RunRecord], metric: str) -> list[dict]:
    """Mean and spread of the best metric over seeds, for configurations run with several completed
    seeds. A seed run twice (a rerun in another directory) counts once: its first run in path order."""
    best_by_seed: dict[tuple, dict] = {}  # (fingerprint, configuration) -> {seed: best}
    for r in sorted(runs, key=lambda r: r.path):
        best = r.best(metric)
        if best is not None and r.status == "completed":
            best_by_seed.setdefault((r.fingerprint, configuration(r)), {}).setdefault(seed_of(r), best)
    out = []
    sign = -1 if higher_is_better(metric) else 1
    by_config = {key: list(seeds.values()) for key, seeds in best_by_seed.items()}
    for (fingerprint, config), values in sorted(by_config.items(), key=lambda kv: sign * statistics.mean(kv[1])):
        if len(values) > 1:
            out.append({"configuration": config, "seeds": len(values), "mean": statistics.mean(values),
                        "std": statistics.stdev(values), "min": min(values), "max": max(values), "data": fingerprint})
    return out


# ---- formatting ------------------------------------------------------------------------------


def _fmt(key: str, value) -> str:
    if value is None:
        return "-"
    if key in ("best", "final", "last_bucket", "mean", "std", "min", "max", "selection_hit"):
        return f"{value:.4f}"
    if key in ("tokens_per_s", "peak_mem_mb"):
        return f"{value:,.0f}"
    if key == "params":
        return f"{value / 1e6:.2f}M"
    if key == "wall_s":
        return f"{value:.0f}s"
    return str(value)


def _columns(rows: list[dict]) -> list[str]:
    shown = [c for c in OPTIONAL if any(row[c] is not None for row in rows)]
    return [c for c in dict.fromkeys(COLUMNS + OPTIONAL) if c not in OPTIONAL or c in shown]


def _headers(metric: str, columns: list[str], rows: list[dict]) -> list[str]:
    ranges = {row["last_bucket_range"] for row in rows if row["last_bucket_range"]}
    names = {"best": f"best {metric}", "final": f"final {metric}", "tokens_per_s": "tokens/s", "peak_mem_mb": "peak MB",
             "wall_s": "wall", "selection_hit": "selection hit",
             "last_bucket": f"val_bpc {ranges.pop()}" if len(ranges) == 1 else "val_bpc last bucket"}
    return [names.get(c, c) for c in columns]


def text_table(groups: dict[str, list[dict]], metric: str, markdown: bool) -> str:
    out = []
    for fingerprint, rows in groups.items():
        if len(groups) > 1:
            out.append(f"{'### ' if markdown else ''}data {fingerprint} (ranked on its own: other runs saw other data)\n")
        columns = _columns(rows)
        cells = [[_fmt(c, row[c]) for c in columns] for row in rows]
        out.extend(_grid(_headers(metric, columns, rows), cells, markdown))
        problems = [row for row in rows if row["error"] or row["status"] in ("interrupted", "running")]
        if problems:
            out.append("")
            for row in problems:
                what = row["error"] or ("still running" if row["status"] == "running" else "killed before it finished")
                out.append(f"{'- ' if markdown else '  '}{row['run']}: {row['status']}: {what}")
        out.append("")
    return "\n".join(out)


def _grid(headers: list[str], cells: list[list[str]], markdown: bool) -> list[str]:
    """The lines of a table: markdown, or columns padded to their widths."""
    if markdown:
        return ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|",
                *("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells)]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    return ["  ".join(h.ljust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths),
            *("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells)]


def position_table(curves: dict[str, dict[str, list[dict]]], markdown: bool) -> str:
    """Final val_bpc per bucket of positions (the numbers of bpc_by_position.png): a row per
    configuration and member, the mean over its seeds; a table per data fingerprint and bucket set."""
    out = []
    for fingerprint, lines in sorted(curves.items()):
        by_edges: dict[tuple, list] = {}
        for label, seeds in sorted(lines.items()):
            by_edges.setdefault(tuple(seeds[0]["edges"]), []).append((label, seeds))
        for edges, rows in by_edges.items():
            out += [f"{'## ' if markdown else ''}final val_bpc by position, data {fingerprint}", ""]
            headers = ["run", *(f"[{lo},{hi})" for lo, hi in zip(edges, edges[1:]))]
            cells = [[label + (f" (mean of {len(seeds)} seeds)" if len(seeds) > 1 else ""),
                      *(f"{statistics.mean(v):.4f}" for v in zip(*(s["values"] for s in seeds)))]
                     for label, seeds in rows]
            out += [*_grid(headers, cells, markdown), ""]
    return "\n".join(out)


def seed_table(stats: list[dict], metric: str, markdown: bool) -> str:
    if not stats:
        return ""
    lines = [f"{'## ' if markdown else ''}best {metric} over seeds", ""]
    for s in stats:
        text = f"{s['configuration']}: {s['mean']:.4f} ± {s['std']:.4f} over {s['seeds']} seeds (min {s['min']:.4f}, max {s['max']:.4f})"
        lines.append(("- " if markdown else "  ") + text)
    return "\n".join(lines) + "\n"


def csv_text(groups: dict[str, list[dict]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=_columns([r for rows in groups.values() for r in rows])
                            + ["error", "data", "path"], extrasaction="ignore")
    writer.writeheader()
    for rows in groups.values():
        writer.writerows(rows)
    return buffer.getvalue()


# ---- plots -------------------------------------------------------------------------------------


# ---- command -----------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.review", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--metric", default="val_bpc",
                        help="validation metric to rank by (val_bpc, val_loss, val_accuracy; recall runs: val_accuracy)")
    parser.add_argument("--sort", default="best", choices=COLUMNS, help="column to sort by (default: best metric)")
    parser.add_argument("--format", default="table", choices=["table", "markdown", "csv", "json"])
    parser.add_argument("--out", type=Path, help="where review.md and the plots go (default: into the first directory named)")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)

    missing = [p for p in args.paths if not p.exists()]
    if missing:
        print(f"error: no such path: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    runs = find_runs(args.paths)
    if not runs:
        print(f"error: no run directories (with {OVERRIDES} and {METRICS} or {SUMMARY}) under "
              f"{', '.join(map(str, args.paths))}", file=sys.stderr)
        return 1
    for r in runs:
        if r.unreadable is not None:
            print(f"warning: {r.path / SUMMARY} cannot be read ({r.unreadable}): its status is shown as unreadable",
                  file=sys.stderr)
    metric = args.metric
    recorded = sorted({key for r in runs for row in r.metrics for key, value in row.items()
                       if key.startswith("val_") and isinstance(value, (int, float)) and not isinstance(value, bool)})
    if recorded and metric not in recorded and metric != "val_bpc":  # (val_bpc: the default, which falls back)
        print(f"error: --metric {metric}: no run recorded it as a number; their validation metrics: "
              f"{', '.join(recorded)}",
              file=sys.stderr)
        return 2
    if metric == "val_bpc" and any(r.curve("val_accuracy") for r in runs):
        metric = "val_accuracy"  # recall runs: what they found, ranked highest first
    elif metric == "val_bpc" and not any(r.curve("val_bpc") for r in runs) and any(r.curve("val_loss") for r in runs):
        metric = "val_loss"  # runs that are not byte-level report no bits per byte
    out_dir = args.out or (args.paths[0] if args.paths[0].is_dir() else args.paths[0].parent)
    try:  # where review.md goes, before anything is printed
        out_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(out_dir, os.W_OK | os.X_OK):
            raise PermissionError("not writable")
    except OSError as e:
        print(f"error: --out {out_dir}: review.md and the plots cannot be written there ({e.strerror or e}): "
              "choose another --out", file=sys.stderr)
        return 2
    groups = rank(runs, metric, args.sort)
    stats = seed_statistics(runs, metric)
    curves = position_curves(runs, configuration)
    fingerprints = {r.fingerprint for r in runs if r.fingerprint}
    if len(fingerprints) > 1:
        print(f"warning: these runs saw {len(fingerprints)} different data sets; each is ranked on its own",
              file=sys.stderr)

    if args.format == "json":
        print(json.dumps({"metric": metric, "groups": groups, "over_seeds": stats}, indent=2, default=str))
    elif args.format == "csv":
        print(csv_text(groups), end="")
    else:
        markdown = args.format == "markdown"
        print(text_table(groups, metric, markdown) + seed_table(stats, metric, markdown)
              + position_table(curves, markdown), end="")

    pictures = [] if args.no_plots else (plot(runs, groups, metric, out_dir) + position_plot(curves, out_dir)
                                         + recall_plots(runs, out_dir))
    report = [f"# Review of {', '.join(map(str, args.paths))}", "", f"{len(runs)} runs, ranked by best {metric}.", "",
              text_table(groups, metric, markdown=True), seed_table(stats, metric, markdown=True),
              position_table(curves, markdown=True)]
    report += [f"![{p.stem}]({p.name})\n" for p in pictures]
    (out_dir / "review.md").write_text("\n".join(report))
    print(f"\nwrote {out_dir / 'review.md'}" + "".join(f", {p.name}" for p in pictures), file=sys.stderr)
    return 0


def _alive(summary: dict) -> bool:
    """Whether the process a "running" summary names still runs (on this host; elsewhere: assume so)."""
    pid, host = summary.get("pid"), summary.get("host")
    if pid is None or host != socket.gethostname():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
