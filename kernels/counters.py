"""What our Triton kernels launch, read while `recording()` is open, so that a CPU can check what
decides their speed on a GPU (experiments/bench/kernels.py --count holds them to budgets).

Each launch site reports one `Launch`: the kernel's name, its grid, its tile (query rows per
program, keys per tile), and, for attention kernels, the (query row, key) pairs inside the tiles
its programs walk (`visited`, counted by the kernel itself when `counting()` is true) against the
pairs its mask lets through (`needed`, from positions). Outside `recording()` nothing is counted
and the kernels compile without the counting code.

    with recording() as launches:
        layer(x).backward(grad)
    sum(launch.visited for launch in launches) / sum(launch.needed for launch in launches)

What a launch site does only to report (a counter tensor for the visited pairs, reading it back,
computing the needed pairs) runs inside `bookkeeping()`, so that an op counter
(experiments/runtime/op_counts.py) leaves it out of what the GPU would run.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional


@dataclass(frozen=True)
class Launch:
    kernel: str  # the Triton kernel's name
    grid: tuple[int, ...]  # programs along each axis
    rows: int  # query rows (positions x heads) one program holds
    keys: int  # keys per tile it walks
    visited: int = 0  # (query row, key) pairs in the tiles walked, summed over programs (0: not attention)
    needed: int = 0  # pairs the mask lets through


_launches: Optional[list[Launch]] = None
_bookkeeping = 0


@contextmanager
def recording() -> Iterator[list[Launch]]:
    """Collect every Launch reported until the block ends (nested: the inner block's launches are
    the outer's too)."""
    global _launches
    outer, _launches = _launches, []
    try:
        yield _launches
    finally:
        if outer is not None:
            outer.extend(_launches)
        _launches = outer


def counting() -> bool:
    """Whether launches are being recorded: kernels then count the pairs they visit."""
    return _launches is not None


def record(launch: Launch) -> None:
    if _launches is not None:
        _launches.append(launch)


@contextmanager
def bookkeeping() -> Iterator[None]:
    """Within it, tensor work that only serves the counting: op counters leave it out."""
    global _bookkeeping
    _bookkeeping += 1
    try:
        yield
    finally:
        _bookkeeping -= 1


def in_bookkeeping() -> bool:
    return _bookkeeping > 0
