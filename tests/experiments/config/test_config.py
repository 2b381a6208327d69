"""Every config option composes and instantiates; bad keys and values fail at composition."""

import pytest
import torch
from hydra.errors import ConfigCompositionException, MissingConfigException
from hydra.utils import instantiate
from omegaconf.errors import ConfigKeyError, ValidationError

from tests.helpers.runs import ROOT

OPTIONS = {group: sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))
           for group in ("model", "data", "optimizer", "schedule", "backend", "tracker", "task")}


def tiny_data_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(range(256)) * 40)
    return path


def tiny_image_folder(tmp_path):
    from PIL import Image

    for i, colour in enumerate(["red", "blue", "green"]):
        Image.new("RGB", (12, 12), colour).save(tmp_path / f"{i}.png")
        (tmp_path / f"{i}.txt").write_text(f"a {colour} square\n")
    return tmp_path


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in OPTIONS.items() for o in opts],
                         ids=[f"{g}={o}" for g, opts in OPTIONS.items() for o in opts])
def test_every_option_composes_and_instantiates(compose, tmp_path, group, option):
    images = (group, option) in {("data", "shapes"), ("data", "image_folder")}
    recall = (group, option) in {("data", "mqar"), ("data", "passkey")}
    overrides = [f"{group}={option}"] + ([] if images else [f"data.seq_len={128 if option == 'passkey' else 64}"])
    if (group, option) in {("data", "text"), ("data", "enwik8")}:
        overrides.append(f"data.path={tiny_data_file(tmp_path)}")
        if option == "enwik8":
            overrides += ["data.train_bytes=8000", "data.val_bytes=2000"]
    if (group, option) == ("data", "image_folder"):
        overrides += [f"data.path={tiny_image_folder(tmp_path)}", "data.image_size=8"]
    cfg = compose(*overrides)
    part = instantiate(cfg[group])
    if (group, option) == ("model", "dvae"):
        loss, figures = part(torch.rand(2, 3, part.image_size, part.image_size))
        assert loss.ndim == 0 and "recon_loss" in figures
    elif (group, option) == ("model", "dalle"):  # the task completes it from the data and the VAE
        dalle = part(num_text_tokens=10, text_seq_len=4, num_image_tokens=16, image_fmap_size=2)
        assert dalle(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 26)
    elif images:
        text, pictures = part.train_batch(2, seed=0, step=0)
        assert text.shape == (2, part.text_seq_len) and pictures.shape[0] == 2
    elif group == "optimizer":
        optimizer = part([torch.nn.Parameter(torch.zeros(2))])
        assert type(optimizer) is {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[option]
        schedule = instantiate(cfg.schedule)(optimizer)
        assert schedule.get_last_lr()[0] > 0
    elif group == "schedule":  # the first step's rate: the base one, or a warm-up's first share of it
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
        part(optimizer)
        first = optimizer.param_groups[0]["lr"]
        assert first == 1.0 if option in ("constant", "plateau") else 0 < first < 1
    elif group == "model":
        assert part(torch.zeros(1, 64, dtype=torch.long)).shape == (1, 64, 256)
    elif recall:  # inputs, targets (IGNORE but at the answers), depth bins
        inputs, targets, depth = part.train_batch(2, seed=0, step=0)
        assert inputs.shape == targets.shape == (2, part.seq_len) and depth.shape == (2,)
    elif group == "data":
        assert part.train_batch(2, seed=0, step=0).shape == (2, 65)
    else:  # backend, tracker, task: the class the option names
        from experiments.runtime import backends, trackers
        from experiments.tasks import dalle, dvae, lm, recall, speculative

        assert type(part) is {
            ("backend", "local"): backends.LocalBackend, ("backend", "ddp"): backends.DDPBackend,
            ("backend", "deepspeed"): backends.DeepSpeedBackend, ("tracker", "none"): trackers.NoTracker,
            ("tracker", "wandb"): trackers.WandbTracker, ("task", "lm"): lm.LanguageModelTask,
            ("task", "speculative"): speculative.SpeculativeTask, ("task", "dvae"): dvae.DiscreteVAETask,
            ("task", "dalle"): dalle.TextToImageTask, ("task", "recall"): recall.RecallTask}[group, option]


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")))
def test_every_experiment_preset_composes(compose, experiment):
    cfg = compose(f"experiment={experiment}")
    assert cfg.model._target_ and cfg.trainer.max_steps > 0


def test_nsa_enwik8_preset_matches_the_seed(compose):
    cfg = compose("experiment=nsa_enwik8")
    m, t = cfg.model, cfg.trainer
    assert (cfg.data.seq_len, m.dim, m.depth, m.heads, m.kv_heads, m.dim_head) == (512, 512, 6, 8, 4, 64)
    assert (m.sliding_window_size, m.compress_block_size, m.fine_block_size, m.num_fine_selected) == (64, 16, 16, 4)
    assert (t.batch_size, t.grad_accum, t.clip_grad_norm, t.validate_every, t.generate_every) == (4, 4, 0.5, 100, 500)
    assert cfg.optimizer._target_ == "torch.optim.Adam" and cfg.optimizer.lr == 1e-4
    assert (cfg.task.prime_length, cfg.task.generate_length) == (64, 512)
    assert cfg.tracker.project == "native-sparse-attention"
    assert cfg.tracker.name == "sparse-attn: compress size 16 | fine size 16 | 4 selected"


def test_speculative_presets_have_a_target_and_a_draft(compose):
    seed = compose("experiment=speculative_enwik8")
    assert (seed.model.dim, seed.model.depth, seed.draft.dim, seed.draft.depth) == (512, 10, 512, 2)
    assert (seed.trainer.batch_size, seed.trainer.grad_accum, seed.optimizer.lr) == (4, 4, 1e-4)
    assert (seed.task.prime_length, seed.task.generate_length, seed.task.gamma, seed.trainer.generate_every) == (
        128, 512, 5, 500)
    small = compose("experiment=speculative")
    assert small.draft.depth < small.model.depth and small.data._target_.endswith("ByteText")
    assert compose().draft is None  # the LM task has no draft


def test_default_is_nsa_on_the_builtin_corpus(compose):
    cfg = compose()
    assert cfg.model._target_ == "models.lm.nsa_lm"
    assert cfg.data._target_ == "experiments.data.text.ByteText" and cfg.data.path is None


def test_the_interpreters_standard_library_is_its_own_option(compose):
    cfg = compose("data=stdlib")
    assert cfg.data._target_ == "experiments.data.text.InterpreterStdlib" and "path" not in cfg.data
    assert cfg.data.cache_dir.endswith("/sparse-attention") and "cache_dir" not in compose().data


def test_misspelt_key_fails_naming_it(compose):
    with pytest.raises(ConfigCompositionException) as info:
        compose("trainer.max_step=5")
    assert "max_step" in str(info.value) or "max_step" in str(info.value.__cause__)


def test_misspelt_model_knob_fails_naming_it(compose):
    with pytest.raises((ConfigCompositionException, ConfigKeyError)) as info:
        compose("model.num_fine_selectd=2")
    assert "num_fine_selectd" in str(info.value) + str(info.value.__cause__)


@pytest.mark.parametrize("override", ["model.depth=abc", "trainer.device=gpu", "trainer.precision=fp8"])
def test_wrong_type_or_value_fails_at_composition(compose, override):
    with pytest.raises((ConfigCompositionException, ValidationError)) as info:
        compose(override)
    assert override.split("=")[0].split(".")[-1] in str(info.value) + str(info.value.__cause__)


def test_unknown_group_option_fails(compose):
    with pytest.raises(MissingConfigException, match="model/nope"):
        compose("model=nope")
