"""The FLOPs our own kernels do, for FLOP counts that cannot see inside them.

PyTorch's FLOP counter counts torch operators; a C kernel called through ctypes or a Triton kernel
is invisible to it, so each of our autograd Functions reports the products it computes while
`counting()` is open, counted as PyTorch counts flash attention: q.k and p.v forward; q.k again
(recomputed), dp, dv, dq and dk backward; 2 FLOPs a multiply-add.

    with counting() as ledger:
        loss.backward()
    ledger.total

attention_flops and linear_flops give the same counts from shapes alone, for estimates of work
that is not run (experiments/bench/roofline.py).
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional


@dataclass
class Ledger:
    total: float = 0.0


_ledger: Optional[Ledger] = None


@contextmanager
def counting() -> Iterator[Ledger]:
    """Collect the FLOPs the kernels report until the block ends."""
    global _ledger
    outer, _ledger = _ledger, Ledger()
    try:
        yield _ledger
    finally:
        if outer is not None:  # a count inside a count: the outer one sees these FLOPs too
            outer.total += _ledger.total
        _ledger = outer


FORWARD_PRODUCTS, BACKWARD_PRODUCTS = 2, 5  # attention's products of dim_head multiply-adds a (query, key) pair


def attention_flops(pairs: float, heads: int, dim_head: int, backward: bool = False) -> float:
    """FLOPs of attention over `pairs` (query, key) pairs per head: q.k and p.v forward; q.k
    recomputed, dp, dv, dq and dk backward; 2 FLOPs a multiply-add."""
    return 2 * (BACKWARD_PRODUCTS if backward else FORWARD_PRODUCTS) * float(pairs) * heads * dim_head


def linear_flops(rows: int, fan_in: int, fan_out: int, backward: bool = False) -> float:
    """FLOPs of a linear layer x [rows, fan_in] @ w [fan_in, fan_out]: one product forward, two
    backward (the input's gradient and the weight's); 2 FLOPs a multiply-add."""
    return 2 * (2 if backward else 1) * float(rows) * fan_in * fan_out


def attention(pairs: Callable[[], float], heads: int, dim_head: int, backward: bool = False) -> None:
    """Report attention over pairs() (query, key) pairs per head (attention_flops). pairs is called
    only while counting (on a GPU it would wait for the device)."""
    if _ledger is not None:
        _ledger.total += attention_flops(pairs(), heads, dim_head, backward)
