"""The shared backbone: every attention variant plugs into the same decoder-only transformer.

An attention is any module built by a zero-argument factory with

    forward(x [batch, seq, dim], cache: dict | None) -> [batch, seq, dim]

`cache` is the layer's own dict for incremental decoding: the attention stores whatever it needs
in it (keys, values, the position reached) and must return, for the new tokens, exactly what the
parallel forward pass returns at their positions. `truncate_cache(cache, length)` rolls the dict
back to its first `length` positions. An attention may expose `aux_loss` (a scalar
tensor set during forward), which the backbone sums into `TransformerLM.aux_loss()`, and
`after_optimizer_step()` (state updated once per optimizer step, such as routing's centroids),
which the task calls through `TransformerLM.after_optimizer_step()`.
"""

from contextlib import nullcontext
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from models.recompute import RecomputedLayers, recomputation_pays
from models.reversible import reversible_stack

IGNORE = -100  # a target the training losses skip (cross_entropy's ignore_index)

AttentionFactory = Callable[[], nn.Module]


def trains_part_alone(model: nn.Module) -> bool:
    """Whether this training step trains a part of the model alone, the rest frozen: a module says
    so through `freezes_model` (DSA's indexer warm-up). The distributed backends read it too."""
    return any(getattr(m, "freezes_model", False) for m in model.modules())


def parameters_trained_alone(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that such steps train (a module's `part_trained_alone`: DSA's indexer where its
    warm-up freezes the rest); empty where no step trains a part alone."""
    parts = [getattr(m, "part_trained_alone", None) for m in model.modules()]
    return [p for part in parts if part is not None for p in part.parameters()]


class FeedForward(nn.Module):
    """Linear -> GELU -> Linear, applied to `chunks` slices of the sequence one after another:
    the hidden activation [batch, seq / chunks, hidden] is what peaks, so chunking bounds the
    memory of the forward pass (and of a reversible block's recomputation)."""

    def __init__(self, dim: int, mult: float = 4.0, dropout: float = 0.0, chunks: int = 1):
        super().__init__()
        hidden = int(dim * mult)
        self.chunks = chunks
        self.net = nn.Sequential(
            nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, dim)
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.chunks == 1 or x.shape[1] < 2:
            return self.net(x)
        return torch.cat([self.net(part) for part in x.chunk(self.chunks, dim=1)], dim=1)


class Block(nn.Module):
    """Pre-norm residual block with two branches, attend(x) = attn(norm(x)) and
    feed(x) = ff(norm(x)): x + attend(x), then x + feed(x) (or their reversible coupling).

    In training each norm's output is recomputed in the backward from its input, which the norm
    keeps for its own backward anyway, instead of being kept for the projections that read it
    (models/recompute.py): a block keeps two [batch, seq, dim] fewer, for one LayerNorm each.

    LayerNorm, not RMSNorm: LayerNorm is one fused kernel on every device, while RMSNorm runs as
    separate element-wise kernels on the CPU (5x slower forward + backward at [4, 1024, 256])."""

    def __init__(self, dim: int, attention: nn.Module, ff: nn.Module):
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = attention
        self.ff_norm = nn.LayerNorm(dim)
        self.ff = ff

    def attend(self, x: Tensor, cache: Optional[dict] = None) -> Tensor:
        with RecomputedLayers(enabled=cache is None and recomputation_pays()) as layers:
            return self.attn(layers.apply(self.attn_norm, x), cache=cache)

    def feed(self, x: Tensor) -> Tensor:
        with RecomputedLayers(enabled=recomputation_pays()) as layers:
            return self.ff(layers.apply(self.ff_norm, x))

    def attn_params(self) -> list[nn.Parameter]:
        return [*self.attn_norm.parameters(), *self.attn.parameters()]

    def ff_params(self) -> list[nn.Parameter]:
        return [*self.ff_norm.parameters(), *self.ff.parameters()]

    def forward(self, x: Tensor, cache: Optional[dict] = None) -> Tensor:
        x = x + self.attend(x, cache)
        return x + self.feed(x)

    def forward_reversible(self, x1: Tensor, x2: Tensor, cache: Optional[dict] = None) -> tuple[Tensor, Tensor]:
        """(x1, x2) -> (x1 + attend(x2), x2 + feed(y1)): the coupling models.reversible inverts."""
        y1 = x1 + self.attend(x2, cache)
        return y1, x2 + self.feed(y1)


class TransformerLM(nn.Module):
    """Token embedding -> `depth` blocks -> norm -> logits. Positions come from the attention
    (rotary), so the backbone has no position table.

    emb_dim: a factorised embedding (ALBERT): tokens are embedded in emb_dim and projected to
    dim, and logits come back through emb_dim. reversible: the blocks couple two halves of the
    residual stream (models.reversible), so training keeps no per-block activations; the halves
    start equal and their mean is the output.

    forward(tokens [batch, seq]) -> logits [batch, seq, num_tokens]
    forward(tokens, at=mask [batch, seq] bool) -> logits [mask.sum(), num_tokens] at those positions
        alone (a loss that reads a few positions skips the output layer everywhere else)
    """

    def __init__(
        self,
        *,
        num_tokens: int,
        dim: int,
        depth: int,
        attention: AttentionFactory,
        feed_forward: Optional[Callable[[], nn.Module]] = None,
        ff_mult: float = 4.0,
        ff_dropout: float = 0.0,
        ff_chunks: int = 1,
        emb_dim: Optional[int] = None,
        reversible: bool = False,
    ):
        super().__init__()
        if ff_chunks < 1:
            raise ValueError(f"ff_chunks must be >= 1, got {ff_chunks}")
        if emb_dim is not None and emb_dim < 1:
            raise ValueError(f"emb_dim must be >= 1 (or null: no factorisation), got {emb_dim}")
        self.num_tokens = num_tokens
        self.reversible = reversible
        emb_dim = emb_dim or dim
        self.token_emb = nn.Embedding(num_tokens, emb_dim)
        self.project_in = nn.Linear(emb_dim, dim, bias=False) if emb_dim != dim else nn.Identity()
        feed_forward = feed_forward or (lambda: FeedForward(dim, ff_mult, ff_dropout, ff_chunks))
        self.blocks = nn.ModuleList(Block(dim, attention(), feed_forward()) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.project_out = nn.Linear(dim, emb_dim, bias=False) if emb_dim != dim else nn.Identity()
        self.to_logits = nn.Linear(emb_dim, num_tokens, bias=False)
        self._stack_aux: Optional[Tensor] = None  # the reversible stack's auxiliary loss
        self.apply(_init_weights)

    def forward(self, tokens: Tensor, cache: Optional[list] = None, at: Optional[Tensor] = None) -> Tensor:
        # an attention that trains a part of its own alone this step (DSA's indexer warm-up) freezes the
        # rest: no gradient reaches any other parameter, and the backward costs only that part's
        frozen = self.training and trains_part_alone(self)
        with torch.no_grad() if frozen else nullcontext():
            features = self.hidden(tokens, cache)
            return self.to_logits(features if at is None else features[at])

    def embed(self, tokens: Tensor, start: int) -> Tensor:
        """tokens [batch, seq] at positions start.. -> [batch, seq, dim] (positions: the attention's)."""
        return self.project_in(self.token_emb(tokens))

    def hidden(self, tokens: Tensor, cache: Optional[list] = None) -> Tensor:
        """tokens [batch, seq] -> the final features [batch, seq, emb_dim] that the logits read."""
        x = self.embed(tokens, cache[0].get("pos", 0) if cache else 0)
        caches = cache or [None] * len(self.blocks)
        self._stack_aux = None
        if not self.reversible:
            for block, layer_cache in zip(self.blocks, caches):
                x = block(x, cache=layer_cache)
        elif torch.is_grad_enabled() and cache is None:  # training: recompute instead of storing
            x1, x2, self._stack_aux = reversible_stack(x, x, self.blocks)
            x = (x1 + x2) / 2
        else:  # inference keeps nothing for a backward pass anyway
            x1 = x2 = x
            for block, layer_cache in zip(self.blocks, caches):
                x1, x2 = block.forward_reversible(x1, x2, cache=layer_cache)
            x = (x1 + x2) / 2
        return self.project_out(self.norm(x))

    def new_cache(self) -> list:
        """One empty dict per layer, filled by the attentions as decoding proceeds."""
        return [{} for _ in self.blocks]

    def truncate_cache(self, cache: list, length: int) -> None:
        """Forget every cached position from `length` on (speculative decoding's rollback)."""
        for block, layer_cache in zip(self.blocks, cache):
            block.attn.truncate_cache(layer_cache, length)

    def aux_loss(self) -> Tensor:
        """Sum of the auxiliary losses the attentions set in the last forward (0 if none)."""
        if self._stack_aux is not None:
            return self._stack_aux
        losses = [b.attn.aux_loss for b in self.blocks if getattr(b.attn, "aux_loss", None) is not None]
        return torch.stack(losses).sum() if losses else self.to_logits.weight.new_zeros(())

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Let the attentions update their per-step state (routing's k-means centroids)."""
        for block in self.blocks:
            if hasattr(block.attn, "after_optimizer_step"):
                block.attn.after_optimizer_step()


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
