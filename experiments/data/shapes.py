"""`data=shapes`: captioned images drawn on the fly, and a detector that scores generated ones.

Each image holds one shape (circle, square, triangle) of one colour, size and position on a black
background; its caption says so: "a large red circle at the top left". Nothing is downloaded, the
data is infinite, and a training batch is a pure function of (seed, step, micro-batch, rank), so a
resumed run sees what an uninterrupted one would. Validation draws from its own fixed seed.

The detector reads an image back: the dominant colour is the palette colour nearest to the mean
of the bright pixels, the shape class comes from how much of its bounding box the shape fills
(square 1, circle pi/4, triangle 1/2). `score` compares both with what the caption asked for.
"""

import re
from typing import Iterator, Optional

import numpy as np
import torch
from torch import Tensor

from experiments.data.draws import VAL_SEED, step_generator
from experiments.runtime.errors import UserError
from experiments.data.tokenizer import WordTokenizer, tokenize


COLOURS = {  # RGB in [0, 1], far apart so that a blurry sample is still nearest to its own colour
    "red": (0.9, 0.15, 0.15),
    "green": (0.15, 0.75, 0.2),
    "blue": (0.15, 0.3, 0.95),
    "yellow": (0.95, 0.85, 0.1),
    "purple": (0.6, 0.2, 0.8),
    "cyan": (0.1, 0.85, 0.9),
}
SHAPES = ("circle", "square", "triangle")
SIZES = {"small": 0.13, "large": 0.21}  # half the shape's extent, as a fraction of the image size
ROWS = {"top": 0.27, "middle": 0.5, "bottom": 0.73}
COLUMNS = {"left": 0.27, "center": 0.5, "right": 0.73}
_WORDS = ["a", "at", "the", *SIZES, *COLOURS, *SHAPES, *ROWS, *COLUMNS]


def caption(size: str, colour: str, shape: str, row: str, column: str) -> str:
    return f"a {size} {colour} {shape} at the {row} {column}"


def parse(text: str) -> dict[str, Optional[str]]:
    """The attributes a caption names (None where it names none)."""
    words = set(re.findall(r"[a-z]+", text.lower()))
    pick = lambda options: next((w for w in options if w in words), None)  # noqa: E731
    return {"colour": pick(COLOURS), "shape": pick(SHAPES)}


def draw(image_size: int, size: str, colour: str, shape: str, row: str, column: str,
         jitter: tuple[float, float] = (0.0, 0.0)) -> np.ndarray:
    """One image [3, image_size, image_size] in [0, 1]."""
    s = image_size
    y, x = np.mgrid[0:s, 0:s].astype(np.float32) + 0.5
    cy, cx = (ROWS[row] + jitter[0]) * s, (COLUMNS[column] + jitter[1]) * s
    r = SIZES[size] * s
    if shape == "circle":
        inside = (x - cx) ** 2 + (y - cy) ** 2 <= r * r
    elif shape == "square":
        inside = (abs(x - cx) <= r) & (abs(y - cy) <= r)
    else:  # an upright triangle: apex at the top, base at the bottom of the same box
        depth = (y - (cy - r)) / (2 * r)  # 0 at the apex, 1 at the base
        inside = (depth >= 0) & (depth <= 1) & (abs(x - cx) <= depth * r)
    image = np.zeros((3, s, s), dtype=np.float32)
    image[:, inside] = np.asarray(COLOURS[colour], dtype=np.float32)[:, None]
    return image


def detect(images: Tensor) -> list[dict[str, Optional[str]]]:
    """images [batch, 3, h, w] in [0, 1] -> the dominant colour and shape class of each."""
    palette = torch.tensor(list(COLOURS.values()))
    names = list(COLOURS)
    found = []
    for image in images.detach().float().cpu().clamp(0, 1):
        brightness = image.max(0).values
        if brightness.max() < 0.2:  # nothing drawn
            found.append({"colour": None, "shape": None})
            continue
        fg = brightness >= 0.5 * brightness.max()
        mean = image[:, fg].mean(1)
        colour = names[int(((palette - mean) ** 2).sum(1).argmin())]
        rows, cols = fg.any(1).nonzero(), fg.any(0).nonzero()
        box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
        fill = float(fg.sum() / box)
        shape = "square" if fill > 0.9 else "circle" if fill > 0.64 else "triangle"
        found.append({"colour": colour, "shape": shape})
    return found


def score(images: Tensor, captions: list[str]) -> dict[str, float]:
    """Agreement of the detected colour and shape with the captions, over the images whose
    caption names one (chance: 1/6 for colour, 1/3 for shape)."""
    out = {}
    detected = detect(images)
    for key in ("colour", "shape"):
        pairs = [(d[key], parse(c)[key]) for d, c in zip(detected, captions) if parse(c)[key] is not None]
        if pairs:
            out[f"{key}_agreement"] = sum(a == b for a, b in pairs) / len(pairs)
    return out


class Shapes:
    """Generated captioned images: train_batch / val_batches give (text [batch, text_seq_len],
    images [batch, 3, image_size, image_size] in [0, 1])."""

    kind = "images"  # what a task trains on (experiments/tasks/task.py check_parts)
    channels = 3

    def __init__(self, image_size: int = 32, text_seq_len: int = 16):
        if image_size < 8:
            raise UserError(f"data.image_size={image_size} is too small to draw shapes in: use 8 or more")
        self.image_size = image_size
        self.tokenizer = WordTokenizer(_WORDS)
        longest = max(len(self.tokenizer.encode(caption("small", "purple", "triangle", "bottom", "center"))), 1)
        if text_seq_len < longest:
            raise UserError(f"data.text_seq_len={text_seq_len} is shorter than a shapes caption ({longest} words)")
        self.text_seq_len = text_seq_len
        self.name = "shapes"
        self.fingerprint = f"shapes/1:{image_size}"

    def _draw_batch(self, gen: torch.Generator, n: int) -> tuple[list[str], Tensor]:
        pick = lambda options: [list(options)[i] for i in torch.randint(len(options), (n,), generator=gen)]  # noqa: E731
        sizes, colours, shapes, rows, cols = (pick(o) for o in (SIZES, COLOURS, SHAPES, ROWS, COLUMNS))
        jitter = ((torch.rand(n, 2, generator=gen) - 0.5) * 0.06).tolist()
        captions = [caption(*attrs) for attrs in zip(sizes, colours, shapes, rows, cols)]
        images = np.stack([draw(self.image_size, *attrs, jitter=j)
                           for *attrs, j in zip(sizes, colours, shapes, rows, cols, jitter)])
        return captions, torch.from_numpy(images)

    def _batch(self, gen: torch.Generator, n: int) -> tuple[Tensor, Tensor]:
        captions, images = self._draw_batch(gen, n)
        return tokenize(self.tokenizer, captions, self.text_seq_len, truncate=False), images

    def train_batch(self, batch_size: int, *, seed: int, step: int, micro: int = 0, rank: int = 0,
                    world_size: int = 1) -> tuple[Tensor, Tensor]:
        """The global batch drawn once from its coordinates; each rank takes its own rows."""
        gen = step_generator(seed, step, micro, 0)
        text, images = self._batch(gen, batch_size * world_size)
        rows = slice(rank * batch_size, (rank + 1) * batch_size)
        return text[rows], images[rows]

    def val_batches(self, num_batches: int, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
        gen = torch.Generator().manual_seed(VAL_SEED)
        for _ in range(num_batches):
            yield self._batch(gen, batch_size)

    def prompts(self, n: int) -> list[str]:
        """n validation captions to generate from: the same ones at every generation."""
        return self._draw_batch(torch.Generator().manual_seed(VAL_SEED + 1), n)[0]

    score = staticmethod(score)
