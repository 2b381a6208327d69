"""NSA's block compressor (Yuan et al. 2025, the compressed branch's phi) for the keys' and values'
compressors together, on token-first input: `compress_blocks`.

Per head h (heads [0, kv_heads) compress keys and [kv_heads, 2 * kv_heads) values when the two
compressors' weights are held side by side), block c covers tokens [start + c * stride,
start + c * stride + block) with start = first * stride, and becomes one vector

    out[c] = gelu(flatten(x[block c] + pos) @ w1 + b1) @ w2

with pos a learned intra-block position embedding. Two implementations:

    torch   the readable path (einsums; any device and dtype, fp64 included)
    triton  compressor_triton.py's kernels as the custom operators sparse_attention::compress_forward
            and sparse_attention::compress_backward (1 launch forward, 2 backward), so torch.compile and
            CUDA graphs see through them

x may be a strided view (a token stride larger than heads * dim_head, as a slice of the key/value
projection's output): neither path copies it.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import dispatch
from kernels.nsa_attention.blocks import compressed_blocks

MAX_HIDDEN = 256  # the Triton kernels hold the hidden layer whole: [64, hidden] fp32 per program


def num_blocks(seq: int, block: int, stride: int, first: int) -> int:
    """Complete blocks from block index `first` on."""
    return compressed_blocks(seq - first * stride, block, stride)


def triton_problem(dim_head: int, hidden: int) -> Optional[str]:
    """What the Triton kernels need that this shape lacks (one phrase, to follow "needs"), or None."""
    return dispatch.power_of_two("dim_head", dim_head, 256, low=16) or (
        f"the compressor's hidden width ({hidden}) to be at most {MAX_HIDDEN}" if hidden > MAX_HIDDEN else None)


def compress_blocks(x: Tensor, pos: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, block: int, stride: int,
                    first: int = 0, kernel: str = "auto") -> Tensor:
    """x [batch, seq, heads, dim_head], pos [heads, block, dim_head], w1 [heads, block * dim_head, hidden],
    b1 [heads, 1, hidden], w2 [heads, hidden, dim_head] -> [batch, blocks, heads, dim_head]: the
    compressed complete blocks from block index `first` on (decoding compresses only the blocks its
    new tokens complete), blocks = max(0, (seq - first * stride - block) // stride + 1).

    kernel: model.kernel, by kernels/dispatch.py's rule (the compressor has no C kernel: "cpu" runs torch)."""
    kernel = "torch" if kernel == "cpu" else kernel
    if dispatch.choose(x, kernel, triton_problem(x.shape[3], w1.shape[2]), what="NSA's compressor") == "triton":
        return compress_forward(x, pos, w1, b1, w2, block, stride, first)
    return compress_torch(x, pos, w1, b1, w2, block, stride, first)


def compress_torch(x: Tensor, pos: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, block: int, stride: int,
                   first: int = 0) -> Tensor:
    """compress_blocks in plain PyTorch (models/attention/nsa.py's BlockCompressor, token-first)."""
    batch, _, heads, dim = x.shape
    x = x[:, first * stride:]
    nc = num_blocks(x.shape[1], block, stride, 0)
    # the intra-block positions enter the first layer linearly: as a bias of their own
    bias = b1[:, 0] + torch.einsum("hx,hxy->hy", pos.flatten(1), w1)  # [heads, hidden]
    hidden = F.gelu(_first_layer(x, w1, nc, block, stride) + bias)
    return torch.einsum("bchy,hyd->bchd", hidden, w2)


def _first_layer(x: Tensor, w1: Tensor, nc: int, block: int, stride: int) -> Tensor:
    """The first layer's product over each block's tokens, x [batch, seq, heads, dim_head] ->
    [batch, nc, heads, hidden]. Where the block is r strides long, block c is strides c .. c + r - 1:
    one product of the non-overlapping strides with the r slices of w1 gives every term, with no
    overlapping copy of the tokens (an unfold copies each token r times, and its backward adds the
    copies back)."""
    l, s = block, stride
    heads, dim = w1.shape[0], x.shape[-1]
    w = w1.view(heads, l, dim, -1)  # [heads, l, d, hidden]
    if nc == 0:  # no block: an empty product that still passes (zero) gradients to x and w1
        return torch.einsum("bchd,hdy->bchy", x[:, :0], w[:, 0])
    if l % s:
        windows = x.unfold(1, l, s)  # [b, nc, heads, d, l]
        return torch.einsum("bchdl,hldy->bchy", windows, w)
    r = l // s
    strides = x[:, : (nc + r - 1) * s].unflatten(1, (nc + r - 1, s))  # [b, nc + r - 1, s, heads, d]
    terms = torch.einsum("bcshd,hrsdy->bchry", strides, w.unflatten(1, (r, s)))  # [b, nc + r - 1, heads, r, hidden]
    return sum(terms[:, i: i + nc, :, i] for i in range(r))


def compress_mean(x: Tensor, block: int, stride: int, first: int = 0) -> Tensor:
    """InfLLM-v2's parameter-free compressor: each complete block's mean, x [batch, seq, heads,
    dim_head] -> [batch, blocks, heads, dim_head] from block index `first` on. Plain torch on every
    device: it is an average of a few tokens, whatever path the attention then runs on."""
    x = x[:, first * stride:]
    nc = num_blocks(x.shape[1], block, stride, 0)
    if nc == 0:  # no complete block: an empty result that still passes (zero) gradients to x
        return x[:, :0]
    return x[:, : (nc - 1) * stride + block].unfold(1, block, stride).mean(-1)  # [b, nc, heads, d]


@torch.library.custom_op("sparse_attention::compress_forward", mutates_args=())
def compress_forward(x: Tensor, pos: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, block: int, stride: int,
                     first: int) -> Tensor:
    """-> out [batch, blocks, heads, dim_head] (compressor_triton.forward)."""
    from kernels.nsa_attention import compressor_triton as kernels

    return kernels.forward(x, pos, w1, b1, w2, block, stride, first)


@compress_forward.register_fake
def _(x, pos, w1, b1, w2, block, stride, first):
    batch, seq, heads, dim = x.shape
    return x.new_empty(batch, num_blocks(seq, block, stride, first), heads, dim)


@torch.library.custom_op("sparse_attention::compress_backward", mutates_args=())
def compress_backward(dout: Tensor, x: Tensor, pos: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, block: int,
                      stride: int, first: int) -> list[Tensor]:
    """-> dx, dpos, dw1, db1, dw2 (compressor_triton.backward)."""
    from kernels.nsa_attention import compressor_triton as kernels

    return list(kernels.backward(dout, x, pos, w1, b1, w2, block, stride, first))


@compress_backward.register_fake
def _(dout, x, pos, w1, b1, w2, block, stride, first):
    return [x.new_empty(x.shape), *(torch.empty_like(t) for t in (pos, w1, b1, w2))]


def _setup_context(ctx, inputs, output):
    x, pos, w1, b1, w2, block, stride, first = inputs
    ctx.save_for_backward(x, pos, w1, b1, w2)  # the backward recomputes the hidden layer from these
    ctx.knobs = (block, stride, first)


def _backward(ctx, dout):
    grads = compress_backward(dout, *ctx.saved_tensors, *ctx.knobs)
    return (*grads, None, None, None)


compress_forward.register_autograd(_backward, setup_context=_setup_context)
