"""Training-step figures per model: tokens/s, peak memory, MFU, and the training loop's overhead.

    python -m experiments.benchmark                         # the bench config, every LM model
    python -m experiments.benchmark --models nsa --seq 8192 --batch 1

Models are composed from conf/ exactly as train.py composes them (bench config: vocab 256,
dim 256, depth 4, heads 4, dim_head 64; NSA adds its conf/model/nsa.yaml knobs), fp32. Each
measurement runs in a fresh process so that its peak memory is its own.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CONF = Path(__file__).resolve().parents[1] / "conf"
BENCH = ["model.num_tokens=256", "model.dim=256", "model.depth=4", "model.heads=4", "model.dim_head=64"]


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
        cfg = compose("config", overrides=[f"model={model_name}", f"data.seq_len={seq}", *BENCH, *extra])
    model = instantiate(cfg.model)
    optimizer = instantiate(cfg.optimizer)(model.parameters())
    data = ByteText(seq_len=seq, cache_dir=cfg.data.cache_dir)
    batch_tokens = data.train_batch(batch, seed=0, step=0)

    def step():
        loss = F.cross_entropy(model(batch_tokens[:, :-1]).flatten(0, 1), batch_tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: first-call allocations
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]  # the median resists a noisy neighbour

    # the loop's own work per step: sampling a batch and writing one metrics row
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run = Run(tmp)
        t0 = time.perf_counter()
        for i in range(20):
            data.train_batch(batch, seed=0, step=i)
            run.log_metrics({"step": i, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 1.0})
        loop_s = (time.perf_counter() - t0) / 20

    flops = training_flops_per_token(model, seq, torch.device("cpu"))
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
        "gflop_per_token": round(flops / 1e9, 4),
        "mfu": round(tok_s * flops / peak, 3),
        "matmul_peak_gflops": round(peak / 1e9, 1),
        "loop_overhead": round(loop_s / step_s, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["transformer", "nsa"])
    parser.add_argument("--seq", type=int, nargs="+", default=[1024])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--override", nargs="*", default=[], help="extra config overrides, e.g. model.num_fine_selected=8")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child process: print one JSON row
    args = parser.parse_args()

    if args.one:
        print(json.dumps(measure(args.models[0], args.seq[0], args.batch, args.steps, args.threads, args.override)))
        return

    header = f"{'model':<12} {'seq':>6} {'batch':>5} {'tokens/s':>10} {'step s':>8} {'peak MB':>8} {'MFU':>6} {'loop %':>7}"
    print(header)
    print("-" * len(header))
    for seq in args.seq:
        for name in args.models:
            cmd = [sys.executable, "-m", "experiments.benchmark", "--one", "--models", name, "--seq", str(seq),
                   "--batch", str(args.batch), "--steps", str(args.steps), "--threads", str(args.threads),
                   "--override", *args.override]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{name:<12} {seq:>6} failed: {out.stderr.strip().splitlines()[-1]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{r['model']:<12} {r['seq']:>6} {r['batch']:>5} {r['tokens_per_s']:>10,.0f} {r['step_s']:>8.3f} "
                  f"{r['peak_mem_mb']:>8,.0f} {r['mfu']:>6.1%} {r['loop_overhead']:>7.2%}")
    print(f"(fp32, {args.threads} threads, median of {args.steps} steps; MFU against the measured fp32 matmul peak)")


if __name__ == "__main__":
    main()
