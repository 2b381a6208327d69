"""The C kernels' build: on PyTorch's OpenMP threads, never beside a second OpenMP runtime."""

import sys

import pytest

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
