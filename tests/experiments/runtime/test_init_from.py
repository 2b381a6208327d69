"""experiments/runtime/init_from.py: trainer.init_from loads another run's matching weights into a new
run, reports what it loaded, converted, left new and dropped, and refuses bad sources in one line
before any weight changes. A run started that way resumes its own checkpoints, never the source."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from experiments.runtime import checkpoint
from experiments.runtime.errors import UserError
from experiments.runtime.init_from import initialise
from models.lm import dsa_lm, moba_lm, nsa_lm, transformer_lm
from tests.helpers.runs import (ROOT, TINY_LM, kill_after_first_checkpoint, losses, read_metrics, read_summary, torchrun,
                                train)

SIZE = dict(num_tokens=32, dim=32, depth=2, heads=4, dim_head=8)
DENSE_CFG = {"_target_": "models.lm.transformer_lm", **SIZE}
NSA = dict(kv_heads=2, sliding_window_size=8, compress_block_size=4, compress_stride=2, fine_block_size=4,
           num_fine_selected=3)
LM_CFG = {"_target_": "models.lm.nsa_lm"}


def save_run(run, model, model_cfg=DENSE_CFG, task="lm", step=7):
    """A run directory holding one checkpoint of `model`, as the loop writes them."""
    config = OmegaConf.to_yaml({"model": model_cfg, "task": {"_target_": f"experiments.tasks.{task}.Task"}})
    checkpoint.save({"step": step, "model": model.state_dict(), "config": config, "data_fingerprint": "text:1:ab",
                     "summary": {"task": task, "model": "transformer"}}, run / "checkpoints")
    return run


@pytest.fixture
def dense_run(tmp_path):
    torch.manual_seed(0)
    return save_run(tmp_path / "dense", transformer_lm(**SIZE))


def nets(model):
    return {"": model}


def test_loading_reports_what_was_loaded_converted_new_and_dropped(dense_run):
    torch.manual_seed(1)
    model = nsa_lm(**SIZE, **NSA)
    report = initialise(nets(model), str(dense_run), {"": LM_CFG})
    assert report["path"] == str(dense_run / "checkpoints" / "step_0000007.pt") and report["step"] == 7
    assert len(report["fingerprint"]) == 16 and report["data_fingerprint"] == "text:1:ab"
    assert report["converted"] == ["blocks.*.attn.to_gates.bias (x2)", "blocks.*.attn.to_kv.weight (x2)",
                                   "blocks.*.attn.to_q.weight (x2)"]
    assert report["new"] == ["blocks.*.attn.compressor.b1 (x2)", "blocks.*.attn.compressor.pos (x2)",
                             "blocks.*.attn.compressor.w1 (x2)", "blocks.*.attn.compressor.w2 (x2)",
                             "blocks.*.attn.to_gates.weight (x2)"]
    assert report["dropped"] == []
    assert "token_emb.weight" in report["loaded"] and "blocks.*.attn.to_out.weight (x2)" in report["loaded"]
    params = sum(p.numel() for p in model.parameters())
    compressor_and_gates = sum(p.numel() for n, p in model.named_parameters() if "compressor" in n or "to_gates.weight" in n)
    assert report["new_params"] == compressor_and_gates and report["loaded_params"] == params - compressor_and_gates
    source = checkpoint.load(dense_run / "checkpoints" / "step_0000007.pt")["model"]
    assert torch.equal(model.token_emb.weight, source["token_emb.weight"])


def test_mean_compressor_nsa_and_moba_gain_no_parameter_but_the_gates(dense_run):
    nsa = nsa_lm(**SIZE, **NSA, compressor="mean")
    assert initialise(nets(nsa), str(dense_run), {"": LM_CFG})["new"] == ["blocks.*.attn.to_gates.weight (x2)"]
    moba = moba_lm(**SIZE, kv_heads=4, block_size=4, top_k=2)
    report = initialise(nets(moba), str(dense_run), {"": LM_CFG})
    assert report["new"] == [] and report["new_params"] == 0


def test_dsa_gets_a_new_indexer_and_a_fresh_stage_counter(dense_run, tmp_path):
    knobs = dict(kv_heads=1, index_heads=2, index_dim_head=8, top_k=4, warmup_steps=3, kl_weight=1.0)
    report = initialise(nets(dsa_lm(**SIZE, **knobs)), str(dense_run), {"": LM_CFG})
    assert report["new"] == ["blocks.*.attn.indexer.to_k.weight (x2)", "blocks.*.attn.indexer.to_q.weight (x2)",
                             "blocks.*.attn.indexer.to_w.weight (x2)", "blocks.*.attn.steps (x2)"]
    trained = dsa_lm(**SIZE, **knobs)
    trained.blocks[0].attn.steps.fill_(50)  # past its warm-up: a new run starts its own
    fresh = dsa_lm(**SIZE, **knobs)
    initialise(nets(fresh), str(save_run(tmp_path / "dsa", trained)), {"": LM_CFG})
    assert int(fresh.blocks[0].attn.steps) == 0 and fresh.blocks[0].attn.warming_up


def test_a_shape_mismatch_is_refused_naming_the_weight_and_nothing_changes(dense_run):
    model = nsa_lm(**{**SIZE, "heads": 2}, **NSA)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserError) as refused:
        initialise(nets(model), str(dense_run), {"": LM_CFG})
    message = str(refused.value)
    assert "\n" not in message
    assert "blocks.0.attn.to_q.weight (from blocks.0.attn.to_qkv.weight) is [32, 32] there and [16, 32] here" in message
    assert "trainer.init_strict=false" in message
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_init_strict_false_drops_mismatched_weights_and_loads_the_rest(dense_run):
    model = nsa_lm(**{**SIZE, "heads": 2}, **NSA)
    own_q = model.blocks[0].attn.to_q.weight.detach().clone()
    report = initialise(nets(model), str(dense_run), {"": LM_CFG}, strict=False)
    # the queries and the output do not fit two heads; the keys and values, pooled to two heads, do
    assert report["dropped"] == ["blocks.*.attn.to_out.weight (x2)", "blocks.*.attn.to_q.weight (x2)"]
    assert "blocks.*.attn.to_kv.weight (x2)" in report["converted"]
    assert torch.equal(model.blocks[0].attn.to_q.weight, own_q)  # kept its own initialisation
    assert "token_emb.weight" in report["loaded"]


# ---- bad sources: one line each, before any weight changes ------------------------------------------


def _not_a_torch_file(tmp_path):
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    return tmp_path / "notes.pt"


def _foreign_torch_file(tmp_path):
    torch.save({"weights": torch.ones(2)}, tmp_path / "foreign.pt")
    return tmp_path / "foreign.pt"


def _dvae_run(tmp_path):
    from models.dvae import DiscreteVAE

    vae = DiscreteVAE(image_size=16, num_tokens=16, codebook_dim=16, num_layers=2, num_resnet_blocks=0, hidden_dim=16,
                      temperature=0.9, anneal_rate=1e-4)
    return save_run(tmp_path / "dvae", vae, {"_target_": "models.dvae.DiscreteVAE"}, task="dvae")


def _empty_directory(tmp_path):
    (tmp_path / "empty" / "logs").mkdir(parents=True)
    return tmp_path / "empty"


BAD_SOURCES = [
    ("nothing there", lambda tmp: tmp / "nowhere", "no such checkpoint file or run directory"),
    ("not a run directory", _empty_directory, "is not a run directory (it holds no checkpoints/step_*.pt)"),
    ("a dVAE into a language model", _dvae_run,
     "is a checkpoint of a dVAE (task dvae) and this run trains a language model"),
    ("not a torch file", _not_a_torch_file, "it is corrupt, truncated or not a checkpoint: point trainer.init_from"),
    ("another program's torch file", _foreign_torch_file, "was not written by this project"),
]


@pytest.mark.parametrize("make,message", [c[1:] for c in BAD_SOURCES], ids=[c[0] for c in BAD_SOURCES])
def test_bad_sources_are_refused_in_one_line(tmp_path, make, message):
    model = nsa_lm(**SIZE, **NSA)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    source = make(tmp_path)
    with pytest.raises(UserError) as refused:
        initialise(nets(model), str(source), {"": LM_CFG})
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert str(refused.value).startswith("trainer.init_from=") or str(source) in str(refused.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# ---- whole runs ----------------------------------------------------------------------------------


TINY_NSA = [o for o in TINY_LM if o != "model=transformer"] + [
    "model=nsa", "model.kv_heads=2", "model.sliding_window_size=8", "model.compress_block_size=4",
    "model.compress_stride=2", "model.fine_block_size=4", "model.num_fine_selected=3"]


def test_a_run_from_a_dense_run_starts_at_step_0_and_resuming_it_never_reads_the_source(tmp_path):
    dense, sparse = tmp_path / "dense", tmp_path / "sparse"
    train(dense, "trainer.max_steps=3")
    overrides = ["trainer.max_steps=4", "trainer.checkpoint_every=2", f"trainer.init_from={dense}"]
    kill_after_first_checkpoint(sparse, *overrides, base=TINY_NSA)
    assert checkpoint.latest(sparse / "checkpoints").name == "step_0000002.pt"
    log = (sparse / "train.log").read_text()
    assert f"initialised from {dense}/checkpoints/step_0000003.pt (step 3, model transformer" in log
    # the source replaced by files that are no checkpoints: a rerun resumes its own weights
    for path in (dense / "checkpoints").iterdir():
        path.write_text("gone")
    train(sparse, *overrides, base=TINY_NSA)
    summary = read_summary(sparse)
    assert summary["status"] == "completed" and summary["step"] == 4
    assert summary["init_from"]["step"] == 3 and summary["init_from"]["model"] == "transformer"
    assert "blocks.*.attn.compressor.w1" in summary["init_from"]["new"]
    assert "is not read again" in (sparse / "train.log").read_text()
    assert [r["step"] for r in read_metrics(sparse) if "loss" in r] == [1, 2, 3, 4]  # its own steps, from 0


def test_a_bad_source_stops_train_py_with_one_line(tmp_path):
    (tmp_path / "not_a_run").mkdir()
    result = train(tmp_path / "run", f"trainer.init_from={tmp_path / 'not_a_run'}", check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: trainer.init_from={tmp_path / 'not_a_run'} is not a run directory (it holds no "
        "checkpoints/step_*.pt): point it at a run directory that has written a checkpoint, or at a checkpoint file")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_resume_naming_other_weights_beside_init_from_is_refused_in_one_line(dense_run, tmp_path):
    source = dense_run / "checkpoints" / "step_0000007.pt"
    result = train(tmp_path / "run", f"trainer.init_from={dense_run}", f"trainer.resume={source}", check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: trainer.resume={source} and trainer.init_from={dense_run} both name weights to start from: keep "
        "trainer.init_from (a new run from its weights) and trainer.resume=auto")
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---- the config: DSA's warm-up follows init_from ----------------------------------------------------


def test_dsa_warms_up_its_indexer_alone_from_a_dense_run_and_everything_from_scratch(compose):
    assert compose("model=dsa", "trainer.init_from=/runs/dense").model.warmup_trains.value == "indexer"
    assert compose("model=dsa").model.warmup_trains.value == "all"
    assert compose("model=dsa", "model.warmup_trains=all", "trainer.init_from=/d").model.warmup_trains.value == "all"


# ---- distributed backends: the weights load before the backend wraps the model -----------------------


TINY_DSA = [o for o in TINY_LM if o != "model=transformer"] + [
    "model=dsa", "model.kv_heads=2", "model.index_heads=2", "model.index_dim_head=8", "model.top_k=8",
    "model.warmup_steps=2"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", [["backend=ddp"], ["backend=deepspeed", "backend.zero_stage=2"]],
                         ids=["ddp", "deepspeed"])
def test_two_ranks_warm_up_the_indexer_alone_as_one_process_of_twice_the_batch(tmp_path, backend):
    """Two ranks start from the dense run, and DSA's frozen warm-up runs on them: two ranks of batch
    2 give one process of batch 4's losses, and after the 2 warm-up steps every weight but the
    indexer's is the dense run's to the bit. ddp averages the indexer's gradients outside its
    reducer; DeepSpeed, which gives the frozen weights zero gradients and steps them, holds their
    optimizer group still (ZeRO 2: the group is a flat partition). Step 4's loss shows step 3's
    update, the first of the whole model: its optimizer state starts there on every backend."""
    dense, ranks, one = tmp_path / "dense", tmp_path / "ranks", tmp_path / "one"
    train(dense, "trainer.max_steps=2")
    common = [*TINY_DSA, "trainer.max_steps=4", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=2",
              f"trainer.init_from={dense}"]
    result = torchrun(ROOT, f"hydra.run.dir={ranks}", *common, *backend, "trainer.batch_size=2")
    assert result.returncode == 0, result.stderr[-2000:]
    train(one, *common, "trainer.batch_size=4", base=[])
    assert losses(ranks) == pytest.approx(losses(one), rel=1e-5) and sorted(losses(ranks)) == [1, 2, 3, 4]
    summary = read_summary(ranks)
    assert summary["status"] == "completed" and summary["init_from"]["step"] == 2
    assert "blocks.*.attn.indexer.to_k.weight" in summary["init_from"]["new"], summary["init_from"]["new"]
    assert "blocks.*.attn.to_kv.weight" in summary["init_from"]["converted"]

    source = torch.load(dense / "checkpoints" / "step_0000002.pt", weights_only=True)["model"]
    warmed = torch.load(ranks / "checkpoints" / "step_0000002.pt", weights_only=True)["model"]
    indexer = {n for n in warmed if ".attn.indexer." in n}
    assert indexer and all(not torch.equal(warmed[n], torch.zeros_like(warmed[n])) for n in indexer)
    frozen = [n for n in warmed if n not in indexer and n in source]
    assert len(frozen) > 8 and [n for n in frozen if not torch.equal(warmed[n], source[n])] == []


def test_init_strict_false_reaches_the_loader_from_train_py(tmp_path):
    from tests.helpers.runs import TINY_LM, read_summary, train

    dense = tmp_path / "dense"
    train(dense, "trainer.max_steps=1")
    nsa = [o for o in TINY_LM if o != "model=transformer"] + [
        "model=nsa", "model.heads=1", "model.kv_heads=1", "model.sliding_window_size=8", "model.compress_block_size=4",
        "model.compress_stride=2", "model.fine_block_size=4", "model.num_fine_selected=3"]
    train(tmp_path / "sparse", "trainer.max_steps=1", f"trainer.init_from={dense}", "trainer.init_strict=false",
          base=nsa)
    report = read_summary(tmp_path / "sparse")["init_from"]
    assert report["strict"] is False and report["dropped"]
