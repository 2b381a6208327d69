"""Reviewing run directories: tables in every format, plots that are real images, statuses."""

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from matplotlib.image import imread

from experiments.review.runs import find_runs, main
from experiments.review.plots import pareto_front
from tests.helpers.runs import ROOT, TINY, TINY_NSA, read_metrics, run_env, train_py


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Two tiny NSA jobs over two seeds, plus one configuration that fails (a vocabulary the data lacks)."""
    directory = tmp_path_factory.mktemp("review") / "sweep"
    result = train_py("-m", f"hydra.sweep.dir={directory}", *TINY_NSA, "trainer.max_steps=4", "trainer.validate_every=2",
                      "model.num_tokens=256,128", "trainer.seed=0,1")
    assert result.returncode == 1 and "2 job(s) of the sweep failed" in result.stderr, result.stderr[-3000:]
    return directory


def review(*args):
    """`python -m experiments.review args` as a user runs it: a child process."""
    return subprocess.run([sys.executable, "-m", "experiments.review", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=run_env())


def review_here(capsys, *args) -> subprocess.CompletedProcess:
    """The same review through main(argv), in this process: (status, stdout, stderr) as review() gives them."""
    status = main([str(a) for a in args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, status, out.out, out.err)


def test_table_markdown_and_real_pngs(sweep):
    out = review(sweep)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:4] == ["run", "status", "step", "best"]
    ranked = [line for line in lines if line.startswith("model.num_tokens=256 trainer.seed=")]
    assert len(ranked) == 2 and all("completed" in line for line in ranked)
    assert any(line.startswith("model.num_tokens=128 ") and "failed" in line for line in lines)
    assert "does not match the data's vocabulary" in out.stdout  # the failure's first line
    assert "over 2 seeds" in out.stdout  # mean and spread over seeds
    report = (sweep / "review.md").read_text()
    assert "| run | status |" in report and "![val_curves](val_curves.png)" in report
    assert "val_bpc [16,32)" in lines[0]  # the last bucket of loss by position, beside val_bpc
    for name in ("val_curves.png", "quality_vs_speed.png", "bpc_by_position.png"):
        image = imread(sweep / name)
        assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 500
        assert image[..., :3].std() > 0.01, f"{name} is blank"


def test_rows_sorted_by_the_metric(sweep, capsys):
    rows = json.loads(review_here(capsys, sweep, "--format", "json", "--no-plots").stdout)["groups"]
    (rows,) = rows.values()
    best = [r["best"] for r in rows if r["best"] is not None]
    assert best == sorted(best) and len(best) == 2
    assert [r["status"] for r in rows[-2:]] == ["failed", "failed"]  # no metric: last


def test_csv_and_sort_by_speed(sweep, capsys):
    out = review_here(capsys, sweep, "--format", "csv", "--sort", "tokens_per_s", "--no-plots")
    header, *rows = out.stdout.strip().splitlines()
    assert header.startswith("run,status,step,best,final,last_bucket,tokens_per_s")
    assert len(rows) == 4


def test_killed_runs_show_as_interrupted_and_live_ones_as_running(sweep, tmp_path):
    job = next(p.parent for p in sweep.rglob("summary.json") if "num_tokens=256" in str(p))
    killed, running, dead = tmp_path / "killed", tmp_path / "running", tmp_path / "dead"
    for copy in (killed, running, dead):
        shutil.copytree(job, copy)
    (killed / "summary.json").unlink()
    old = time.time() - 3600
    os.utime(killed / "metrics.jsonl", (old, old))
    (running / "summary.json").unlink()  # metrics written just now: in progress
    os.utime(running / "metrics.jsonl")
    summary = json.loads((dead / "summary.json").read_text())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    # a process that no longer exists, and a start's wall time no real row has (0.5 s: a tiny run's own)
    summary.update(status="running", pid=proc.pid, step=0, wall_s=-1.0)
    (dead / "summary.json").write_text(json.dumps(summary))
    records = {r.path.name: r for r in find_runs([tmp_path])}
    assert {name: r.status for name, r in records.items()} == {"killed": "interrupted", "running": "running",
                                                                "dead": "interrupted"}
    # a killed run's summary still holds its start's figures: the row shows how far its metrics got
    rows = [r for r in read_metrics(dead) if "wall_s" in r]
    dead_row = records["dead"].row("val_bpc")
    assert dead_row["step"] == max(r["step"] for r in read_metrics(dead)) > 0
    assert dead_row["wall_s"] == rows[-1]["wall_s"] != -1.0


def test_runs_on_different_data_are_ranked_apart(sweep, tmp_path, capsys):
    job = next(p.parent for p in sweep.rglob("summary.json") if "num_tokens=256" in str(p))
    other = tmp_path / "other"
    shutil.copytree(job, other)
    summary = json.loads((other / "summary.json").read_text())
    summary["data_fingerprint"] = "enwik8:95000000:0123456789abcdef"
    (other / "summary.json").write_text(json.dumps(summary))
    out = review_here(capsys, sweep, tmp_path, "--no-plots")
    assert "2 different data sets" in out.stderr
    headings = [line for line in out.stdout.splitlines() if line.startswith("data ")]
    assert sum(h.startswith("data stdlib-py") for h in headings) == 1
    assert sum(h.startswith("data enwik8:") for h in headings) == 1


def test_no_runs_is_a_clear_error(tmp_path, capsys):
    out = review_here(capsys, tmp_path)
    assert out.returncode == 1 and "no run directories" in out.stderr
    assert main([str(tmp_path / "missing")]) == 2


def test_a_metric_no_run_recorded_is_refused_naming_those_they_did(sweep, capsys):
    out = review_here(capsys, sweep, "--metric", "val_bogus", "--no-plots")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().startswith("error: --metric val_bogus: no run recorded it as a number; their validation "
                                         "metrics: ")
    assert "val_bpc" in out.stderr and "val_loss" in out.stderr


def test_pareto_front_keeps_only_undominated_points():
    points = [(100, 3.0), (200, 2.5), (150, 2.0), (50, 1.9), (120, 2.6)]
    assert pareto_front(points) == [(50, 1.9), (150, 2.0), (200, 2.5)]


@pytest.mark.slow
def test_optuna_preset_runs_trials_in_their_own_directories(tmp_path):
    result = train_py("-m", "experiment=nsa_optuna", "hydra.sweeper.n_trials=2", f"hydra.sweep.dir={tmp_path}", *TINY,
                      "model.kv_heads=1", "trainer.max_steps=2")
    assert result.returncode == 0, result.stderr
    jobs = sorted(p.parent.parent.name.split(",")[0] for p in tmp_path.rglob("summary.json"))
    assert jobs == ["trial=0", "trial=1"]
    assert "best_value" in (tmp_path / "optimization_results.yaml").read_text()


def _recall_run(root: Path, name: str, model: str, dim: int, seq: int, accuracy: float, depths=None,
                hit=None) -> None:
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(f"- model={model}\n- model.dim={dim}\n- data.seq_len={seq}\n")
    (run / ".hydra" / "config.yaml").write_text(f"model:\n  dim: {dim}\ndata:\n  seq_len: {seq}\n")
    figures = {"val_accuracy": accuracy, **{f"val_accuracy_depth{i}": a for i, a in enumerate(depths or [])}}
    figures |= {} if hit is None else {"val_selection_hit": hit}
    (run / "metrics.jsonl").write_text(json.dumps({"step": 10, "val_loss": 1 - accuracy, **figures}) + "\n")
    (run / "summary.json").write_text(json.dumps({"status": "completed", "step": 10, "model": model, "task": "recall",
                                                  "data_fingerprint": f"mqar-{seq}", **figures}))


def test_recall_runs_are_ranked_by_accuracy_and_drawn_by_width_and_depth(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    for model, accuracies in {"transformer": (1.0, 1.0), "nsa": (0.4, 0.9)}.items():
        for dim, accuracy in zip((32, 64), accuracies):
            _recall_run(sweep, f"{model}-{dim}", model, dim, 64, accuracy, hit=0.75 if model == "nsa" else None)
    _recall_run(sweep, "passkey-nsa", "nsa", 64, 2048, 0.5, depths=[1.0, 0.0])
    assert main([str(sweep), "--format", "csv"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [dict(zip(out[0].split(","), line.split(","))) for line in out[1:] if line]
    mqar = [r for r in rows if r["data"] == "mqar-64"]
    assert [float(r["best"]) for r in mqar] == [1.0, 1.0, 0.9, 0.4]  # highest first
    assert [r["selection_hit"] for r in mqar] == ["", "", "0.75", "0.75"]  # NSA's selection found 3 needles in 4
    assert (sweep / "recall_by_width.png").stat().st_size > 0 and (sweep / "passkey_depth.png").stat().st_size > 0
    assert "val_accuracy" in (sweep / "review.md").read_text() and "selection hit" in (sweep / "review.md").read_text()


def test_recall_by_width_keeps_each_attentions_style_in_every_panel():
    from experiments.review.plots import _pyplot, recall_by_width

    plt = _pyplot()
    fig = recall_by_width(plt, {64: {"routing": {32: 0.1}, "transformer": {32: 1.0}},
                                128: {"nsa": {32: 0.5}, "transformer": {32: 0.9, 64: 1.0}}})
    colours = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            colours.setdefault(line.get_label(), set()).add((line.get_color(), line.get_marker(), line.get_linestyle()))
    plt.close(fig)
    assert sorted(colours) == ["nsa", "routing", "transformer"]
    assert all(len(c) == 1 for c in colours.values())  # one colour per attention across panels
    assert len({next(iter(c))[0] for c in colours.values()}) == 3  # and no two attentions share a colour
    assert len({next(iter(c))[1] for c in colours.values()}) == 3  # nor a marker (coinciding lines stay apart)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["nsa", "routing", "transformer"]


def _lm_run(root: Path, name: str, model: str, seed: int, by_position=None, draft=None, val_bpc=1.4427,
            status="completed") -> None:
    """A language-model run directory; by_position: its final val_bpc per bucket of [0, 16, 64, 256]."""
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(f"- model={model}\n- trainer.seed={seed}\n")
    figures = {"val_loss": val_bpc * 0.6931, "val_bpc": val_bpc}
    for key, values in (("val_bpc_by_position", by_position), ("draft_val_bpc_by_position", draft)):
        if values is not None:
            figures[key] = {"edges": [0, 16, 64, 256], "values": values}
    (run / "metrics.jsonl").write_text(json.dumps({"step": 10, **figures}) + "\n")
    (run / "summary.json").write_text(json.dumps({"status": status, "step": 10, "model": model, "task": "lm",
                                                  "data_fingerprint": "text-256", **figures}))


def _position_sweep(root: Path) -> Path:
    _lm_run(root, "nsa-0", "nsa", 0, [3.0, 2.0, 1.6])
    _lm_run(root, "nsa-1", "nsa", 1, [3.2, 2.2, 1.8])
    _lm_run(root, "dense-0", "transformer", 0, [3.0, 2.0, 1.2], draft=[3.5, 3.0, 2.5])  # a speculative pair
    _lm_run(root, "older", "sinkhorn", 0)  # written before loss by position: reviewed all the same
    return root


def test_loss_by_position_is_a_column_beside_val_bpc_and_a_plot(tmp_path, capsys):
    sweep = _position_sweep(tmp_path / "sweep")
    assert main([str(sweep), "--format", "csv", "--no-plots"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [dict(zip(out[0].split(","), line.split(","))) for line in out[1:]]
    assert out[0].startswith("run,status,step,best,final,last_bucket,tokens_per_s")
    assert {r["run"]: r["last_bucket"] for r in rows} == {
        "model=nsa trainer.seed=0": "1.6", "model=nsa trainer.seed=1": "1.8",
        "model=transformer trainer.seed=0": "1.2", "model=sinkhorn trainer.seed=0": ""}
    assert main([str(sweep)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "final val_bpc  val_bpc [64,256)  tokens/s" in out[0]  # the last bucket's range names the column
    # and every bucket, a row per configuration and member, the mean over seeds
    table = out[out.index("final val_bpc by position, data text-256") + 2:]
    assert table[0].split() == ["run", "[0,16)", "[16,64)", "[64,256)"]
    assert [row.split() for row in table[2:5]] == [
        ["model=nsa", "(mean", "of", "2", "seeds)", "3.1000", "2.1000", "1.7000"],
        ["model=transformer", "3.0000", "2.0000", "1.2000"],
        ["model=transformer", "(draft)", "3.5000", "3.0000", "2.5000"]]
    image = imread(sweep / "bpc_by_position.png")
    assert image.ndim == 3 and image[..., :3].std() > 0.01
    assert "![bpc_by_position](bpc_by_position.png)" in (sweep / "review.md").read_text()


def test_a_seed_run_twice_counts_once_over_seeds(tmp_path, capsys):
    """A rerun of one configuration and seed in another directory is no new seed."""
    _lm_run(tmp_path, "nsa-0", "nsa", 0, val_bpc=1.5)
    _lm_run(tmp_path, "nsa-0-again", "nsa", 0, val_bpc=1.5)
    _lm_run(tmp_path, "nsa-1", "nsa", 1, val_bpc=1.7)
    out = review_here(capsys, tmp_path, "--no-plots")
    assert "(all): 1.6000 ± 0.1414 over 2 seeds (min 1.5000, max 1.7000)" in out.stdout


def test_a_seed_stopped_early_stays_out_of_the_mean_by_position(tmp_path, capsys):
    _lm_run(tmp_path, "nsa-0", "nsa", 0, [3.0, 2.0, 1.6])
    _lm_run(tmp_path, "nsa-1", "nsa", 1, [3.2, 2.2, 1.8])
    _lm_run(tmp_path, "nsa-2", "nsa", 2, [5.0, 5.0, 5.0], status="interrupted")
    _lm_run(tmp_path, "dense-0", "transformer", 0, [4.0, 4.0, 4.0], status="interrupted")  # its only run: shown
    out = review_here(capsys, tmp_path, "--no-plots").stdout.splitlines()
    table = out[out.index("final val_bpc by position, data text-256") + 4:]
    assert [row.split() for row in table[:2]] == [
        ["model=nsa", "(mean", "of", "2", "seeds)", "3.1000", "2.1000", "1.7000"],
        ["model=transformer", "4.0000", "4.0000", "4.0000"]]


def test_a_figure_that_is_not_a_number_is_no_metric_to_rank_by(sweep, capsys):
    out = review_here(capsys, sweep, "--metric", "val_bpc_by_position", "--no-plots")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("error: --metric val_bpc_by_position: no run recorded it as a number; ")
    assert "val_bpc_by_position" not in out.stderr.split("metrics: ")[1]


def test_an_out_that_cannot_be_written_is_refused_before_the_table(sweep, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    out = review_here(capsys, sweep, "--out", tmp_path / "a_file", "--no-plots")
    assert out.returncode == 2 and out.stdout == "" and "\n" not in out.stderr.strip()
    assert out.stderr.startswith(f"error: --out {tmp_path / 'a_file'}: review.md and the plots cannot be written there")


def test_loss_by_position_draws_a_line_per_configuration_and_member(tmp_path):
    from experiments.review.runs import configuration
    from experiments.review.plots import _pyplot, loss_by_position, position_curves

    curves = position_curves(find_runs([_position_sweep(tmp_path)]), configuration)
    assert sorted(curves["text-256"]) == ["model=nsa", "model=transformer", "model=transformer (draft)"]
    plt = _pyplot()
    fig = loss_by_position(plt, curves)
    (ax,) = fig.axes
    lines = {line.get_label(): line.get_ydata().tolist() for line in ax.get_lines()}
    assert lines["model=nsa, 2 seeds"] == pytest.approx([3.1, 2.1, 1.7])  # the mean over seeds
    assert lines["model=transformer (draft)"] == [3.5, 3.0, 2.5]
    (band,) = ax.collections  # the two nsa seeds' range; one seed draws none
    assert band.get_paths()[0].vertices[:, 1].min() == pytest.approx(1.6)
    assert band.get_paths()[0].vertices[:, 1].max() == pytest.approx(3.2)
    assert ax.get_xscale() == "log"
    plt.close(fig)


def test_seed_statistics_are_the_sample_mean_and_spread_of_completed_runs_best_first():
    from experiments.review.runs import RunRecord, seed_statistics

    def run(name, status, *values):
        record = RunRecord(Path(name), {}, {"status": status, "data_fingerprint": "d"},
                           [{"step": i, "val_bpc": v} for i, v in enumerate(values)])
        record.name = name
        return record

    runs = [run("model=a trainer.seed=0", "completed", 3.0, 1.0), run("model=a trainer.seed=1", "completed", 2.0),
            run("model=a trainer.seed=2", "failed", 0.1),
            run("model=b trainer.seed=0", "completed", 5.0), run("model=b trainer.seed=1", "completed", 7.0)]
    stats = seed_statistics(runs, "val_bpc")
    assert [s["configuration"] for s in stats] == ["model=a", "model=b"]  # lowest mean first
    a = stats[0]
    assert (a["seeds"], a["mean"], a["min"], a["max"]) == (2, 1.5, 1.0, 2.0)
    assert a["std"] == pytest.approx(math.sqrt(0.5))  # the sample deviation of 1 and 2


def test_a_runs_final_figure_is_its_last_validation_and_best_its_lowest():
    from experiments.review.runs import RunRecord

    record = RunRecord(Path("r"), {}, {"status": "completed"},
                       [{"step": s, "val_bpc": v} for s, v in ((1, 3.0), (2, 1.0), (3, 2.0))])
    assert (record.final("val_bpc"), record.best("val_bpc")) == (2.0, 1.0)
