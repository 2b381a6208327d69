"""kernels/triton_interpreter.py: Triton's interpreter patches its language once a launch, and the
kernels compute there exactly what they compute with Triton's own patching on every helper call,
its own int32 overflow checks (which it computes and then drops) and its dtype lookups; each launch
runs in a thread of its own, whose page faults do not depend on the caller's depth."""

import pytest
import torch

from kernels.dispatch import triton_interpreting
from tests.helpers.nsa_inputs import GRADIENTS, inputs

pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(not triton_interpreting(), reason="the kernels compile on this machine: no interpreter")]


def fused_forward_and_backward() -> dict:
    """NSA's fused kernels at group 16 (helpers called in per-position loops): out, blocks, gradients."""
    from kernels.nsa_attention import triton as kernels

    tensors, phases, knobs = inputs(21, 16, 1, 16, 8, 4, 8, 4, 8, torch.float32)
    out, blocks, saved, lse, order, ranked = kernels.forward(*tensors, phases, 0, knobs, save=True, fsa=False)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = kernels.backward(grad, *tensors, phases, saved, lse, blocks, order, ranked, knobs, False)
    return {"out": out, "blocks": blocks, **dict(zip(GRADIENTS, grads))}


def test_the_quickened_interpreter_computes_what_tritons_own_patching_does(monkeypatch):
    from triton.runtime import interpreter

    import kernels.triton_tiles  # noqa: F401 (quickens the interpreter on import)

    quick = interpreter._patch_lang
    assert getattr(quick, "quickened", False), "kernels.triton_tiles did not quicken the interpreter"
    tritons, full = quick.original, []
    monkeypatch.setattr(quick, "original", lambda fn: full.append(fn.__name__) or tritons(fn))
    quickened = fused_forward_and_backward()
    launches = [name for name in full if name.endswith("_kernel")]
    # a launch patches once; a helper that sees other modules (Triton's tl.max) at most once a launch
    assert launches and len(full) <= 2 * len(launches), full

    assert not interpreter.interpreter_builder.options.sanitize_overflow, "the overflow checks still run"
    assert hasattr(interpreter._get_np_dtype, "original"), "the dtype table is built at every lookup"

    monkeypatch.setattr(interpreter, "_patch_lang", tritons)  # Triton's own: a whole patch every helper call
    monkeypatch.setattr(interpreter.interpreter_builder, "options", interpreter.InterpreterOptions())  # and checks
    monkeypatch.setattr(interpreter, "_get_np_dtype", interpreter._get_np_dtype.original)  # and dtype lookups
    for name, want in fused_forward_and_backward().items():
        assert torch.equal(quickened[name], want), f"{name} differs"


def doubled(x: torch.Tensor) -> torch.Tensor:
    """x [1] int32 doubled in a Triton kernel: int32 arithmetic that overflows for |x| >= 2**30."""
    import triton
    import triton.language as tl

    @triton.jit
    def double_kernel(X):
        tl.store(X, tl.load(X) * 2)

    x = x.clone()
    double_kernel[(1,)](x)
    return x


def test_the_interpreters_own_overflow_checks_assert_nothing(monkeypatch):
    """Why skipping them changes nothing: with the options as Triton ships them, an int32 product
    that overflows is checked, not asserted, and wraps as a compiled kernel's does."""
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter.interpreter_builder, "options", interpreter.InterpreterOptions())
    assert interpreter.interpreter_builder.options.sanitize_overflow
    assert doubled(torch.tensor([2**30 + 1], dtype=torch.int32)).item() == 2 - 2**31


def test_a_launch_runs_in_a_thread_of_its_own_and_what_it_raises_reaches_the_caller():
    """Its frames start at the base of a fresh thread (the module says why); its effects and its
    errors are the caller's, under inference_mode too."""
    import threading

    import triton
    import triton.language as tl

    import kernels.triton_tiles  # noqa: F401 (quickens the interpreter on import)

    @triton.jit
    def triple_kernel(X):
        tl.store(X, tl.load(X) * 3)

    threads = []
    triple_kernel.add_pre_run_hook(lambda *args, **kwargs: threads.append(threading.current_thread()))
    x = torch.tensor([2], dtype=torch.int32)
    triple_kernel[(1,)](x)
    assert x.item() == 6 and threads and threads[0] is not threading.current_thread()
    with torch.inference_mode():
        y = torch.tensor([5], dtype=torch.int32)
        triple_kernel[(1,)](y)
    assert y.item() == 15
    with pytest.raises(TypeError, match="takes 1 positional argument but 2 were given"):
        triple_kernel[(1,)](x, x)


def test_a_launchs_page_faults_do_not_depend_on_the_depth_it_is_called_from():
    """A launch called from depths 1 KiB apart across three of the frame stack's 16 KiB chunks:
    where its helpers' returns crossed a chunk's start, each crossing mapped a new chunk (up to
    5,367 page faults a launch, measured); in a thread of its own, a few at every depth."""
    import resource

    import triton
    import triton.language as tl

    import kernels.triton_tiles  # noqa: F401

    @triton.jit
    def sums_kernel(X, N: tl.constexpr):
        offsets = tl.arange(0, N)
        total = tl.zeros([N], tl.float32)
        for _ in range(64):  # many tl calls: many returns below and above the caller's depth
            total += tl.load(X + offsets) * 2.0 + 1.0
        tl.store(X + offsets, total)

    def at_depth(depth: int) -> int:
        if depth:
            return at_depth(depth - 1)
        x = torch.ones(16)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        sums_kernel[(1,)](x, 16)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    at_depth(0)  # compiled and warmed
    faults = [at_depth(depth) for depth in range(0, 400, 8)]  # at_depth's frame: 16 slots, 128 bytes
    assert max(faults) < 200, faults
