"""Byte-level language-model data: the built-in corpus, any file, the interpreter's standard library,
and enwik8 (DESIGN.md section 6).

Training crops are a pure function of (seed, step, micro-batch, rank, world size), so a resumed run sees
exactly the batches an uninterrupted one would, with no loader state to save. Validation uses the
same fixed crops in every run, so val_loss is comparable across runs and seeds.
"""

import gzip
import hashlib
import os
import zipfile
import zlib
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
from torch import Tensor

from experiments.data import corpus
from experiments.data.draws import VAL_SEED, step_generator
from experiments.runtime.errors import UserError


class ByteData:
    """Train/validation byte arrays with crop sampling. Subclasses only load the bytes."""

    kind = "text"  # what a task trains on (experiments/tasks/task.py check_parts)
    vocab_size = 256  # a token is a byte

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
        digest.update(val.tobytes())  # the bytes, and below, where validation begins among them
        self.fingerprint = f"{name}:{len(train)}+{len(val)}:{digest.hexdigest()[:16]}"

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
    """A byte-level corpus: `path`, or by default the built-in corpus (experiments/data/corpus.py),
    the same bytes on every install; the last `val_fraction` of it validates."""

    def __init__(self, seq_len: int, path: Optional[str] = None, val_fraction: float = 0.1):
        check_val_fraction(val_fraction)
        if path is None:
            data, name = corpus.snapshot(), corpus.SNAPSHOT
        else:
            data, name = read_bytes(Path(path), key="data.path"), Path(path).expanduser().name
        super().__init__(*split_from_the_end(data, val_fraction), seq_len, name)


class InterpreterStdlib(ByteData):
    """data=stdlib: the running interpreter's standard-library sources, built at first use and cached
    (they differ between Python versions, and so does this corpus's fingerprint)."""

    def __init__(self, seq_len: int, val_fraction: float = 0.1, cache_dir: Optional[str] = None):
        check_val_fraction(val_fraction)
        data = corpus.interpreter_stdlib(Path(cache_dir).expanduser() if cache_dir else default_cache_dir())
        super().__init__(*split_from_the_end(data, val_fraction), seq_len, corpus.interpreter_name())


class Enwik8(ByteData):
    """enwik8 as the seeds use it: the first train_bytes + val_bytes bytes, split in that order."""

    def __init__(self, seq_len: int, path: str, train_bytes: int = 90_000_000, val_bytes: int = 5_000_000):
        data = read_bytes(
            Path(path),
            key="data.path",
            limit=train_bytes + val_bytes,
            hint="download http://mattmahoney.net/dc/enwik8.zip and pass data.path=<that file> (unzipped "
            "or gzipped is fine too)",
        )
        if len(data) < train_bytes + val_bytes:  # a short file would leave validation short or empty
            raise UserError(f"data.path={path} holds {len(data):,} bytes, fewer than data.train_bytes + "
                            f"data.val_bytes = {train_bytes + val_bytes:,}: give the whole enwik8 file, or set the two "
                            "sizes to fit it")
        super().__init__(data[:train_bytes], data[train_bytes : train_bytes + val_bytes], seq_len, "enwik8")


def check_val_fraction(val_fraction: float) -> None:
    if not 0 < val_fraction < 1:
        raise UserError(f"data.val_fraction={val_fraction} must lie strictly between 0 and 1")


def split_from_the_end(data: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): the last val_fraction of data validates, as the seeds split enwik8."""
    split = len(data) - int(len(data) * val_fraction)
    return data[:split], data[split:]


def default_cache_dir() -> Path:
    """The same folder conf/data/stdlib.yaml names: $XDG_CACHE_HOME or ~/.cache, /sparse-attention."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sparse-attention"


def read_bytes(path: Path, *, key: str, limit: Optional[int] = None, hint: str = "") -> np.ndarray:
    """A file's bytes as uint8: gzip and a zip archive of one file (enwik8.zip as downloaded) are read
    decompressed, by their suffix (.gz, .zip) or by their first bytes where they open as one; anything
    else, raw."""
    path = path.expanduser()
    if path.is_dir():
        raise UserError(f"{key}={path} is a directory: give the file to read")
    if not path.is_file():
        raise UserError(f"{key}={path}: no such file: {hint or 'check the path'}")
    size, kind = -1 if limit is None else limit, "raw"
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        suffix = path.suffix.lower()
        if suffix == ".gz" or (magic[:2] == b"\x1f\x8b" and _opens_as_gzip(path)):
            kind = "gzip"
        elif suffix == ".zip" or (magic == b"PK\x03\x04" and zipfile.is_zipfile(path)):
            kind = "zip"
        if kind == "gzip":
            with gzip.open(path, "rb") as f:
                raw = f.read(size)
        elif kind == "zip":
            with zipfile.ZipFile(path) as archive:
                files = [m for m in archive.infolist() if not m.is_dir()]
                if len(files) != 1:
                    raise UserError(f"{key}={path} is a zip archive of {len(files)} files: unzip it and give "
                                    "the one to read")
                with archive.open(files[0]) as f:
                    raw = f.read(size)
        else:
            with open(path, "rb") as f:
                raw = f.read(size)
    except (OSError, EOFError, zlib.error, zipfile.BadZipFile) as e:  # not gzip, cut short, unreadable
        what = {"gzip": "a complete gzip file", "zip": "a complete zip archive"}.get(kind, "readable")
        raise UserError(f"{key}={path} is not {what} ({e}): give an intact file (.gz and .zip are read "
                        "decompressed, anything else as raw bytes)") from None
    if not raw:
        raise UserError(f"{key}={path} is empty: give a file with text in it")
    return np.frombuffer(raw, dtype=np.uint8).copy()


def _opens_as_gzip(path: Path) -> bool:
    """Whether the file gets through gzip's header (a file may begin with its signature by chance)."""
    try:
        with gzip.open(path, "rb") as f:
            f.read(1)
        return True
    except (OSError, EOFError, zlib.error):
        return False
