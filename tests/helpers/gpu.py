"""Checks of the CUDA tier (tests marked `gpu`, which tests/conftest.py skips where there is no CUDA
device): a few training steps on CUDA in each precision, cached decoding on CUDA, and a first
training step that agrees between the CPU and CUDA."""

import math
import statistics
from pathlib import Path

from experiments.bench.agreement import first_step_agreement
from tests.helpers.attention_checks import assert_cached_decoding_equals_parallel
from tests.helpers.runs import TINY_LM, read_metrics, read_summary, train

PRECISIONS = ["fp32", "bf16", "fp16"]

# the first step on an NVIDIA H200, default NSA LM: loss to 1e-7 relative, gradients to 3e-6
LOSS_AGREEMENT = 1e-5
GRADIENT_AGREEMENT = 1e-4


def train_on_cuda(run_dir: Path, precision: str, *overrides: str, base: list[str] = TINY_LM,
                  steps: int = 20) -> list[dict]:
    """`steps` steps of train.py on CUDA in `precision` (tiny dense model unless `base` says otherwise):
    the run completes there, in that precision, with every loss finite. Its metrics.jsonl rows."""
    train(run_dir, "trainer.device=cuda", f"trainer.precision={precision}", f"trainer.max_steps={steps}", *overrides,
          base=base)
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["device"].startswith("cuda"), summary
    assert summary["precision"] == precision
    rows = read_metrics(run_dir)
    figures = [(row["step"], key, value) for row in rows for key, value in row.items() if key.endswith("loss")]
    assert figures and all(math.isfinite(value) for _, _, value in figures), figures
    return rows


def assert_loss_falls(rows: list[dict], key: str = "loss", window: int = 5) -> None:
    """The mean of the last `window` logged values of `key` lies below that of the first `window`."""
    values = [row[key] for row in rows if key in row]
    assert len(values) >= 2 * window, f"{len(values)} values of {key}"
    first, last = statistics.mean(values[:window]), statistics.mean(values[-window:])
    assert last < first, f"{key} did not fall: {first:.4f} over the first {window} steps, {last:.4f} over the last"


def assert_devices_agree(build, loss, train: bool = True) -> None:
    """The first training step of build(device) on the CPU and on CUDA, fp32 (experiments.bench.gpu_report's
    first_step_agreement): the losses within LOSS_AGREEMENT, every gradient within GRADIENT_AGREEMENT,
    relative."""
    agreement = first_step_agreement(build, loss, ("cpu", "cuda"), train=train)
    assert agreement.loss <= LOSS_AGREEMENT, f"losses {agreement.losses} differ by {agreement.loss:.2e} relative"
    assert agreement.gradient <= GRADIENT_AGREEMENT, (
        f"the gradient of {agreement.parameter} differs by {agreement.gradient:.2e} relative")


def assert_cached_decoding_on_cuda(model, tokens, pieces: list[int]) -> None:
    """Feeding `tokens` [b, n] to the cache in pieces gives the parallel logits, on CUDA in fp32: sums
    in other orders move them by ~1e-6, a wrong cache or mask by O(1)."""
    assert_cached_decoding_equals_parallel(model.float().eval().cuda(), tokens.cuda(), pieces, atol=1e-4)
