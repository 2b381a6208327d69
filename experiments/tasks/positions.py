"""Validation loss by position in the sequence: where in its context a model loses.

Position i is the prediction of token i + 1 from tokens 0..i. The positions are grouped in
log-spaced buckets whose edges are the powers of 4 from 16 below seq_len, then seq_len:

    seq_len 4096: [0, 16) [16, 64) [64, 256) [256, 1024) [1024, 4096)
    seq_len 256:  [0, 16) [16, 64) [64, 256)          seq_len 32: [0, 16) [16, 32)

so a bucket means the same positions at every length, and the last one holds the longest-range
predictions. A figure is `{"edges": [0, 16, ..., seq_len], "values": [one per bucket]}`, the mean
loss over the bucket's positions (in bits for byte-level text). Every validation row covers every
position, so the values weighted by their bucket widths average to the whole validation figure.
"""

import math

import torch

FIRST_EDGE, RATIO = 16, 4


def bucket_edges(seq_len: int) -> list[int]:
    """[0, 16, 64, ..., seq_len]: the powers of RATIO from FIRST_EDGE below seq_len, between 0 and seq_len."""
    edges, edge = [0], FIRST_EDGE
    while edge < seq_len:
        edges.append(edge)
        edge *= RATIO
    return edges + [seq_len]


class PositionLoss:
    """Sums per-position losses over validation batches; `buckets()` gives the mean per bucket."""

    def __init__(self, seq_len: int):
        self.edges = bucket_edges(seq_len)
        self.sums = torch.zeros(seq_len, dtype=torch.float64)
        self.rows = 0

    def add(self, losses: torch.Tensor) -> None:
        """losses [batch, seq_len]: each position's loss in nats."""
        self.sums += losses.detach().double().sum(0).cpu()
        self.rows += losses.shape[0]

    def buckets(self, all_reduce_mean=float) -> dict:
        """{"edges", "values"}: the mean loss in bits per bucket, averaged over ranks by all_reduce_mean
        (every rank holds as many rows, so the mean of rank means is the mean over all rows)."""
        means = [self.sums[lo:hi].sum().item() / (self.rows * (hi - lo)) / math.log(2)
                 for lo, hi in zip(self.edges, self.edges[1:])]
        return {"edges": self.edges, "values": [all_reduce_mean(m) for m in means]}


def is_figure(value) -> bool:
    """Whether a metrics value is a by-position figure."""
    return isinstance(value, dict) and set(value) == {"edges", "values"}


def scalars(row: dict) -> dict:
    """The row with each by-position figure spread into one scalar per bucket, `<key>/<lo>-<hi>`,
    for trackers that chart numbers only."""
    out = {}
    for key, value in row.items():
        if is_figure(value):
            edges = value["edges"]
            out.update({f"{key}/{lo}-{hi}": v for lo, hi, v in zip(edges, edges[1:], value["values"])})
        else:
            out[key] = value
    return out
