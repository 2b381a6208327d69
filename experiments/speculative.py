"""Speculative decoding: the training task for a target/draft pair, and decoding from a run.

    python train.py experiment=speculative                       # train the pair, time both decoders
    python -m experiments.speculative outputs/2026-11-22/10-00-00 --prompt "def main(" --gamma 5

The command rebuilds both models from the checkpoint's own config, then decodes the prompt
plainly (KV cache) and speculatively, printing both outputs, tokens/s, the speedup and the
acceptance (accepted draft tokens per verification step, and as a fraction of gamma).
"""

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from experiments.errors import UserError
from experiments.language_model import LanguageModelTask
from models.sampling import generate
from models.speculative import speculative_generate


def compare_decoding(target, draft, prompt, length: int, gamma: int, temperature: float, top_k: Optional[int],
                     seed: int = 0) -> dict:
    """Plain against speculative decoding of prompt [batch, prime]: outputs and figures."""
    device = prompt.device
    t0 = time.perf_counter()
    plain = generate(target, prompt, length, temperature, top_k, torch.Generator(device=device).manual_seed(seed))
    plain_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    spec, stats = speculative_generate(target, draft, prompt, length, gamma, temperature, top_k,
                                       torch.Generator(device=device).manual_seed(seed))
    spec_s = time.perf_counter() - t0
    tokens = prompt.shape[0] * length
    return {
        "plain": plain,
        "speculative": spec,
        "base_tokens_per_s": round(tokens / plain_s, 1),
        "spec_tokens_per_s": round(tokens / spec_s, 1),
        "speedup": round(plain_s / spec_s, 3),
        "accepted_per_step": round(stats.mean_accepted, 3),
        "acceptance_rate": round(stats.mean_accepted / gamma, 4),  # as a fraction of gamma
        "same_output": bool(torch.equal(plain, spec)),
    }


class SpeculativeTask(LanguageModelTask):
    """Trains `model` (the target) and `draft` together; samples by timing both decoders."""

    task_name = "speculative"

    def __init__(self, gamma: int = 5, **kwargs):
        super().__init__(**kwargs)
        if gamma < 1:
            raise ValueError(f"gamma={gamma} must be at least 1: set task.gamma")
        self.gamma = gamma

    def __call__(self, *, draft=None, **parts) -> float:
        if draft is None:
            raise UserError("task=speculative needs a draft model: add `- /model@draft: transformer` to the "
                            "defaults (as conf/experiment/speculative.yaml does) or use experiment=speculative")
        return super().__call__(draft=draft, **parts)

    @torch.no_grad()
    def sample(self, step: int) -> None:
        target, draft = (m.model.eval() for m in self.members)
        prime = self.data.prime(self.prime_length).to(self.backend.device)[None]
        with self.backend.autocast():
            result = compare_decoding(target, draft, prime, self.generate_length, self.gamma, self.temperature,
                                      self.top_k, seed=self.trainer.seed + step)
        figures = {k: v for k, v in result.items() if k not in ("plain", "speculative")}
        self.run.log_metrics({"step": step, **figures})
        self.tracker.log(figures, step)
        self.run.update_summary(**figures)
        text = (f"=== prime\n{self.data.decode(prime[0])}\n=== plain decoding ({figures['base_tokens_per_s']} tokens/s)\n"
                f"{self.data.decode(result['plain'][0])}\n=== speculative decoding, gamma {self.gamma} "
                f"({figures['spec_tokens_per_s']} tokens/s, {figures['speedup']}x, "
                f"{figures['accepted_per_step']} accepted per step)\n{self.data.decode(result['speculative'][0])}\n")
        self.run.write_sample(f"step_{step:07d}.txt", text)
        self.tracker.log_text("samples", text, step)


def load_pair(run_dir: Path, device: str = "cpu"):
    """The target and draft of a speculative run, rebuilt from its latest checkpoint's config."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    import experiments.schema  # noqa: F401  (the job_subdir resolver may appear in the config)
    from experiments import checkpoint

    path = checkpoint.resolve(run_dir, key="run")
    state = checkpoint.load(path, map_location=device)
    cfg = OmegaConf.create(state["config"])
    if cfg.get("draft") is None or "draft_model" not in state:
        raise UserError(f"{run_dir} is not a speculative run (no draft model in its checkpoint)")
    models = []
    for key, weights in (("model", "model"), ("draft", "draft_model")):
        model = instantiate(cfg[key])
        checkpoint.load_weights(model, state, weights, path)
        models.append(model.to(device).eval())
    return models[0], models[1], cfg


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a speculative run directory or checkpoint")
    parser.add_argument("--prompt", default="def ", help="text to continue (bytes)")
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                        help="weights and activations for decoding. On a CPU with bf16 instructions, bf16 verifies "
                             "several tokens faster and decodes one token slower than fp32")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        target, draft, _ = load_pair(args.run)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.dtype == "bf16":
        target, draft = target.to(torch.bfloat16), draft.to(torch.bfloat16)
    prompt = torch.tensor([list(args.prompt.encode())])
    generate(target, prompt, 8, 0.0)  # warm-up: first-call allocations are not decoding speed
    result = compare_decoding(target, draft, prompt, args.length, args.gamma, args.temperature, args.top_k, args.seed)
    decode = lambda t: bytes(t.tolist()).decode("utf-8", errors="replace")  # noqa: E731
    print(f"=== plain decoding\n{args.prompt}{decode(result['plain'][0])}\n")
    print(f"=== speculative decoding (gamma {args.gamma})\n{args.prompt}{decode(result['speculative'][0])}\n")
    print(f"plain        {result['base_tokens_per_s']:>8.1f} tokens/s")
    print(f"speculative  {result['spec_tokens_per_s']:>8.1f} tokens/s   speedup {result['speedup']:.2f}x")
    print(f"accepted     {result['accepted_per_step']:.2f} of {args.gamma} draft tokens per verification step "
          f"({result['acceptance_rate']:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
