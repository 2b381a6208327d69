"""The shared backbone: every attention variant plugs into the same decoder-only transformer.

An attention is any module built by a zero-argument factory with

    forward(x [batch, seq, dim], cache: dict | None) -> [batch, seq, dim]

`cache` is the layer's own dict for incremental decoding: the attention stores whatever it needs
in it (keys, values, the position reached) and must return, for the new tokens, exactly what the
parallel forward pass returns at their positions. `truncate_cache(cache, length)` rolls the dict
back to its first `length` positions. An attention may expose `aux_loss` (a scalar
tensor set during forward), which the backbone sums into `TransformerLM.aux_loss()`.
"""

from typing import Callable, Optional

import torch
from torch import Tensor, nn

AttentionFactory = Callable[[], nn.Module]


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: float = 4.0, dropout: float = 0.0):
        super().__init__()
        hidden = int(dim * mult)
        self.net = nn.Sequential(
            nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, dim)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ff(norm(x))."""

    def __init__(self, dim: int, attention: nn.Module, ff: nn.Module):
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim)
        self.attn = attention
        self.ff_norm = nn.RMSNorm(dim)
        self.ff = ff

    def forward(self, x: Tensor, cache: Optional[dict] = None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cache=cache)
        return x + self.ff(self.ff_norm(x))


class TransformerLM(nn.Module):
    """Token embedding -> `depth` blocks -> norm -> logits. Positions come from the attention
    (rotary), so the backbone has no position table.

    forward(tokens [batch, seq]) -> logits [batch, seq, num_tokens]
    """

    def __init__(
        self,
        *,
        num_tokens: int,
        dim: int,
        depth: int,
        attention: AttentionFactory,
        ff_mult: float = 4.0,
        ff_dropout: float = 0.0,
    ):
        super().__init__()
        self.num_tokens = num_tokens
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.blocks = nn.ModuleList(
            Block(dim, attention(), FeedForward(dim, ff_mult, ff_dropout)) for _ in range(depth)
        )
        self.norm = nn.RMSNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens, bias=False)
        self.apply(_init_weights)

    def forward(self, tokens: Tensor, cache: Optional[list] = None) -> Tensor:
        x = self.token_emb(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x, cache=None if cache is None else cache[i])
        return self.to_logits(self.norm(x))

    def new_cache(self) -> list:
        """One empty dict per layer, filled by the attentions as decoding proceeds."""
        return [{} for _ in self.blocks]

    def truncate_cache(self, cache: list, length: int) -> None:
        """Forget every cached position from `length` on (speculative decoding's rollback)."""
        for block, layer_cache in zip(self.blocks, cache):
            block.attn.truncate_cache(layer_cache, length)

    def aux_loss(self) -> Tensor:
        """Sum of the auxiliary losses the attentions set in the last forward (0 if none)."""
        losses = [b.attn.aux_loss for b in self.blocks if getattr(b.attn, "aux_loss", None) is not None]
        return torch.stack(losses).sum() if losses else self.to_logits.weight.new_zeros(())


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
