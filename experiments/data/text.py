"""Byte-level language-model data: the built-in corpus, any file, and enwik8 (DESIGN.md section 6).

Training crops are a pure function of (seed, step, micro-batch, rank, world size), so a resumed run sees
exactly the batches an uninterrupted one would, with no loader state to save. Validation uses the
same fixed crops in every run, so val_loss is comparable across runs and seeds.
"""

import gzip
import hashlib
import logging
import os
import sys
import sysconfig
import zlib
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
from torch import Tensor

from experiments.data.draws import VAL_SEED, step_generator
from experiments.runtime.errors import UserError
from experiments.runtime.files import atomic_write


log = logging.getLogger(__name__)


class ByteData:
    """Train/validation byte arrays with crop sampling. Subclasses only load the bytes."""

    def __init__(self, train: np.ndarray, val: np.ndarray, seq_len: int, name: str):
        if seq_len < 1:
            raise UserError(f"data.seq_len={seq_len} must be at least 1")
        for split, array in (("training", train), ("validation", val)):
            if len(array) <= seq_len + 1:
                raise UserError(
                    f"data.seq_len={seq_len} is longer than the {split} split of {name} "
                    f"({len(array):,} bytes): lower data.seq_len or use a larger corpus"
                )
        self.train = torch.from_numpy(train)
        self.val = torch.from_numpy(val)
        self.seq_len = seq_len
        self.name = name
        digest = hashlib.sha256(train.tobytes())
        digest.update(val.tobytes())
        self.fingerprint = f"{name}:{len(train) + len(val)}:{digest.hexdigest()[:16]}"

    def _crops(self, data: Tensor, starts: Tensor) -> Tensor:
        index = starts[:, None] + torch.arange(self.seq_len + 1)
        return data[index].long()

    def train_batch(self, batch_size: int, *, seed: int, step: int, micro: int = 0, rank: int = 0,
                    world_size: int = 1) -> Tensor:
        """Random crops [batch, seq_len + 1] for one rank's micro-batch, reproducible from its
        coordinates: the global batch of batch_size * world_size crops is drawn once, and each
        rank takes its own rows, so N ranks of batch b see what one process of batch N * b sees."""
        gen = step_generator(seed, step, micro, 0)
        starts = torch.randint(0, len(self.train) - self.seq_len - 1, (batch_size * world_size,), generator=gen)
        return self._crops(self.train, starts[rank * batch_size : (rank + 1) * batch_size])

    def val_batches(self, num_batches: int, batch_size: int) -> Iterator[Tensor]:
        """The same `num_batches` validation crops [batch, seq_len + 1] every time."""
        gen = torch.Generator().manual_seed(VAL_SEED)
        starts = torch.randint(0, len(self.val) - self.seq_len - 1, (num_batches, batch_size), generator=gen)
        for row in starts:
            yield self._crops(self.val, row)

    def prime(self, length: int, index: int = 0) -> Tensor:
        """A validation excerpt [length] to prompt generation with."""
        gen = torch.Generator().manual_seed(VAL_SEED + 1 + index)
        start = int(torch.randint(0, len(self.val) - length, (1,), generator=gen))
        return self.val[start : start + length].long()

    @staticmethod
    def decode(tokens) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


class ByteText(ByteData):
    """A byte-level corpus: `path`, or by default this Python's standard library sources."""

    def __init__(self, seq_len: int, path: Optional[str] = None, val_fraction: float = 0.1,
                 cache_dir: Optional[str] = None):
        if not 0 < val_fraction < 1:
            raise UserError(f"data.val_fraction={val_fraction} must lie strictly between 0 and 1")
        if path is None:
            data, name = builtin_corpus(Path(cache_dir or default_cache_dir())), "stdlib-py" + ".".join(
                map(str, sys.version_info[:3]))
        else:
            data, name = read_bytes(Path(path), key="data.path"), Path(path).name
        split = len(data) - int(len(data) * val_fraction)
        super().__init__(data[:split], data[split:], seq_len, name)


class Enwik8(ByteData):
    """enwik8 as the seeds use it: the first train_bytes + val_bytes bytes, split in that order."""

    def __init__(self, seq_len: int, path: str, train_bytes: int = 90_000_000, val_bytes: int = 5_000_000):
        data = read_bytes(
            Path(path),
            key="data.path",
            limit=train_bytes + val_bytes,
            hint="download http://mattmahoney.net/dc/enwik8.zip, unzip it (gzip is fine too) and "
            "pass data.path=<file>",
        )
        super().__init__(data[:train_bytes], data[train_bytes : train_bytes + val_bytes], seq_len, "enwik8")


def default_cache_dir() -> Path:
    """The same folder conf/data/text.yaml names: $XDG_CACHE_HOME or ~/.cache, /sparse-attention."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sparse-attention"


def read_bytes(path: Path, *, key: str, limit: Optional[int] = None, hint: str = "") -> np.ndarray:
    """A file's bytes as uint8 (gzip-compressed files by their .gz suffix)."""
    if path.is_dir():
        raise UserError(f"{key}={path} is a directory: give the file to read")
    if not path.is_file():
        raise UserError(f"{key}={path}: no such file: {hint or 'check the path'}")
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                raw = f.read(-1 if limit is None else limit)
        else:
            with open(path, "rb") as f:
                raw = f.read(-1 if limit is None else limit)
    except (OSError, EOFError, zlib.error) as e:  # not gzip, cut short, unreadable
        what = "a complete gzip file" if path.suffix == ".gz" else "readable"
        raise UserError(f"{key}={path} is not {what} ({e}): give an intact file (a .gz is read as gzip, "
                        "anything else as raw bytes)") from None
    return np.frombuffer(raw, dtype=np.uint8).copy()


def builtin_corpus(cache_dir: Path) -> np.ndarray:
    """This interpreter's standard-library .py sources (tests excluded), sorted, joined; cached."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    if not files:
        raise UserError(f"no Python sources under {root} for the built-in corpus: set data.path=<a text file>")
    listing = "\n".join(f"{p.relative_to(root)}:{p.stat().st_size}" for p in files)
    key = hashlib.sha256(listing.encode()).hexdigest()[:16]
    cache = cache_dir / f"stdlib-corpus-{key}.u8"
    if cache.is_file():
        return np.fromfile(cache, dtype=np.uint8)
    data = b"\n".join(p.read_bytes() for p in files)
    try:
        atomic_write(cache, lambda f: f.write(data))
    except OSError as e:  # a read-only home, say: build it again next time, but run now
        log.warning("could not cache the built-in corpus in %s (%s); set data.cache_dir to a writable folder",
                    cache_dir, e)
    return np.frombuffer(data, dtype=np.uint8).copy()
