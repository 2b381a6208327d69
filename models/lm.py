"""Language-model builders: the backbone with one attention variant each.

Each builder takes the flat keyword arguments of its config (conf/model/<name>.yaml), so every
knob is `model.<knob>` on the command line. The attention's own knobs go to its factory; the rest
(`num_tokens`, `dim`, `depth`, `ff_mult`, `ff_dropout`) go to the backbone unchanged.
"""

from functools import partial

from models.attention.dense import DenseAttention
from models.attention.nsa import NativeSparseAttention
from models.transformer import TransformerLM


def transformer_lm(*, heads: int, dim_head: int, attn_dropout: float = 0.0, **backbone) -> TransformerLM:
    attention = partial(DenseAttention, dim=backbone["dim"], heads=heads, dim_head=dim_head, dropout=attn_dropout)
    return TransformerLM(attention=attention, **backbone)


def nsa_lm(
    *,
    heads: int,
    dim_head: int,
    kv_heads: int,
    sliding_window_size: int,
    compress_block_size: int,
    compress_stride: int,
    fine_block_size: int,
    num_fine_selected: int,
    compress_hidden_mult: float = 1.0,
    kernel="auto",
    attn_dropout: float = 0.0,
    **backbone,
) -> TransformerLM:
    attention = partial(
        NativeSparseAttention,
        dim=backbone["dim"],
        heads=heads,
        dim_head=dim_head,
        kv_heads=kv_heads,
        sliding_window_size=sliding_window_size,
        compress_block_size=compress_block_size,
        compress_stride=compress_stride,
        fine_block_size=fine_block_size,
        num_fine_selected=num_fine_selected,
        compress_hidden_mult=compress_hidden_mult,
        dropout=attn_dropout,
        kernel=getattr(kernel, "value", kernel),
    )
    return TransformerLM(attention=attention, **backbone)
