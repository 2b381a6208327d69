"""`data=image_folder`: captioned images from a folder or from tar shards.

Layouts (those of the DALL-E seed):
- a folder (searched recursively) of images with same-stem .txt captions, one caption per line:
  `cat.jpg` + `cat.txt`;
- tar shards in the WebDataset layout: members grouped by the name before the first dot
  (`0001.jpg` + `0001.txt`); `path` is one .tar or a folder of them.

An image without a caption (or with an empty one) is left out, with one warning that counts them;
captions are UTF-8. A folder of both loose images and shards, or two images of one caption, is refused.
Every caption is tokenized once at start, so a caption longer than text_seq_len is an error naming
it before any training (or is cut, with truncate_captions=true). An image that cannot be decoded is
skipped with a warning when first met, and the next one in order takes its place.

Training draws images and caption lines from (seed, step, micro-batch, rank), like the text data,
and applies a random resized crop (square, covering resize_ratio..1 of the image's area);
validation takes the last val_fraction of the items, centre-cropped.
"""

import hashlib
import io
import logging
import math
import tarfile
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

from experiments.data.draws import step_generator
from experiments.runtime.errors import UserError
from experiments.data.tokenizer import BPETokenizer, ByteTokenizer, tokenize

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff"}


class _Item:
    """One image (its reader and its size in bytes) and its caption lines, from a file or a tar member."""

    def __init__(self, key: str, read_image, size: int, captions: list[str]):
        self.key, self.read_image, self.size, self.captions = key, read_image, size, captions


class ImageTextFolder:
    kind = "images"  # what a task trains on (experiments/tasks/task.py check_parts)

    def __init__(self, path: str, image_size: int = 64, text_seq_len: int = 64, resize_ratio: float = 0.75,
                 truncate_captions: bool = False, val_fraction: float = 0.05, channels: int = 3,
                 tokenizer: str = "bytes"):
        if not 0 < resize_ratio <= 1:
            raise UserError(f"data.resize_ratio={resize_ratio} must lie in (0, 1]")
        if not 0 < val_fraction < 1:
            raise UserError(f"data.val_fraction={val_fraction} must lie strictly between 0 and 1")
        if channels not in (1, 3, 4):
            raise UserError(f"data.channels={channels} must be 1 (L), 3 (RGB) or 4 (RGBA)")
        root = Path(path).expanduser()
        if not root.exists():
            raise UserError(f"data.path={path}: no such folder or tar file")
        if root.is_file() and not tarfile.is_tarfile(root):
            raise UserError(f"data.path={path} is a file but not a tar shard: give the folder of captioned "
                            "images (or a .tar of them)")
        self.image_size, self.text_seq_len, self.channels = image_size, text_seq_len, channels
        self.resize_ratio, self.truncate = resize_ratio, truncate_captions
        self.mode = {1: "L", 3: "RGB", 4: "RGBA"}[channels]
        self.tokenizer = ByteTokenizer() if tokenizer == "bytes" else BPETokenizer(tokenizer)
        shards = [root] if root.is_file() else sorted(root.rglob("*.tar"))
        if shards and root.is_dir() and (loose := next(_images_in(root), None)):
            raise UserError(f"data.path={path} holds tar shards and loose images ({loose.relative_to(root)}), "
                            "and only the shards would be read: point data.path at a folder of one kind")
        items = self._from_tars(shards) if shards else self._from_folder(root)
        if len(items) < 2:
            raise UserError(f"data.path={path}: found {len(items)} captioned images; need at least 2 "
                            f"(images ({', '.join(sorted(IMAGE_SUFFIXES))}) with same-stem .txt captions, "
                            "or .tar shards of them)")
        self._tokens = {item.key: [self._tokenize(c, item.key) for c in item.captions] for item in items}
        self.root = root
        n_val = max(1, int(len(items) * val_fraction))
        self.train_items, self.val_items = items[:-n_val], items[-n_val:]
        self._bad: set[str] = set()
        self.name = root.name
        # the items (names, image sizes, captions) and where validation begins among them
        digest = hashlib.sha256("\n".join(f"{i.key}:{i.size}:{'|'.join(i.captions)}" for i in items).encode())
        self.fingerprint = f"{self.name}:{len(self.train_items)}+{n_val}:{digest.hexdigest()[:16]}"
        log.info("data %s: %d captioned images (%d for validation)", path, len(items), n_val)
        for split, part in (("training", self.train_items), ("validation", self.val_items)):
            self._image(part, 0, None, split)  # a readable image in each, or say so now rather than mid-run

    # ---- indexing

    def _from_folder(self, root: Path) -> list[_Item]:
        images: dict[Path, Path] = {}
        for image in _images_in(root):
            if (other := images.setdefault(image.with_suffix(""), image)) != image:
                raise UserError(f"data.path={root}: {other.relative_to(root)} and {image.relative_to(root)} share "
                                f"one caption ({image.with_suffix('.txt').name}): rename one of them")
        items, missing = [], 0
        for stem, image in images.items():
            text = stem.with_suffix(".txt")
            captions = _lines(_caption_text(text.read_bytes(), text)) if text.is_file() else []
            if not captions:
                missing += 1
                continue
            items.append(_Item(str(stem.relative_to(root)), lambda p=image: p.read_bytes(), image.stat().st_size,
                               captions))
        if missing:
            log.warning("%d of %d images in %s have no caption (.txt beside them) and are left out",
                        missing, len(images), root)
        if orphans := sum(1 for p in root.rglob("*.txt") if p.with_suffix("") not in images):
            log.warning("%d captions in %s have no image beside them (%s) and are left out", orphans, root,
                        ", ".join(sorted(IMAGE_SUFFIXES)))
        return items

    def _from_tars(self, shards: list[Path]) -> list[_Item]:
        items, missing = [], 0
        for shard in shards:
            groups: dict[str, dict[str, tarfile.TarInfo]] = {}
            try:
                with tarfile.open(shard) as tar:
                    for member in tar.getmembers():
                        if member.isfile():  # WebDataset's key: the path up to the first dot of the file's name
                            folder, _, name = member.name.rpartition("/")
                            stem, _, ext = name.partition(".")
                            groups.setdefault(f"{folder}/{stem}" if folder else stem, {})[f".{ext.lower()}"] = member
                    texts = {key: _caption_text(tar.extractfile(g[".txt"]).read(), f"{shard}/{key}.txt")
                             for key, g in groups.items() if ".txt" in g}
            except (tarfile.TarError, OSError, EOFError) as e:
                reason = str(e).splitlines()[0].rstrip(":")
                raise UserError(f"data.path: {shard} is not a readable tar shard ({reason}): replace or remove "
                                "it") from None
            for key, group in sorted(groups.items()):
                image = next((m for ext, m in group.items() if ext in IMAGE_SUFFIXES), None)
                if image is None:
                    continue
                captions = _lines(texts.get(key, ""))
                if not captions:
                    missing += 1
                    continue
                items.append(_Item(f"{shard.name}/{key}", lambda s=shard, m=image: _read_member(s, m), image.size,
                                   captions))
        if missing:
            log.warning("%d images in the tar shards have no caption and are left out", missing)
        return items

    def _tokenize(self, caption: str, key: str) -> Tensor:
        try:
            return tokenize(self.tokenizer, [caption], self.text_seq_len, self.truncate)[0]
        except UserError as e:
            raise UserError(f"{key}: {e}") from None

    # ---- batches

    def _image(self, items: list[_Item], index: int, gen: Optional[torch.Generator],
               split: str = "") -> tuple[_Item, Tensor]:
        """The image at `index`, or the next readable one; randomly cropped when gen is given."""
        for offset in range(len(items)):
            item = items[(index + offset) % len(items)]
            if item.key in self._bad:
                continue
            try:
                image = _eight_bit(Image.open(io.BytesIO(item.read_image()))).convert(self.mode)
            except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
                log.warning("skipping %s: the image cannot be read (%s)", item.key, e)
                self._bad.add(item.key)
                continue
            return item, self._crop(image, gen)
        where = f"its {split} split's" if split else "its"
        raise UserError(f"data.path={self.root}: none of {where} {len(items)} images can be read (see the warnings "
                        "above): give a folder of PNG/JPEG images with same-stem .txt captions")

    def _crop(self, image: Image.Image, gen: Optional[torch.Generator]) -> Tensor:
        """A square crop resized to image_size -> [channels, size, size] in [0, 1]."""
        w, h = image.size
        if gen is None:  # validation: the centre square
            side, x, y = min(w, h), (w - min(w, h)) // 2, (h - min(w, h)) // 2
        else:  # area in [resize_ratio, 1] of the image, square, inside it
            scale = self.resize_ratio + (1 - self.resize_ratio) * float(torch.rand((), generator=gen))
            side = min(int(math.sqrt(scale * w * h)), w, h)
            x = int(torch.randint(0, w - side + 1, (), generator=gen))
            y = int(torch.randint(0, h - side + 1, (), generator=gen))
        crop = image.crop((x, y, x + side, y + side)).resize((self.image_size, self.image_size), Image.BICUBIC)
        array = np.asarray(crop, dtype=np.float32) / 255.0
        array = array[..., None] if array.ndim == 2 else array
        return torch.from_numpy(array).permute(2, 0, 1).clamp(0, 1)

    def _batch(self, items: list[_Item], indices: list[int], gen: Optional[torch.Generator]):
        texts, images = [], []
        for index in indices:
            item, image = self._image(items, index, gen)
            options = self._tokens[item.key]
            line = int(torch.randint(len(options), (), generator=gen)) if gen is not None else 0
            texts.append(options[line])
            images.append(image)
        return torch.stack(texts), torch.stack(images)

    def train_batch(self, batch_size: int, *, seed: int, step: int, micro: int = 0, rank: int = 0,
                    world_size: int = 1) -> tuple[Tensor, Tensor]:
        gen = step_generator(seed, step, micro, 0)
        indices = torch.randint(len(self.train_items), (batch_size * world_size,), generator=gen).tolist()
        # every rank draws the global batch's indices, and reads only its own rows
        rank_gen = step_generator(seed, step, micro, rank, 1)
        return self._batch(self.train_items, indices[rank * batch_size : (rank + 1) * batch_size], rank_gen)

    def val_batches(self, num_batches: int, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
        for b in range(num_batches):
            start = b * batch_size
            yield self._batch(self.val_items, [(start + i) % len(self.val_items) for i in range(batch_size)], None)

    def prompts(self, n: int) -> list[str]:
        return [self.val_items[i % len(self.val_items)].captions[0] for i in range(n)]


def _images_in(root: Path) -> Iterator[Path]:
    return (p for p in sorted(root.rglob("*")) if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def _caption_text(raw: bytes, where) -> str:
    """A caption file's text: UTF-8 (a byte-order mark dropped); anything else is refused, naming the
    file, rather than trained on as replacement characters."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(f"data.path: the caption {where} is not UTF-8 (byte {e.start}): save it as UTF-8") from None


def _eight_bit(image: Image.Image) -> Image.Image:
    """16- and 32-bit greyscale scaled to 8 bits (PIL's convert clips them at 255: all but black is
    white). A 32-bit image is scaled by the range its values use: 8 bits, 16, or its own maximum."""
    if image.mode.startswith("I;16") or image.mode == "I":
        array = np.asarray(image, dtype=np.float64)
        top = 65535.0 if image.mode.startswith("I;16") else next(
            (bound for bound in (255.0, 65535.0) if array.max() <= bound), float(array.max()))
        return Image.fromarray(np.clip(np.round(array / top * 255), 0, 255).astype(np.uint8), "L")
    return image


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _read_member(shard: Path, member: tarfile.TarInfo) -> bytes:
    with tarfile.open(shard) as tar:
        return tar.extractfile(member).read()
