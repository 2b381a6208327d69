"""Training-step and decoding figures per model: tokens/s, peak memory, MFU, the training loop's
overhead, and each model's speed as a ratio to the dense transformer measured in the same run.

    python -m experiments.bench.models                         # the bench config, dense and NSA
    python -m experiments.bench.models --models nsa transformer --seq 4096 8192 --batch 1
    python -m experiments.bench.models --models nsa transformer sinkhorn routing \
        --seq 1024 4096 8192 16384 32768 --batch 1 --plot scaling.png  # cost against length
    python -m experiments.bench.models --decode --seq 4096 16384         # one decoding step after a cache
    python -m experiments.bench.models --precision bf16                  # autocast, as trainer.precision=bf16
    python -m experiments.bench.models --models nsa --seq 8192 --batch 1 --profile  # the ops of one step
    python -m experiments.bench.models --models nsa transformer --seq 8192 --batch 1 --tensor-peak
    python -m experiments.bench.models --models sinkhorn ref:sinkhorn routing ref:routing
    python -m experiments.bench.models --device cuda --precision bf16 --seq 8192 32768 --batch 1   # on a GPU
    python -m experiments.bench.models --count                           # launches per training step

Models are composed from conf/ exactly as train.py composes them (bench config: vocab 256,
dim 256, depth 4, heads 4, dim_head 64; each attention adds its conf/model/<name>.yaml knobs;
routing gets seq / window_size clusters, as the reference package derives them; dsa is measured in
its sparse stage, warmup_steps=0), fp32. Each
measurement runs in a fresh process so that its peak memory is its own, with the C allocator set
as train.py sets it (trainer.cpu_allocator; `--override trainer.cpu_allocator=system` for glibc's
defaults). That peak is resident memory, which also holds what the allocator keeps after a free
(the pool's kept blocks; with `caching`, the heap's largest extent), read once it has held for 3
steps (a heap grows for several); --tensor-peak adds the peak of live tensors over one more step, what the
model itself needs.

The header names the processor or GPU: figures from different machines do not compare, ratios
measured in one run do. `--device` (auto: CUDA when there is one) runs every measurement there: on
CUDA the peak is `torch.cuda.max_memory_allocated` (tensors alone), steps are timed to the device's
completion, and MFU is against a square matrix product measured in the step's precision (bf16 under
--precision bf16); on the CPU, against the fp32 product, as before.

--count counts what one training step (forward and loss, backward, optimizer step) would launch on
a GPU, on the CUDA code path (experiments/runtime/op_counts.py): aten ops that launch a kernel, and
Triton kernels (NSA with model.kernel=triton; on a CPU in Triton's interpreter, TRITON_INTERPRET=1,
set here; AdamW with foreach, as torch picks it on CUDA), after a step that creates the optimizer's
state. By default at the seed's size (dim 512, depth 6, 8 heads of 64), 512 tokens, batch 1; every
launch on a GPU costs microseconds of host time, so a small model's step is bound by their number.
Under --precision bf16 the casts are CPU autocast's, close to CUDA's but not the same list.

`ref:sinkhorn` and `ref:routing` measure the reference packages (sinkhorn-transformer 0.11.4,
routing-transformer 1.6.1) at the same config, when they are installed; they are not
dependencies of this project: `pip install sinkhorn-transformer==0.11.4 routing-transformer==1.6.1`.
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from experiments.config import register
from experiments.config.checks import composition_error, flag_error

if TYPE_CHECKING:
    import torch

CONF = Path(__file__).resolve().parents[2] / "conf"
BENCH = ["model.num_tokens=256", "model.dim=256", "model.depth=4", "model.heads=4", "model.dim_head=64"]
SEED_SIZE = ["model.dim=512", "model.depth=6", "model.heads=8", "model.dim_head=64"]  # --count's default size


def bench_overrides(model_name: str, seq: int) -> list[str]:
    overrides = [f"model={model_name}", f"data.seq_len={seq}", *BENCH]
    if model_name == "routing":
        overrides.append(f"model.num_clusters={max(1, seq // 64)}")
    if model_name == "dsa":  # its sparse stage: a fresh model would attend densely for warmup_steps
        overrides.append("model.warmup_steps=0")
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


def build(model_name: str, seq: int, threads: int, extra: list[str], device: str = "cpu"):
    """The composed config and the model (ours or a reference package's) -> (cfg, model, forward)."""
    import torch
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from experiments.config import register
    from experiments.runtime import allocator

    register()

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*bench_overrides(model_name.removeprefix("ref:"), seq), *extra])
    allocator.use(cfg.trainer.cpu_allocator.value)  # as train.py's backend sets it, before any tensor
    if model_name.startswith("ref:"):
        model, forward = reference_model(model_name, cfg, seq)
    else:
        model = instantiate(cfg.model)
        forward = lambda tokens: (model(tokens), model.aux_loss())  # noqa: E731
    return cfg, model.to(device), forward


def training_loss(forward, tokens, precision: str, device: "torch.device"):
    """The LM loss of one batch of tokens [batch, seq + 1], in the step's precision."""
    import torch.nn.functional as F

    from experiments.runtime.backends import autocast

    with autocast(precision, device.type):
        logits, aux = forward(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) + aux


def measure(model_name: str, seq: int, batch: int, steps: int, threads: int, extra: list[str],
            precision: str = "fp32", profile: bool = False, tensor_peak: bool = False, device: str = "cpu") -> dict:
    """One model's training-step figures, measured in this process; the peak memory is that of the
    timed steps and of those after them until it settles (model, optimizer state, activations, the
    C heap), not of the FLOP counting after them."""
    import torch
    from hydra.utils import instantiate

    from experiments.bench.measure import median_seconds, settled_peak_mb, synced
    from experiments.data.text import ByteText
    from experiments.runtime import allocator
    from experiments.runtime.backends import autocast
    from experiments.runtime.run import Run
    from experiments.runtime.throughput import (matmul_peak_flops, peak_memory_mb, reset_peak_memory,
                                                training_flops_per_token)

    cfg, model, forward = build(model_name, seq, threads, extra, device)
    optimizer = instantiate(cfg.optimizer)(model.parameters())
    data = ByteText(seq_len=seq)
    batch_tokens = data.train_batch(batch, seed=0, step=0).to(device)
    dev = torch.device(device)

    def step():
        training_loss(forward, batch_tokens, precision, dev).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step = synced(step, dev)
    reset_peak_memory(dev)
    step_s = median_seconds(step, steps)
    peak_mb, _, settled = settled_peak_mb(step, lambda: peak_memory_mb(dev), step_s)
    if profile:
        print_profile(step)
    tensors_mb = live_tensor_peak_bytes(step, model, optimizer) / 2**20 if tensor_peak else None

    # the loop's own work per step: sampling a batch and writing one metrics row
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run = Run(tmp)
        t0 = time.perf_counter()
        for i in range(20):
            data.train_batch(batch, seed=0, step=i)
            run.log_metrics({"step": i, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 1.0})
        loop_s = (time.perf_counter() - t0) / 20

    with autocast(precision, dev.type):  # what the timed steps kept, in their precision
        activation_mb = saved_activation_bytes(forward, batch_tokens[:, :-1]) / 2**20
    reference = model_name.startswith("ref:")  # another package's model: FLOPs not counted
    flops = None if reference else training_flops_per_token(model, seq, dev)
    # the CPU's MFU stays against the fp32 product (its figures in the README); a GPU's against the step's precision
    peak = matmul_peak_flops(dev, torch.bfloat16 if dev.type == "cuda" and precision == "bf16" else torch.float32)
    tok_s = batch * seq / step_s
    return {
        "model": model_name,
        "device": device,
        "seq": seq,
        "batch": batch,
        "mode": "train",
        "cpu_allocator": allocator.active(),
        "params": sum(p.numel() for p in model.parameters()),
        "step_s": round(step_s, 3),
        "tokens_per_s": round(tok_s, 1),
        "peak_mem_mb": round(peak_mb, 1),
        "memory_settled": settled,
        "tensor_peak_mb": None if tensors_mb is None else round(tensors_mb, 1),
        "gflop_per_token": None if reference else round(flops / 1e9, 4),
        "mfu": None if reference else round(tok_s * flops / peak, 3),
        "matmul_peak_gflops": round(peak / 1e9, 1),
        "loop_overhead": round(loop_s / step_s, 4),
        "activation_mb": round(activation_mb, 1),
    }


def count_step(model_name: str, seq: int, batch: int, threads: int, extra: list[str], precision: str = "fp32",
               device: str = "cpu") -> dict:
    """What one training step launches on the CUDA code path, in this process: {"forward" (and
    the loss), "backward", "optimizer" (step and zeroing): OpCounts}, after a first optimizer step
    on zero gradients has created the optimizer's state."""
    import torch
    from hydra.utils import instantiate

    from experiments.data.text import ByteText
    from experiments.runtime.op_counts import count_ops

    cfg, model, forward = build(model_name, seq, threads, extra, device)
    dev = torch.device(device)
    # on CUDA torch's AdamW picks its foreach path (a few launches for all parameters); on the CPU, a loop
    optimizer = instantiate(cfg.optimizer)(model.parameters(), **({"foreach": True} if dev.type == "cpu" else {}))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tokens = ByteText(seq_len=seq).train_batch(batch, seed=0, step=0).to(device)
    with count_ops() as forward_counts:
        loss = training_loss(forward, tokens, precision, dev)
    with count_ops() as backward_counts:
        loss.backward()
    with count_ops() as optimizer_counts:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"forward": forward_counts, "backward": backward_counts, "optimizer": optimizer_counts}


def print_step_counts(models: list[str], seqs: list[int], args, device: str) -> None:
    """One row per model and length: the launches of each part of a training step."""
    import torch

    from experiments.runtime.throughput import device_name

    interpreted = " (Triton kernels in Triton's interpreter)" if device == "cpu" else ""
    print(f"counted on {device_name(torch.device(device))}{interpreted}: what one training step launches on a GPU, "
          f"{args.precision}, batch {args.batch}")
    header = (f"{'model':<14} {'seq':>6} {'forward':>8} {'backward':>8} {'optimizer':>9} {'launches':>8} "
              f"{'Triton':>6} {'syncs':>5}")
    print(header)
    print("-" * len(header))
    for seq in seqs:
        for name in models:
            parts = count_step(name, seq, args.batch, args.threads, [*model_overrides(name), *args.override],
                               args.precision, device)
            triton = sum(len(c.triton) for c in parts.values())
            # AdamW reads its step counts with .item(): CPU tensors on CUDA too, so no wait there
            syncs = sum(sum(parts[part].syncs.values()) for part in ("forward", "backward"))
            forward, backward, optimizer = (parts[part].launches for part in ("forward", "backward", "optimizer"))
            print(f"{name:<14} {seq:>6} {forward:>8,} {backward:>8,} {optimizer:>9,} "
                  f"{forward + backward + optimizer:>8,} {triton:>6,} {syncs:>5,}")
    print("(launches: aten ops that launch a kernel, and Triton kernels, Triton's among them; a few aten ops launch "
          "more than one on CUDA, so a floor; syncs: device values the host waits for in the forward and backward)")


def model_overrides(name: str) -> list[str]:
    """--count's defaults for a model: the seed's size, and NSA on its Triton kernels (the CUDA path)."""
    return [*SEED_SIZE, *(["model.kernel=triton"] if name == "nsa" else [])]


def measure_decode(model_name: str, context: int, batch: int, steps: int, threads: int, extra: list[str],
                   precision: str = "fp32", profile: bool = False, device: str = "cpu") -> dict:
    """Greedy decoding figures after a cache of `context` tokens, measured in this process: the
    tokens/s of one decoding step (median of `steps`), the prompt's time, and the peak memory of both."""
    import torch

    from experiments.bench.measure import median_seconds, synced
    from experiments.data.text import ByteText
    from experiments.runtime import allocator
    from experiments.runtime.backends import autocast
    from experiments.runtime.throughput import peak_memory_mb, reset_peak_memory
    from models.sampling import decoding_linears

    _, model, _ = build(model_name, context + steps + 2, threads, extra, device)
    if model_name.startswith("ref:"):
        raise SystemExit(f"--decode measures this project's models only, not {model_name}")
    model.eval()
    data = ByteText(seq_len=context)
    prompt = data.train_batch(batch, seed=0, step=0)[:, :context].to(device)
    dev = torch.device(device)
    reset_peak_memory(dev)
    with torch.no_grad(), autocast(precision, dev.type), decoding_linears(model):  # as generate decodes
        cache = model.new_cache()
        t0 = time.perf_counter()
        token = model(prompt, cache=cache)[:, -1:].argmax(-1)
        prompt_s = time.perf_counter() - t0

        def step():
            nonlocal token
            token = model(token, cache=cache)[:, -1:].argmax(-1)

        step_s = median_seconds(synced(step, dev), steps)
        peak_mb = peak_memory_mb(dev)
        if profile:
            print_profile(step)
    return {
        "model": model_name,
        "device": device,
        "seq": context,
        "batch": batch,
        "mode": "decode",
        "cpu_allocator": allocator.active(),
        "params": sum(p.numel() for p in model.parameters()),
        "step_s": round(step_s, 5),
        "tokens_per_s": round(batch / step_s, 1),
        "prompt_s": round(prompt_s, 3),
        "peak_mem_mb": round(peak_mb, 1),
    }


def print_profile(step, rows: int = 20) -> None:
    """The operators of one call of step(), by their own time."""
    from torch.profiler import profile

    with profile() as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows), flush=True)


def live_tensor_peak_bytes(step, model, optimizer) -> int:
    """The most bytes tensors held at once during one call of step(): the weights, buffers and
    optimizer state live before it, plus the peak of what the step allocated and had not yet freed
    (the profiler's allocation events, in time order). Unlike resident memory, this leaves out
    what the C allocator keeps after a free."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    before = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
              for t in (*model.parameters(), *model.buffers(), *state)}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = prof.profiler.kineto_results.events()
    changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in changes:
        live += nbytes
        peak = max(peak, live)
    return sum(before.values()) + peak


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench.models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["transformer", "nsa"])
    parser.add_argument("--seq", type=int, nargs="+",
                        help="sequence lengths, default 1024, with --count 512 (with --decode: the cached context "
                             "before each step)")
    parser.add_argument("--batch", type=int, help="default 4, with --count 1")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1, help="interleaved rounds; the median round is shown")
    parser.add_argument("--decode", action="store_true", help="time one decoding step after a cache, not training")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: autocast on the device, as trainer.precision=bf16")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where every measurement runs (auto: CUDA when there is one)")
    parser.add_argument("--plot", type=Path, help="write tokens/s and peak memory against length (log-log) here")
    parser.add_argument("--profile", action="store_true", help="print the operators of one step of each measurement")
    parser.add_argument("--tensor-peak", action="store_true",
                        help="also the peak of live tensors over one more step (training only)")
    parser.add_argument("--override", nargs="*", default=[], help="extra config overrides, e.g. model.num_fine_selected=8")
    parser.add_argument("--count", action="store_true",
                        help="count what one training step launches (at the seed's size, 512 tokens, batch 1)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child process: print one JSON row
    args = parser.parse_args(argv)
    args.seq = args.seq or ([512] if args.count else [1024])
    args.batch = (1 if args.count else 4) if args.batch is None else args.batch  # 0 is refused, not replaced
    if error := flag_error({flag: ("count", value) for flag, value in (
            ("--batch", args.batch), ("--steps", args.steps), ("--threads", args.threads), ("--repeat", args.repeat),
            ("--seq", min(args.seq)))}):
        parser.error(error)
    if args.decode and args.tensor_peak:
        parser.error("--tensor-peak measures a training step: leave out --decode")
    if args.count and (args.decode or args.tensor_peak or args.plot or args.profile):
        parser.error("--count counts what a training step launches: leave out --decode, --tensor-peak, --plot "
                     "and --profile")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device=cuda: no CUDA device here; use --device cpu")
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    if device == "cuda" and args.tensor_peak:
        parser.error("--tensor-peak reads the CPU's allocations: on CUDA the peak column counts tensors alone already")
    if not args.one and (problem := config_problem(args.models, args.override)):
        parser.error(problem)
    if args.count:
        from experiments.runtime.op_counts import interpret_triton_here

        if device == "cpu" and (problem := interpret_triton_here()):
            parser.error(problem)
        print_step_counts(args.models, args.seq, args, device)
        return 0

    if args.one:
        common = (args.models[0], args.seq[0], args.batch, args.steps, args.threads, args.override, args.precision,
                  args.profile)
        row = (measure_decode(*common, device=device) if args.decode
               else measure(*common, tensor_peak=args.tensor_peak, device=device))
        print(json.dumps(row))
        return 0

    from experiments.bench.measure import measure_in_child
    from experiments.runtime.throughput import device_name

    threads = (f", {args.threads} threads, C kernels {kernels_isa(device)}, PyTorch "
               f"{torch.backends.cpu.get_cpu_capability()}" if device == "cpu" else "")
    print(f"{device_name(torch.device(device))}{threads}, {args.precision}, "
          f"{'decoding after a cache' if args.decode else 'training step'}", flush=True)
    rows: dict[tuple, list[dict]] = {}
    failed = 0
    for _ in range(args.repeat):  # rounds interleave the models, so a noisy spell hits them all
        for seq in args.seq:
            for name in args.models:
                try:
                    row, profile = measure_in_child("experiments.bench.models", [
                        "--models", name, "--seq", str(seq), "--batch", str(args.batch), "--steps", str(args.steps),
                        "--threads", str(args.threads), "--precision", args.precision, "--device", device,
                        *(["--decode"] if args.decode else []), *(["--profile"] if args.profile else []),
                        *(["--tensor-peak"] if args.tensor_peak else []),
                        "--override", *args.override])
                except RuntimeError as e:
                    print(f"{name:<14} {seq:>6} failed: {e}")
                    failed += 1
                    continue
                if profile:
                    print(f"{name} at {seq}:", *profile, sep="\n")
                rows.setdefault((seq, name), []).append(row)
    table = [median_round(runs) for runs in rows.values()]
    if table:  # else the failures above are all there is to say
        print_table(table, args, kernels_isa(device))
    if args.plot and table:
        plot_scaling(table, args.plot, args)
        print(f"wrote {args.plot}")
    return 1 if failed else 0  # a script sees that a figure is missing


def config_problem(models: list[str], overrides: list[str]) -> Optional[str]:
    """What is wrong with the models and overrides asked for, before any child is started (one line),
    or None."""
    register()
    for name in models:
        if name.startswith("ref:") and name not in ("ref:sinkhorn", "ref:routing"):
            return f"--models {name}: the reference packages measured are ref:sinkhorn and ref:routing"
        if error := composition_error(str(CONF), [*bench_overrides(name.removeprefix("ref:"), 1024), *overrides]):
            if overrides:
                return f"--models {name} --override {' '.join(overrides)} (for every model): {error}"
            return f"--models {name}: {error}"
    return None


def median_round(runs: list[dict]) -> dict:
    """The median round by speed, with the largest peak memory of all rounds."""
    from experiments.bench.measure import median_row

    row = dict(median_row(runs, "tokens_per_s"))
    row["peak_mem_mb"] = max(r["peak_mem_mb"] for r in runs)
    if "memory_settled" in row:
        row["memory_settled"] = all(r["memory_settled"] for r in runs)
    if row.get("tensor_peak_mb") is not None:
        row["tensor_peak_mb"] = max(r["tensor_peak_mb"] for r in runs)
    return row


def kernels_isa(device: str) -> str:
    """The ISA the C kernels are built for ($SPARSE_ATTENTION_MARCH, default native): CPU figures depend on it."""
    from kernels import native

    return native.isa() if device == "cpu" else "-"


def print_table(table: list[dict], args, isa: str = "-") -> None:
    dense = {r["seq"]: r for r in table if r["model"] == "transformer"}
    if args.decode:
        header = f"{'model':<14} {'context':>7} {'batch':>5} {'tokens/s':>10} {'step ms':>8} {'x dense':>7} {'prompt s':>8} {'peak MB':>8} ISA"
    else:
        header = (f"{'model':<14} {'seq':>6} {'batch':>5} {'tokens/s':>10} {'step s':>8} {'x dense':>7} {'peak MB':>8} "
                  f"{'/dense':>6} {'act MB':>7} {'MFU':>6} {'loop %':>7}"
                  + (f" {'tensor MB':>9} {'/dense':>6}" if args.tensor_peak else "") + " ISA")
    print(header)
    print("-" * len(header))
    for r in table:
        base = dense.get(r["seq"])
        speed = format(r["tokens_per_s"] / base["tokens_per_s"], ".2f") if base else "-"
        if args.decode:
            print(f"{r['model']:<14} {r['seq']:>7} {r['batch']:>5} {r['tokens_per_s']:>10,.1f} {r['step_s'] * 1e3:>8.2f} "
                  f"{speed:>7} {r['prompt_s']:>8.2f} {r['peak_mem_mb']:>8,.0f} {isa}")
            continue
        memory = format(r["peak_mem_mb"] / base["peak_mem_mb"], ".2f") if base else "-"
        mfu = "-" if r["mfu"] is None else format(r["mfu"], ".1%")
        tensors = ""
        if args.tensor_peak:
            ratio = format(r["tensor_peak_mb"] / base["tensor_peak_mb"], ".2f") if base else "-"
            tensors = f" {r['tensor_peak_mb']:>9,.0f} {ratio:>6}"
        peak = format(r["peak_mem_mb"], ",.0f") + ("" if r["memory_settled"] else "+")
        print(f"{r['model']:<14} {r['seq']:>6} {r['batch']:>5} {r['tokens_per_s']:>10,.0f} {r['step_s']:>8.3f} "
              f"{speed:>7} {peak:>8} {memory:>6} {r['activation_mb']:>7,.0f} {mfu:>6} "
              f"{r['loop_overhead']:>7.2%}{tensors} {isa}")
    what = "one decoding step after the context, greedy" if args.decode else "forward, loss, backward, optimizer step"
    allocators = ", ".join(sorted({r["cpu_allocator"] for r in table}))
    notes = [f"{what}; {args.precision}, {args.threads} threads, {allocators} cpu allocator, median of {args.steps} "
             f"steps, median of {args.repeat} interleaved rounds, largest peak",
             "x dense and /dense: tokens/s and peak memory against the transformer in this run"]
    if not args.decode:
        notes += ["peak MB: resident, once it held for 3 steps in a row (+: still growing after 12 steps or a minute)",
                  "act MB: tensors one forward keeps for the backward", "MFU against the measured fp32 matmul peak"]
    if args.tensor_peak:
        notes.append("tensor MB: the most that live tensors held at once over one more step (weights and optimizer "
                     "state included)")
    print(f"({'; '.join(notes)})")


def plot_scaling(table: list[dict], path: Path, args) -> None:
    """tokens/s and peak memory against length, log-log, one line per model."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from experiments.runtime.throughput import device_name

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(r["model"] for r in table):
        rows = sorted((r for r in table if r["model"] == name), key=lambda r: r["seq"])
        seqs = [r["seq"] for r in rows]
        speed.plot(seqs, [r["tokens_per_s"] for r in rows], marker="o", label=name)
        memory.plot(seqs, [r["peak_mem_mb"] for r in rows], marker="o", label=name)
    what = "one decoding step after a cache" if args.decode else "training step"
    for ax, label in ((speed, "tokens/s"), (memory, "peak memory (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(plain)
        ax.set_xlabel("context (tokens)" if args.decode else "sequence length (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    device = table[0].get("device", "cpu") if table else "cpu"
    threads = f", {args.threads} threads" if device == "cpu" else ""
    fig.suptitle(f"{what}, batch {args.batch}, {args.precision}{threads}: {device_name(torch.device(device))}",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
