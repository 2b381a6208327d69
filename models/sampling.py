"""Sampling helpers shared by every task: filtering, one sampling step, cached generation."""

import contextlib
import time
from typing import Optional

import torch
from torch import Tensor, nn

from kernels import few_row_linear
from models.fused_decoding import fused_blocks


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
# (weight shapes, threads, paths) -> ({bucket's rows: path}, {bucket's rows: {path: median ms of a pass
# over the weights}}), measured once per process
_PLANS: dict = {}


@contextlib.contextmanager
def decoding_linears(*models: nn.Module, plan: Optional[dict[int, str]] = None):
    """Decoding multiplies each weight by one to a few vectors per step, and how fast the BLAS
    does that depends on the CPU: on an AMD EPYC MKL runs a one-row product on one core at a
    fraction of the memory bandwidth (a [2048, 512] fp32 weight streams at ~10 GB/s whatever the
    thread count), where other CPUs run it in parallel, and a general matrix product packs the
    whole weight on every call, a cost a few rows do not repay. Inside this context, fp32 linears
    on the CPU take, per number of rows, whichever of four paths measured fastest on this CPU for
    these weights (`decoding_plan`):

        plain    the usual product
        vector   weight slices [slices, out / slices, in] @ x^T, 4 slices a thread  (EPYC: ~24 GB/s at one row)
        matrix   x @ weight slices^T, a slice per thread                              (EPYC: best at 6-8 rows)
        kernel   kernels/few_row_linear: x times w unpacked, two weight rows a pass against every row, where a C
                 compiler builds it (AMD EPYC Zen 5, its earlier form of 4 outputs a pass: 1.4x the best
                 of the others at one row, 2x at 6)

    The slices are views of the weight, not copies; a linear a path cannot serve (slices need
    out divisible by 4 x threads) takes the plain product. Other dtypes and devices, and products
    under autocast, are left alone (the half-precision product is already parallel). `plan`
    ({bucket's rows: path}) skips the measurement. Inside an enclosing context, the linears it
    patched keep its plan.

    Dense language models go further (models/fused_decoding.py): their decoding steps run through
    all blocks in one C call, whose products are the few-row kernel's, so only the linears outside
    the blocks (the logits) take the plan."""
    threads = torch.get_num_threads()
    linears = [module for module in planned_linears(*models) if "forward" not in vars(module)]  # not patched already
    plan = plan or decoding_plan(linears, threads)
    patched = []
    for module in linears:
        paths = [_path(plan[rows], module, threads) for rows, _ in _BUCKETS]
        if any(path is not _PATHS["plain"] for path in paths):
            module.forward = _planned_linear(module, threads, paths)
            patched.append(module)
    try:
        with fused_blocks(*models):
            yield
    finally:
        for module in patched:
            del module.forward  # back to nn.Linear.forward


def planned_linears(*models: nn.Module) -> list[nn.Linear]:
    """The linears of these models that decoding_linears plans: fp32, on the CPU."""
    return [module for model in models for module in model.modules() if isinstance(module, nn.Linear)
            and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32]


def decoding_plan(linears: list[nn.Linear], threads: int) -> dict[int, str]:
    """{largest rows of a bucket: the path its products take} for these fp32 linears, measured the
    first time a set of weight shapes is seen (~0.1-0.5 s) and kept for the process: each path
    multiplies every weight in turn (the plain product standing in where it cannot serve one), so
    the timing sees the caches as decoding does."""
    return _measured_plan(linears, threads)[0]


def plan_times(linears: list[nn.Linear], threads: int) -> dict[int, dict[str, float]]:
    """What the plan of these linears was chosen from: {bucket's rows: {path: median ms of one pass
    over the weights at the bucket's timed rows}}; {} where nothing but the plain product serves."""
    return _measured_plan(linears, threads)[1]


def _measured_plan(linears: list[nn.Linear], threads: int) -> tuple[dict[int, str], dict[int, dict[str, float]]]:
    key = _plan_key(linears, threads)
    if key is None:
        return {rows: "plain" for rows, _ in _BUCKETS}, {}
    if key not in _PLANS:
        _PLANS[key] = _measure_plan(linears, threads, list(key[2]))
    return _PLANS[key]


def _plan_key(linears: list[nn.Linear], threads: int):
    """The key of these linears' plan: their shapes, the threads and the paths that can serve them
    (None where only the plain one can)."""
    candidates = [name for name in _PATHS if any(_path(name, m, threads) is _PATHS[name] for m in linears)]
    if candidates == ["plain"] or not linears:
        return None
    return tuple(sorted({tuple(m.weight.shape) for m in linears})), threads, tuple(candidates)


def describe_plan(plan: dict[int, str], times: Optional[dict[int, dict[str, float]]] = None) -> str:
    """A plan as a line: "1 row kernel, 2-4 rows kernel, 5-16 rows matrix", with `times` (plan_times)
    each bucket's measured ms per path in brackets."""
    low, names = 1, []
    for rows, _ in _BUCKETS:
        name = f"{low} row {plan[rows]}" if rows == 1 else f"{low}-{rows} rows {plan[rows]}"
        if times and rows in times:
            name += " (" + ", ".join(f"{path} {ms:.2f}" for path, ms in times[rows].items()) + " ms)"
        names.append(name)
        low = rows + 1
    return ", ".join(names)


def _path(name: str, linear: nn.Linear, threads: int):
    """The product `name` names, or the plain one where that path cannot serve this linear."""
    if name in ("vector", "matrix") and not (threads > 1 and linear.out_features % (4 * threads) == 0):
        return _PATHS["plain"]
    if name == "kernel" and not few_row_linear.available():
        return _PATHS["plain"]
    return _PATHS[name]


@torch.no_grad()
def _measure_plan(linears: list[nn.Linear], threads: int, candidates: list[str],
                  rounds: int = 5) -> tuple[dict[int, str], dict[int, dict[str, float]]]:
    """The fastest path per bucket, and each path's ms: `rounds` interleaved passes over the weights,
    the median pass."""
    weights = list({id(m.weight): m for m in linears}.values())
    plan, medians = {}, {}
    # inputs of its own generator: a plan is measured once a process, so drawing from the global one
    # would shift a resumed run's dropout from its first sample on
    gen = torch.Generator().manual_seed(0)
    for rows, timed_rows in _BUCKETS:
        inputs = {m.in_features: torch.randn(timed_rows, m.in_features, generator=gen) for m in weights}
        times: dict[str, list[float]] = {name: [] for name in candidates}
        for _ in range(rounds + 1):  # the first round warms up
            for name in candidates:
                products = [(_path(name, m, threads), m.weight) for m in weights]
                t0 = time.perf_counter()
                for product, w in products:
                    product(inputs[w.shape[1]], w, None, threads)
                times[name].append(time.perf_counter() - t0)
        medians[rows] = {name: 1e3 * sorted(times[name][1:])[rounds // 2] for name in candidates}
        plan[rows] = min(medians[rows], key=medians[rows].get)
    return plan, medians


def _plain(x: Tensor, w: Tensor, b: Optional[Tensor], threads: int) -> Tensor:
    return nn.functional.linear(x, w, b)


def _vector(x: Tensor, w: Tensor, b: Optional[Tensor], threads: int) -> Tensor:
    """x [rows, in] @ w^T as weight slices [slices, out / slices, in] times x^T -> [rows, out]."""
    slices = w.view(4 * threads, -1, w.shape[1])
    # x^T [slices, in, rows] as a transposed view: MKL's fast path (a copy with unit last stride is not)
    columns = x.t().expand(len(slices), -1, -1)
    # made row-major: a column-major output sends the next linear down MKL's slow path and
    # attention down sdpa's math path
    out = torch.bmm(slices, columns).permute(2, 0, 1).contiguous().view(x.shape[0], -1)
    return out if b is None else out + b  # (baddbmm's broadcast bias is slower than this add)


def _matrix(x: Tensor, w: Tensor, b: Optional[Tensor], threads: int) -> Tensor:
    """x [rows, in] @ w^T as x times weight slices^T [threads, in, out / threads] -> [rows, out]."""
    slices = w.view(threads, -1, w.shape[1]).transpose(1, 2)
    out = torch.bmm(x[None].expand(threads, -1, -1), slices).transpose(0, 1).reshape(x.shape[0], -1)
    return out if b is None else out + b


def _kernel(x: Tensor, w: Tensor, b: Optional[Tensor], threads: int) -> Tensor:
    return few_row_linear.few_row_linear(x, w, b, threads)


_PATHS = {"plain": _plain, "vector": _vector, "matrix": _matrix, "kernel": _kernel}


def _planned_linear(linear: nn.Linear, threads: int, by_rows: list):
    """linear's forward through the product of its number of rows' bucket (see decoding_linears)."""
    w, b = linear.weight, linear.bias

    def forward(x: Tensor) -> Tensor:
        rows = x.numel() // x.shape[-1]
        # autocast (trainer.precision=bf16 samples under it) computes the product in half precision:
        # nn.Linear's own path, as for any input that is not fp32
        if rows > _FEW_ROWS or torch.is_grad_enabled() or x.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
            return nn.functional.linear(x, w, b)
        product = by_rows[0] if rows == 1 else by_rows[1] if rows <= _BUCKETS[1][0] else by_rows[2]
        return product(x.reshape(rows, -1), w, b, threads).reshape(*x.shape[:-1], -1)

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
