"""$SPARSE_ATTENTION_MARCH: the C kernels built for a named target (x86-64-v3: AVX2, x86-64-v4:
AVX-512) instead of this CPU, cached apart, and the kernel tests passing on each build this CPU
can run (a target it cannot run is refused in words, never left to die on an illegal instruction)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import native
from kernels.nsa_attention import compressed

ROOT = Path(__file__).resolve().parents[2]
SELECTION = Path(compressed.__file__).with_name("selection.c")


def test_the_setting_changes_the_flags_and_the_cache_key(monkeypatch):
    monkeypatch.delenv(native.MARCH_VARIABLE, raising=False)
    assert native.march() == "native" and "-march=native" in native.build_flags()
    default = native.cache_path("cc", SELECTION, native.build_flags())
    monkeypatch.setenv(native.MARCH_VARIABLE, "x86-64-v3")
    assert native.march() == "x86-64-v3"
    flags = native.build_flags()
    assert "-march=x86-64-v3" in flags and "-march=native" not in flags
    v3 = native.cache_path("cc", SELECTION, flags)
    monkeypatch.setenv(native.MARCH_VARIABLE, "x86-64-v4")
    v4 = native.cache_path("cc", SELECTION, native.build_flags())
    assert len({default, v3, v4}) == 3  # three builds, never one served for another
    assert v3 == native.cache_path("cc", SELECTION, native.build_flags("x86-64-v3"))  # the key is the same each time


def test_a_value_that_is_no_target_is_refused(monkeypatch):
    monkeypatch.setenv(native.MARCH_VARIABLE, "native -O0")
    with pytest.raises(ValueError, match="SPARSE_ATTENTION_MARCH"):
        native.build_flags()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/cpuinfo")
def test_a_target_this_cpu_cannot_run_is_refused_in_words(monkeypatch):
    if native._compiler() is None:
        pytest.skip("no C compiler here")
    if not native.missing_features("x86-64-v4"):
        pytest.skip("this CPU runs AVX-512 (avx512f): nothing to refuse")
    monkeypatch.setenv(native.MARCH_VARIABLE, "x86-64-v4")
    with pytest.raises(RuntimeError, match="avx512f"):
        native.load(SELECTION, (("block_selection", 7, 15),))


@pytest.mark.parametrize("target,isa", [("x86-64-v3", "AVX2"), ("x86-64-v4", "AVX-512")])
def test_isa_names_the_target(target, isa):
    if native._compiler() is None or native._macros(native._compiler(), target) is None:
        pytest.skip(f"no C compiler here that builds for {target}")
    assert native.isa(target) == f"{isa} ({target})"


@pytest.mark.slow
@pytest.mark.parametrize("target", ["x86-64-v3", "x86-64-v4"])
def test_the_kernel_tests_pass_on_the_build(target):
    """The C kernels' tests against their references, and the NSA model's on them, in a process whose
    kernels are built for target."""
    if native._compiler() is None or native._macros(native._compiler(), target) is None:
        pytest.skip(f"no C compiler here that builds for {target}")
    if missing := native.missing_features(target):
        pytest.skip(f"this CPU lacks {', '.join(missing)}: a {target} build cannot run here")
    tests = ["tests/kernels/test_span_attention.py", "tests/kernels/test_compressed_attention.py",
             "tests/kernels/test_few_row_linear.py", "tests/kernels/test_native.py", "tests/models/attention/test_nsa.py"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not triton",
                           "-k", "cpu or span or native or tiles or selection or few_row", *tests],
                          cwd=ROOT, env={**os.environ, native.MARCH_VARIABLE: target}, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout
