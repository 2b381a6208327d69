"""The C kernels' build (on PyTorch's OpenMP threads, never beside a second OpenMP runtime) and the
key layout they read."""

import sys

import pytest
import torch

from kernels import native, span_attention


def _openmp_runtimes() -> set[str]:
    with open("/proc/self/maps") as maps:
        return {line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]}


@pytest.mark.skipif(not sys.platform.startswith("linux") or not native._torch_libgomp_loaded(),
                    reason="PyTorch's OpenMP runtime here is not a libgomp.so.1 (the kernels then use POSIX threads)")
def test_kernels_share_pytorchs_openmp_runtime():
    if not span_attention.available():
        pytest.skip("no C compiler: the kernels are not built here")
    before = _openmp_runtimes()
    library = span_attention._library()
    assert _openmp_runtimes() == before and len(before) == 1  # no second runtime was loaded
    assert _uses_openmp(library._name)  # built with -fopenmp: its rows run on those threads


def _uses_openmp(path: str) -> bool:
    """Whether the built library calls into libgomp (it was built with -fopenmp, not with threads of its own)."""
    with open(path, "rb") as built:
        return b"GOMP_parallel" in built.read()


@pytest.mark.parametrize("n", [1, 15, 16, 33, 48])
def test_transposed_tiles_hold_each_key_once_and_zeros_past_the_end(n):
    keys = torch.randn(3, 2 * n, 5)[:, ::2]  # a strided view, as the kernels are handed
    tiles = native.transposed_tiles(keys)
    tile = native.TILE
    assert tiles.is_contiguous() and tiles.shape == (3, -(-n // tile), 5, tile)
    flat = tiles.transpose(-1, -2).flatten(1, 2)  # back to [bh, padded n, d]
    assert torch.equal(flat[:, :n], keys)
    assert not flat[:, n:].any()
