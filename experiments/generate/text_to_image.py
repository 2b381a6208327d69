"""Generating images from a trained DALL-E run (train one with `python train.py experiment=dalle`).

    python -m experiments.generate.text_to_image outputs/<run> --prompt "a large red circle at the top left"
"""

import argparse
import sys
from pathlib import Path

import torch
import yaml

from experiments.config.checks import flag_error
from experiments.data.shapes import score
from experiments.data.tokenizer import from_spec
from experiments.runtime.errors import UserError
from experiments.runtime.image_grid import save_grid
from experiments.tasks.dalle import generate_images
from experiments.tasks.members import load_members


def load_run(spec: str, device: str = "cpu"):
    """(dalle, vae, tokenizer) of a dalle run directory or checkpoint."""
    models, state = load_members(spec, ("", "vae_"), device=device)
    if "dalle_hparams" not in state:
        raise UserError(f"{spec} is not a dalle run (its checkpoint has no dalle_hparams)")
    return models[""], models["vae_"], from_spec(yaml.safe_load(state["tokenizer"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.generate.text_to_image", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a dalle run directory or checkpoint")
    parser.add_argument("--prompt", required=True, help="the caption to draw")
    parser.add_argument("--num-images", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: <run>/samples/generated.png)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--filter-thres", type=float, default=0.9, help="keep the top (1 - this) of the image logits")
    parser.add_argument("--cond-scale", type=float, default=1.0, help="classifier-free guidance scale (1: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--truncate", action="store_true",
                        help="cut a prompt longer than the model reads (its text_seq_len tokens) instead of "
                             "refusing it")
    args = parser.parse_args(argv)
    if error := flag_error({"--num-images": ("num_samples", args.num_images), "--temperature": ("temperature", args.temperature),
                            "--filter-thres": ("filter_thres", args.filter_thres),
                            "--cond-scale": ("cond_scale", args.cond_scale)}):
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not args.prompt.strip():
        print("error: --prompt is empty: give the caption to draw", file=sys.stderr)
        return 2
    if args.out is not None and args.out.suffix.lower() != ".png":
        print(f"error: --out {args.out}: the grid is written as a PNG: name a .png file", file=sys.stderr)
        return 2
    try:
        dalle, vae, tokenizer = load_run(args.run)
        if (tokens := len(tokenizer.encode(args.prompt))) > dalle.text_seq_len and not args.truncate:
            raise UserError(f"--prompt is {tokens} tokens and the model reads {dalle.text_seq_len}: the words past "
                            "them would be dropped: shorten it, or pass --truncate")
        images = generate_images(dalle, vae, tokenizer, [args.prompt] * args.num_images,
                                 temperature=args.temperature, filter_thres=args.filter_thres,
                                 cond_scale=args.cond_scale, generator=torch.Generator().manual_seed(args.seed))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    run_dir = Path(args.run) if Path(args.run).is_dir() else Path(args.run).parent.parent
    out = args.out or run_dir / "samples" / "generated.png"
    try:
        save_grid(out, images, [args.prompt] * args.num_images)
    except OSError as e:
        print(f"error: --out {out}: {e.strerror or e}: name a .png file in a folder you can write", file=sys.stderr)
        return 1
    scores = score(images, [args.prompt] * args.num_images)
    print(f"wrote {out}" + "".join(f"  {k} {v:.2f}" for k, v in scores.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
