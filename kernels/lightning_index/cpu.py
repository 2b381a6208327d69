"""The lightning indexer on the CPU kernel (lightning_index.c):

- index_topk: each chunk's products q . k by a PyTorch matrix product, then its scores and top-k
  keys in one C pass (`sparse_attention::index_topk_rows`), the same keys as reference.py's,
  ties included;
- gathered_scores: the scores of each query's chosen keys, with their gradients (DSA's sparse KL),
  without a gathered copy of the keys (`sparse_attention::gathered_index_scores` and its backward).

Custom operators, so torch.compile traces through them; computed in fp32 whatever the inputs' dtype."""

import ctypes
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from kernels import at_least_fp32, dispatch
from kernels.lightning_index import reference
from kernels.native import load, pointer

_SOURCE = Path(__file__).with_name("lightning_index.c")
_SIGNATURES = (("gathered_scores_forward", 5, 6), ("gathered_scores_backward", 8, 6), ("index_topk_rows", 3, 6))


@dispatch.constant_result  # torch.compile reads the answer, never the compiler's files
def available() -> bool:
    """Whether the CPU kernel is built (or can be built) here."""
    return _library() is not None


def index_topk(q: Tensor, k: Tensor, w: Tensor, start: int, top_k: int) -> Tensor:
    """Shapes and meaning as kernels.lightning_index.index_topk."""
    if not available():
        raise RuntimeError("the indexer's CPU kernel could not be built here (no working C compiler)")
    b, m, heads, d = q.shape
    out = torch.empty(b, m, top_k, dtype=torch.long)
    w = at_least_fp32(w)
    step = max(1, reference._CHUNK // (k.shape[1] * heads))  # the reference's chunks
    for c0 in range(0, m, step):
        c1 = min(m, c0 + step)
        visible = start + c1  # keys up to the chunk's last query
        products = at_least_fp32(torch.bmm(q[:, c0:c1].reshape(b, -1, d), k[:, :visible].transpose(1, 2)))
        out[:, c0:c1] = _index_topk_rows(products.view(b, c1 - c0, heads, visible), w[:, c0:c1], start + c0, top_k)
    return out


@torch.library.custom_op("sparse_attention::index_topk_rows", mutates_args=())
def _index_topk_rows(products: Tensor, w: Tensor, first: int, top_k: int) -> Tensor:
    """products [b, c, heads, visible], w [b, c, heads] of queries at positions first.. -> their
    top_k keys [b, c, top_k], -1 past a query's keys."""
    products, w = _fp32(products, w)
    b, c, heads, visible = products.shape
    out = torch.empty(b, c, top_k, dtype=torch.long)
    status = _library().index_topk_rows(pointer(products), pointer(w), pointer(out), b, c, heads, visible, first,
                                        top_k, ctypes.c_float(0), torch.get_num_threads())
    if status:
        raise MemoryError("lightning indexer: a thread could not allocate its scores")
    return out


@_index_topk_rows.register_fake
def _(products, w, first, top_k):
    return products.new_empty(*products.shape[:2], top_k, dtype=torch.long)


def gathered_scores(q: Tensor, k: Tensor, w: Tensor, indices: Tensor) -> Tensor:
    """Shapes and meaning as kernels.lightning_index.gathered_scores."""
    if not available():
        raise RuntimeError("the indexer's CPU kernel could not be built here (no working C compiler)")
    b, m, heads, d = q.shape
    if k.dim() != 3 or k.shape[0] != b or k.shape[2] != d or w.shape != (b, m, heads) or indices.shape[:2] != (b, m):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, w {tuple(w.shape)} and indices "
                         f"{tuple(indices.shape)} do not go together")  # the kernel would read past them
    return _gathered_scores(q, k, w, indices.to(torch.int64).contiguous())


def _fp32(*tensors: Tensor) -> list[Tensor]:
    return [t.float().contiguous() for t in tensors]  # the kernel reads contiguous fp32


@torch.library.custom_op("sparse_attention::gathered_index_scores", mutates_args=())
def _gathered_scores(q_in: Tensor, k_in: Tensor, w_in: Tensor, indices: Tensor) -> Tensor:
    q, k, w = _fp32(q_in, k_in, w_in)
    b, c, heads, d = q.shape
    if indices.numel() and int(indices.max()) >= k.shape[1]:  # checked here, where torch.compile does not trace
        raise ValueError(f"an index past the {k.shape[1]} keys")
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
