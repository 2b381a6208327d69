"""Language-model builders: the backbone with one attention variant each.

Each builder takes the flat keyword arguments of its config (conf/model/<name>.yaml), so every
knob is `model.<knob>` on the command line, and passes the attention's own knobs to its factory.
"""

from functools import partial

from models.attention.dense import DenseAttention
from models.attention.nsa import NativeSparseAttention
from models.transformer import TransformerLM


def transformer_lm(
    *,
    num_tokens: int,
    dim: int,
    depth: int,
    heads: int,
    dim_head: int,
    max_seq_len: int,
    ff_mult: float = 4.0,
    attn_dropout: float = 0.0,
    ff_dropout: float = 0.0,
) -> TransformerLM:
    attention = partial(DenseAttention, dim=dim, heads=heads, dim_head=dim_head, dropout=attn_dropout)
    return TransformerLM(
        num_tokens=num_tokens,
        dim=dim,
        depth=depth,
        attention=attention,
        max_seq_len=max_seq_len,
        ff_mult=ff_mult,
        ff_dropout=ff_dropout,
    )


def nsa_lm(
    *,
    num_tokens: int,
    dim: int,
    depth: int,
    heads: int,
    dim_head: int,
    max_seq_len: int,
    kv_heads: int,
    sliding_window_size: int,
    compress_block_size: int,
    compress_stride: int,
    fine_block_size: int,
    num_fine_selected: int,
    compress_hidden_mult: float = 1.0,
    kernel="auto",
    ff_mult: float = 4.0,
    attn_dropout: float = 0.0,
    ff_dropout: float = 0.0,
) -> TransformerLM:
    attention = partial(
        NativeSparseAttention,
        dim=dim,
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
    return TransformerLM(
        num_tokens=num_tokens,
        dim=dim,
        depth=depth,
        attention=attention,
        max_seq_len=max_seq_len,
        ff_mult=ff_mult,
        ff_dropout=ff_dropout,
    )
