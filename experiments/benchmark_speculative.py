"""Decoding speed at the speculative-decoding seed's size, side by side with the reference package.

    python -m experiments.benchmark_speculative                   # plain decoding: ours and the reference
    python -m experiments.benchmark_speculative --run RUN         # and plain vs speculative with a trained pair

Plain decoding: the seed's target (10 layers, dim 512, 8 heads of 64, vocab 256) with random
weights (a decoding step costs the same whatever their values), batch 1, a 128-token prime, 512
greedy tokens, fp32. `ref` is speculative-decoding 0.2.0's Decoder and base_decoding at the same
config (RMSNorm without bias, so 10,752 fewer parameters). It is not a dependency of this
project: `pip install speculative-decoding==0.2.0`.

--run: a speculative run's trained target and draft (python train.py experiment=speculative, or
any size), plain against speculative decoding of --length tokens at --gamma from --primes
excerpts of the run's validation text (the prime length the run used), with the acceptance at
which the speedup was measured. It also times the three calls a speculative round is made of
(a one-token target step, the target's verification of gamma + 1 tokens, a one-token draft
step) and prints the speedup they allow: a round yields accepted + 1 tokens for gamma draft steps
and one verification (the rest of the loop, sampling and the prompt, costs a few percent), so

    speedup ~ (accepted + 1) * step / (gamma * draft + verify)    at most (gamma + 1) * step / (...)

Each measurement runs in a fresh process; rounds interleave them and the median round is shown.
"""

import argparse
import json
import time
from pathlib import Path

from experiments.config.checks import flag_error

SEED_TARGET = dict(num_tokens=256, dim=512, depth=10, heads=8, dim_head=64)
PRIME, LENGTH = 128, 512


def plain(name: str, threads: int) -> dict:
    """Plain greedy KV-cache decoding of the seed's target, by our code or the reference's."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    prompt = torch.randint(0, SEED_TARGET["num_tokens"], (1, PRIME))
    if name == "ref":
        from speculative_decoding import Decoder, base_decoding

        model = Decoder(**SEED_TARGET).eval()
        decode = lambda: base_decoding(model, prompt, PRIME + LENGTH, temperature=0.0)  # noqa: E731
    else:
        from models.lm import transformer_lm
        from models.sampling import generate

        model = transformer_lm(**SEED_TARGET).eval()
        decode = lambda: generate(model, prompt, LENGTH, temperature=0.0)  # noqa: E731
    with torch.no_grad():
        decode()  # warm-up: first-call allocations (and measuring the linears' plan) are not decoding speed
        t0 = time.perf_counter()
        decode()
        seconds = time.perf_counter() - t0
    return {"model": name, "params": sum(p.numel() for p in model.parameters()), "tokens_per_s": LENGTH / seconds,
            "plan": None if name == "ref" else _plan(model, threads)}


def _plan(model, threads: int) -> str:
    """The paths decoding's linears took on this CPU, as a line."""
    from torch import nn

    from models.sampling import decoding_plan, describe_plan

    return describe_plan(decoding_plan([m for m in model.modules() if isinstance(m, nn.Linear)], threads))


def speculative(run: Path, gamma: int, length: int, primes: int, temperature: float, threads: int,
                dtype: str) -> dict:
    """Plain against speculative decoding with a trained pair, summed over `primes` excerpts."""
    import torch
    from hydra.utils import instantiate

    from experiments.speculative import load_pair
    from experiments.tasks.speculative import compare_decoding
    from models.sampling import generate

    torch.set_num_threads(threads)
    target, draft, cfg = load_pair(run)
    if dtype == "bf16":
        target, draft = target.to(torch.bfloat16), draft.to(torch.bfloat16)
    data = instantiate(cfg.data)
    prime_length = int(cfg.task.get("prime_length", PRIME))
    generate(target, data.prime(prime_length)[None], 8, 0.0)  # warm-up
    plain_s = spec_s = accepted = 0.0
    same = True
    for index in range(primes):
        prompt = data.prime(prime_length, index)[None]
        r = compare_decoding(target, draft, prompt, length, gamma, temperature, None, seed=index)
        plain_s += length / r["base_tokens_per_s"]
        spec_s += length / r["spec_tokens_per_s"]
        accepted += r["accepted_per_step"] / primes
        same &= r["same_output"]
    costs = call_costs(target, draft, data.prime(prime_length + length // 2), gamma)
    return {**costs, "plain_tokens_per_s": primes * length / plain_s, "spec_tokens_per_s": primes * length / spec_s,
            "speedup": plain_s / spec_s, "accepted_per_step": accepted, "acceptance_rate": accepted / gamma,
            "same_output": same, "target_params": sum(p.numel() for p in target.parameters()),
            "draft_params": sum(p.numel() for p in draft.parameters())}


def call_costs(target, draft, context, gamma: int, calls: int = 21) -> dict:
    """Median milliseconds of a one-token target step, a verification of gamma + 1 tokens and a
    one-token draft step after `context` [seq], interleaved as in decoding (the draft's weights
    leave the cache while the target runs), so that the VM's drifts touch all three alike."""
    import torch

    from models.sampling import decoding_linears

    kinds = {"step_ms": (target, 1), "verify_ms": (target, gamma + 1), "draft_ms": (draft, 1)}
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    with torch.no_grad(), decoding_linears(target, draft):
        caches = {model: model.new_cache() for model in (target, draft)}
        for model, cache in caches.items():
            model(context[None], cache=cache)
        for _ in range(calls):
            for kind, (model, tokens) in kinds.items():
                t0 = time.perf_counter()
                model(context[-tokens:][None], cache=caches[model])
                times[kind].append(1e3 * (time.perf_counter() - t0))
                model.truncate_cache(caches[model], len(context))
    return {kind: sorted(ms)[calls // 2] for kind, ms in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["ours", "ref"], choices=["ours", "ref"],
                        help="plain decoding at the seed's size (none: only --run's pair)")
    parser.add_argument("--run", type=Path, help="a speculative run: also time its pair, plain against speculative")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--length", type=int, default=LENGTH)
    parser.add_argument("--primes", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the pair's decoding precision")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the median round is shown")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child process: one JSON row
    args = parser.parse_args()
    if error := flag_error({"--gamma": ("gamma", args.gamma), "--length": ("generate_length", args.length),
                            "--temperature": ("temperature", args.temperature), "--primes": ("count", args.primes),
                            "--threads": ("count", args.threads), "--repeat": ("count", args.repeat)}):
        parser.error(error)
    if args.one:
        row = (speculative(args.run, args.gamma, args.length, args.primes, args.temperature, args.threads, args.dtype)
               if args.run else plain(args.models[0], args.threads))
        print(json.dumps(row))
        return
    import torch

    from experiments.runtime.throughput import bf16_matrix_units, device_name, measure_in_child, median_row

    rows: dict[str, list[dict]] = {}
    failed = set()
    for _ in range(args.repeat):
        jobs = [(name, ["--models", name]) for name in args.models if name not in failed]
        if args.run:
            jobs.append(("pair", ["--run", str(args.run), "--gamma", str(args.gamma), "--length", str(args.length),
                                  "--primes", str(args.primes), "--temperature", str(args.temperature),
                                  "--dtype", args.dtype]))
        for name, extra in jobs:
            try:
                rows.setdefault(name, []).append(
                    measure_in_child("experiments.benchmark_speculative", [*extra, "--threads", str(args.threads)])[0])
            except RuntimeError as e:
                print(f"{name} failed: {e}" + (" (see the module docstring to install it)" if name == "ref" else ""))
                failed.add(name)
    plain_rows = {name: median_row(runs, "tokens_per_s") for name, runs in rows.items() if name != "pair" and runs}
    print(f"{device_name(torch.device('cpu'))}, {args.threads} threads; bf16 matrix units: "
          f"{'yes' if bf16_matrix_units() else 'no'}")
    if plain_rows.get("ours"):
        print(f"decoding linears (measured on this CPU): {plain_rows['ours']['plan']}")
    if plain_rows:
        print(f"plain decoding, seed target: {PRIME}-token prime, {LENGTH} greedy tokens, batch 1, fp32")
        print(f"{'model':<6} {'params':>12} {'tokens/s':>10}")
        for name, r in plain_rows.items():
            print(f"{name:<6} {r['params']:>12,} {r['tokens_per_s']:>10.1f}")
        if {"ours", "ref"} <= set(plain_rows):
            print(f"ours / ref: {plain_rows['ours']['tokens_per_s'] / plain_rows['ref']['tokens_per_s']:.2f}x")
    if rows.get("pair"):
        r = median_row(rows["pair"], "speedup")
        print(f"\n{args.run}: target {r['target_params']:,} params, draft {r['draft_params']:,}; "
              f"{args.primes} validation primes, {args.length} tokens each, temperature {args.temperature}, {args.dtype}")
        print(f"plain        {r['plain_tokens_per_s']:>8.1f} tokens/s")
        print(f"speculative  {r['spec_tokens_per_s']:>8.1f} tokens/s   speedup {r['speedup']:.2f}x at gamma {args.gamma}")
        print(f"accepted     {r['accepted_per_step']:.2f} of {args.gamma} draft tokens per verification step "
              f"({r['acceptance_rate']:.0%})" + (f"; greedy output equal to plain decoding's: {r['same_output']}"
                                                 if args.temperature == 0 else ""))
        round_ms = args.gamma * r["draft_ms"] + r["verify_ms"]
        print(f"calls        target step {r['step_ms']:.2f} ms, verification of {args.gamma + 1} tokens "
              f"{r['verify_ms']:.2f} ms ({r['verify_ms'] / r['step_ms']:.2f} steps), draft step {r['draft_ms']:.2f} ms")
        print(f"             so {(r['accepted_per_step'] + 1) * r['step_ms'] / round_ms:.2f}x at this acceptance, "
              f"{(args.gamma + 1) * r['step_ms'] / round_ms:.2f}x if every draft token were accepted")
    print(f"({args.threads} threads, median of {args.repeat} interleaved rounds, each in a fresh process)")


if __name__ == "__main__":
    main()
