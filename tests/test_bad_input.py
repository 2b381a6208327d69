"""The project's corpus of bad input, by category: each gets one line that names the input and says
what to do, before any work, with no traceback, and changes nothing in an existing run directory.

Config values and flags are checked in-process (the same functions train.py and the tools call);
what only a whole run shows (the run directory, exit status, leftovers) runs train.py as a user would.
"""

import gzip
import io
import json
import shutil
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr
from pathlib import Path

import pytest
import torch

from experiments.config.checks import check_config, composition_error
from experiments.runtime.errors import UserError
from tests.helpers.runs import (ROOT, TINY_LM, read_metrics, read_summary, run_env, start_long_train, start_train,
                                train, train_py)

# ---- config values: every group, checked before anything is built ---------------------------------

CONFIG_CASES = [
    (["optimizer.lr=-1e-3"], "optimizer.lr=-0.001 must be positive"),
    (["trainer.compile=fast"], "trainer.compile=fast must be false, default or reduce-overhead (true: default)"),
    (["optimizer.betas=[0.9]"], "optimizer.betas=[0.9] must be two numbers in [0, 1)"),
    (["optimizer.eps=0"], "optimizer.eps=0.0 must be positive"),
    (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay=-0.1 must be 0 or more"),
    (["schedule=plateau", "schedule.factor=2.0"], "schedule.factor=2.0 must lie strictly between 0 and 1"),
    (["schedule=plateau", "schedule.window=0"], "schedule.window=0 must be at least 1"),
    (["schedule.warmup_steps=-5"], "schedule.warmup_steps=-5 must be 0 or more"),
    (["schedule.min_lr_ratio=2"], "schedule.min_lr_ratio=2.0 must lie in [0, 1]"),
    (["model.heads=0"], "model.heads=0 must be at least 1"),
    (["model.dim=-8"], "model.dim=-8 must be at least 1"),
    (["model.attn_dropout=1.5"], "model.attn_dropout=1.5 must lie in [0, 1)"),
    (["model.num_fine_selected=0"], "model.num_fine_selected=0 must be at least 1"),
    (["model=sinkhorn", "model.bucket_size=0"], "model.bucket_size=0 must be at least 1"),
    (["model=routing", "model.n_local_attn_heads=-1"], "model.n_local_attn_heads=-1 must be an int >= 0"),
    (["model=routing", "model.ema_decay=1.0"], "model.ema_decay=1.0 must lie in [0, 1)"),
    (["model=moba", "model.top_k=0"], "model.top_k=0 must be at least 1"),
    (["model=moba", "model.block_size=0"], "model.block_size=0 must be at least 1"),
    (["model=dsa", "model.index_dim_head=0"], "model.index_dim_head=0 must be at least 1"),
    (["model=dsa", "model.kl_weight=-1"], "model.kl_weight=-1.0 must be 0 or more"),
    (["data.seq_len=0"], "data.seq_len=0 must be at least 1"),
    (["data.val_fraction=1.0"], "data.val_fraction=1.0 must lie strictly between 0 and 1"),
    (["task.top_k=0"], "task.top_k=0 must be at least 1, or null"),
    (["task.generate_length=-5"], "task.generate_length=-5 must be at least 1"),
    (["task.prime_length=0"], "task.prime_length=0 must be at least 1"),
    (["task.temperature=-1"], "task.temperature=-1.0 must be 0 or more"),
    (["experiment=speculative", "task.gamma=0"], "task.gamma=0 must be at least 1"),
    (["experiment=speculative", "task.distill_weight=-0.5"], "task.distill_weight=-0.5 must be 0 or more"),
    (["experiment=passkey", "task.context_weight=-1"], "task.context_weight=-1.0 must be 0 or more"),
    (["experiment=passkey", "data.curriculum_steps=-1"], "data.curriculum_steps=-1 must be 0 or more"),
    (["experiment=dalle", "task.filter_thres=1.5"], "task.filter_thres=1.5 must lie in [0, 1)"),
    (["experiment=dalle", "task.vae_steps=-1"], "task.vae_steps=-1 must be 0 or more"),
    (["experiment=dalle", "vae.num_tokens=0"], "vae.num_tokens=0 must be at least 1"),
    (["experiment=speculative", "draft.depth=0"], "draft.depth=0 must be at least 1"),
    (["backend=deepspeed", "backend.offload_optimizer=disk"], "backend.offload_optimizer=disk must be none, cpu or nvme"),
    (["backend=deepspeed", "backend.zero_stage=4"], "backend.zero_stage=4 must be 0, 1, 2 or 3"),
    (["backend=ddp", "backend.timeout_s=0"], "backend.timeout_s=0.0 must be positive"),
    (["trainer.grad_accum=0"], "trainer.grad_accum=0 must be at least 1"),
    (["trainer.clip_grad_norm=-1"], "trainer.clip_grad_norm=-1.0 must be positive, or null"),
    (["trainer.validate_every=-1"], "trainer.validate_every=-1 must be 0 (off) or a number of steps"),
    (["trainer.threads=0"], "trainer.threads=0 must be at least 1, or null"),
    (["trainer.seed=-1"], "trainer.seed=-1 must be 0 or more"),
    (["+trainer.max_step=5"], "trainer.max_step is not a key of this trainer config: did you mean trainer.max_steps?"),
    (["+model.dimm=5"], "model.dimm is not a key of this model config: did you mean model.dim?"),
    (["+task.topk=5"], "task.topk is not a key of this task config: did you mean task.top_k?"),
    (["+foo=1"], "foo is not a config section"),
    (["experiment=dalle", "data=image_folder"], "data.path has no value: set data.path=<the folder or file to read>"),
    (["data.seq_len=64"], "task.prime_length=64 must be shorter than data.seq_len=64"),
]


@pytest.mark.parametrize("overrides,message", CONFIG_CASES, ids=[" ".join(o) for o, _ in CONFIG_CASES])
def test_config_values_are_refused_by_key(compose, overrides, message):
    with pytest.raises(UserError) as refused:
        check_config(compose(*overrides))
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_every_problem_of_a_config_is_named_at_once(compose):
    with pytest.raises(UserError, match="model.heads=0 .*; optimizer.lr=-1.0 "):
        check_config(compose("model.heads=0", "optimizer.lr=-1"))


def test_the_shipped_options_and_presets_pass(compose):
    presets = [[f"experiment={p.stem}"] for p in sorted((ROOT / "conf" / "experiment").glob("*.yaml"))]
    for overrides in ([], ["model=sinkhorn"], ["model=routing"], ["model=moba"], ["model=dsa"], ["backend=deepspeed"],
                      ["schedule=plateau"], *presets):
        check_config(compose(*overrides))


COMPOSITION_CASES = [
    (["trainer.max_stepz=3"], "Key 'max_stepz' not in 'TrainerConfig'; did you mean trainer.max_steps?"),
    (["model=transformer", "model.kv_heads=2"], "model.kv_heads is a key of model=nsa, model=moba, model=dsa, not "
     "of model=transformer: choose such an option"),  # not a misspelt model.heads
    (["model=moba", "model.num_fine_selectd=2"], "did you mean model.num_fine_selected (a key of model=nsa)?"),
    (["model.depth=two"], "model.depth=two; Value 'two' of type 'str' could not be converted to Integer"),
    (["model=nope"], "Could not find 'model/nope'; Available options in 'model': dalle; dsa; dvae; moba; nsa"),
    (["trainer.precision=fp8"], "trainer.precision=fp8"),
    (["trainer.cpu_allocator=jemalloc"], "Invalid value 'jemalloc', expected one of [system, caching, pooled]"),
    # values the override grammar reserves characters of: how to quote them
    (["data.path=~/notes.txt"], "data.path=~/notes.txt: Hydra's override grammar cannot read this value (it "
     "reserves ~ = ( ) [ ] { } , and spaces in unquoted values): quote it, as 'data.path=\"~/notes.txt\"'"),
    (["data.path=/data/a=b.txt"], "quote it, as 'data.path=\"/data/a=b.txt\"' in the shell"),
    # the rules of check_config and of the models' constructors, before a run's directory is made
    (["model.heads=0"], "model.heads=0 must be at least 1"),
    (["model.kv_heads=2", "model.heads=3"], "model: heads=3 must be a multiple of kv_heads=2 (GQA groups)"),
    # groups that do not go together: an image model's ${data.image_size} on text data
    (["experiment=dalle", "data=text"], "vae.image_size: Interpolation key 'data.image_size' not found: an image "
     "model reads data.image_size: use data=shapes or data=image_folder"),
    (["data.path=${oc.env:SPARSE_ATTENTION_NO_SUCH_VARIABLE}"], "Environment variable "
     "'SPARSE_ATTENTION_NO_SUCH_VARIABLE' not found\": set it, or give data.path a value"),
]


@pytest.mark.parametrize("overrides,message", COMPOSITION_CASES, ids=[" ".join(o) for o, _ in COMPOSITION_CASES])
def test_composition_errors_are_one_line(overrides, message):
    error = composition_error(str(ROOT / "conf"), overrides)
    assert message in error and "\n" not in error and "+trainer" not in error  # no advice to add the typo


def test_a_value_only_the_run_can_resolve_is_left_to_the_run():
    """${hydra:...} names the run's own settings, which exist once it runs: the run checks it."""
    assert composition_error(str(ROOT / "conf"), ["data=stdlib", "data.cache_dir=${hydra:runtime.output_dir}/c"]) is None
    assert composition_error(str(ROOT / "conf"), ["trainer.init_from=${hydra:runtime.cwd}/x"]) is None


def test_a_single_run_that_breaks_a_rule_makes_no_directory(tmp_path):
    result = train(tmp_path / "run", "model.heads=0", check=False)
    assert result.returncode == 1 and result.stderr.strip() == "error: model.heads=0 must be at least 1"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides,message", [
    (["experiment=passkey", "data.seq_len=40"], "error: data.seq_len=40 leaves no room for filler around the "
     "60-byte needle and the 44-byte question: raise data.seq_len to 120 or more"),
    (["experiment=mqar", "data.vocab_size=8"], "error: data.vocab_size=8 has 3 key ids (the lower half but 0), "
     "fewer than data.num_kv_pairs=4 distinct keys: raise data.vocab_size to 10 or more"),
], ids=["passkey-room", "mqar-keys"])
def test_data_settings_that_draw_no_item_make_no_directory(tmp_path, overrides, message):
    """The data class's own rules (check_settings) run in the pre-check: they failed in the run's
    setup, after its directory was made."""
    result = train_py(f"hydra.run.dir={tmp_path / 'run'}", *overrides)
    assert result.returncode == 1 and result.stderr.strip() == message
    assert not (tmp_path / "run").exists()


SWEEP_CASES = [
    (["model=transformer,nsa", "model.num_fine_selected=2"],
     "the sweep's job model=transformer: Could not override 'model.num_fine_selected'"),
    (["model.depth=two,4"], "the sweep's job model.depth=two: Error merging override model.depth=two"),
    (["model=nsaa,transformer"], "the sweep's job model=nsaa: In 'config': Could not find 'model/nsaa'"),
    (["model.depth=[1,2"], "error: no viable alternative at input '[1,2'"),  # a syntax error: Hydra's words
    (["model.num_fine_selected=2,0", "trainer.seed=0,1"],  # a rule of check_config
     "the sweep's job model.num_fine_selected=0 trainer.seed=0: model.num_fine_selected=0 must be at least 1"),
    (["trainer.max_step=5", "model.num_fine_selected=2,4"], "error: Could not override 'trainer.max_step'"),  # no job's
    # 5 x 4 x 2 jobs, past the 16 composed one by one: each value once, beside the others' first
    (["model.dim=16,32,64,128,256", "trainer.seed=0,1,2,3", "model.depth=1,0"],
     "the sweep's job model.dim=16 trainer.seed=0 model.depth=0: model.depth=0 must be at least 1"),
    (["model.kv_heads=2", "model.heads=2,3"],  # a rule of the model's constructor, built on the meta device
     "the sweep's job model.heads=3: model: heads=3 must be a multiple of kv_heads=2 (GQA groups)"),
    (["experiment=dalle", "data.image_size=32,34"],  # the VAE's constructor too
     "the sweep's job data.image_size=34: vae: image_size=34 must be divisible by 2**num_layers=4"),
    (["experiment=mqar", "data.num_kv_pairs=4,20"],  # a rule of the data's settings alone (its check_settings)
     "the sweep's job data.num_kv_pairs=20: data.num_kv_pairs=20 pairs and their 20 queries take 80 tokens"),
    (["data.seq_len=64,128"],  # a rule across sections
     "the sweep's job data.seq_len=64: task.prime_length=64 must be shorter than data.seq_len=64"),
    # the sweeper's and the parallel launcher's options, which would fail after the sweep's directory is made
    (["experiment=nsa_optuna", "hydra.sweeper.n_trials=0"], "error: hydra.sweeper.n_trials=0 must be at least 1"),
    (["experiment=nsa_optuna", "hydra.sweeper.direction=up"],
     "error: hydra.sweeper.direction=up must be minimize or maximize"),
    (["hydra/launcher=local_gpus", "hydra.launcher.n_jobs=0", "trainer.seed=0,1"],
     "error: hydra.launcher.n_jobs=0 must be the number of jobs at once (1 or more; -1: one a CPU)"),
]


@pytest.mark.parametrize("overrides,message", SWEEP_CASES, ids=[" ".join(o) for o, _ in SWEEP_CASES])
def test_a_sweep_with_a_job_that_cannot_run_is_one_line(overrides, message):
    from experiments.config.checks import sweep_error

    error = sweep_error(str(ROOT / "conf"), overrides)
    assert message in f"error: {error}" and "\n" not in error


def test_a_sweep_whose_jobs_compose_passes_and_sampled_values_are_the_sweepers():
    from experiments.config.checks import sweep_error

    assert sweep_error(str(ROOT / "conf"), ["model=nsa,moba", "model.kv_heads=2", "trainer.seed=range(0,2)",
                                            "optimizer.lr=interval(0.0001,0.01)"]) is None


def test_a_bad_sweep_is_refused_before_its_directory_exists(tmp_path):
    """Not Hydra's lines from its first job, after the sweep directory was made: one line, first."""
    cmd = [sys.executable, "train.py", "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}", "model.depth=two,4"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=run_env())
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: the sweep's job model.depth=two: Error merging override model.depth=two; Value 'two' of type 'str' "
        "could not be converted to Integer (python train.py --help lists every group and option, and the keys of "
        "those chosen)"]
    assert not (tmp_path / "sweep").exists()


def test_a_refused_sweep_job_names_the_sweeps_directory_setting(tmp_path):
    """A sweep's job lives where hydra.sweep.dir says: a new hydra.run.dir would change nothing."""
    sweep = ["-m", f"hydra.sweep.dir={tmp_path}", *TINY_LM, "trainer.max_steps=2", "trainer.seed=0"]
    assert train_py(*sweep).returncode == 0
    record = (tmp_path / "multirun.yaml").read_bytes()
    result = train_py(*sweep, "trainer.batch_size=3")
    assert "so this run cannot continue it: use a new hydra.sweep.dir, or pass the same overrides" in result.stderr
    # the refused job left its directory as it was, summary too: the sweep's exit status still says so
    assert result.returncode == 1 and "error: 1 job(s) of the sweep failed: " in result.stderr.splitlines()[-1]
    # and the sweep's own record (Hydra rewrites it at every launch) names the config that trained
    assert (tmp_path / "multirun.yaml").read_bytes() == record


# ---- files the project reads -----------------------------------------------------------------------


def byte_text(path):
    from experiments.data.text import ByteText

    return ByteText(seq_len=16, path=str(path), val_fraction=0.1)


def test_text_files(tmp_path):
    (tmp_path / "plain.gz").write_bytes(b"not gzip at all" * 10)
    whole = gzip.compress(b"x" * 100_000)
    (tmp_path / "cut.gz").write_bytes(whole[: len(whole) // 2])
    cases = {
        tmp_path / "plain.gz": "is not a complete gzip file",
        tmp_path / "cut.gz": "is not a complete gzip file",
        tmp_path: "is a directory: give the file to read",
        tmp_path / "missing.txt": "no such file: check the path",
    }
    for path, message in cases.items():
        with pytest.raises(UserError, match=message) as refused:
            byte_text(path)
        assert f"data.path={path}" in str(refused.value)


def image_folder(path, **kw):
    from experiments.data.image_text import ImageTextFolder

    knobs = dict(image_size=16, text_seq_len=16, resize_ratio=0.75, truncate_captions=False, val_fraction=0.5,
                 channels=3, tokenizer="bytes")
    return ImageTextFolder(path=str(path), **{**knobs, **kw})


def test_image_folders_shards_and_tokenizers(tmp_path):
    junk = tmp_path / "junk"
    junk.mkdir()
    for i in range(3):
        (junk / f"{i}.png").write_bytes(b"not a png")
        (junk / f"{i}.txt").write_text("a red circle")
    with pytest.raises(UserError, match=f"data.path={junk}: none of its training split's 2 images can be read"):
        image_folder(junk)
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.tar").write_bytes(b"not a tar file" * 100)
    with pytest.raises(UserError, match=r"a.tar is not a readable tar shard"):
        image_folder(shards)
    with pytest.raises(UserError, match="no such folder or tar file"):
        image_folder(tmp_path / "missing")
    pytest.importorskip("tokenizers")
    (tmp_path / "tok.json").write_text("{not json")
    good = tmp_path / "good"
    good.mkdir()
    _png_pair(good, "a"), _png_pair(good, "b")
    with pytest.raises(UserError, match="not a tokenizers JSON file"):
        image_folder(good, tokenizer=str(tmp_path / "tok.json"))


def _png_pair(folder: Path, stem: str) -> None:
    from PIL import Image

    Image.new("RGB", (20, 20), (255, 0, 0)).save(folder / f"{stem}.png")
    (folder / f"{stem}.txt").write_text("a red square")


def test_deepspeed_config_files(tmp_path):
    pytest.importorskip("deepspeed")
    from omegaconf import OmegaConf

    from experiments.config.schema import TrainerConfig
    from experiments.runtime.backends import DeepSpeedBackend

    trainer = OmegaConf.merge(OmegaConf.structured(TrainerConfig), OmegaConf.load(ROOT / "conf" / "config.yaml").trainer)
    (tmp_path / "bad.json").write_text("{bad")
    (tmp_path / "list.json").write_text("[1, 2]")
    cases = {"bad.json": "is not valid JSON", "list.json": "holds a JSON list"}
    for name, message in cases.items():
        backend = DeepSpeedBackend(config_file=str(tmp_path / name))
        with pytest.raises(UserError, match=message):
            backend.deepspeed_config(trainer)


# ---- command-line tools --------------------------------------------------------------------------

FLAG_CASES = [
    ("experiments.generate.speculative", ["RUN", "--gamma", "0"], "--gamma=0 must be at least 1"),
    ("experiments.generate.speculative", ["RUN", "--length", "-5"], "--length=-5 must be at least 1"),
    ("experiments.generate.speculative", ["RUN", "--top-k", "0"], "--top-k=0 must be at least 1, or leave the flag out"),
    ("experiments.generate.speculative", ["RUN", "--threads", "0"], "--threads=0 must be at least 1"),
    ("experiments.generate.speculative", ["RUN", "--prompt", ""], "--prompt is empty"),
    ("experiments.generate.speculative", ["RUN", "--engine", "static", "--temperature", "0.8"],
     "--engine=static decodes greedily: set temperature 0, or engine cache to sample"),
    ("experiments.generate.text_to_image", ["RUN", "--prompt", "x", "--num-images", "0"], "--num-images=0 must be at least 1"),
    ("experiments.generate.text_to_image", ["RUN", "--prompt", " "], "--prompt is empty: give the caption to draw"),
    ("experiments.generate.text_to_image", ["RUN", "--prompt", "x", "--out", "grid.jpg"],
     "--out grid.jpg: the grid is written as a PNG: name a .png file"),
    ("experiments.generate.text_to_image", ["RUN", "--prompt", "x", "--filter-thres", "1.5"], "--filter-thres=1.5 must lie in [0, 1)"),
]


@pytest.mark.parametrize("module,argv,message", FLAG_CASES, ids=[" ".join(a) for _, a, _ in FLAG_CASES])
def test_tool_flags_are_refused_before_loading(tmp_path, module, argv, message):
    import importlib

    err = io.StringIO()
    with redirect_stderr(err):
        status = importlib.import_module(module).main([str(tmp_path / "no-run") if a == "RUN" else a for a in argv])
    assert status == 2 and message in err.getvalue() and err.getvalue().count("\n") == 1


@pytest.mark.parametrize("module", ["experiments.generate.speculative", "experiments.generate.text_to_image"])
def test_a_generator_given_a_file_that_is_no_checkpoint_says_what_to_point_it_at(tmp_path, module):
    import importlib

    (tmp_path / "notes.pt").write_text("not a checkpoint")
    err = io.StringIO()
    with redirect_stderr(err):
        status = importlib.import_module(module).main([str(tmp_path / "notes.pt"), "--prompt", "x"])
    assert status == 1 and err.getvalue().count("\n") == 1
    assert "not a checkpoint: point run at a run directory" in err.getvalue() and "trainer.resume" not in err.getvalue()


BENCHMARK_CASES = [
    (["foo"], [], "--models foo: In 'config': Could not find 'model/foo'; Available options in 'model'"),
    (["ref:foo"], [], "--models ref:foo: the reference packages measured are ref:sinkhorn and ref:routing"),
    (["nsa"], ["model.num_fine_selectd=3"], "--models nsa --override model.num_fine_selectd=3 (for every model): Could"),
    (["nsa", "transformer"], ["model.num_fine_selected=8"],
     "--models transformer --override model.num_fine_selected=8 (for every model): Could not override"),
]


BENCHMARK_FLAG_CASES = [
    ("experiments.bench.models", ["--seq", "1024", "0", "--repeat", "0"], "--repeat=0 must be at least 1; --seq=0 must"),
    ("experiments.bench.models", ["--batch", "0"], "--batch=0 must be at least 1"),  # not taken as the default
    ("experiments.bench.speculative", ["--models"], "--models with none named measures nothing"),
    ("experiments.bench.models", ["--decode", "--tensor-peak"], "--tensor-peak measures a training step: leave out"),
    ("experiments.bench.speculative", ["--gamma", "0", "--primes", "0"], "--gamma=0 must be at least 1; --primes"),
    ("experiments.bench.speculative", ["--temperature", "-1"], "--temperature=-1.0 must be 0 or more"),
    ("experiments.bench.speculative", ["--models", "--run", "/nowhere"],
     "--run=/nowhere: no such checkpoint file or run directory"),
    ("experiments.bench.speculative", ["--engine", "compiled", "--temperature", "1"],
     "--engine=compiled decodes greedily: set temperature 0"),
    ("experiments.bench.dalle", ["--steps", "0", "--ff-mult", "0"], "--steps=0 must be at least 1; --ff-mult=0.0 "
                                                                        "must be positive"),
    ("experiments.bench.kernels", ["--lengths", "64", "0", "--repeats", "0"], "--lengths=0 must be at least 1; --repeats=0"),
]


@pytest.mark.parametrize("module,argv,message", BENCHMARK_FLAG_CASES, ids=[" ".join(c[1]) for c in BENCHMARK_FLAG_CASES])
def test_benchmark_flags_are_refused_before_measuring(module, argv, message, capsys):
    import importlib

    with pytest.raises(SystemExit) as exited:
        importlib.import_module(module).main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"python -m {module}: error: {message}")


def test_a_benchmark_refusal_is_exit_status_2_and_one_line_as_a_command():
    """The one flag refusal run as a user runs it: the process's exit status and its last line."""
    result = subprocess.run([sys.executable, "-m", "experiments.bench.models", "--repeat", "0"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env=run_env())
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == ("python -m experiments.bench.models: error: --repeat=0 must be "
                                                      "at least 1")


@pytest.mark.parametrize("models,overrides,message", BENCHMARK_CASES, ids=[c[2][:24] for c in BENCHMARK_CASES])
def test_benchmark_models_and_overrides_are_refused_before_measuring(models, overrides, message):
    from experiments.bench.models import config_problem

    assert config_problem(models, overrides).startswith(message)
    assert config_problem(["nsa", "transformer", "ref:sinkhorn"], ["model.depth=2"]) is None


def test_tools_name_a_missing_run(tmp_path):
    from experiments.generate import speculative, text_to_image

    for main, argv in ((speculative.main, []), (text_to_image.main, ["--prompt", "x"])):
        err = io.StringIO()
        with redirect_stderr(err):
            assert main([str(tmp_path / "nowhere"), *argv]) == 1
        assert "no such checkpoint file or run directory" in err.getvalue()


# ---- the run directory: a refused rerun changes nothing --------------------------------------------


@pytest.fixture(scope="module")
def completed_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("done") / "run"
    train(run, "trainer.max_steps=2")
    return run


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != "train.log"}


def _truncated_newest(run: Path) -> None:
    newest = run / "checkpoints" / "step_0000002.pt"
    (run / "checkpoints" / "step_0000003.pt").write_bytes(newest.read_bytes()[:1000])


def _foreign_newest(run: Path) -> None:
    torch.save({"weights": torch.ones(2)}, run / "checkpoints" / "step_0000003.pt")


def _resumed_with_other_settings(run: Path) -> None:
    """An accepted resume whose overrides differ in keys a resume may change: its .hydra files are the run's now."""
    train(run, "trainer.max_steps=2", "trainer.log_every=2", "trainer.generate_every=0")


REFUSALS = [
    ("another model", None, ["model.depth=2"], "model.depth differ"),
    ("another batch and seed", None, ["trainer.batch_size=4", "trainer.seed=1"],
     "trainer.batch_size, trainer.seed differ"),
    ("another precision", None, ["trainer.precision=bf16"], "trainer.precision differ"),
    # the schedule reads its length from max_steps (cosine's default): the key typed is named beside it
    ("more steps on a schedule of their length", None, ["trainer.max_steps=4"],
     "(schedule.total_steps (from trainer.max_steps) differ)"),
    ("another model after a resume with other settings", _resumed_with_other_settings, ["model.depth=2"],
     "model.depth differ"),
    ("resume never", None, ["trainer.resume=never"], "trainer.resume=never would overwrite"),
    ("truncated newest checkpoint", _truncated_newest, ["trainer.max_steps=4"], "cannot be read"),
    ("foreign newest checkpoint", _foreign_newest, ["trainer.max_steps=4"], "not written by this project"),
    ("a bad value", None, ["optimizer.lr=-1"], "optimizer.lr=-1.0 must be positive"),
    ("a data file that is not gzip", None, ["data.path=setup.gz"], "is not a complete gzip file"),
    ("other weights to start from", None, ["trainer.init_from=SOURCE"], "trainer.init_from differ"),
]


@pytest.mark.parametrize("case,prepare,overrides,message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_refused_rerun_leaves_the_run_byte_identical(tmp_path, completed_run, case, prepare, overrides, message):
    run = tmp_path / "run"
    shutil.copytree(completed_run, run)
    (tmp_path / "setup.gz").write_bytes(b"plain text, not gzip" * 100)
    if prepare:
        prepare(run)
    before = snapshot(run)
    overrides = [o.replace("setup.gz", str(tmp_path / "setup.gz")).replace("SOURCE", str(completed_run))
                 for o in overrides]
    result = train(run, "trainer.max_steps=2", *overrides, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: ") and message in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert snapshot(run) == before  # summary, metrics, checkpoints, .hydra/: as they were


def test_a_refused_rerun_of_a_run_that_never_trained_leaves_it_byte_identical(tmp_path):
    """A first session that stopped before training (here: its data missing; or killed while the
    models were built) kept no accepted config aside: a refused rerun still puts its .hydra back."""
    run = tmp_path / "run"
    first = train(run, f"data.path={tmp_path / 'missing.txt'}", check=False)
    assert first.returncode == 1 and (run / ".hydra" / "overrides.yaml").is_file()
    before = snapshot(run)
    result = train(run, "trainer.precision=fp16", check=False)  # refused on a CPU
    assert result.returncode == 1 and "was left as it was" in result.stderr
    assert snapshot(run) == before


def test_a_resume_on_data_that_changed_under_the_same_path_is_refused(tmp_path):
    """The same data.path with other bytes in it: the steps after the checkpoint would train on data
    the run's summary does not name."""
    text, run = tmp_path / "corpus.txt", tmp_path / "run"
    text.write_bytes(bytes(range(32, 127)) * 60)
    train(run, f"data.path={text}", "trainer.max_steps=2", "schedule=constant")
    text.write_bytes(bytes(range(126, 31, -1)) * 60)
    before = snapshot(run)
    result = train(run, f"data.path={text}", "trainer.max_steps=3", "schedule=constant", check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr + result.stdout
    assert "was trained on other data: corpus.txt" in result.stderr.strip().splitlines()[-1]
    assert snapshot(run) == before


@pytest.mark.slow
def test_a_rerun_with_another_backend_leaves_the_run_byte_identical(tmp_path, completed_run):
    run = tmp_path / "run"
    shutil.copytree(completed_run, run)
    before = snapshot(run)
    result = train(run, "trainer.max_steps=2", "backend=deepspeed", check=False, timeout=600)
    assert result.returncode == 1 and "not written by backend=deepspeed" in result.stderr
    assert snapshot(run) == before


def test_a_checkpoint_the_disk_refuses_is_one_line_and_a_rerun_goes_on(tmp_path, completed_run):
    """A full disk, stood in for by a file-size limit below a checkpoint's size (EFBIG, as ENOSPC):
    one line naming the file, no temporary file left, and the same command run again completes."""
    import resource

    limit = (completed_run / "checkpoints" / "step_0000002.pt").stat().st_size // 2

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    run, overrides = tmp_path / "run", ["trainer.max_steps=4", "trainer.checkpoint_every=2"]
    result = subprocess.run([sys.executable, "train.py", f"hydra.run.dir={run}", *TINY_LM, *overrides], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env=run_env(), preexec_fn=small_files)
    assert result.returncode == 1 and "Traceback" not in result.stderr + result.stdout
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: File too large writing {run / 'checkpoints' / 'step_0000002.pt'}: free some space (or choose a "
        "hydra.run.dir on another disk), then rerun the same command to go on from the last checkpoint")
    assert list((run / "checkpoints").iterdir()) == []
    assert read_summary(run)["status"] == "failed" and "File too large" in read_summary(run)["error"]

    train(run, *overrides)
    assert read_summary(run)["status"] == "completed"
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3, 4]


def test_a_run_or_sweep_directory_that_is_a_file(tmp_path):
    (tmp_path / "taken").write_text("a file")
    result = train_py(f"hydra.run.dir={tmp_path / 'taken' / 'run'}")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"error: hydra.run.dir={tmp_path / 'taken' / 'run'}: {tmp_path / 'taken'} is a " \
                                    "file, not a directory: choose another hydra.run.dir"
    result = train_py("-m", "trainer.seed=0,1", f"hydra.sweep.dir={tmp_path / 'taken' / 'sweep'}")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"error: hydra.sweep.dir={tmp_path / 'taken' / 'sweep'}: {tmp_path / 'taken'} is " \
                                    "a file, not a directory: choose another hydra.sweep.dir"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep"])
def test_a_directory_the_system_will_not_make_is_one_line(sweep):
    """/proc passes the permission check (root may write anywhere) and refuses the mkdir."""
    key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    result = train_py(*(["-m", "trainer.seed=0,1"] if sweep else []), f"{key}=/proc/no_run_here")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (f"error: {key}=/proc/no_run_here cannot be made (No such file or directory): "
                                     f"choose a {key} where you can write")


# ---- interruptions: exit status and leftovers -----------------------------------------------------


def test_ctrl_c_exits_130_and_records_interrupted(tmp_path):
    run = tmp_path / "run"
    proc = start_long_train(run, 2)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 128 + signal.SIGINT
    assert read_summary(run)["status"] == "interrupted"


def test_ctrl_c_while_starting_exits_130_in_one_line(tmp_path):
    """0.8 s in: the imports or the checks, before the run takes the signal over (a traceback before)."""
    proc = start_train(tmp_path / "run")
    time.sleep(0.8)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT and "Traceback" not in err, err[-3000:]
    if not (tmp_path / "run" / "summary.json").exists():  # else the run had begun: recorded interrupted
        assert err.strip().splitlines()[-1] == "interrupted: no run was training"


def test_sigterm_stops_a_sweep_after_checkpointing_its_current_job(tmp_path):

    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "train.py", "-m", f"hydra.sweep.dir={sweep}", *TINY_LM, "trainer.max_steps=100000",
           "trainer.checkpoint_every=0", "trainer.validate_every=0", "trainer.seed=0,1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=run_env())
    deadline = time.time() + 120
    while time.time() < deadline and not any(sweep.rglob("metrics.jsonl")):
        time.sleep(0.1)
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    summaries = [json.loads(p.read_text()) for p in sweep.rglob("summary.json")]
    assert [s["status"] for s in summaries] == ["interrupted"]  # the second job never started


def test_sigterm_to_a_parallel_sweeps_parent_stops_its_running_jobs_at_a_checkpoint(tmp_path):
    """hydra/launcher=local_gpus: the parent alone signalled (as `kill <pid>` does) passes the stop to
    its workers: each running job checkpoints and records interrupted, the queued job never starts
    (it left its workers training to the end)."""
    import os

    sweep = tmp_path / "sweep"
    tiny = [o for o in TINY_LM if not o.startswith("trainer.threads")]
    cmd = [sys.executable, "train.py", "-m", f"hydra.sweep.dir={sweep}", "hydra/launcher=local_gpus",
           "hydra.launcher.n_jobs=2", *tiny, "trainer.max_steps=100000", "trainer.checkpoint_every=20",
           "trainer.validate_every=0", "trainer.seed=0,1,2"]
    log = tmp_path / "stderr.txt"  # a file, not a pipe: the workers hold it open after the parent is gone
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("w"), env=run_env(),
                            start_new_session=True)  # its workers in its group: killed at the end, whatever happens
    try:
        jobs = [sweep / f"seed={seed}" for seed in (0, 1)]
        deadline = time.time() + 120
        while time.time() < deadline and not all(any(job.glob("checkpoints/step_*.pt")) for job in jobs):
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert "Traceback" not in log.read_text()
        deadline = time.time() + 60
        while time.time() < deadline and any(read_summary(job)["status"] == "running" for job in jobs):
            time.sleep(0.2)
        for job in jobs:
            summary = read_summary(job)
            assert summary["status"] == "interrupted"
            assert (job / "checkpoints" / f"step_{summary['step']:07d}.pt").is_file()  # where it stopped
        assert not (sweep / "seed=2").exists()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # joblib's idle workers outlive the parent
        except ProcessLookupError:
            pass


def test_a_fresh_start_after_a_kill_keeps_none_of_the_killed_attempt(tmp_path):
    """Killed before its first checkpoint: the next start is a fresh run, without the old rows."""
    run = tmp_path / "run"
    proc = start_long_train(run, 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (run / "checkpoints").mkdir(exist_ok=True)
    (run / "checkpoints" / ".step_0000009.pt.x1y2.tmp").write_bytes(b"half a checkpoint")
    train(run, "trainer.max_steps=2")
    steps = [row["step"] for row in read_metrics(run) if "loss" in row]
    assert steps == [1, 2]
    assert not list((run / "checkpoints").glob(".*.tmp"))


def test_a_checkpoint_write_cut_short_leaves_no_temporary_file_after_resume(tmp_path):
    """Nor a sample's (samples/ are written the same way)."""
    run = tmp_path / "run"
    train(run, "trainer.max_steps=2", "schedule=constant")
    (run / "checkpoints" / ".step_0000003.pt.abcd.tmp").write_bytes(b"cut short")
    (run / ".summary.json.efgh.tmp").write_bytes(b"{")
    (run / "samples" / ".step_0000003.txt.ijkl.tmp").write_bytes(b"=== gen")
    train(run, "trainer.max_steps=3", "schedule=constant")
    assert not list(run.rglob(".*.tmp")) and json.loads((run / "summary.json").read_text())["step"] == 3


# ---- review -----------------------------------------------------------------------------------


def test_review_names_an_unreadable_summary(tmp_path, completed_run, capsys):
    from experiments.review.runs import main

    run = tmp_path / "sweep" / "job"
    shutil.copytree(completed_run, run)
    (run / "summary.json").write_text("{torn")
    assert main([str(tmp_path / "sweep"), "--no-plots", "--format", "csv"]) == 0
    out = capsys.readouterr()
    assert f"{run / 'summary.json'} cannot be read" in out.err
    assert ",unreadable," in out.out

