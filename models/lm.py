"""Language-model builders: the backbone with one attention variant each.

Each builder takes the flat keyword arguments of its config (conf/model/<name>.yaml), so every
knob is `model.<knob>` on the command line. The attention's own knobs go to its factory; the rest
(`num_tokens`, `dim`, `depth`, `ff_mult`, `ff_dropout`, `ff_chunks`, `emb_dim`, `reversible`) go
to the backbone unchanged.
"""

from functools import partial

from models.attention.dense import DenseAttention
from models.attention.dsa import DeepSeekSparseAttention
from models.attention.moba import MixtureOfBlockAttention
from models.attention.nsa import BRANCH_NAMES, NativeSparseAttention
from models.attention.routing import RoutingAttention
from models.attention.sinkhorn import SinkhornAttention
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
    compressor="mlp",
    diff_topk: bool = False,
    branches=BRANCH_NAMES,
    gate_bias=(0.0, 0.0, 0.0),
    shared_kv: bool = False,
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
        compressor=getattr(compressor, "value", compressor),
        diff_topk=diff_topk,
        branches=tuple(getattr(b, "value", b) for b in branches),
        gate_bias=tuple(gate_bias),
        shared_kv=shared_kv,
        dropout=attn_dropout,
        kernel=getattr(kernel, "value", kernel),
    )
    return TransformerLM(attention=attention, **backbone)


def sinkhorn_lm(
    *,
    heads: int,
    dim_head: int,
    bucket_size: int,
    n_local_attn_heads,
    sinkhorn_iter: int = 5,
    temperature: float = 0.75,
    attn_dropout: float = 0.0,
    **backbone,
) -> TransformerLM:
    local_heads = _per_layer(n_local_attn_heads, backbone["depth"], "n_local_attn_heads")
    attention = lambda: SinkhornAttention(  # noqa: E731 (one call per layer, in order)
        dim=backbone["dim"], heads=heads, dim_head=dim_head, bucket_size=bucket_size,
        n_local_attn_heads=next(local_heads), sinkhorn_iter=sinkhorn_iter, temperature=temperature,
        dropout=attn_dropout,
    )
    return TransformerLM(attention=attention, **backbone)


def routing_lm(
    *,
    heads: int,
    dim_head: int,
    window_size: int,
    num_clusters: int,
    n_local_attn_heads,
    ema_decay: float,
    commitment_weight: float = 1e-4,
    attn_dropout: float = 0.0,
    **backbone,
) -> TransformerLM:
    local_heads = _per_layer(n_local_attn_heads, backbone["depth"], "n_local_attn_heads")
    attention = lambda: RoutingAttention(  # noqa: E731 (one call per layer, in order)
        dim=backbone["dim"], heads=heads, dim_head=dim_head, window_size=window_size,
        num_clusters=num_clusters, n_local_attn_heads=next(local_heads), ema_decay=ema_decay,
        commitment_weight=commitment_weight, dropout=attn_dropout,
    )
    return TransformerLM(attention=attention, **backbone)


def moba_lm(*, kernel="auto", attn_dropout: float = 0.0, **knobs) -> TransformerLM:
    """MoBA's knobs (heads, dim_head, kv_heads, block_size, top_k, include_own_block) beside the backbone's."""
    return _with_attention(MixtureOfBlockAttention, kernel, attn_dropout, knobs)


def dsa_lm(*, kernel="auto", attn_dropout: float = 0.0, warmup_trains=None, **knobs) -> TransformerLM:
    """DSA's knobs (heads, dim_head, kv_heads, index_heads, index_dim_head, top_k, warmup_steps,
    kl_weight, warmup_trains: None for the layer's default) beside the backbone's."""
    if warmup_trains is not None:
        knobs["warmup_trains"] = getattr(warmup_trains, "value", warmup_trains)
    return _with_attention(DeepSeekSparseAttention, kernel, attn_dropout, knobs)


_BACKBONE = ("num_tokens", "dim", "depth", "ff_mult", "ff_dropout", "ff_chunks", "emb_dim", "reversible")


def _with_attention(attention_class, kernel, attn_dropout: float, knobs: dict) -> TransformerLM:
    """The backbone with `attention_class` in every layer, built from every knob that is not the backbone's."""
    backbone = {key: knobs.pop(key) for key in _BACKBONE if key in knobs}
    attention = partial(attention_class, dim=backbone["dim"], dropout=attn_dropout,
                        kernel=getattr(kernel, "value", kernel), **knobs)
    return TransformerLM(attention=attention, **backbone)


def _per_layer(value, depth: int, name: str):
    """An int for every layer, or one value per layer (a list of `depth` ints) -> an iterator."""
    values = [value] * depth if isinstance(value, int) else list(value)
    if len(values) != depth:
        raise ValueError(f"{name} lists {len(values)} values but depth is {depth}: give one per layer, or one int")
    return iter(values)
