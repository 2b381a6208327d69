"""The indexer's scores of each query's chosen keys on the CPU kernel (gathered_scores.c), with
their gradients: DSA's sparse KL scores the top-k keys it chose without a gathered copy of them.
Registered as the custom operators `sparse_attention::gathered_index_scores` and its backward, so
torch.compile traces through them. Computed in fp32 whatever the inputs' dtype."""

import ctypes
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from kernels import dispatch
from kernels.native import load, pointer

_SOURCE = Path(__file__).with_name("gathered_scores.c")
_SIGNATURES = (("gathered_scores_forward", 5, 6), ("gathered_scores_backward", 8, 6))


@dispatch.constant_result  # torch.compile reads the answer, never the compiler's files
def available() -> bool:
    """Whether the CPU kernel is built (or can be built) here."""
    return _library() is not None


def gathered_scores(q: Tensor, k: Tensor, w: Tensor, indices: Tensor) -> Tensor:
    """Shapes and meaning as kernels.lightning_index.gathered_scores."""
    if not available():
        raise RuntimeError("the indexer's CPU kernel could not be built here (no working C compiler)")
    return _gathered_scores(q, k, w, indices.to(torch.int64).contiguous())


def _fp32(*tensors: Tensor) -> list[Tensor]:
    return [t.float().contiguous() for t in tensors]  # the kernel reads contiguous fp32


@torch.library.custom_op("sparse_attention::gathered_index_scores", mutates_args=())
def _gathered_scores(q_in: Tensor, k_in: Tensor, w_in: Tensor, indices: Tensor) -> Tensor:
    q, k, w = _fp32(q_in, k_in, w_in)
    b, c, heads, d = q.shape
    scores = q.new_empty(indices.shape)
    _library().gathered_scores_forward(pointer(q), pointer(k), pointer(w), pointer(indices), pointer(scores), b, c,
                                       heads, d, k.shape[1], indices.shape[-1], ctypes.c_float(0),
                                       torch.get_num_threads())
    return scores


@_gathered_scores.register_fake
def _(q_in, k_in, w_in, indices):
    return q_in.new_empty(indices.shape, dtype=torch.float32)


@torch.library.custom_op("sparse_attention::gathered_index_scores_backward", mutates_args=())
def _gathered_scores_backward(q_in: Tensor, k_in: Tensor, w_in: Tensor, indices: Tensor,
                              dscores: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """-> dq, dk, dw in q's, k's and w's dtypes."""
    q, k, w, dscores = _fp32(q_in, k_in, w_in, dscores)
    b, c, heads, d = q.shape
    threads = torch.get_num_threads()
    dq, dw = torch.empty_like(q), torch.empty_like(w)
    dk = k.new_empty(threads, *k.shape)  # one buffer a thread, zeroed in C: no two threads add into one key
    _library().gathered_scores_backward(pointer(q), pointer(k), pointer(w), pointer(indices), pointer(dscores),
                                        pointer(dq), pointer(dk), pointer(dw), b, c, heads, d, k.shape[1],
                                        indices.shape[-1], ctypes.c_float(0), threads)
    return dq.to(q_in.dtype), dk.sum(0).to(k_in.dtype), dw.to(w_in.dtype)


@_gathered_scores_backward.register_fake
def _(q_in, k_in, w_in, indices, dscores):
    return q_in.new_empty(q_in.shape), k_in.new_empty(k_in.shape), w_in.new_empty(w_in.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dscores):
    dq, dk, dw = _gathered_scores_backward(*ctx.saved_tensors, dscores)
    return dq, dk, dw, None


_gathered_scores.register_autograd(_backward, setup_context=_setup_context)


def _library() -> Optional[ctypes.CDLL]:
    return load(_SOURCE, _SIGNATURES)
