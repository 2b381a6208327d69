"""Caption tokenizers for text-to-image data: id 0 pads, every other id is a word, a byte or a
BPE piece.

    encode(text) -> list[int]      decode(ids) -> str      vocab_size (padding included)
    spec() -> dict                 what `from_spec` rebuilds it from (kept in checkpoints)

`tokenize(tokenizer, captions, length, truncate)` makes the [batch, length] tensor the model reads.
"""

import re
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from experiments.runtime.errors import UserError
from models.dalle import PAD  # the model reads id 0 as padding (and as its first token)


class ByteTokenizer:
    """UTF-8 bytes shifted by one (0 pads): any text, 257 ids."""

    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(int(i) - 1 for i in ids if int(i) != PAD).decode("utf-8", errors="replace")

    def spec(self) -> dict:
        return {"bytes": True}


class WordTokenizer:
    """A fixed word list (lower-cased, split on anything but letters and digits); an unknown word
    is an error that names it, so a caption is never silently changed."""

    def __init__(self, words: list[str]):
        self.words = ["<pad>", *dict.fromkeys(words)]
        self.ids = {w: i for i, w in enumerate(self.words)}
        self.vocab_size = len(self.words)

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in re.findall(r"[a-z0-9]+", text.lower()):
            if word not in self.ids:
                raise UserError(f"the word {word!r} of the caption {text!r} is not in the tokenizer's vocabulary")
            ids.append(self.ids[word])
        return ids

    def decode(self, ids) -> str:
        return " ".join(self.words[int(i)] for i in ids if int(i) != PAD)

    def spec(self) -> dict:
        return {"words": self.words[1:]}


class BPETokenizer:
    """A trained BPE of the `tokenizers` library (its tokenizer.json), ids shifted by one so that
    0 pads: `pip install tokenizers` (the `bpe` extra)."""

    def __init__(self, path: Optional[str] = None, json: Optional[str] = None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError("data.tokenizer=<a BPE file> needs the tokenizers package: pip install -e '.[bpe]'") from None
        if json is None and not Path(path).is_file():
            raise UserError(f"data.tokenizer={path}: no such tokenizer file (a tokenizers JSON, or `bytes`)")
        try:
            self.tokenizer = Tokenizer.from_str(json) if json is not None else Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises its own (Rust) exception types
            raise UserError(f"data.tokenizer={path or 'the checkpoint'}: not a tokenizers JSON file ({e}): give the "
                            "tokenizer.json a `tokenizers` BPE saved, or data.tokenizer=bytes") from None
        self.vocab_size = self.tokenizer.get_vocab_size() + 1

    def encode(self, text: str) -> list[int]:
        return [i + 1 for i in self.tokenizer.encode(text).ids]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) - 1 for i in ids if int(i) != PAD])

    def spec(self) -> dict:
        return {"bpe": self.tokenizer.to_str()}


def from_spec(spec: dict):
    if "words" in spec:
        return WordTokenizer(spec["words"])
    if "bpe" in spec:
        return BPETokenizer(json=spec["bpe"])
    return ByteTokenizer()


def tokenize(tokenizer, captions: list[str], length: int, truncate: bool) -> Tensor:
    """captions -> [batch, length] ids, padded with 0; a longer caption is cut when `truncate`,
    an error naming it otherwise."""
    out = torch.full((len(captions), length), PAD, dtype=torch.long)
    for row, caption in enumerate(captions):
        ids = tokenizer.encode(caption)
        if len(ids) > length:
            if not truncate:
                raise UserError(f"the caption {caption[:60]!r} is {len(ids)} tokens, longer than "
                                f"data.text_seq_len={length}: set data.truncate_captions=true or a longer text_seq_len")
            ids = ids[:length]
        out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out
