"""Triton's interpreter (TRITON_INTERPRET=1: the kernels on a CPU, for the tests and the counts)
without its cost per helper call.

The interpreter patches `triton.language` for the launch it runs, then again, with a scan of the
whole language (`inspect.getmembers`, ~3 ms), on every call of a `@triton.jit` helper inside it
(`interpreter.InterpretedFunction.__call__`), though the launch has patched the same modules and
nothing in between restores them. The NSA kernels call their helpers in per-position loops: at
the budget test's group of 16 that was 17,000 rescans in one forward, most of its minute. Here a
helper's call inside a launch that patched the same language modules patches nothing; every other
call (a launch, the first call of a helper whose module sees other modules, as Triton's `tl.max`
sees `triton.language.core`) goes through Triton's own patching. What
the kernels compute is unchanged (tests/kernels/test_triton_interpreter.py, bit for bit).

It also stops the interpreter computing int32 overflow checks it then drops: every int32 +, - and
* is computed again in int64 and compared with the bounds, ~40% of an NSA kernel's time there, for
a `device_assert` that does nothing unless the options say debug, which the interpreter's never
do. Where they do (a Triton that sets them), the checks stay. And it keeps the numpy dtype of each
Triton dtype, which the interpreter built a table for at every lookup.

And it runs each launch in a thread of its own. CPython (3.11 at least) keeps a thread's frames in
16 KiB chunks and frees a chunk as soon as the calls return below its start, mapping a new one when
they go deeper again; the interpreter's helper chains are deep and return thousands of times a
second, so at an unlucky depth each crossing costs an mmap, an munmap and four page faults (the
budget test's group-16 forward: 34.5 s in a pytest-xdist worker, 23.2 s in plain pytest; 19.7 and
17.7 s with each launch in its own thread; AMD EPYC, Zen 3). A thread's first chunk is never freed,
and a launch's frames start near its base, at a depth that is the kernel's own wherever it is
called from."""

import dataclasses
import functools
import inspect
import threading

_ACTIVE: list[frozenset] = []  # the language modules the running launch patched (launches do not nest)
_LANGUAGES: dict[int, tuple[dict, frozenset]] = {}  # per module namespace (kept, so its id stays its own)


class _NothingPatched:
    def restore(self) -> None:
        pass


def _languages(fn) -> frozenset:
    """The language modules Triton's `_patch_lang` would patch for fn: those of its globals (looked
    up once per module: a scan of its namespace at every helper call was 5% of a kernel's time)."""
    import triton.language as tl

    namespace = fn.__globals__
    if (known := _LANGUAGES.get(id(namespace))) is None:
        known = _LANGUAGES[id(namespace)] = (namespace, frozenset(
            id(value) for value in namespace.values() if inspect.ismodule(value) and value in (tl, tl.core)))
    return known[1]


def quicken() -> bool:
    """Patch the language once per launch, not once per helper call. Returns whether the interpreter
    is quickened (False where this Triton has no `_patch_lang` to wrap: it then runs as shipped)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None:
        return False
    if getattr(patch, "quickened", False):
        return True

    def patch_once(fn):
        languages = _languages(fn)
        if _ACTIVE and languages <= _ACTIVE[0]:
            return _NothingPatched()  # a helper inside a launch that patched these modules already
        scope = patch_once.original(fn)
        if _ACTIVE:  # a helper that sees other modules (Triton's own tl.max sees triton.language.core):
            _ACTIVE[0] |= languages  # patched as Triton does, a patch it never restores
            return scope
        _ACTIVE.append(languages)  # a launch: its scope's restore ends it
        restore = scope.restore

        def end_launch():
            _ACTIVE.clear()
            restore()

        scope.restore = end_launch
        return scope

    patch_once.quickened, patch_once.original = True, patch
    interpreter._patch_lang = patch_once
    _skip_unasserted_overflow_checks(interpreter)
    _np_dtypes_looked_up_once(interpreter)
    executor = getattr(interpreter, "GridExecutor", None)
    if executor is not None:
        executor.__call__ = _in_own_thread(executor.__call__)
    return True


def _in_own_thread(launch):
    """launch(...) run to its end in a new thread; what it raises is raised here. (Torch's
    thread-local modes stay behind: the launch's copies to and from the host tensors are storage
    copies, the same under no_grad or inference_mode.)"""

    @functools.wraps(launch)
    def launch_in_own_thread(*args, **kwargs):
        outcome = {}

        def run():
            try:
                outcome["result"] = launch(*args, **kwargs)
            except BaseException as error:  # noqa: B036 (raised again in the caller's thread)
                outcome["error"] = error

        thread = threading.Thread(target=run, name="triton-interpreter-launch")
        thread.start()
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("result")

    return launch_in_own_thread


def _skip_unasserted_overflow_checks(interpreter) -> None:
    """Turn off the overflow checks where the interpreter's options would drop their asserts."""
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and getattr(options, "sanitize_overflow", False) \
            and getattr(options, "debug", True) is False:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def _np_dtypes_looked_up_once(interpreter) -> None:
    """The interpreter's `_get_np_dtype` builds its table of every dtype at each call, thousands of
    times a launch (~6% of an NSA kernel's time here): the same answers, each looked up once and kept."""
    import triton.language as tl

    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None:
        return
    known = {}

    def np_dtype(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(element, tl.pointer_type):  # (unhashable) an address: uint64
            return original(element)
        if (found := known.get(element)) is None:
            found = known[element] = original(element)
        return found

    np_dtype.original = original
    interpreter._get_np_dtype = np_dtype
