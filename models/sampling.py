"""Sampling helpers shared by every task: filtering, one sampling step, cached generation."""

import contextlib
import time
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
# rows of a product -> the bucket whose measured path it takes: one row (a decoding step), a few,
# many (a verification pass of gamma + 1 tokens); each bucket is timed at its representative rows
_BUCKETS = ((1, 1), (4, 4), (_FEW_ROWS, 8))  # (up to rows, rows timed)
_PLANS: dict = {}  # (weight shapes, threads) -> {bucket's rows: path}, measured once per process


@contextlib.contextmanager
def decoding_linears(*models: nn.Module, plan: Optional[dict[int, str]] = None):
    """Decoding multiplies each weight by one to a few vectors per step, and how fast the BLAS
    does that depends on the CPU: on an AMD EPYC MKL runs a one-row product on one core at a
    fraction of the memory bandwidth (a [2048, 512] fp32 weight streams at ~10 GB/s whatever the
    thread count), where other CPUs run it in parallel. Inside this context, fp32 linears on the
    CPU take, per number of rows, whichever of three paths measured fastest on this CPU for these
    weights (`decoding_plan`):

        plain    the usual product
        vector   weight slices [slices, out / slices, in] @ x^T, 4 slices a thread  (EPYC: ~24 GB/s at one row)
        matrix   x @ weight slices^T, a slice per thread                              (EPYC: best at 6-8 rows)

    The slices are views of the weight, not copies. Other dtypes and devices are left alone (the
    half-precision product is already parallel). `plan` ({bucket's rows: path}) skips the
    measurement. Inside an enclosing context, the linears it patched keep its plan."""
    threads = torch.get_num_threads()
    linears = [module for model in models for module in model.modules()
               if isinstance(module, nn.Linear) and module.weight.device.type == "cpu"
               and module.weight.dtype == torch.float32 and "forward" not in vars(module)]  # not patched already
    plan = plan or decoding_plan(linears, threads)
    patched = []
    if any(path != "plain" for path in plan.values()):
        for module in linears:
            if _sliceable(module, threads):
                module.forward = _planned_linear(module, threads, plan)
                patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward  # back to nn.Linear.forward


def decoding_plan(linears: list[nn.Linear], threads: int) -> dict[int, str]:
    """{largest rows of a bucket: the path its products take} for these fp32 linears, measured the
    first time a set of weight shapes is seen (~0.1-0.5 s) and kept for the process: each path
    multiplies every weight in turn, so the timing sees the caches as decoding does."""
    sliceable = [m for m in linears if _sliceable(m, threads)]
    if threads < 2 or not sliceable:
        return {rows: "plain" for rows, _ in _BUCKETS}
    key = (tuple(sorted({tuple(m.weight.shape) for m in sliceable})), threads)
    if key not in _PLANS:
        _PLANS[key] = _measure_plan(sliceable, threads)
    return _PLANS[key]


def describe_plan(plan: dict[int, str]) -> str:
    """A plan as a line: "1 row vector, 2-4 rows vector, 5-16 rows matrix"."""
    low, names = 1, []
    for rows, _ in _BUCKETS:
        names.append(f"{low} row {plan[rows]}" if rows == 1 else f"{low}-{rows} rows {plan[rows]}")
        low = rows + 1
    return ", ".join(names)


def _sliceable(linear: nn.Linear, threads: int) -> bool:
    return threads > 1 and linear.out_features % (4 * threads) == 0


@torch.no_grad()
def _measure_plan(linears: list[nn.Linear], threads: int, rounds: int = 5) -> dict[int, str]:
    """The fastest path per bucket: `rounds` interleaved passes over the weights, the median pass."""
    weights = list({id(m.weight): m.weight for m in linears}.values())
    plan = {}
    for rows, timed_rows in _BUCKETS:
        inputs = {w.shape[1]: torch.randn(timed_rows, w.shape[1]) for w in weights}
        times: dict[str, list[float]] = {path: [] for path in _PATHS}
        for _ in range(rounds + 1):  # the first round warms up
            for path, product in _PATHS.items():
                t0 = time.perf_counter()
                for w in weights:
                    product(inputs[w.shape[1]], w, threads)
                times[path].append(time.perf_counter() - t0)
        plan[rows] = min(times, key=lambda path: sorted(times[path][1:])[rounds // 2])
    return plan


def _plain(x: Tensor, w: Tensor, threads: int) -> Tensor:
    return nn.functional.linear(x, w)


def _vector(x: Tensor, w: Tensor, threads: int) -> Tensor:
    """x [rows, in] @ w^T as weight slices [slices, out / slices, in] times x^T -> [rows, out]."""
    slices = w.view(4 * threads, -1, w.shape[1])
    # x^T [slices, in, rows] as a transposed view: MKL's fast path (a copy with unit last stride is not)
    columns = x.t().expand(len(slices), -1, -1)
    # made row-major: a column-major output sends the next linear down MKL's slow path and
    # attention down sdpa's math path
    return torch.bmm(slices, columns).permute(2, 0, 1).contiguous().view(x.shape[0], -1)


def _matrix(x: Tensor, w: Tensor, threads: int) -> Tensor:
    """x [rows, in] @ w^T as x times weight slices^T [threads, in, out / threads] -> [rows, out]."""
    slices = w.view(threads, -1, w.shape[1]).transpose(1, 2)
    return torch.bmm(x[None].expand(threads, -1, -1), slices).transpose(0, 1).reshape(x.shape[0], -1)


_PATHS = {"plain": _plain, "vector": _vector, "matrix": _matrix}


def _planned_linear(linear: nn.Linear, threads: int, plan: dict[int, str]):
    """linear's forward through the plan's path for its number of rows (see decoding_linears)."""
    w, b = linear.weight, linear.bias
    by_rows = [_PATHS[plan[rows]] for rows, _ in _BUCKETS]

    def forward(x: Tensor) -> Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > _FEW_ROWS or torch.is_grad_enabled():
            return nn.functional.linear(x, w, b)
        product = by_rows[0] if rows == 1 else by_rows[1] if rows <= _BUCKETS[1][0] else by_rows[2]
        out = product(x.reshape(rows, -1), w, threads).reshape(*x.shape[:-1], -1)
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
