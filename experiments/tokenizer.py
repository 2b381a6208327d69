"""Caption tokenizers for text-to-image data: id 0 pads, every other id is a word or a byte.

    encode(text) -> list[int]      decode(ids) -> str      vocab_size (padding included)

`tokenize(tokenizer, captions, length, truncate)` makes the [batch, length] tensor the model reads.
"""

import re

import torch
from torch import Tensor

from experiments.errors import UserError

PAD = 0


class ByteTokenizer:
    """UTF-8 bytes shifted by one (0 pads): any text, 257 ids."""

    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(int(i) - 1 for i in ids if int(i) != PAD).decode("utf-8", errors="replace")


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
