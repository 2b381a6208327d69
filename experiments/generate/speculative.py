"""Decoding from a trained speculative pair (train it with `python train.py experiment=speculative`).

    python -m experiments.generate.speculative outputs/2026-11-22/10-00-00 --prompt "def main(" --gamma 5

The command rebuilds both models from the checkpoint's own config, then decodes the prompt
plainly (KV cache) and speculatively, printing both outputs, tokens/s, the speedup and the
acceptance (accepted draft tokens per verification step, and as a fraction of gamma).
"""

import argparse
import sys
from pathlib import Path

import torch

from experiments.config.checks import flag_error
from experiments.config.schema import DecodingEngine
from experiments.runtime.errors import UserError
from experiments.tasks.members import load_members
from experiments.tasks.speculative import compare_decoding
from models.decoding import choose_engine
from models.sampling import generate


def load_pair(run_dir: Path, device: str = "cpu"):
    """The target and draft of a speculative run (directory or checkpoint) -> (target, draft, config)."""
    from omegaconf import OmegaConf

    models, state = load_members(run_dir, ("", "draft_"), device=device)
    return models[""], models["draft_"], OmegaConf.create(state["config"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.generate.speculative", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    parser.add_argument("--engine", choices=[e.value for e in DecodingEngine], default="auto",
                        help="how both decoders run (models/decoding.py): the growing cache, or static caches eager, "
                             "compiled, or replayed as CUDA graphs (greedy only); auto: graphs on CUDA, cache on the CPU")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    if error := flag_error({"--length": ("generate_length", args.length), "--gamma": ("gamma", args.gamma),
                            "--top-k": ("top_k", args.top_k), "--temperature": ("temperature", args.temperature),
                            "--threads": ("threads", args.threads)}):
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device is visible", file=sys.stderr)
        return 2
    if not args.prompt:
        print("error: --prompt is empty: give the models at least one byte to continue", file=sys.stderr)
        return 2
    try:
        engine = choose_engine(args.engine, torch.device(args.device), args.temperature)
    except ValueError as e:
        print(f"error: --{e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        target, draft, _ = load_pair(args.run, args.device)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.dtype == "bf16":
        target, draft = target.to(torch.bfloat16), draft.to(torch.bfloat16)
    prompt = torch.tensor([list(args.prompt.encode())], device=args.device)
    generate(target, prompt, 8, 0.0)  # warm-up: first-call allocations are not decoding speed
    result = compare_decoding(target, draft, prompt, args.length, args.gamma, args.temperature, args.top_k, args.seed,
                              engine)
    decode = lambda t: bytes(t.tolist()).decode("utf-8", errors="replace")  # noqa: E731
    print(f"=== plain decoding\n{args.prompt}{decode(result['plain'][0])}\n")
    print(f"=== speculative decoding (gamma {args.gamma})\n{args.prompt}{decode(result['speculative'][0])}\n")
    print(f"plain        {result['base_tokens_per_s']:>8.1f} tokens/s   (engine {engine}, {args.device})")
    print(f"speculative  {result['spec_tokens_per_s']:>8.1f} tokens/s   speedup {result['speedup']:.2f}x")
    print(f"accepted     {result['accepted_per_step']:.2f} of {args.gamma} draft tokens per verification step "
          f"({result['acceptance_rate']:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
