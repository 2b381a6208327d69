"""kernels/triton_interpreter.py: Triton's interpreter patches its language once a launch, and the
kernels compute there exactly what they compute with Triton's own patching on every helper call
and its own int32 overflow checks (which it computes and then drops)."""

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

    monkeypatch.setattr(interpreter, "_patch_lang", tritons)  # Triton's own: a whole patch every helper call
    monkeypatch.setattr(interpreter.interpreter_builder, "options", interpreter.InterpreterOptions())  # and checks
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
