"""Decoding speed at the speculative-decoding seed's size, side by side with the reference package.

    python -m experiments.bench.speculative                   # plain decoding: ours and the reference
    python -m experiments.bench.speculative --run RUN         # and plain vs speculative with a trained pair

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

--engine (models/decoding.py): cache, the growing KV cache, eager (the CPU's figures); static,
preallocated caches and steps of fixed shapes, eager; compiled, those steps through torch.compile;
graphs, replayed as CUDA graphs. auto: graphs on CUDA, cache on the CPU. On CUDA each call's
kernel launches are counted too (torch.profiler: the host's launch calls, one per graph replay,
and the kernels the GPU ran). --device: cpu, cuda, or auto (cuda where there is one).

Each measurement runs in a fresh process; rounds interleave them and the median round is shown.
"""

import argparse
import json
import sys
import time
from pathlib import Path

from experiments.config.checks import flag_error
from experiments.config.schema import DecodingEngine

SEED_TARGET = dict(num_tokens=256, dim=512, depth=10, heads=8, dim_head=64)
PRIME, LENGTH = 128, 512


def plain(name: str, threads: int, engine: str, device: str) -> dict:
    """Plain greedy decoding of the seed's target, by our code (on `engine`) or the reference's."""
    import torch

    from experiments.runtime.throughput import sync

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    prompt = torch.randint(0, SEED_TARGET["num_tokens"], (1, PRIME), device=device)
    if name == "ref":
        from speculative_decoding import Decoder, base_decoding

        model = Decoder(**SEED_TARGET).to(device).eval()
        decode = lambda: base_decoding(model, prompt, PRIME + LENGTH, temperature=0.0)  # noqa: E731
    else:
        from models.lm import transformer_lm

        model = transformer_lm(**SEED_TARGET).to(device).eval()
        decode = _plain_decoder(model, prompt, engine)
    with torch.no_grad():
        decode()  # warm-up: first-call allocations (the linears' plan, compiled steps) are not decoding speed
        sync(torch.device(device))
        t0 = time.perf_counter()
        decode()
        sync(torch.device(device))
        seconds = time.perf_counter() - t0
    return {"model": name, "params": sum(p.numel() for p in model.parameters()), "tokens_per_s": LENGTH / seconds,
            "plan": None if name == "ref" or engine != "cache" else _plan(threads, model)}


def _plain_decoder(model, prompt, engine: str):
    """decode() -> greedy tokens of `model` after prompt [1, n], on `engine`."""
    from models.decoding import ENGINES, StaticDecoder, greedy
    from models.sampling import generate

    if engine == "cache":
        return lambda: generate(model, prompt, LENGTH, temperature=0.0)
    decoder = StaticDecoder(model, 1, prompt.shape[1] + LENGTH, ENGINES[engine])
    return lambda: greedy(decoder, prompt, LENGTH)


def _plan(threads: int, *models) -> str:
    """How decoding ran on this CPU, as a line: whether the blocks took the fused kernel, and the paths
    the linears took (the ms of each path they were chosen from)."""
    from kernels import dense_decoding
    from models.fused_decoding import fits
    from models.sampling import decoding_plan, describe_plan, plan_times, planned_linears

    linears = planned_linears(*models)
    plan = describe_plan(decoding_plan(linears, threads), plan_times(linears, threads))
    fused = dense_decoding.available() and all(fits(model) is None for model in models)
    return f"blocks fused (one C call a step), the other linears {plan}" if fused else plan


def speculative(run: Path, gamma: int, length: int, primes: int, temperature: float, threads: int,
                dtype: str, engine: str, device: str) -> dict:
    """Plain against speculative decoding with a trained pair on `engine`, summed over `primes` excerpts."""
    import torch
    from hydra.utils import instantiate

    from experiments.generate.speculative import load_pair
    from experiments.tasks.speculative import compare_decoding
    from models.sampling import generate

    torch.set_num_threads(threads)
    target, draft, cfg = load_pair(run, device)
    if dtype == "bf16":
        target, draft = target.to(torch.bfloat16), draft.to(torch.bfloat16)
    data = instantiate(cfg.data)
    prime_length = int(cfg.task.get("prime_length", PRIME))
    generate(target, data.prime(prime_length)[None].to(device), 8, 0.0)  # warm-up
    plain_s = spec_s = accepted = 0.0
    same, same_as_cache = True, True
    for index in range(primes):
        prompt = data.prime(prime_length, index)[None].to(device)
        r = compare_decoding(target, draft, prompt, length, gamma, temperature, None, seed=index, engine=engine)
        plain_s += length / r["base_tokens_per_s"]
        spec_s += length / r["spec_tokens_per_s"]
        accepted += r["accepted_per_step"] / primes
        same &= r["same_output"]
        if engine != "cache" and index == 0:  # the engine's greedy tokens against the growing cache's
            same_as_cache = bool(torch.equal(r["plain"], generate(target, prompt, length, 0.0)))
    # the calls after a context half the decoding's length, on engines of the decoding's capacity (the same graphs)
    costs = call_costs(target, draft, data.prime(prime_length + length // 2).to(device), gamma, engine,
                       capacity=prime_length + length + gamma + 1)
    return {**costs, "plain_tokens_per_s": primes * length / plain_s, "spec_tokens_per_s": primes * length / spec_s,
            "speedup": plain_s / spec_s, "accepted_per_step": accepted, "acceptance_rate": accepted / gamma,
            "same_output": same, "same_as_cache": same_as_cache,
            "plan": _plan(threads, target, draft) if engine == "cache" else None,
            "target_params": sum(p.numel() for p in target.parameters()),
            "draft_params": sum(p.numel() for p in draft.parameters())}


def call_costs(target, draft, context, gamma: int, engine: str = "cache", capacity: int = 0, calls: int = 21) -> dict:
    """Median milliseconds of a one-token target step, a verification of gamma + 1 tokens and a
    one-token draft step after `context` [seq] on `engine` (static engines of `capacity` positions, at
    least the context's and a verification's), interleaved as in decoding (the draft's
    weights leave the cache while the target runs), so that the VM's drifts touch all three alike;
    on CUDA also each call's launches ({kind}_launches, {kind}_kernels)."""
    import contextlib

    import torch

    from experiments.bench.measure import cuda_launches
    from experiments.runtime.throughput import sync
    from models.decoding import ENGINES, StaticDecoder
    from models.sampling import decoding_linears

    kinds = {"step": (target, 1), "verify": (target, gamma + 1), "draft": (draft, 1)}
    with torch.no_grad(), (decoding_linears(target, draft) if engine == "cache" else contextlib.nullcontext()):
        if engine == "cache":
            caches = {model: model.new_cache() for model in (target, draft)}
            for model, cache in caches.items():
                model(context[None], cache=cache)

            def call(model, tokens: int) -> None:
                model(context[-tokens:][None], cache=caches[model])
                model.truncate_cache(caches[model], len(context))
        else:
            engines = {model: StaticDecoder(model, 1, max(capacity, len(context) + gamma + 1), ENGINES[engine])
                       for model in (target, draft)}
            for model, decoder in engines.items():
                decoder.warm_up(*{tokens for m, tokens in kinds.values() if m is model})
                decoder.prefill(context[None])

            def call(model, tokens: int) -> None:
                engines[model].step(context[-tokens:][None])
                engines[model].rollback(len(context))

        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(calls):
            for kind, (model, tokens) in kinds.items():
                sync(context.device)
                t0 = time.perf_counter()
                call(model, tokens)
                sync(context.device)
                times[kind].append(1e3 * (time.perf_counter() - t0))
        costs = {f"{kind}_ms": sorted(ms)[calls // 2] for kind, ms in times.items()}
        if context.is_cuda:
            for kind, (model, tokens) in kinds.items():
                costs[f"{kind}_launches"], costs[f"{kind}_kernels"] = cuda_launches(lambda: call(model, tokens))
    return costs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench.speculative", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["ours", "ref"], choices=["ours", "ref"],
                        help="plain decoding at the seed's size (none: only --run's pair)")
    parser.add_argument("--run", type=Path, help="a speculative run: also time its pair, plain against speculative")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--length", type=int, default=LENGTH)
    parser.add_argument("--primes", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the pair's decoding precision")
    parser.add_argument("--engine", choices=[e.value for e in DecodingEngine], default="auto",
                        help="how our decoders run (models/decoding.py); auto: graphs on CUDA, cache on the CPU")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the median round is shown")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child process: one JSON row
    args = parser.parse_args(argv)
    if error := flag_error({"--gamma": ("gamma", args.gamma), "--length": ("generate_length", args.length),
                            "--temperature": ("temperature", args.temperature), "--primes": ("count", args.primes),
                            "--threads": ("count", args.threads), "--repeat": ("count", args.repeat)}):
        parser.error(error)
    import torch

    from models.decoding import choose_engine

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible (use --device cpu or auto)")
    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    try:
        engine = choose_engine(args.engine, device, args.temperature)
    except ValueError as e:
        parser.error(f"--{e}")
    if not args.models and not args.run:
        parser.error("--models with none named measures nothing: name ours and/or ref, or give --run")
    if args.run and not args.one:
        from experiments.runtime import checkpoint
        from experiments.runtime.errors import UserError

        try:
            checkpoint.resolve(args.run, key="--run")
        except UserError as e:
            parser.error(str(e))
    if args.one:
        row = (speculative(args.run, args.gamma, args.length, args.primes, args.temperature, args.threads, args.dtype,
                           engine, str(device))
               if args.run else plain(args.models[0], args.threads, engine, str(device)))
        print(json.dumps(row))
        return 0

    from experiments.bench.measure import measure_in_child, median_row
    from experiments.runtime.throughput import bf16_matrix_units, device_name

    rows: dict[str, list[dict]] = {}
    failed = set()
    for _ in range(args.repeat):
        jobs = [(name, ["--models", name]) for name in args.models if name not in failed]
        if args.run and "pair" not in failed:
            jobs.append(("pair", ["--run", str(args.run), "--gamma", str(args.gamma), "--length", str(args.length),
                                  "--primes", str(args.primes), "--temperature", str(args.temperature),
                                  "--dtype", args.dtype]))
        for name, extra in jobs:
            try:
                child = [*extra, "--threads", str(args.threads), "--engine", engine, "--device", device.type]
                rows.setdefault(name, []).append(measure_in_child("experiments.bench.speculative", child)[0])
            except RuntimeError as e:
                print(f"{name} failed: {e}" + (" (see the module docstring to install it)" if name == "ref" else ""))
                failed.add(name)
    plain_rows = {name: median_row(runs, "tokens_per_s") for name, runs in rows.items() if name != "pair" and runs}
    print(f"{device_name(device)}" + (f", {args.threads} threads; bf16 matrix units: "
                                       f"{'yes' if bf16_matrix_units() else 'no'}" if device.type == "cpu" else "")
          + f"; our decoders: engine {engine}")
    if plain_rows.get("ours", {}).get("plan"):
        print(f"decoding (measured on this CPU): {plain_rows['ours']['plan']}")
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
        if engine != "cache":
            print(f"             plain greedy output equal to the growing cache's (eager): {r['same_as_cache']}")
        if r.get("plan"):
            print(f"decoding     {r['plan']}")
        round_ms = args.gamma * r["draft_ms"] + r["verify_ms"]
        print(f"calls        target step {r['step_ms']:.2f} ms, verification of {args.gamma + 1} tokens "
              f"{r['verify_ms']:.2f} ms ({r['verify_ms'] / r['step_ms']:.2f} steps), draft step {r['draft_ms']:.2f} ms")
        if "step_launches" in r:
            print("launches     " + ", ".join(f"{kind} {r[f'{kind}_launches']} ({r[f'{kind}_kernels']} kernels, "
                                              f"{1e3 * r[f'{kind}_ms'] / max(1, r[f'{kind}_kernels']):.1f} us each)"
                                              for kind in ("step", "verify", "draft")))
        print(f"             so {(r['accepted_per_step'] + 1) * r['step_ms'] / round_ms:.2f}x at this acceptance, "
              f"{(args.gamma + 1) * r['step_ms'] / round_ms:.2f}x if every draft token were accepted")
    print(f"({args.threads} threads, median of {args.repeat} interleaved rounds, each in a fresh process)")
    return 1 if failed else 0  # a measurement that failed is no figure


if __name__ == "__main__":
    sys.exit(main())
