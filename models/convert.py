"""Dense -> sparse conversion: a trained dense model's attention weights under the names another
attention reads (trainer.init_from, experiments/runtime/init_from.py; docs/conversion.md).

The dense baseline holds its projections side by side in `to_qkv` [3 * heads * d, dim] (queries,
keys, values, each heads in order); NSA, MoBA and DSA project queries with `to_q` [heads * d, dim]
and keys and values with `to_kv` [copies * 2 * kv_heads * d, dim] (keys then values, `copies` times:
NSA's compressor, selected and window branches, or once). `from_dense` gives each such attention:

- to_q: the dense queries, as they are;
- to_kv: the dense keys and values, the key/value heads of each GQA group averaged into one (the
  GQA paper's mean-pooling conversion; the same heads at kv_heads = heads), in every copy, so
  NSA's three branches start from the one dense projection;
- NSA's gate bias (when the source has no gates): the window gate open and the other two nearly
  shut, so the converted layer starts as the dense layer over its sliding window rather than as a
  sum of three half-weighted attentions (measured in docs/conversion.md).

to_out, the norms, the feed-forwards and the embeddings keep their names and load as they are.
"""

import torch
from torch import Tensor, nn

# sigmoid(4) = 0.982, sigmoid(-4) = 0.018: the window's output nearly whole, the others' a trace
# that still passes them gradient
OPEN_GATE_LOGIT = 4.0


def from_dense(source: dict[str, Tensor], target: nn.Module) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Entries of target's state dict made from source's dense attention weights -> (entries,
    {target name: the source name it came from}). Layers whose names match no dense attention in
    `source`, or that read to_qkv themselves, give nothing."""
    entries: dict[str, Tensor] = {}
    origins: dict[str, str] = {}
    for name, module in target.named_modules():
        prefix = f"{name}." if name else ""
        qkv = source.get(f"{prefix}to_qkv.weight")
        if qkv is None or not (hasattr(module, "to_q") and hasattr(module, "to_kv")):
            continue
        d, kv_heads = module.dim_head, module.kv_heads
        q, k, v = qkv.chunk(3)  # [heads * d, dim] each
        entries[f"{prefix}to_q.weight"] = q.clone()
        copies = module.to_kv.weight.shape[0] // (2 * kv_heads * d)
        kv = torch.cat([_pooled(k, d, kv_heads), _pooled(v, d, kv_heads)] * max(copies, 1))
        entries[f"{prefix}to_kv.weight"] = kv
        origins[f"{prefix}to_q.weight"] = origins[f"{prefix}to_kv.weight"] = f"{prefix}to_qkv.weight"
        gates = getattr(module, "to_gates", None)
        if gates is not None and gates.bias is not None and f"{prefix}to_gates.bias" not in source:
            entries[f"{prefix}to_gates.bias"] = _window_open(gates.bias, module.heads)
            origins[f"{prefix}to_gates.bias"] = "(window gate open)"
    return entries, origins


def _pooled(w: Tensor, d: int, kv_heads: int) -> Tensor:
    """Dense key (or value) rows [heads * d, dim] -> [kv_heads * d, dim], each group of consecutive
    heads averaged (query head i reads kv head i // group, as the sparse layers' GQA). Left as they
    are when the heads do not split into kv_heads groups (the shape check then names the weight)."""
    heads = w.shape[0] // d
    if heads % kv_heads:
        return w.clone()
    return w.view(kv_heads, heads // kv_heads, d, -1).mean(1).flatten(0, 1)


def _window_open(bias: Tensor, heads: int) -> Tensor:
    """NSA's gate bias [3 * heads] (compressed, selected, window; heads each): window open, others shut."""
    logits = torch.full_like(bias, -OPEN_GATE_LOGIT).detach().view(3, heads)
    logits[2] = OPEN_GATE_LOGIT
    return logits.flatten()
