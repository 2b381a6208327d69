"""Sampling helpers shared by every task: filtering, one sampling step, cached generation."""

import contextlib
from typing import Optional

import torch
from torch import Tensor, nn


def filter_top_k(logits: Tensor, k: Optional[int]) -> Tensor:
    """Keep the k largest logits of the last axis, -inf elsewhere (k None or >= vocab: all)."""
    if k is None or k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def probabilities(logits: Tensor, temperature: float, top_k: Optional[int]) -> Tensor:
    """The distribution that `sample` draws from; temperature 0 puts all mass on the argmax."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return torch.softmax(filter_top_k(logits, top_k) / temperature, dim=-1)


def sample(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """logits [..., vocab] -> tokens [...]; temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = probabilities(logits.float(), temperature, top_k)
    flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
    return flat.reshape(probs.shape[:-1])


@contextlib.contextmanager
def decoding_layout(*models: nn.Module):
    """Decoding multiplies each weight by one vector per token, and on the CPU that product reads
    a weight fastest along its longer side: a [2048, 512] fp32 weight streams at ~19 GB/s stored
    column-major against ~10 GB/s row-major (MKL, 2 threads), while [512, 2048] is fastest
    row-major. Inside this context, linear weights wider in output than in input are stored
    column-major (same values and shape); the training layout is back on exit."""
    kept = []
    for model in models:
        for module in model.modules():
            if not isinstance(module, nn.Linear) or module.out_features <= module.in_features:
                continue
            w = module.weight
            if w.device.type == "cpu" and w.is_contiguous():
                kept.append((w, w.data))
                w.data = w.data.t().contiguous().t()
    try:
        yield
    finally:
        for w, data in kept:
            w.data = data


@torch.no_grad()
def generate(
    model,
    prompt: Tensor,
    length: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """Decode `length` tokens after prompt [batch, prime] with the model's cache -> [batch, length]."""
    cache = model.new_cache()
    with decoding_layout(model):
        logits = model(prompt, cache=cache)[:, -1]
        out = []
        for _ in range(length):
            token = sample(logits, temperature, top_k, generator)
            out.append(token)
            logits = model(token[:, None], cache=cache)[:, -1]
    return torch.stack(out, dim=1)
