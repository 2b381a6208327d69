"""DALL-E (Ramesh et al. 2021): one causal transformer over text tokens followed by image codes.

The sequence the backbone reads is [bos, text_1 .. text_T, code_1 .. code_{N-1}] (N = fmap**2
codes of a discrete VAE, row-major); position i predicts the token at i + 1, so the last T + N
outputs predict the caption and then the image. Text and image ids share one embedding table
(text ids first, image ids after them); each position adds a learned position embedding, 2-D for
the image (row + column). Text positions predict only text ids and image positions only image
ids, so the two heads are slices of one output matrix and no logit is spent on the other kind.

Attention types cycle over the layers: `full` (causal), `axial_row`, `axial_col` and
`conv_like` (an image code sees the caption and the earlier codes of its row, of its column, or
of a kernel_size x kernel_size window around it), or `nsa`, `sinkhorn`, `routing`: this
repository's sparse attentions over the whole sequence, with their knobs in `sparse_options`.
Layers with the same id in `shared_attn_ids` / `shared_ff_ids` share one module. `shift_tokens`
mixes the previous position's and (for image codes) the above code's channels into each
attention's input.

forward(tokens [batch, seq], cache=None) -> logits [batch, seq, num_text_tokens + num_image_tokens]
    (the other modality's logits are -inf);
forward(tokens, targets=[batch, seq]) -> (loss, text_loss, image_loss) for training.
"""

import math
from itertools import cycle
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.attention import cache as kv_cache
from models.attention.dense import DenseAttention
from models.attention.nsa import NativeSparseAttention
from models.attention.routing import RoutingAttention
from models.attention.sinkhorn import SinkhornAttention
from models.sampling import decoding_linears, sample
from models.transformer import IGNORE, FeedForward, TransformerLM

PAD = 0  # the text padding id, also the sequence's first (bos) token
MASKED_TYPES = ("full", "axial_row", "axial_col", "conv_like")
SPARSE_TYPES = {"nsa": NativeSparseAttention, "sinkhorn": SinkhornAttention, "routing": RoutingAttention}


class ShiftTokens(nn.Module):
    """Token shift before an attention: a quarter of each position's channels come from the
    position before it and, for an image code, another quarter from the code one row above
    (zeros where there is none). Only earlier positions are read, so causality holds; decoding
    keeps the layer inputs in the cache for the shifts to read. x: [batch, seq, dim]."""

    def __init__(self, attention: nn.Module, text_len: int, fmap: int):
        super().__init__()
        self.attention, self.text_len, self.fmap = attention, text_len, fmap

    def forward(self, x: Tensor, cache: Optional[dict] = None) -> Tensor:
        start = 0 if cache is None else cache.get("pos", 0)
        seen = x if cache is None else kv_cache.append(cache.setdefault("shift", {}), start, x=x)[0]
        n, q = x.shape[1], x.shape[-1] // 4
        pos = torch.arange(start, start + n, device=x.device)
        prev = _gather(seen, pos - 1, pos >= 1)
        # input position text_len + 1 + j holds code j; the code above it, j - fmap, sits fmap earlier
        above = _gather(seen, pos - self.fmap, pos >= self.text_len + 1 + self.fmap)
        is_image = (pos > self.text_len)[None, :, None]
        second = torch.where(is_image, above[..., q : 2 * q], x[..., q : 2 * q])
        return self.attention(torch.cat([prev[..., :q], second, x[..., 2 * q :]], dim=-1), cache=cache)

    def truncate_cache(self, cache: dict, length: int) -> None:
        self.attention.truncate_cache(cache, length)
        kv_cache.truncate(cache.setdefault("shift", {}), length)

    @property
    def aux_loss(self):
        return getattr(self.attention, "aux_loss", None)

    def after_optimizer_step(self) -> None:
        if hasattr(self.attention, "after_optimizer_step"):
            self.attention.after_optimizer_step()


def _gather(x: Tensor, index: Tensor, valid: Tensor) -> Tensor:
    """x[:, index] where valid, zeros elsewhere -> [batch, len(index), dim]."""
    picked = x[:, index.clamp(min=0)]
    return picked * valid[None, :, None].to(x.dtype)


def attention_mask(kind: str, text_len: int, fmap: int, kernel_size: int = 5) -> Optional[Tensor]:
    """[T + N, T + N] bool for the input sequence [bos, text, codes[:-1]] (None for `full`).

    The query at position T + k predicts code k; the key at T + 1 + j holds code j. Every query
    sees the bos and the caption causally; a code's query sees code j < k when the pattern allows.
    """
    if kind == "full":
        return None
    n = text_len + fmap * fmap
    pos = torch.arange(n)
    mask = pos[None, :] <= pos[:, None]  # causal
    code = pos - text_len  # the code a query predicts
    held = pos - text_len - 1  # the code a key holds (negative: bos or text)
    q_row, q_col = code.div(fmap, rounding_mode="floor"), code % fmap
    k_row, k_col = held.div(fmap, rounding_mode="floor"), held % fmap
    if kind == "axial_row":
        allowed = q_row[:, None] == k_row[None, :]
    elif kind == "axial_col":
        allowed = q_col[:, None] == k_col[None, :]
    elif kind == "conv_like":
        r = kernel_size // 2
        allowed = ((q_row[:, None] - k_row[None, :]).abs() <= r) & ((q_col[:, None] - k_col[None, :]).abs() <= r)
    else:
        raise ValueError(f"unknown attention type {kind!r}")
    image_pair = (code[:, None] >= 0) & (held[None, :] >= 0)
    return mask & (~image_pair | allowed)


class DALLE(TransformerLM):
    def __init__(
        self,
        *,
        num_text_tokens: int,
        text_seq_len: int,
        num_image_tokens: int,
        image_fmap_size: int,
        dim: int = 256,
        depth: int = 4,
        heads: int = 4,
        dim_head: int = 64,
        ff_mult: float = 4.0,
        attn_dropout: float = 0.0,
        ff_dropout: float = 0.0,
        attn_types: Sequence[str] = ("full",),
        kernel_size: int = 5,
        sparse_options: Optional[dict] = None,
        shared_attn_ids: Optional[Sequence] = None,
        shared_ff_ids: Optional[Sequence] = None,
        share_input_output_emb: bool = False,
        rotary_emb: bool = True,
        shift_tokens: bool = False,
        loss_img_weight: float = 7.0,
        cond_drop_prob: float = 0.0,
        reversible: bool = False,
    ):
        attn_types = [attn_types] if isinstance(attn_types, str) else list(attn_types)
        unknown = [t for t in attn_types if t not in MASKED_TYPES and t not in SPARSE_TYPES]
        if unknown:
            raise ValueError(f"attn_types: unknown {unknown}; choose from {[*MASKED_TYPES, *SPARSE_TYPES]}")
        if not 0 <= cond_drop_prob < 1:
            raise ValueError(f"cond_drop_prob={cond_drop_prob} must lie in [0, 1)")
        self.text_seq_len, self.num_text_tokens = text_seq_len, num_text_tokens
        self.num_image_tokens, self.image_fmap_size = num_image_tokens, image_fmap_size
        self.image_seq_len = image_fmap_size**2
        self.seq_len = text_seq_len + self.image_seq_len
        self.loss_img_weight, self.cond_drop_prob = loss_img_weight, cond_drop_prob
        types = [t for t, _ in zip(cycle(attn_types), range(depth))]
        sparse_options = dict(sparse_options or {})
        masks = {t: attention_mask(t, text_seq_len, image_fmap_size, kernel_size) for t in set(types) & set(MASKED_TYPES)}

        def make_attention(kind: str) -> nn.Module:
            if kind in MASKED_TYPES:
                attention = DenseAttention(dim=dim, heads=heads, dim_head=dim_head, dropout=attn_dropout,
                                           mask=masks[kind], rotary=rotary_emb)
            else:
                options = dict(sparse_options.get(kind) or {})
                attention = SPARSE_TYPES[kind](dim=dim, heads=heads, dim_head=dim_head, dropout=attn_dropout, **options)
            return ShiftTokens(attention, text_seq_len, image_fmap_size) if shift_tokens else attention

        attention = _shared(shared_attn_ids, depth, "shared_attn_ids", make_attention, types)
        feed_forward = _shared(shared_ff_ids, depth, "shared_ff_ids",
                               lambda _: FeedForward(dim, ff_mult, ff_dropout), ["ff"] * depth)
        super().__init__(num_tokens=num_text_tokens + num_image_tokens, dim=dim, depth=depth,
                         attention=attention, feed_forward=feed_forward, reversible=reversible)
        self.attn_types = types
        self.text_pos = nn.Embedding(text_seq_len + 1, dim)  # bos and the caption
        self.row_pos = nn.Embedding(image_fmap_size, dim)
        self.col_pos = nn.Embedding(image_fmap_size, dim)
        for emb in (self.text_pos, self.row_pos, self.col_pos):
            nn.init.normal_(emb.weight, std=0.02)
        if share_input_output_emb:
            self.to_logits.weight = self.token_emb.weight

    # ---- sequences ---------------------------------------------------------------------------

    def sequence(self, text: Tensor, codes: Tensor) -> tuple[Tensor, Tensor]:
        """text [b, T] (0 pads), codes [b, N] -> (input tokens [b, T + N], targets [b, T + N]).

        Text targets after the first padding are ignored: the first pad ends the caption, the rest
        carry nothing to learn."""
        image_ids = codes + self.num_text_tokens
        tokens = torch.cat([torch.full_like(text[:, :1], PAD), text, image_ids[:, :-1]], dim=1)
        padding = text == PAD
        after_end = padding & F.pad(padding[:, :-1], (1, 0), value=False)
        text_targets = text.masked_fill(after_end, IGNORE)
        return tokens, torch.cat([text_targets, image_ids], dim=1)

    def embed(self, tokens: Tensor, start: int) -> Tensor:
        n = tokens.shape[1]
        image_pos = (self.row_pos.weight[:, None] + self.col_pos.weight[None, :]).flatten(0, 1)
        table = torch.cat([self.text_pos.weight, image_pos[: self.image_seq_len - 1]])
        if start + n > table.shape[0]:
            raise ValueError(f"positions up to {start + n} exceed the sequence of {table.shape[0]} (text + image - 1)")
        return self.token_emb(tokens) + table[start : start + n]

    # ---- forward -----------------------------------------------------------------------------

    def forward(self, tokens: Tensor, cache: Optional[list] = None, targets: Optional[Tensor] = None):
        start = cache[0].get("pos", 0) if cache else 0
        if targets is not None and self.training and self.cond_drop_prob > 0:
            tokens, targets = self._drop_captions(tokens, targets)
        h = self.hidden(tokens, cache)
        split = max(0, min(h.shape[1], self.text_seq_len - start))  # outputs before it predict text
        weight = self.to_logits.weight
        text_logits = F.linear(h[:, :split], weight[: self.num_text_tokens])
        image_logits = F.linear(h[:, split:], weight[self.num_text_tokens :])
        if targets is None:
            return torch.cat([F.pad(text_logits, (0, self.num_image_tokens), value=float("-inf")),
                              F.pad(image_logits, (self.num_text_tokens, 0), value=float("-inf"))], dim=1)
        text_targets, image_targets = targets[:, :split], targets[:, split:] - self.num_text_tokens
        text_loss = F.cross_entropy(text_logits.flatten(0, 1).float(), text_targets.flatten(), ignore_index=IGNORE)
        image_loss = F.cross_entropy(image_logits.flatten(0, 1).float(), image_targets.flatten())
        loss = (text_loss + self.loss_img_weight * image_loss) / (self.loss_img_weight + 1)
        return loss + self.aux_loss(), text_loss.detach(), image_loss.detach()

    def _drop_captions(self, tokens: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """Classifier-free guidance training: a row's caption becomes all padding with probability
        cond_drop_prob (its text is then not a target)."""
        drop = torch.rand(tokens.shape[0], 1, device=tokens.device) < self.cond_drop_prob
        text = slice(1, self.text_seq_len + 1)
        tokens = tokens.clone()
        tokens[:, text] = tokens[:, text].masked_fill(drop, PAD)
        targets = targets.clone()
        targets[:, : self.text_seq_len] = targets[:, : self.text_seq_len].masked_fill(drop, IGNORE)
        return tokens, targets

    # ---- generation --------------------------------------------------------------------------

    @torch.no_grad()
    def generate_codes(self, text: Tensor, *, temperature: float = 1.0, filter_thres: float = 0.9,
                       cond_scale: float = 1.0, generator: Optional[torch.Generator] = None) -> Tensor:
        """text [b, T] -> image codes [b, N], sampled with the cache. filter_thres keeps the top
        (1 - filter_thres) fraction of the image logits; cond_scale > 1 mixes in the logits of an
        empty caption (classifier-free guidance: null + scale * (cond - null))."""
        if text.shape[1] != self.text_seq_len:
            raise ValueError(f"text has {text.shape[1]} tokens; this model reads text_seq_len={self.text_seq_len}")
        b = text.shape[0]
        guided = cond_scale != 1.0
        if guided:
            text = torch.cat([text, torch.full_like(text, PAD)])
        top_k = max(1, math.ceil((1 - filter_thres) * self.num_image_tokens))
        cache = self.new_cache()
        tokens = torch.cat([torch.full_like(text[:, :1], PAD), text], dim=1)
        codes = []
        with decoding_linears(self):
            for i in range(self.image_seq_len):
                logits = self(tokens, cache=cache)[:, -1, self.num_text_tokens :].float()
                if guided:
                    cond, null = logits[:b], logits[b:]
                    logits = null + cond_scale * (cond - null)
                code = sample(logits, temperature, top_k, generator)
                codes.append(code)
                if i + 1 < self.image_seq_len:
                    tokens = (code + self.num_text_tokens)[:, None]
                    if guided:
                        tokens = tokens.repeat(2, 1)
        return torch.stack(codes, dim=1)


def _shared(ids: Optional[Sequence], depth: int, name: str, make, types: list[str]):
    """A factory called once per layer, in order, building make(type of the layer): layers with
    the same id get the same module (which must be of one type)."""
    if ids is None:
        layers = iter(types)
        return lambda: make(next(layers))
    ids = [i for i, _ in zip(cycle(list(ids)), range(depth))]
    built: dict = {}
    kinds: dict = {}
    layers = iter(zip(ids, types))

    def factory():
        layer_id, kind = next(layers)
        if layer_id in built:
            if kinds[layer_id] != kind:
                raise ValueError(f"{name}: layers with id {layer_id!r} have different types "
                                 f"({kinds[layer_id]} and {kind}); a shared layer needs one type")
            return built[layer_id]
        built[layer_id], kinds[layer_id] = make(kind), kind
        return built[layer_id]

    return factory
