"""Sample grids: images with their captions under them, written as one PNG."""

import textwrap
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont
from torch import Tensor

from experiments.runtime.files import atomic_write


def grid(images: Tensor, captions: list[str], columns: int = 4, cell: int = 128) -> Image.Image:
    """images [batch, channels, h, w] in [0, 1] -> a PIL image: each scaled to `cell` pixels
    (nearest neighbour: the pixels a model made stay visible), its caption below."""
    arrays = (images.detach().float().clamp(0, 1).cpu().permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    font = ImageFont.load_default()
    lines = [textwrap.wrap(c, width=max(8, cell // 6))[:3] for c in captions]
    text_h = 12 * max((len(wrapped) for wrapped in lines), default=0) + 4
    rows = -(-len(arrays) // columns)
    sheet = Image.new("RGB", (columns * (cell + 4) + 4, rows * (cell + text_h + 4) + 4), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (array, wrapped) in enumerate(zip(arrays, lines)):
        x, y = 4 + (i % columns) * (cell + 4), 4 + (i // columns) * (cell + text_h + 4)
        tile = Image.fromarray(array.squeeze(-1) if array.shape[-1] == 1 else array[..., :3])
        sheet.paste(tile.convert("RGB").resize((cell, cell), Image.NEAREST), (x, y))
        for j, line in enumerate(wrapped):
            draw.text((x, y + cell + 2 + 12 * j), line, fill="black", font=font)
    return sheet


def save_grid(path: Path, images: Tensor, captions: list[str], columns: int = 4) -> Path:
    """Write the grid atomically (a reader never sees half a PNG)."""
    sheet = grid(images, captions, columns)
    atomic_write(Path(path), lambda f: sheet.save(f, format="PNG"))
    return Path(path)
