"""GPU timings of NSA's selected-block attention: the Triton kernel against the torch reference and
dense flash attention, forward and forward+backward, then whole-model training tokens/s.

    python -m experiments.benchmark_kernels                      # 8k, 16k, 32k, 64k tokens, bf16
    python -m experiments.benchmark_kernels --lengths 8192 --dtype fp16

On a machine without CUDA it says so and exits 0 (the kernels are verified there by the tests,
under TRITON_INTERPRET=1).
"""

import argparse
import sys

import torch
import torch.nn.functional as F

from experiments.config.checks import flag_error
from experiments.runtime.backends import DTYPES


def timed(fn, repeats: int = 10) -> float:
    """Median milliseconds of fn() on the GPU (CUDA events)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def attention_rows(n: int, dtype, heads: int = 64, kv_heads: int = 4, dim: int = 128, block: int = 64,
                   selected: int = 16) -> list[tuple[str, float, float]]:
    """(name, forward ms, forward+backward ms) at sequence length n, the paper's kernel setting."""
    from kernels.selected_attention import selected_attention
    from kernels.selected_attention.naive import random_selection

    group = heads // kv_heads
    q = torch.randn(kv_heads, n, group, dim, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(kv_heads, n, dim, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(kv_heads, n, dim, device="cuda", dtype=dtype, requires_grad=True)
    indices, valid = (t.cuda() for t in random_selection(kv_heads, n, 0, block, selected))
    rows = []
    for kernel in ("triton", "torch"):
        def fwd(kernel=kernel):
            return selected_attention(q, k, v, indices, valid, 0, block, kernel)[0]

        rows.append((f"selected/{kernel}", timed(fwd), timed(lambda: fwd().sum().backward())))
    qd = q.permute(0, 2, 1, 3).reshape(1, heads, n, dim).detach().requires_grad_()
    kd = k[None].repeat_interleave(group, 1).detach().requires_grad_()
    vd = v[None].repeat_interleave(group, 1).detach().requires_grad_()

    def dense():
        return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)

    rows.append(("dense sdpa", timed(dense), timed(lambda: dense().sum().backward())))
    return rows


def model_tokens_per_s(kernel: str, n: int, dtype) -> float:
    from models.lm import nsa_lm

    model = nsa_lm(num_tokens=256, dim=512, depth=6, heads=8, dim_head=64, kv_heads=4, sliding_window_size=512,
                   compress_block_size=32, compress_stride=16, fine_block_size=64, num_fine_selected=16,
                   kernel=kernel).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (1, n + 1), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=dtype):
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return n / (timed(step, repeats=5) / 1000)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--model-length", type=int, default=8192)
    args = parser.parse_args(argv)
    if error := flag_error({"--lengths": ("count", min(args.lengths)), "--model-length": ("count", args.model_length)}):
        parser.error(error)
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to time (the kernels are checked by `pytest -m triton`, which runs "
              "them in Triton's interpreter on the CPU)")
        return 0
    dtype = DTYPES[args.dtype]
    print(f"{torch.cuda.get_device_name()}, {args.dtype}; 64 query heads over 4 KV heads, dim_head 128, "
          "block 64, 16 selected")
    print(f"{'tokens':>7} {'attention':<16} {'forward ms':>11} {'fwd+bwd ms':>11} {'fwd+bwd vs dense':>17}")
    for n in args.lengths:
        rows = attention_rows(n, dtype)
        dense_both = rows[-1][2]
        for name, forward, both in rows:
            print(f"{n:>7} {name:<16} {forward:>11.2f} {both:>11.2f} {dense_both / both:>16.1f}x")
    for kernel in ("triton", "torch"):
        print(f"NSA model (dim 512, depth 6) training at {args.model_length} tokens, kernel={kernel}: "
              f"{model_tokens_per_s(kernel, args.model_length, dtype):,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
