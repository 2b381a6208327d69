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


_FEW_ROWS = 16  # decoding steps and verification passes; longer inputs (a prompt) keep the plain product
_VECTOR_ROWS = 4  # up to here, weight slices times x^T beats x times slices^T


@contextlib.contextmanager
def decoding_linears(*models: nn.Module):
    """Decoding multiplies each weight by one to a few vectors per step, and MKL runs those
    products on one core at a fraction of the memory bandwidth: a [2048, 512] fp32 weight times
    one vector streams at ~10 GB/s whatever the thread count. Inside this context, fp32 linears on
    the CPU cut the weight into slices of output rows (views, no copies) and multiply all slices
    in one batched product, which spreads them over the cores:

        1-4 rows       weight slices [slices, out / slices, in] @ x^T   ~30 GB/s at one row (4 slices a thread)
        5-16 rows      x @ weight slices^T, a slice per thread           ~12 GB/s (vs ~10)

    Ten layers of dim 512 then read their weights in ~3.5 ms per token instead of ~9-12 ms.
    Other dtypes and devices are left alone (the half-precision product is already parallel)."""
    threads = torch.get_num_threads()
    patched = []
    for model in models:
        for module in model.modules():
            if (isinstance(module, nn.Linear) and threads > 1 and module.out_features % (4 * threads) == 0
                    and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32
                    and "forward" not in vars(module)):  # not sliced already by an enclosing context
                module.forward = _sliced_linear(module, threads)
                patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward  # back to nn.Linear.forward


def _sliced_linear(linear: nn.Linear, threads: int):
    """linear's forward as batched products over slices of its output rows (see decoding_linears)."""
    w, b = linear.weight, linear.bias
    vector_slices = w.view(4 * threads, -1, w.shape[1])  # [slices, out / slices, in]
    matrix_slices = w.view(threads, -1, w.shape[1]).transpose(1, 2)  # [threads, in, out / threads]

    def forward(x: Tensor) -> Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > _FEW_ROWS or torch.is_grad_enabled():
            return nn.functional.linear(x, w, b)
        if rows <= _VECTOR_ROWS:
            # x^T [slices, in, rows] as a transposed view: MKL's fast path (a copy with unit last stride is not)
            columns = x.reshape(rows, -1).t().expand(len(vector_slices), -1, -1)
            # [rows, slices, out / slices], made row-major: a column-major output sends the next
            # linear down MKL's slow path and attention down sdpa's math path
            out = torch.bmm(vector_slices, columns).permute(2, 0, 1).contiguous()
        else:
            flat = x.reshape(1, rows, -1).expand(threads, -1, -1)  # [threads, rows, in]
            out = torch.bmm(flat, matrix_slices).transpose(0, 1)  # [rows, threads, out / threads]
        out = out.reshape(*x.shape[:-1], -1)
        return out if b is None else out + b  # (baddbmm's broadcast bias is slower than this add)

    return forward


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
    with decoding_linears(model):
        logits = model(prompt, cache=cache)[:, -1]
        out = []
        for _ in range(length):
            token = sample(logits, temperature, top_k, generator)
            out.append(token)
            logits = model(token[:, None], cache=cache)[:, -1]
    return torch.stack(out, dim=1)
