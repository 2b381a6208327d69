"""The dvae and dalle tasks end to end: stages, run directory, scores, generation, resume; on CUDA (the
gpu tier): the preset."""

import json

import pytest
import torch
from PIL import Image

from tests.helpers.runs import (ROOT, TINY_DALLE, TINY_DVAE, kill_after_first_checkpoint, read_metrics, read_summary,
                                train)
from experiments.runtime import checkpoint


@pytest.fixture(scope="module")
def dalle_run(tmp_path_factory):
    """The tiny text-to-image run, trained once for the tests that read it."""
    run = tmp_path_factory.mktemp("dalle") / "run"
    train(run, base=TINY_DALLE)
    return run


def test_dalle_trains_the_vae_then_dalle_and_leaves_scored_image_grids(dalle_run):
    tmp_path = dalle_run
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows if "vae_loss" in r] == [1, 2, 3]
    assert [r["step"] for r in rows if "image_loss" in r] == [4, 5, 6]
    summary = read_summary(tmp_path)
    assert summary["status"] == "completed" and summary["step"] == 6
    for key in ("vae_val_hard_recon_loss", "vae_val_colour_agreement", "val_loss", "val_image_loss",
                "colour_agreement", "shape_agreement", "tokens_per_s"):
        assert key in summary, key
    assert 0 <= summary["colour_agreement"] <= 1
    grid = Image.open(tmp_path / "samples" / "step_0000006.png")
    assert grid.size[0] > 4 * 64  # four tiles in a row
    assert (tmp_path / "samples" / "step_0000003_vae.png").is_file()  # the end of the VAE stage
    state = checkpoint.load(checkpoint.latest(tmp_path / "checkpoints"))
    assert {"dalle_hparams", "vae_config", "tokenizer", "model", "vae_model"} <= set(state)


def test_generate_command_needs_only_the_checkpoint(dalle_run, tmp_path, monkeypatch, capsys):
    from experiments.generate.text_to_image import load_run, main
    from experiments.tasks.dalle import generate_images

    monkeypatch.chdir(tmp_path)  # away from the repository: the run's checkpoint is all it reads
    out = tmp_path / "made.png"
    assert main([str(dalle_run), "--prompt", "a large red circle at the top left", "--num-images", "3",
                 "--out", str(out)]) == 0
    assert out.is_file() and "colour_agreement" in capsys.readouterr().out
    dalle, vae, tokenizer = load_run(str(dalle_run))
    images = generate_images(dalle, vae, tokenizer, ["a small blue square at the top left"] * 2,
                             generator=torch.Generator().manual_seed(0))
    assert images.shape == (2, 3, 16, 16)


def test_generate_command_refuses_a_prompt_the_model_would_cut_and_an_unwritable_out(dalle_run, tmp_path, capsys):
    from experiments.generate.text_to_image import load_run, main

    _, _, tokenizer = load_run(str(dalle_run))
    words = "a " * 40 + "large red circle"
    assert main([str(dalle_run), "--prompt", words, "--num-images", "1", "--out", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --prompt is {len(tokenizer.encode(words))} tokens and the model reads ")
    assert err.count("\n") == 1 and not (tmp_path / "x.png").exists()
    assert main([str(dalle_run), "--prompt", words, "--num-images", "1", "--out", str(tmp_path / "x.png"),
                 "--truncate"]) == 0
    (tmp_path / "file").write_text("")
    unwritable = tmp_path / "file" / "x.png"  # under a file
    assert main([str(dalle_run), "--prompt", "a red circle", "--num-images", "1", "--out", str(unwritable)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: --out {unwritable}: ")


@pytest.mark.slow
def test_resume_across_the_stage_boundary_equals_an_uninterrupted_run(tmp_path):
    steps = ["trainer.checkpoint_every=2", "trainer.keep_checkpoints=10"]
    train(tmp_path / "whole", *steps, base=TINY_DALLE)
    kill_after_first_checkpoint(tmp_path / "killed", *steps, base=TINY_DALLE)
    assert checkpoint.latest(tmp_path / "killed" / "checkpoints").name == "step_0000002.pt"  # inside the VAE stage
    train(tmp_path / "killed", *steps, base=TINY_DALLE)
    figures = lambda d: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu", "wall_s")}  # noqa: E731
                         for r in read_metrics(d)]
    assert figures(tmp_path / "killed") == figures(tmp_path / "whole")


@pytest.mark.slow
def test_a_trained_vae_from_another_run_skips_the_vae_stage(tmp_path):
    train(tmp_path / "vae", base=TINY_DVAE)
    vae_summary = read_summary(tmp_path / "vae")
    assert "val_hard_recon_loss" in vae_summary and (tmp_path / "vae" / "samples" / "step_0000003_vae.png").is_file()
    train(tmp_path / "dalle", f"task.vae_path={tmp_path / 'vae'}", base=TINY_DALLE)
    rows = read_metrics(tmp_path / "dalle")
    assert not any("vae_loss" in r for r in rows) and [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert read_summary(tmp_path / "dalle")["vae_path"] == str(tmp_path / "vae")
    state = checkpoint.load(checkpoint.latest(tmp_path / "dalle" / "checkpoints"))
    vae_state = checkpoint.load(checkpoint.latest(tmp_path / "vae" / "checkpoints"))
    assert all(torch.equal(state["vae_model"][k], v) for k, v in vae_state["model"].items())  # frozen


def test_a_vae_path_that_is_not_a_vae_run_is_refused(tmp_path):
    train(tmp_path / "lm", "trainer.max_steps=1")
    result = train(tmp_path / "dalle", f"task.vae_path={tmp_path / 'lm'}", base=TINY_DALLE, check=False)
    assert result.returncode != 0
    assert "neither a dvae nor a dalle run" in result.stderr
    assert not (tmp_path / "dalle" / "checkpoints").exists()
    missing = train(tmp_path / "other", f"task.vae_path={tmp_path / 'nowhere'}", base=TINY_DALLE, check=False)
    assert "task.vae_path=" in missing.stderr and "no such checkpoint file or run directory" in missing.stderr


def test_data_and_vae_image_sizes_must_agree(tmp_path):
    result = train(tmp_path, "vae.image_size=32", base=TINY_DALLE, check=False)
    assert result.returncode != 0 and "data.image_size=32" in result.stderr


@pytest.mark.slow
def test_dalle_with_deepspeed(tmp_path):
    train(tmp_path, "backend=deepspeed", base=TINY_DALLE, timeout=600)
    summary = read_summary(tmp_path)
    assert summary["status"] == "completed" and "colour_agreement" in summary
    assert json.loads((tmp_path / "summary.json").read_text())["step"] == 6


def test_tasks_refuse_models_and_data_they_cannot_train(tmp_path, compose):
    """Each task's check_parts refuses the model and the data it cannot train (the models on the meta
    device, as train.py's pre-check builds them); one of them as train.py runs it: one line, no
    traceback, and no run directory."""
    from experiments.config.checks import composition_error, parts_error

    cases = ((["model=dvae"], "task=lm trains language models"),
             (["task=dvae", "data=shapes"], "task=dvae trains a discrete VAE"),
             (["task=dalle", "data=shapes"], "task=dalle needs model=dalle"),
             (["task=recall", "model=transformer"], "task=recall reads recall data, and data=text is not"),
             (["task=speculative"], "task=speculative needs a draft model"))
    for overrides, message in cases:
        assert message in parts_error(compose(*overrides)), overrides
    # image models on text: their config reads data.image_size, which composing already refuses
    assert "an image model reads data.image_size" in composition_error(str(ROOT / "conf"), ["experiment=dvae",
                                                                                          "data=text"])
    for preset in ("dvae", "dalle", "mqar", "passkey", "speculative"):
        assert parts_error(compose(f"experiment={preset}")) is None
    quick = ["tracker=none", "trainer.progress=false", "trainer.max_steps=1"]
    result = train(tmp_path / "run", "model=dvae", base=quick, check=False)
    assert result.returncode != 0 and "task=lm trains language models" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


@pytest.mark.gpu
def test_the_preset_runs_a_few_steps_of_each_stage_on_cuda(tmp_path):
    """experiment=dalle as the README runs it, five VAE steps and five DALL-E steps, then validation and
    a generated grid."""
    train(tmp_path, "experiment=dalle", "task.vae_steps=5", "trainer.max_steps=5", "trainer.device=cuda",
          "trainer.log_every=1", "tracker=none", "trainer.progress=false", base=[])
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows if "vae_loss" in r] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in rows if "image_loss" in r] == [6, 7, 8, 9, 10]
    summary = read_summary(tmp_path)
    assert summary["status"] == "completed" and summary["device"].startswith("cuda")
    assert 0 <= summary["colour_agreement"] <= 1 and (tmp_path / "samples" / "step_0000010.png").is_file()


def test_the_dalle_runs_text_and_image_figures_combine_into_its_loss(tmp_path):
    import yaml

    from tests.helpers.runs import TINY_DALLE, read_metrics, read_summary, train

    run = tmp_path / "run"
    train(run, base=TINY_DALLE)
    w = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())["model"]["loss_img_weight"]
    assert w != 1
    summary = read_summary(run)
    rows = [r for r in read_metrics(run) if "image_loss" in r]
    for loss, text, image in [(r["loss"], r["text_loss"], r["image_loss"]) for r in rows] + [
            (summary["val_loss"], summary["val_text_loss"], summary["val_image_loss"])]:
        assert loss == pytest.approx((text + w * image) / (w + 1), abs=1e-4)


def test_a_vae_on_data_that_is_not_its_images_is_refused_naming_the_knob():
    from types import SimpleNamespace

    from experiments.runtime.errors import UserError
    from experiments.tasks.dvae import check_images

    vae = SimpleNamespace(image_size=16, channels=3)
    with pytest.raises(UserError, match="model reads images, and this data is not images: use data=shapes"):
        check_images(SimpleNamespace(vocab_size=256, seq_len=32), vae, "model")
    with pytest.raises(UserError, match="data gives 1x16x16 images but model expects 3x16x16: set "
                                        "data.channels=3 or model.channels=1$"):
        check_images(SimpleNamespace(image_size=16, channels=1), vae, "model")
    with pytest.raises(UserError, match="set data.image_size=16 or model.image_size=32$"):
        check_images(SimpleNamespace(image_size=32, channels=3), vae, "model")
