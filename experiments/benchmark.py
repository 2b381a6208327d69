"""Training-step figures per model: tokens/s, peak memory, MFU, and the training loop's overhead.

    python -m experiments.benchmark                         # the bench config, every LM model
    python -m experiments.benchmark --models nsa --seq 8192 --batch 1
    python -m experiments.benchmark --models sinkhorn ref:sinkhorn routing ref:routing

Models are composed from conf/ exactly as train.py composes them (bench config: vocab 256,
dim 256, depth 4, heads 4, dim_head 64; each attention adds its conf/model/<name>.yaml knobs;
routing gets seq / window_size clusters, as the reference package derives them), fp32. Each
measurement runs in a fresh process so that its peak memory is its own.

`ref:sinkhorn` and `ref:routing` measure the reference packages (sinkhorn-transformer 0.11.4,
routing-transformer 1.6.1) at the same config, when they are installed; they are not
dependencies of this project: `pip install sinkhorn-transformer==0.11.4 routing-transformer==1.6.1`.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CONF = Path(__file__).resolve().parents[1] / "conf"
BENCH = ["model.num_tokens=256", "model.dim=256", "model.depth=4", "model.heads=4", "model.dim_head=64"]


def bench_overrides(model_name: str, seq: int) -> list[str]:
    overrides = [f"model={model_name}", f"data.seq_len={seq}", *BENCH]
    if model_name == "routing":
        overrides.append(f"model.num_clusters={max(1, seq // 64)}")
    return overrides


def reference_model(name: str, cfg, seq: int):
    """The reference package's LM at our model config -> (model, logits_and_aux(tokens))."""
    m = cfg.model
    common = dict(num_tokens=m.num_tokens, dim=m.dim, depth=m.depth, heads=m.heads, max_seq_len=seq, causal=True,
                  n_local_attn_heads=m.n_local_attn_heads, reversible=m.reversible, ff_chunks=m.ff_chunks)
    if name == "ref:sinkhorn":
        from sinkhorn_transformer import SinkhornTransformerLM

        model = SinkhornTransformerLM(**common, bucket_size=m.bucket_size, dim_head=m.dim_head)
        return model, lambda tokens: (model(tokens), 0.0)
    from routing_transformer import RoutingTransformerLM

    model = RoutingTransformerLM(**common, window_size=m.window_size)
    return model, lambda tokens: model(tokens)


def measure(model_name: str, seq: int, batch: int, steps: int, threads: int, extra: list[str]) -> dict:
    """One model's figures, measured in this process."""
    import resource

    import torch
    import torch.nn.functional as F
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    import experiments.schema  # noqa: F401
    from experiments.data import ByteText
    from experiments.run import Run
    from experiments.throughput import matmul_peak_flops, training_flops_per_token

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*bench_overrides(model_name.removeprefix("ref:"), seq), *extra])
    if model_name.startswith("ref:"):
        model, forward = reference_model(model_name, cfg, seq)
    else:
        model = instantiate(cfg.model)
        forward = lambda tokens: (model(tokens), model.aux_loss())  # noqa: E731
    optimizer = instantiate(cfg.optimizer)(model.parameters())
    data = ByteText(seq_len=seq, cache_dir=cfg.data.cache_dir)
    batch_tokens = data.train_batch(batch, seed=0, step=0)

    def step():
        logits, aux = forward(batch_tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch_tokens[:, 1:].flatten()) + aux
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step_s = median_seconds(step, steps)

    # the loop's own work per step: sampling a batch and writing one metrics row
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run = Run(tmp)
        t0 = time.perf_counter()
        for i in range(20):
            data.train_batch(batch, seed=0, step=i)
            run.log_metrics({"step": i, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 1.0})
        loop_s = (time.perf_counter() - t0) / 20

    activation_mb = saved_activation_bytes(forward, batch_tokens[:, :-1]) / 2**20
    reference = model_name.startswith("ref:")  # another package's model: FLOPs not counted
    flops = None if reference else training_flops_per_token(model, seq, torch.device("cpu"))
    peak = matmul_peak_flops(torch.device("cpu"))
    tok_s = batch * seq / step_s
    return {
        "model": model_name,
        "seq": seq,
        "batch": batch,
        "params": sum(p.numel() for p in model.parameters()),
        "step_s": round(step_s, 3),
        "tokens_per_s": round(tok_s, 1),
        "peak_mem_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "gflop_per_token": None if reference else round(flops / 1e9, 4),
        "mfu": None if reference else round(tok_s * flops / peak, 3),
        "matmul_peak_gflops": round(peak / 1e9, 1),
        "loop_overhead": round(loop_s / step_s, 4),
        "activation_mb": round(activation_mb, 1),
    }


def median_seconds(step, steps: int) -> float:
    """The median time of `steps` calls of step(), after one warm-up call (first-call allocations);
    the median resists a noisy neighbour."""
    step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def saved_activation_bytes(forward, tokens) -> int:
    """Bytes autograd keeps from one training forward for the backward pass (each storage once)."""
    import torch

    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits, aux = forward(tokens)
    (logits.sum() + aux).backward()  # release the graph
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["transformer", "nsa"])
    parser.add_argument("--seq", type=int, nargs="+", default=[1024])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1, help="interleaved rounds; the median round is shown")
    parser.add_argument("--override", nargs="*", default=[], help="extra config overrides, e.g. model.num_fine_selected=8")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child process: print one JSON row
    args = parser.parse_args()

    if args.one:
        print(json.dumps(measure(args.models[0], args.seq[0], args.batch, args.steps, args.threads, args.override)))
        return

    rows: dict[tuple, list[dict]] = {}
    for _ in range(args.repeat):  # rounds interleave the models, so a noisy spell hits them all
        for seq in args.seq:
            for name in args.models:
                cmd = [sys.executable, "-m", "experiments.benchmark", "--one", "--models", name, "--seq", str(seq),
                       "--batch", str(args.batch), "--steps", str(args.steps), "--threads", str(args.threads),
                       "--override", *args.override]
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    print(f"{name:<14} {seq:>6} failed: {out.stderr.strip().splitlines()[-1]}")
                    continue
                rows.setdefault((seq, name), []).append(json.loads(out.stdout.strip().splitlines()[-1]))

    header = (f"{'model':<14} {'seq':>6} {'batch':>5} {'tokens/s':>10} {'step s':>8} {'peak MB':>8} {'act MB':>7} "
              f"{'MFU':>6} {'loop %':>7}")
    print(header)
    print("-" * len(header))
    for runs in rows.values():
        r = sorted(runs, key=lambda row: row["tokens_per_s"])[len(runs) // 2]  # the median round
        r["peak_mem_mb"] = max(row["peak_mem_mb"] for row in runs)
        mfu = "-" if r["mfu"] is None else format(r["mfu"], ".1%")
        print(f"{r['model']:<14} {r['seq']:>6} {r['batch']:>5} {r['tokens_per_s']:>10,.0f} {r['step_s']:>8.3f} "
              f"{r['peak_mem_mb']:>8,.0f} {r['activation_mb']:>7,.0f} {mfu:>6} {r['loop_overhead']:>7.2%}")
    print(f"(fp32, {args.threads} threads, median of {args.steps} steps, median of {args.repeat} interleaved "
          "rounds, largest peak; act MB: tensors one forward keeps for the backward; MFU against the "
          "measured fp32 matmul peak)")


if __name__ == "__main__":
    main()
