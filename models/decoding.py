"""A decoding engine over static caches: every step has the same shapes, so it is compiled once
and, on CUDA, replayed as a CUDA graph (gpt-fast's recipe: a preallocated cache, the position on
the device, `reduce-overhead` compilation).

    engine = StaticDecoder(model.eval(), batch=1, capacity=prime + length + gamma + 1, compile="reduce-overhead")
    tokens = greedy(engine, prompt, length)                                  # plain greedy decoding
    tokens, stats = speculative_greedy(target_engine, draft_engine, prompt, length, gamma)

Each attention layer gets preallocated buffers of `capacity` positions from its
`static_cache(batch, capacity, dtype, device)` (models/attention/cache.py): a step writes its
tokens' keys at the device-side positions and attends over the whole capacity, the positions after
each query masked. Rolling back (speculative decoding's rejected tokens) moves the position; what
lies past it is masked until it is overwritten.

Two step shapes serve both decoders: one token (a plain or draft step) and gamma + 1 tokens (the
target's verification); the prompt is written by an uncompiled prefill of any length. Greedy
output equals the growing cache's (models/sampling.py `generate`, models/speculative.py) token for
token, up to the compiler's reordering of floating-point sums (tests check it in float64).
"""

from typing import Optional

import torch
from torch import Tensor, nn

from models.attention import cache as kv_cache
from models.speculative import SpeculativeStats, verify_greedy
from models.transformer import TransformerLM

COMPILE_MODES = (None, "default", "reduce-overhead")
# how a decoder runs (task.engine, --engine) -> the static engine's compile mode; "cache": no engine,
# the growing cache (models/sampling.py generate, models/speculative.py), eager and any temperature
ENGINES = {"cache": None, "static": None, "compiled": "default", "graphs": "reduce-overhead"}


def choose_engine(name: str, device: torch.device, temperature: float) -> str:
    """An engine of ENGINES for `name` (or "auto": CUDA graphs on CUDA for greedy decoding, the
    growing cache otherwise); ValueError, in one line, for one that cannot serve."""
    if name == "auto":
        return "graphs" if device.type == "cuda" and temperature == 0 else "cache"
    if name not in ENGINES:
        raise ValueError(f"engine={name} must be auto or one of {', '.join(ENGINES)}")
    if name != "cache" and temperature != 0:
        raise ValueError(f"engine={name} decodes greedily: set temperature 0, or engine cache to sample")
    if name == "graphs" and device.type != "cuda":
        raise ValueError("engine=graphs replays CUDA graphs: on the CPU use engine static, compiled or cache")
    return name


class StaticDecoder(nn.Module):
    """A language model with static caches for `batch` rows of up to `capacity` positions.

    forward(tokens [batch, t]) -> logits [batch, t, vocab] of the tokens at the next t positions,
    which it writes to the caches (uncompiled: any t, the prefill); `step(tokens)` is the same
    through the compiled step (compile: None, "default", or "reduce-overhead": CUDA graphs, CUDA
    only). Under CUDA graphs the logits a step returns live in the graph's memory until the next
    step: read them first."""

    def __init__(self, model: TransformerLM, batch: int, capacity: int, compile: Optional[str] = None):
        super().__init__()
        if type(model).embed is not TransformerLM.embed:
            raise ValueError(f"{type(model).__name__} embeds positions of its own: it decodes with the growing cache")
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile={compile!r} must be one of {COMPILE_MODES}")
        lacking = sorted({type(block.attn).__name__ for block in model.blocks if not hasattr(block.attn, "static_cache")})
        if lacking:
            raise ValueError(f"{', '.join(lacking)} has no static cache: decode it with the growing cache "
                             "(models/sampling.py generate, models/speculative.py)")
        weight = next(model.parameters())
        if compile == "reduce-overhead" and weight.device.type != "cuda":
            raise ValueError("compile='reduce-overhead' replays CUDA graphs: it needs the model on CUDA "
                             "(on the CPU use compile='default' or None)")
        self.model, self.batch, self.capacity, self.mode = model, batch, capacity, compile
        self.layers = nn.ModuleList(_LayerCache(block.attn.static_cache(batch, capacity, weight.dtype, weight.device))
                                    for block in model.blocks)
        self.register_buffer("pos", torch.zeros((), dtype=torch.long, device=weight.device), persistent=False)
        if compile == "reduce-overhead":  # graphs write into these in place, never into copies of them
            for t in self.buffers():
                torch._dynamo.mark_static_address(t, guard=False)  # no guard: engines of one shape share graphs
        self.length = 0  # the host's copy of pos: capacity is checked without reading the device
        # static shapes, one graph per step length; the whole step in one graph (no break splits it)
        self._step = torch.compile(self.forward, mode=compile, dynamic=False, fullgraph=True) if compile else self.forward

    def forward(self, tokens: Tensor) -> Tensor:
        positions = self.pos + torch.arange(tokens.shape[1], device=tokens.device)
        logits = self.model(tokens, cache=[layer.at(positions) for layer in self.layers])
        self.pos.add_(tokens.shape[1])
        return logits

    @torch.no_grad()  # decoding only: the caches never join an autograd graph
    def prefill(self, tokens: Tensor) -> Tensor:
        """Write tokens [batch, n] (any n) from the current position, uncompiled -> logits [batch, n, vocab]."""
        self._advance(tokens.shape[1])
        return self.forward(tokens)

    @torch.no_grad()  # decoding only: the caches never join an autograd graph
    def step(self, tokens: Tensor) -> Tensor:
        """One compiled step of tokens [batch, t] -> logits [batch, t, vocab]."""
        self._advance(tokens.shape[1])
        if self.mode == "reduce-overhead":  # the previous replay's outputs have been read
            torch.compiler.cudagraph_mark_step_begin()
        # contiguous strides whatever the tokens are a view of: the compiled step guards on them
        return self._step(tokens.clone(memory_format=torch.contiguous_format))

    @torch.no_grad()  # decoding only: the caches never join an autograd graph
    def warm_up(self, *lengths: int) -> None:
        """Compile (and on CUDA record) the steps of these lengths, outside any timing; the cache is
        left empty."""
        for t in lengths:
            for _ in range(3):  # CUDA graph trees record on a step's second call and replay from the third
                self.rollback(0)
                self.step(torch.zeros(self.batch, t, dtype=torch.long, device=self.pos.device))
        self.rollback(0)

    def rollback(self, length: int) -> None:
        """Forget every position from `length` on (0: a new sequence)."""
        self.length = min(self.length, length)
        self.pos.fill_(self.length)

    def _advance(self, t: int) -> None:
        if self.length + t > self.capacity:
            raise ValueError(f"decoding {t} more tokens after {self.length} overflows the cache's capacity of "
                             f"{self.capacity} positions: build the engine with a larger capacity")
        self.length += t


class _LayerCache(nn.Module):
    """One layer's static buffers, registered so that the compiler and CUDA graphs see fixed addresses."""

    def __init__(self, buffers: dict[str, Tensor]):
        super().__init__()
        self.names = tuple(buffers)
        for name, t in buffers.items():
            self.register_buffer(name, t, persistent=False)

    def at(self, positions: Tensor) -> dict:
        """The cache the attention reads: its buffers and the step's positions [t]."""
        return {**{name: getattr(self, name) for name in self.names}, kv_cache.POSITIONS: positions}


@torch.no_grad()
def greedy(engine: StaticDecoder, prompt: Tensor, length: int) -> Tensor:
    """Greedy decoding of `length` tokens after prompt [batch, prime] -> [batch, length]: the prompt
    but its last token prefilled, then one compiled step per token, the tokens kept on the device
    (no host sync per token)."""
    engine.rollback(0)
    engine.prefill(prompt[:, :-1])
    token, out = prompt[:, -1:], []
    for _ in range(length):
        token = engine.step(token)[:, -1:].argmax(-1)
        out.append(token)
    return torch.cat(out, dim=1)


@torch.no_grad()
def speculative_greedy(target: StaticDecoder, draft: StaticDecoder, prompt: Tensor, length: int,
                       gamma: int) -> tuple[Tensor, SpeculativeStats]:
    """Greedy speculative decoding of `length` tokens after prompt [1, prime] -> ([1, length], stats):
    each round the draft proposes gamma tokens in one-token steps, the target verifies them in one
    step of gamma + 1 tokens (the last committed token, then the drafts) and keeps the drafts it
    agrees with and its own next token; both caches roll back to what was kept. The output is the
    target's greedy decoding. One host sync per round (how many drafts were accepted)."""
    if prompt.shape[0] != 1:
        raise ValueError(f"speculative decoding here takes one row at a time, not {prompt.shape[0]}")
    if gamma < 1:
        raise ValueError(f"gamma={gamma} must be at least 1")
    stats = SpeculativeStats()
    for engine in (target, draft):
        engine.rollback(0)
        engine.prefill(prompt[:, :-1])
    committed = prompt.shape[1]  # tokens in the sequence; the last one neither model has seen
    pending = [prompt[:, -1:]]  # tokens the draft has still to see, the newest last
    out = []
    while len(out) < length:
        for token in pending[:-1]:  # after a round that kept every draft: the last draft, unseen
            draft.step(token)
        token, drafted = pending[-1], []
        for _ in range(gamma):
            token = draft.step(token)[:, -1:].argmax(-1)
            drafted.append(token)
        proposal = torch.cat([pending[-1], *drafted], dim=1)  # [1, gamma + 1]
        predicted = target.step(proposal).argmax(-1)  # the target's token after each
        accepted, new_token = verify_greedy(predicted, proposal[:, 1:])  # the round's one host sync
        stats.accepted.append(accepted)
        out += [*drafted[:accepted], new_token]
        # the target has seen the last committed token and the accepted drafts; the draft, every draft but the last
        target.rollback(committed + accepted)
        draft.rollback(min(committed + accepted, committed + gamma - 1))
        pending = [drafted[-1], new_token] if accepted == gamma else [new_token]
        committed += accepted + 1
    return torch.cat(out[:length], dim=1), stats
