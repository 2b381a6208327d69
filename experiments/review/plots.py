"""The review's pictures: validation curves, quality against speed, language models' loss by
position in the sequence, and for recall runs accuracy against width per attention (Zoology's
layout) and a passkey depth x length map."""

import math
import statistics
from pathlib import Path

BY_POSITION = "val_bpc_by_position"  # a language model's validation by position (experiments/tasks/positions.py)


def higher_is_better(metric: str) -> bool:
    return metric.startswith("val_accuracy")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(runs: list, groups: dict[str, list[dict]], metric: str, out_dir: Path) -> list[Path]:
    """Validation curves by step and by wall-clock time; quality against speed with its Pareto front."""
    plt = _pyplot()
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in runs:
        curve = r.curve(metric)
        if not curve:
            continue
        steps, values, walls = zip(*curve)
        style = "-" if r.status == "completed" else "--"
        axes[0].plot(steps, values, style, marker=".", label=r.name)
        if all(w is not None for w in walls):
            axes[1].plot(walls, values, style, marker=".", label=r.name)
    for ax, xlabel in zip(axes, ("step", "wall-clock seconds")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axes[0].set_title(f"validation {metric} by step")
    axes[1].set_title(f"validation {metric} by time")
    if any(r.curve(metric) for r in runs):
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    written.append(out_dir / "val_curves.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 5))
    for fingerprint, rows in groups.items():
        points = [(row["tokens_per_s"], row["best"], row["run"]) for row in rows
                  if row["tokens_per_s"] is not None and row["best"] is not None]
        if not points:
            continue
        ax.scatter([p[0] for p in points], [p[1] for p in points], label=fingerprint if len(groups) > 1 else None)
        for x, y, name in points:
            ax.annotate(name, (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
        front = pareto_front([(x, y) for x, y, _ in points], higher=higher_is_better(metric))
        ax.plot([p[0] for p in front], [p[1] for p in front], "r--o", markerfacecolor="none", markersize=11,
                label="Pareto front" if fingerprint == next(iter(groups)) else None)
    ax.set_xlabel("training tokens/s (higher is better)")
    ax.set_ylabel(f"best {metric} ({'higher' if higher_is_better(metric) else 'lower'} is better)")
    ax.set_title("quality against speed")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out_dir / "quality_vs_speed.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def pareto_front(points: list[tuple[float, float]], higher: bool = False) -> list[tuple[float, float]]:
    """Points no other point beats on both speed (higher) and metric (lower, or `higher`), by speed."""
    sign = -1 if higher else 1
    front = []
    for x, y in sorted(points, key=lambda p: (-p[0], sign * p[1])):
        if not front or sign * y < sign * front[-1][1]:
            front.append((x, y))
    return sorted(front)


def _section(config: dict, dotted: str):
    for part in dotted.split("."):
        config = config.get(part, {}) if isinstance(config, dict) else {}
    return config if config != {} else None


def recall_by_width(plt, points: dict):
    """points {seq_len: {attention: {dim: accuracy}}} -> a figure of one panel per seq_len; each
    attention keeps its colour and marks in every panel, and one legend names them all. Attentions
    that all solve the task lie on one line: each is drawn thinner, with smaller marks, than the
    one before it, so that every line stays visible."""
    lengths = sorted(points, key=lambda s: (s is None, s))
    names = sorted({model for by_model in points.values() for model in by_model})
    styles = {model: dict(color=f"C{i % 10}", marker="osD^v<>"[i % 7], linestyle=("-", "--", "-.", ":")[i % 4],
                          linewidth=3.0 - 0.6 * (i % 4), markersize=10 - 2 * (i % 4))
              for i, model in enumerate(names)}
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 4), squeeze=False)
    for ax, seq in zip(axes[0], lengths):
        for model, by_dim in sorted(points[seq].items()):
            dims = sorted(d for d in by_dim if d is not None)
            ax.plot(dims, [by_dim[d] for d in dims], label=model, **styles[model])
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("model.dim")
        ax.set_title(f"seq_len {seq}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("best val_accuracy")
    handles = [plt.Line2D([], [], label=m, **styles[m]) for m in names]
    fig.legend(handles=handles, loc="lower center", ncol=len(names), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def recall_plots(runs: list, out_dir: Path) -> list[Path]:
    """recall_by_width.png: best val_accuracy against model.dim, one line per attention, one panel per
    data.seq_len (MQAR sweeps). passkey_depth.png: final accuracy per depth bin and length, one map per
    attention (passkey runs)."""
    plt = _pyplot()
    written = []
    points = {}  # seq_len -> attention -> {dim: best accuracy}
    for r in runs:
        best, config = r.best("val_accuracy"), r.config()
        if best is None or any(k.startswith("val_accuracy_depth") for k in r.summary):
            continue
        model, dim, seq = r.summary.get("model") or "?", _section(config, "model.dim"), _section(config, "data.seq_len")
        previous = points.setdefault(seq, {}).setdefault(model, {}).get(dim, 0.0)
        points[seq][model][dim] = max(previous, best)  # the best seed
    if points:
        fig = recall_by_width(plt, points)
        written.append(out_dir / "recall_by_width.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    maps = {}  # attention -> {(depth bin, seq_len): accuracy}
    for r in runs:
        depths = {k: v for k, v in r.summary.items() if k.startswith("val_accuracy_depth")}
        seq = _section(r.config(), "data.seq_len")
        for key, value in depths.items():
            maps.setdefault(r.summary.get("model") or "?", {})[(int(key.removeprefix("val_accuracy_depth")), seq)] = value
    if maps:
        fig, axes = plt.subplots(1, len(maps), figsize=(4.5 * len(maps), 4), squeeze=False)
        for ax, (model, cells) in zip(axes[0], sorted(maps.items())):
            bins = sorted({b for b, _ in cells})
            lengths = sorted({s for _, s in cells}, key=lambda s: (s is None, s))
            grid = [[cells.get((b, s), float("nan")) for s in lengths] for b in bins]
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="upper")
            ax.set_xticks(range(len(lengths)), [str(s) for s in lengths])
            ax.set_yticks(range(len(bins)), [f"{(b + 0.5) / len(bins):.0%}" for b in bins])
            ax.set_xlabel("data.seq_len")
            ax.set_ylabel("needle depth")
            ax.set_title(model)
        fig.colorbar(image, ax=axes[0].tolist(), label="val_accuracy")
        written.append(out_dir / "passkey_depth.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def position_curves(runs: list, configuration) -> dict[str, dict[str, list[dict]]]:
    """{data fingerprint: {line label: [by-position figure of each seed]}} from each run's final
    validation; a line is a configuration (`configuration(run)`: its name without the seed) and one of
    its members (the target, or `(draft)` for a speculative pair's draft_ key). Seeds whose buckets
    differ from the line's first are left out, as a band needs the same buckets. Completed runs only,
    where a configuration has one: a seed stopped early would pull its mean up."""
    curves: dict[str, dict[str, list[dict]]] = {}
    completed = {configuration(r) for r in runs if r.status == "completed"}
    for r in runs:
        if r.status != "completed" and configuration(r) in completed:
            continue
        for key in sorted(k for k in r.summary.keys() | {k for row in r.metrics for k in row}
                          if k.endswith(BY_POSITION)):
            figure = r.latest(key)
            if not figure:
                continue
            member = key.removesuffix(BY_POSITION).rstrip("_")
            label = configuration(r) + (f" ({member})" if member else "")
            seeds = curves.setdefault(r.fingerprint or "?", {}).setdefault(label, [])
            if not seeds or seeds[0]["edges"] == figure["edges"]:
                seeds.append(figure)
    return curves


def bucket_centres(edges: list[int]) -> list[float]:
    """Where each bucket [lo, hi) sits on a log axis: the geometric mean of max(lo, 1) and hi."""
    return [math.sqrt(max(lo, 1) * hi) for lo, hi in zip(edges, edges[1:])]


def loss_by_position(plt, curves: dict[str, dict[str, list[dict]]]):
    """curves (position_curves) -> one panel per data fingerprint of val_bpc against position (log
    x-axis): a line per configuration through the mean over its seeds, their range as a band. A
    configuration keeps its colour in every panel."""
    labels = sorted({label for lines in curves.values() for label in lines})
    colours = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    fig, axes = plt.subplots(1, len(curves), figsize=(6.5 * len(curves), 4.8), squeeze=False)
    for ax, (fingerprint, lines) in zip(axes[0], sorted(curves.items())):
        edges = set()
        for label, seeds in sorted(lines.items()):
            x = bucket_centres(seeds[0]["edges"])
            by_bucket = list(zip(*(s["values"] for s in seeds)))
            seeds_note = f", {len(seeds)} seeds" if len(seeds) > 1 else ""
            ax.plot(x, [statistics.mean(v) for v in by_bucket], marker="o", color=colours[label],
                    label=label + seeds_note)
            if len(seeds) > 1:
                ax.fill_between(x, [min(v) for v in by_bucket], [max(v) for v in by_bucket], color=colours[label],
                                alpha=0.2, linewidth=0)
            edges.update(seeds[0]["edges"][1:])
        ax.set_xscale("log")
        ax.set_xlim(1, max(edges))
        ticks = [1, *sorted(edges)]  # a log axis has no 0: position 0 is drawn at 1
        ax.set_xticks(ticks, ["0", *map(str, ticks[1:])])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.set_xlabel("position in the sequence (a point per bucket, between its edges)")
        ax.set_ylabel("val_bpc (lower is better)")
        ax.set_title(f"loss by position (mean over seeds, their range shaded), data {fingerprint}", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def position_plot(curves: dict[str, dict[str, list[dict]]], out_dir: Path) -> list[Path]:
    """bpc_by_position.png of position_curves' lines when there are any (language models), else nothing."""
    if not curves:
        return []
    plt = _pyplot()
    fig = loss_by_position(plt, curves)
    path = out_dir / "bpc_by_position.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
