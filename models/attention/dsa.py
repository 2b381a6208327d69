"""DeepSeek Sparse Attention (DeepSeek-V3.2-Exp report, 2025): a lightning indexer picks each
query's `top_k` earlier tokens, and the query attends to those alone.

The indexer has `index_heads` small heads of `index_dim_head` with one key per token: it scores
every key s <= t for query t as I(t, s) = sum_j w(t, j) * ReLU(q_I(t, j) . k_I(s)), where q_I,
k_I and the weights w are projections of the layer's input (the indexer queries and keys carry
rotary positions; the queries are scaled by index_dim_head^-1/2 and the weights by
index_heads^-1/2). Its top_k keys (ties to the later key) are shared by every head of the layer,
as the report shares them across the heads of its MQA attention; the heads keep their own keys
and values (`kv_heads`, GQA). Scoring and top-k run a chunk of queries at a time
(kernels/lightning_index/), the attention over the chosen tokens is gather attention
(kernels/gather_attention/): neither keeps a [seq, seq] tensor.

Training follows the report's two stages, counted in optimizer steps (`steps`, a buffer saved with
the model and advanced by `after_optimizer_step`, which the training loop calls):
- warm-up (the first `warmup_steps`): attention is dense, and the indexer learns to match it: the
  auxiliary loss is kl_weight * the mean over queries of KL(p_t || softmax(I(t, :))), with p_t the
  dense attention's distribution over the keys s <= t averaged over the heads. `warmup_trains`
  says what else learns meanwhile: `indexer`, as the report (which starts from a trained dense
  model, trainer.init_from): the rest of the model is frozen: it runs without gradient
  (`freezes_model`, read by the backbone), so only the indexer's parameters get gradients and
  nothing else changes; `all`, for a model trained from scratch: the rest keeps learning from the
  language-model loss during warm-up.
- sparse training: attention over the top_k tokens, and the KL over the chosen tokens alone, with
  p_t the sparse attention's distribution over them.
In both stages the indexer reads its input detached and the target is detached, so the KL trains
the indexer alone, and the indexer, whose choice passes no gradient, learns from nothing else. The
auxiliary loss is `aux_loss` (in training only), which the language-model task adds to its loss,
as Routing's commitment loss.
"""

from contextlib import nullcontext
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from kernels import at_least_fp32
from kernels.gather_attention import gather_attention, gathered_probabilities
from kernels.gather_attention import cpu_built as gather_cpu_built
from kernels.gather_attention import triton_problem as gather_problem
from kernels.lightning_index import gathered_scores, index_topk
from kernels.lightning_index import cpu_built as index_cpu_built
from kernels.lightning_index import triton_problem as index_problem
from models.attention import cache as kv_cache
from models.attention.knobs import check_at_least_1, check_gqa, check_kernel, check_no_dropout
from models.recompute import recomputed
from models.rotary import Rotary

_KL_CHUNK = 1 << 21  # (query, key) pairs per chunk of the KL losses (times the heads in warm-up)


class LightningIndexer(nn.Module):
    """The indexer's projections: x [b, n, dim] at positions start.. -> queries [b, n, heads, d]
    and keys [b, n, d] (rotated, the queries scaled by d^-1/2) and weights [b, n, heads] (scaled
    by heads^-1/2)."""

    def __init__(self, dim: int, heads: int, dim_head: int):
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_k = nn.Linear(dim, dim_head, bias=False)
        self.to_w = nn.Linear(dim, heads, bias=False)
        self.rotary = Rotary(dim_head)

    def forward(self, x: Tensor, start: int) -> tuple[Tensor, Tensor, Tensor]:
        q = self.rotary(rearrange(self.to_q(x), "b n (j d) -> b j n d", j=self.heads), start)
        k = self.rotary(self.to_k(x), start)
        return rearrange(q, "b j n d -> b n j d") * self.dim_head**-0.5, k, self.to_w(x) * self.heads**-0.5


def indexer_scores(q: Tensor, k: Tensor, w: Tensor) -> Tensor:
    """I(t, s) with gradient, every query against every key: q [b, c, heads, d], k [b, keys, d],
    w [b, c, heads] -> [b, c, keys], at least fp32 (the chosen keys alone: lightning_index's
    gathered_scores)."""
    products = torch.einsum("bcjd,bkd->bcjk", q, k)
    return (at_least_fp32(w)[..., None] * at_least_fp32(products).relu()).sum(2)


def kl_to_target(target: Tensor, scores: Tensor, allowed: Tensor) -> Tensor:
    """sum over queries of KL(target || softmax(scores)) over the allowed keys: target, scores,
    allowed [..., keys] (target 0 where not allowed, each row summing to 1)."""
    log_q = scores.masked_fill(~allowed, float("-inf")).log_softmax(-1)
    terms = target * (target.clamp(min=torch.finfo(target.dtype).tiny).log() - log_q)
    return terms.masked_fill(target == 0, 0.0).sum()


class DeepSeekSparseAttention(nn.Module):
    def __init__(
        self,
        *,
        dim: int,
        heads: int,
        dim_head: int,
        kv_heads: int,
        index_heads: int,
        index_dim_head: int,
        top_k: int,
        warmup_steps: int,
        kl_weight: float,
        warmup_trains: str = "all",
        dropout: float = 0.0,
        kernel: str = "auto",
    ):
        super().__init__()
        _check(heads, kv_heads, dim_head, index_heads, index_dim_head, top_k, warmup_steps, kl_weight, dropout, kernel)
        if warmup_trains not in ("indexer", "all"):
            raise ValueError(f"warmup_trains={warmup_trains} must be indexer or all: set model.warmup_trains")
        self.warmup_trains = warmup_trains
        self.heads, self.kv_heads, self.dim_head = heads, kv_heads, dim_head
        self.group = heads // kv_heads
        self.top_k, self.warmup_steps, self.kl_weight = top_k, warmup_steps, kl_weight
        self.kernel = kernel
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, 2 * kv_heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)
        self.rotary = Rotary(dim_head)
        self.indexer = LightningIndexer(dim, index_heads, index_dim_head)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))  # optimizer steps taken (the stage)
        self.aux_loss: Optional[Tensor] = None

    @property
    def warming_up(self) -> bool:
        """Whether attention is dense and the indexer learns to match it (the first warmup_steps)."""
        return self.warmup_steps > 0 and int(self.steps) < self.warmup_steps

    @property
    def freezes_model(self) -> bool:
        """Whether this training step trains the indexer alone (warm-up with warmup_trains=indexer):
        the backbone then runs the model without gradient, and this layer its indexer with it."""
        return self.training and self.warming_up and self.warmup_trains == "indexer"

    @property
    def part_trained_alone(self) -> Optional[nn.Module]:
        """What the steps that freeze the model train: the indexer, where the warm-up freezes it."""
        return self.indexer if self.warmup_trains == "indexer" and self.warmup_steps > 0 else None

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        self.steps += 1

    def forward(self, x: Tensor, cache: Optional[dict] = None) -> Tensor:
        """x [batch, seq, dim] -> [batch, seq, dim]; with `cache`, x continues the cached tokens."""
        start = 0 if cache is None else cache.get("pos", 0)
        q = rearrange(self.to_q(x), "b n (h g d) -> b h g n d", h=self.kv_heads, g=self.group)
        k, v = rearrange(self.to_kv(x), "b n (s h d) -> s b h n d", s=2, h=self.kv_heads)
        q, k = self.rotary(q.flatten(1, 2), start).view_as(q), self.rotary(k, start)
        frozen = self.freezes_model  # the model runs without gradient: the indexer and its KL need one
        with torch.enable_grad() if frozen else nullcontext():
            index_q, index_k, index_w = self.indexer(x.detach(), start)  # the KL trains the indexer alone
        if cache is not None:
            k, v, index_k = kv_cache.append(cache, start, k=k, v=v, index_k=index_k)
        learn = self.training and self.kl_weight > 0
        if self.warming_up:
            out = self._dense(q, k, v, start)
            with torch.enable_grad() if frozen else nullcontext():
                self.aux_loss = self.kl_weight * self._dense_kl(q, k, index_q, index_k, index_w) if learn else None
        else:
            with torch.no_grad():
                chosen = index_topk(index_q, index_k, index_w, start, self.top_k, self.kernel)  # [b, m, top_k]
            out, lse, indices = self._sparse(q, k, v, chosen, start)
            self.aux_loss = (self.kl_weight * self._sparse_kl(q, k, lse, indices, index_q, index_k, index_w, chosen)
                             if learn else None)
        return self.to_out(rearrange(out, "b h g n d -> b n (h g d)"))

    truncate_cache = staticmethod(kv_cache.truncate)

    def _dense(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        """Causal attention over every key (the warm-up): q [b, h, g, m, d], k, v [b, h, n, d]."""
        m, n = q.shape[3], k.shape[2]
        mask = None if start == 0 else torch.ones(m, n, dtype=torch.bool, device=q.device).tril(n - m)
        out = F.scaled_dot_product_attention(q.flatten(1, 2), k, v, attn_mask=mask, is_causal=start == 0,
                                             enable_gqa=True)
        return out.view_as(q)

    def _sparse(self, q: Tensor, k: Tensor, v: Tensor, chosen: Tensor, start: int) -> tuple[Tensor, Tensor, Tensor]:
        """Gather attention over the chosen tokens [b, m, top_k], shared by every kv head ->
        out [b, h, g, m, d], its log-sum-exp [b * h, m, g] and the indices [b * h, m, top_k]."""
        b, h = q.shape[:2]
        indices = chosen[:, None].expand(b, h, *chosen.shape[1:]).flatten(0, 1)
        out, lse = gather_attention(rearrange(q, "b h g n d -> (b h) n g d"), k.flatten(0, 1), v.flatten(0, 1),
                                    indices, start, self.kernel)
        return rearrange(out, "(b h) n g d -> b h g n d", b=b), lse, indices

    def _dense_kl(self, q: Tensor, k: Tensor, index_q: Tensor, index_k: Tensor, index_w: Tensor) -> Tensor:
        """The warm-up's KL, mean over queries (from position 0): the dense attention's distribution
        over keys s <= t, averaged over the heads, against the indexer's, a chunk of queries at a
        time, each recomputed in the backward."""
        b, h, g, n, _ = q.shape
        step = max(1, _KL_CHUNK // (n * h * g))
        q, k = q.detach(), k.detach()
        total = sum(recomputed(self._dense_kl_chunk, q[:, :, :, c0 : c0 + step], k, index_q[:, c0 : c0 + step],
                               index_k, index_w[:, c0 : c0 + step], c0) for c0 in range(0, n, step))
        return total / (b * n)

    def _dense_kl_chunk(self, q: Tensor, k: Tensor, index_q: Tensor, index_k: Tensor, index_w: Tensor,
                        first: int) -> Tensor:
        c = q.shape[3]
        visible = first + c  # keys up to the chunk's last query
        allowed = torch.arange(visible, device=q.device) <= torch.arange(first, visible, device=q.device)[:, None]
        with torch.no_grad():
            scores = at_least_fp32(torch.einsum("bhgcd,bhkd->bhgck", q, k[:, :, :visible])) * q.shape[-1] ** -0.5
            target = scores.masked_fill(~allowed, float("-inf")).softmax(-1).mean((1, 2))  # [b, c, visible]
        return kl_to_target(target, indexer_scores(index_q, index_k[:, :visible], index_w), allowed)

    def _sparse_kl(self, q: Tensor, k: Tensor, lse: Tensor, indices: Tensor, index_q: Tensor, index_k: Tensor,
                   index_w: Tensor, chosen: Tensor) -> Tensor:
        """The sparse stage's KL, mean over queries (from position 0): the sparse attention's
        distribution over the chosen tokens, averaged over the heads (from its log-sum-exp), against
        the indexer's over them, a chunk of queries at a time, each recomputed in the backward."""
        b, h, g, n, _ = q.shape
        target = gathered_probabilities(rearrange(q.detach(), "b h g n d -> (b h) n g d"), k.detach().flatten(0, 1),
                                        indices, lse.detach(), 0, self.kernel)
        target = target.view(b, h, n, -1).sum(1) / (h * g)  # [b, n, top_k]
        step = max(1, _KL_CHUNK // chosen.shape[-1])
        total = sum(recomputed(self._sparse_kl_chunk, index_q[:, c0 : c0 + step], index_k, index_w[:, c0 : c0 + step],
                               chosen[:, c0 : c0 + step], target[:, c0 : c0 + step]) for c0 in range(0, n, step))
        return total / (b * n)

    def _sparse_kl_chunk(self, index_q: Tensor, index_k: Tensor, index_w: Tensor, chosen: Tensor,
                         target: Tensor) -> Tensor:
        return kl_to_target(target, gathered_scores(index_q, index_k, index_w, chosen, self.kernel), chosen >= 0)


def _check(heads, kv_heads, dim_head, index_heads, index_dim_head, top_k, warmup_steps, kl_weight, dropout,
           kernel) -> None:
    """Reject knob combinations DSA cannot run, saying how to fix them."""
    check_gqa(heads, kv_heads)
    check_at_least_1(index_heads=index_heads, index_dim_head=index_dim_head, top_k=top_k)
    if index_dim_head % 2:
        raise ValueError(f"index_dim_head={index_dim_head} must be even (the indexer's rotary positions pair its "
                         "channels): set model.index_dim_head")
    if warmup_steps < 0 or kl_weight < 0:
        raise ValueError(f"warmup_steps={warmup_steps} and kl_weight={kl_weight} must be 0 or more: "
                         "set model.warmup_steps, model.kl_weight")
    if warmup_steps and not kl_weight:
        raise ValueError(f"warmup_steps={warmup_steps} trains the indexer by its KL alone, and kl_weight=0 turns "
                         "that off: set model.kl_weight > 0, or model.warmup_steps=0")
    check_no_dropout(dropout, "DSA's gather kernels")
    check_kernel(kernel, "DSA", lambda: gather_cpu_built() and index_cpu_built(),
                 gather_problem(heads // kv_heads, dim_head) or index_problem(index_dim_head))
