"""The FLOPs our own kernels do, for FLOP counts that cannot see inside them.

PyTorch's FLOP counter counts torch operators; a C kernel called through ctypes or a Triton kernel
is invisible to it, so each of our autograd Functions reports the products it computes while
`counting()` is open, counted as PyTorch counts flash attention: q.k and p.v forward; q.k again
(recomputed), dp, dv, dq and dk backward; 2 FLOPs a multiply-add.

    with counting() as ledger:
        loss.backward()
    ledger.total
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


def attention(pairs: Callable[[], float], heads: int, dim_head: int, backward: bool = False) -> None:
    """Report attention over pairs() (query, key) pairs per head: 2 products of d multiply-adds a
    pair forward, 5 backward. pairs is called only while counting (on a GPU it would wait for the
    device)."""
    if _ledger is not None:
        _ledger.total += (10 if backward else 4) * float(pairs()) * heads * dim_head
