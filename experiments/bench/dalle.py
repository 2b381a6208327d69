"""DALL-E training-step speed, side by side with the reference package.

    python -m experiments.bench.dalle                 # ours, and dalle-pytorch if installed
    python -m experiments.bench.dalle --repeat 5 --steps 20

The config is the reference's training script at a CPU size: DALLE(dim 256, depth 2, heads 4,
dim_head 64, text_seq_len 64, 1,000 text tokens) over DiscreteVAE(image_size 64, 3 layers, 512
codes, codebook_dim 256, hidden_dim 64), batch 4, Adam, fp32. One step is what the training loop
does: encode the images to codes with the frozen VAE, forward, backward, optimizer step.
tokens/s counts text_seq_len + image codes (64 + 64) per sample. The reference's feed-forward is
a GEGLU (1.5x the weights of our GELU one at the same ff_mult): `--ff-mult 6` gives ours the same
parameter count. Each measurement runs in a
fresh process, rounds interleave the two, and the median round is shown.

`ref` needs dalle-pytorch 1.6.6, which is not a dependency: `pip install --no-deps
dalle-pytorch==1.6.6 axial_positional_embedding==0.2.1 rotary-embedding-torch==0.2.3`. Its
package imports optional parts (VQGAN, tokenizers, torchvision) that its DALLE and DiscreteVAE
do not use; they are stubbed here so that it imports on Python 3.11 without them.
"""

import argparse
import json
import sys

from experiments.config.checks import flag_error

TEXT_SEQ_LEN, TEXT_TOKENS, BATCH = 64, 1000, 4
VAE = dict(image_size=64, num_layers=3, num_tokens=512, codebook_dim=256, hidden_dim=64)
DALLE = dict(dim=256, depth=2, heads=4, dim_head=64)


def ours(ff_mult: float = 4.0):
    from models.dalle import DALLE as Dalle
    from models.dvae import DiscreteVAE

    vae = DiscreteVAE(**VAE, num_resnet_blocks=0, temperature=0.9, anneal_rate=0.0).eval()
    dalle = Dalle(**DALLE, num_text_tokens=TEXT_TOKENS, text_seq_len=TEXT_SEQ_LEN, num_image_tokens=vae.num_tokens,
                  image_fmap_size=vae.fmap_size, ff_mult=ff_mult)

    def loss(text, images):
        tokens, targets = dalle.sequence(text, vae.codebook_indices(images))
        return dalle(tokens, targets=targets)[0]

    return dalle, loss


def reference():
    import types
    from unittest import mock

    for name in ("taming", "taming.models", "taming.models.vqgan", "transformers", "youtokentome", "torchvision",
                 "torchvision.transforms", "ftfy", "tokenizers", "tokenizers.processors", "regex", "pkg_resources"):
        stub = types.ModuleType(name)
        stub.__getattr__ = lambda attr: mock.MagicMock()
        sys.modules.setdefault(name, stub)
    from dalle_pytorch import DALLE as Dalle, DiscreteVAE

    dalle = Dalle(vae=DiscreteVAE(**VAE), num_text_tokens=TEXT_TOKENS, text_seq_len=TEXT_SEQ_LEN, **DALLE)
    return dalle, lambda text, images: dalle(text, images, return_loss=True)


def measure(name: str, steps: int, threads: int, ff_mult: float) -> dict:
    import torch

    from experiments.bench.measure import median_seconds
    from experiments.runtime.throughput import peak_memory_mb

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    dalle, loss_fn = reference() if name == "ref" else ours(ff_mult)
    optimizer = torch.optim.Adam([p for p in dalle.parameters() if p.requires_grad], lr=3e-4)
    text = torch.randint(1, TEXT_TOKENS, (BATCH, TEXT_SEQ_LEN))
    images = torch.rand(BATCH, 3, VAE["image_size"], VAE["image_size"])

    def step():
        loss_fn(text, images).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step_s = median_seconds(step, steps)
    tokens = BATCH * (TEXT_SEQ_LEN + (VAE["image_size"] // 2 ** VAE["num_layers"]) ** 2)
    return {"model": name, "step_s": round(step_s, 4), "tokens_per_s": round(tokens / step_s, 1),
            "params": sum(p.numel() for p in dalle.parameters() if p.requires_grad),
            "peak_mem_mb": round(peak_memory_mb(torch.device("cpu")), 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench.dalle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["ours", "ref"], choices=["ours", "ref"])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the median round is shown")
    parser.add_argument("--ff-mult", type=float, default=4.0,
                        help="our feed-forward width; 6 matches the parameters of the reference's GEGLU at 4")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child process: one JSON row
    args = parser.parse_args(argv)
    if error := flag_error({"--steps": ("count", args.steps), "--threads": ("count", args.threads),
                            "--repeat": ("count", args.repeat), "--ff-mult": ("ff_mult", args.ff_mult)}):
        parser.error(error)
    if args.one:
        print(json.dumps(measure(args.models[0], args.steps, args.threads, args.ff_mult)))
        return 0
    from experiments.bench.measure import measure_in_child, median_row

    rows: dict[str, list[dict]] = {}
    failed = False
    for _ in range(args.repeat):
        for name in args.models:
            try:
                row, _ = measure_in_child("experiments.bench.dalle", [
                    "--models", name, "--steps", str(args.steps), "--threads", str(args.threads),
                    "--ff-mult", str(args.ff_mult)])
            except RuntimeError as e:
                print(f"{name:<6} failed: {e}" + (" (see the module docstring to install it)" if name == "ref" else ""))
                failed = True
                break
            rows.setdefault(name, []).append(row)
    print(f"{'model':<6} {'params':>10} {'tokens/s':>10} {'step s':>8} {'peak MB':>8}")
    for name, runs in rows.items():
        r = median_row(runs, "tokens_per_s")
        print(f"{name:<6} {r['params']:>10,} {r['tokens_per_s']:>10,.0f} {r['step_s']:>8.3f} "
              f"{max(x['peak_mem_mb'] for x in runs):>8,.0f}")
    print(f"(batch {BATCH}, {TEXT_SEQ_LEN} text + 64 image tokens per sample, fp32, {args.threads} threads, "
          f"median of {args.steps} steps, median of {args.repeat} interleaved rounds)")
    return 1 if failed else 0  # a script sees that a figure is missing


if __name__ == "__main__":
    sys.exit(main())
