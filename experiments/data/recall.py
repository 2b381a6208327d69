"""Recall benchmarks, generated on the fly: what a sparse attention gives up is finding distant tokens.

MQAR (multi-query associative recall, Arora et al. 2023, "Zoology"): key-value pairs, then queries
of those keys at power-law distances; after each queried key the model must give its value.

    k1 v1 k2 v2 ... kN vN | 0 0 k2 v2 0 k1 v1 0 0 0 ... kN vN 0 ...
                            targets: v2 after k2, v1 after k1, ...; every other position is ignored

With `max_pairs_offset` > 0 the pairs start at a token drawn in [0, max_pairs_offset] of each item,
after filler, so that no fixed position (NSA's initial block, say) holds them: an attention must
find the queried pair by its content.

Keys come from the lower half of the vocabulary, values from the upper half; the rest is random tokens
(Zoology's `random_non_queries`) or 0.

Passkey retrieval (as the NSA paper checks it): a number hidden at a chosen depth of filler text (the
built-in corpus), asked for at the end; the model must give its digits.

Each item is `(inputs [batch, seq_len], targets [batch, seq_len], depth [batch])`: targets hold IGNORE
except at the answers, depth is the needle's depth bin (passkey) or 0. Batches are a pure function of
(seed, step, micro, rank), like every dataset here, so resume is exact. `needles(inputs, targets)`
says where in its own sequence each answer is to be found (what a sparse attention must reach).
"""

import copy
import hashlib
from typing import Iterator, Optional

import torch
from torch import Tensor

from experiments.data.draws import VAL_SEED, step_generator
from experiments.runtime.errors import UserError
from models.transformer import IGNORE

Batch = tuple[Tensor, Tensor, Tensor]


class RecallData:
    """What the recall task reads; subclasses draw `(tokens [b, seq_len + 1], answer mask, depth)`."""

    kind = "recall"  # what a task trains on (experiments/tasks/task.py check_parts)
    seq_len: int
    name: str
    vocab_size: int
    per_sequence = False  # accuracy per answer token (MQAR) or per sequence, every answer token right (passkey)
    depth_bins = 1

    def _draw(self, n: int, gen: torch.Generator, depths: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """n items -> (tokens [n, seq_len + 1], answer positions [n, seq_len + 1], depth bins [n]); `depths`
        in [0, 1) places the needles (None: drawn)."""
        raise NotImplementedError

    def needles(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """inputs, targets [b, n] of a batch -> [b, n]: at each answer, the position of the token the
        answer copies (MQAR: the queried pair's value; passkey: the digit in the needle), -1 elsewhere."""
        raise NotImplementedError

    def _batch(self, n: int, gen: torch.Generator, depths: Optional[Tensor] = None) -> Batch:
        tokens, answers, depth = self._draw(n, gen, depths)
        targets = tokens[:, 1:].masked_fill(~answers[:, 1:], IGNORE)
        return tokens[:, :-1], targets, depth

    @property
    def train_seq_lens(self) -> tuple[int, ...]:
        """Every length of training items."""
        return (self.seq_len,)

    def train_seq_len(self, step: int) -> int:
        """The length of this step's training items."""
        return self.seq_len

    def train_batch(self, batch_size: int, *, seed: int, step: int, micro: int = 0, rank: int = 0,
                    world_size: int = 1) -> Batch:
        """The global batch drawn once from its coordinates; each rank takes its own rows."""
        inputs, targets, depth = self._batch(batch_size * world_size, step_generator(seed, step, micro, 0))
        rows = slice(rank * batch_size, (rank + 1) * batch_size)
        return inputs[rows], targets[rows], depth[rows]

    def val_batches(self, num_batches: int, batch_size: int) -> Iterator[Batch]:
        """The same items in every run, the needles at the middle of each depth bin in turn."""
        gen = torch.Generator().manual_seed(VAL_SEED)
        for i in range(num_batches):
            index = torch.arange(i * batch_size, (i + 1) * batch_size) % self.depth_bins
            yield self._batch(batch_size, gen, depths=(index + 0.5) / self.depth_bins)

    @property
    def fingerprint(self) -> str:
        """Generated data: the knobs are the data set (a passkey's filler is the fixed built-in corpus)."""
        return f"{self.name}:{hashlib.sha256(self.name.encode()).hexdigest()[:16]}"


class MQAR(RecallData):
    """Zoology's multi-query associative recall. seq_len counts the model's inputs."""

    def __init__(self, vocab_size: int, seq_len: int, num_kv_pairs: int, power_a: float, random_non_queries: bool,
                 max_pairs_offset: int = 0):
        self.check_settings(vocab_size, seq_len, num_kv_pairs, power_a, random_non_queries, max_pairs_offset)
        n = num_kv_pairs
        self.vocab_size, self.seq_len, self.num_kv_pairs, self.power_a = vocab_size, seq_len, n, power_a
        self.random_non_queries, self.max_pairs_offset = random_non_queries, max_pairs_offset
        self.name = (f"mqar-v{vocab_size}-n{seq_len}-kv{n}-a{power_a}" + ("-r" if random_non_queries else "")
                     + (f"-o{max_pairs_offset}" if max_pairs_offset else ""))
        # query slots of two tokens after the pairs (as many as the latest pairs leave room for); slot i
        # (from the pairs on) drawn with weight i^(a - 1)
        self.slots = (seq_len + 1 - max_pairs_offset - 2 * n) // 2
        self.slot_weights = torch.arange(1, self.slots + 1, dtype=torch.float64) ** (power_a - 1)

    @staticmethod
    def check_settings(vocab_size: int, seq_len: int, num_kv_pairs: int, power_a: float, random_non_queries: bool,
                       max_pairs_offset: int = 0) -> None:
        """Refuse, in one line, settings that draw no item (the constructor's arguments; train.py's
        pre-check calls it before any directory is made)."""
        n = num_kv_pairs
        if n < 1:
            raise UserError(f"data.num_kv_pairs={n} must be at least 1")
        if max_pairs_offset < 0:
            raise UserError(f"data.max_pairs_offset={max_pairs_offset} must be 0 (the pairs first) or more")
        if 4 * n + max_pairs_offset > seq_len + 1:
            room = f" after data.max_pairs_offset={max_pairs_offset}" if max_pairs_offset else ""
            raise UserError(f"data.num_kv_pairs={n} pairs and their {n} queries take {4 * n} tokens, more than "
                            f"data.seq_len={seq_len} + 1 leaves{room}: raise data.seq_len to "
                            f"{4 * n + max_pairs_offset - 1}, or lower data.num_kv_pairs or data.max_pairs_offset")
        if vocab_size // 2 - 1 < n:
            raise UserError(f"data.vocab_size={vocab_size} has {max(vocab_size // 2 - 1, 0)} key ids (the lower half "
                            f"but 0), fewer than data.num_kv_pairs={n} distinct keys: raise data.vocab_size to "
                            f"{2 * n + 2} or more")
        if not power_a > 0:
            raise UserError(f"data.power_a={power_a} must be positive (Zoology: 0.01)")

    def _draw(self, b: int, gen: torch.Generator, depths: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        n, half = self.num_kv_pairs, self.vocab_size // 2
        keys = torch.rand(b, half - 1, generator=gen).argsort(-1)[:, :n] + 1  # distinct, in [1, half)
        values = torch.randint(half, self.vocab_size, (b, n), generator=gen)
        if self.random_non_queries:  # what the pairs and queries do not overwrite: any token
            tokens = torch.randint(0, self.vocab_size, (b, self.seq_len + 1), generator=gen)
        else:
            tokens = torch.zeros(b, self.seq_len + 1, dtype=torch.long)
        slots = torch.multinomial(self.slot_weights.expand(b, -1), n, replacement=False, generator=gen)
        which = torch.rand(b, n, generator=gen).argsort(-1)  # the pair each query asks for
        # where the pairs start: drawn last, so that Zoology's layout (offset 0) draws as it always has
        offset = (torch.randint(0, self.max_pairs_offset + 1, (b, 1), generator=gen) if self.max_pairs_offset
                  else torch.zeros(b, 1, dtype=torch.long))
        rows = torch.arange(b)[:, None]
        pairs = offset + torch.arange(0, 2 * n, 2)
        tokens[rows, pairs], tokens[rows, pairs + 1] = keys, values
        at = offset + 2 * n + 2 * slots  # where each query's key goes; its value follows
        tokens[rows, at] = keys.gather(1, which)
        tokens[rows, at + 1] = values.gather(1, which)
        answers = torch.zeros_like(tokens, dtype=torch.bool)
        answers[rows, at + 1] = True
        return tokens, answers, torch.zeros(b, dtype=torch.long)

    def needles(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """The value of the queried pair: the first place before the answer where its key is followed
        by the value it asks for (the pairs come before the queries, and a key is in one pair)."""
        seq = inputs.shape[1]
        following = torch.cat((inputs[:, 1:], inputs.new_full((inputs.shape[0], 1), -1)), dim=1)  # [b, seq]
        earlier = torch.ones(seq, seq, dtype=torch.bool, device=inputs.device).tril(-1)  # [answer, position]
        pair = (inputs[:, None, :] == inputs[:, :, None]) & (following[:, None, :] == targets[:, :, None]) & earlier
        found = pair.any(-1) & (targets != IGNORE)
        return torch.where(found, pair.int().argmax(-1) + 1, -1)


class Passkey(RecallData):
    """A number of `digits` digits hidden at a depth of built-in filler text, asked for at the end:

        <filler> The pass key is 48213. Remember it. 48213 is the pass key. <filler> ... What is the
        pass key? The pass key is 48213

    Training draws the depth uniformly; validation spreads its items evenly over `depth_bins` bins
    and val_accuracy is reported per bin too.

    Length curriculum: the first `curriculum_steps` training steps draw items of `curriculum_seq_len`
    tokens, seq_len / curriculum_seq_len times as many per batch (a step sees as many tokens either
    way). Copying a number back is learnt on short items, where the needle is never far; NSA then
    found it at 2,048 tokens too (experiment=passkey), where from scratch it had learnt nothing in
    2,000 steps. Validation is always at seq_len."""

    per_sequence = True
    vocab_size = 256
    _QUESTION = " What is the pass key? The pass key is "
    _STATED = " The pass key is "  # the needle's first words, the key right after them

    def __init__(self, seq_len: int, digits: int, depth_bins: int, curriculum_seq_len: int = 256,
                 curriculum_steps: int = 0):
        from experiments.data import corpus

        self.check_settings(seq_len, digits, depth_bins, curriculum_seq_len, curriculum_steps)
        self.filler = torch.from_numpy(corpus.snapshot())
        self.seq_len, self.digits, self.depth_bins = seq_len, digits, depth_bins
        self.curriculum_seq_len, self.curriculum_steps = curriculum_seq_len, curriculum_steps
        self.name = f"passkey-n{seq_len}-d{digits}-b{depth_bins}" + (f"-c{curriculum_seq_len}x{curriculum_steps}"
                                                                    if curriculum_steps else "")
        self._short = copy.copy(self)  # the curriculum's items: the same filler, shorter
        self._short.seq_len, self._short.curriculum_steps = curriculum_seq_len, 0

    @classmethod
    def check_settings(cls, seq_len: int, digits: int, depth_bins: int, curriculum_seq_len: int = 256,
                       curriculum_steps: int = 0) -> None:
        """Refuse, in one line, settings that draw no item (the constructor's arguments; train.py's
        pre-check calls it before any directory is made)."""
        if digits < 1:
            raise UserError(f"data.digits={digits} must be at least 1")
        if depth_bins < 1:
            raise UserError(f"data.depth_bins={depth_bins} must be at least 1")
        if curriculum_steps < 0:
            raise UserError(f"data.curriculum_steps={curriculum_steps} must be 0 (no curriculum) or more")
        cls._check_room("data.seq_len", seq_len, digits)
        if curriculum_steps:
            cls._check_room("data.curriculum_seq_len", curriculum_seq_len, digits)
            if seq_len % curriculum_seq_len:
                raise UserError(f"data.curriculum_seq_len={curriculum_seq_len} must divide data.seq_len={seq_len}, "
                                "so that a short batch holds as many tokens as a full one: use a divisor of "
                                "data.seq_len, or data.curriculum_steps=0 for no curriculum")

    @classmethod
    def _check_room(cls, key: str, length: int, digits: int) -> None:
        needle = len(cls._needle("0" * digits))
        question = len(cls._QUESTION) + digits
        if length + 1 < needle + question + 16:
            raise UserError(f"{key}={length} leaves no room for filler around the {needle}-byte needle and "
                            f"the {question}-byte question: raise {key} to {needle + question + 16} or more")

    @property
    def train_seq_lens(self) -> tuple[int, ...]:
        return (self.curriculum_seq_len, self.seq_len) if self.curriculum_steps else (self.seq_len,)

    def train_seq_len(self, step: int) -> int:
        return self.curriculum_seq_len if step < self.curriculum_steps else self.seq_len

    def train_batch(self, batch_size: int, *, seed: int, step: int, micro: int = 0, rank: int = 0,
                    world_size: int = 1) -> Batch:
        """A full-length batch, or during the curriculum seq_len / curriculum_seq_len times as many
        short items per rank."""
        if self.train_seq_len(step) == self.seq_len:
            return super().train_batch(batch_size, seed=seed, step=step, micro=micro, rank=rank, world_size=world_size)
        return self._short.train_batch(batch_size * (self.seq_len // self.curriculum_seq_len), seed=seed, step=step,
                                       micro=micro, rank=rank, world_size=world_size)

    @staticmethod
    def _needle(key: str) -> str:
        return f"{Passkey._STATED}{key}. Remember it. {key} is the pass key. "

    def _draw(self, b: int, gen: torch.Generator, depths: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        total = self.seq_len + 1
        tokens = torch.zeros(b, total, dtype=torch.long)
        answers = torch.zeros_like(tokens, dtype=torch.bool)
        if depths is None:
            depths = torch.rand(b, generator=gen)
        starts = torch.randint(0, len(self.filler) - total, (b,), generator=gen)
        keys = torch.randint(0, 10, (b, self.digits), generator=gen)
        for i in range(b):
            key = "".join(map(str, keys[i].tolist()))
            needle, question = self._needle(key).encode(), (self._QUESTION + key).encode()
            room = total - len(needle) - len(question)
            at = int(depths[i] * room)
            filler = self.filler[starts[i] : starts[i] + room].long()
            row = torch.cat([filler[:at], torch.tensor(list(needle)), filler[at:], torch.tensor(list(question))])
            tokens[i] = row
            answers[i, total - self.digits :] = True
        bins = (depths * self.depth_bins).long().clamp(max=self.depth_bins - 1)
        return tokens, answers, bins

    def needles(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """The i-th answer digit is found at the i-th digit of the needle's first statement of the key."""
        found = torch.full_like(inputs, -1)
        marker = self._STATED.encode()
        for row, (x, y) in enumerate(zip(inputs, targets)):
            answers = (y != IGNORE).nonzero()[:, 0]
            at = bytes(x.clamp(0, 255).tolist()).find(marker)
            if at >= 0 and len(answers):
                found[row, answers] = at + len(marker) + torch.arange(len(answers), device=inputs.device)
        return found

    @staticmethod
    def decode(tokens) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")
