"""Choosing between compiled Triton and Triton's CPU interpreter, before Triton is imported.

Triton decides compile-or-interpret when a function is decorated with ``@triton.jit``, and
its own library (``tl.zeros``, ``tl.max``, ...) is decorated when ``triton`` is imported.
So on a machine with no GPU, ``TRITON_INTERPRET=1`` must be set before the first
``import triton`` anywhere in the process, which is why this runs first thing in
``portable_kernels/__init__.py`` (the only import-time query the library makes: whether
torch sees a GPU, and only when the user has not decided).

numpy: triton 3.6's interpreter converts one-element arrays to Python ints where a kernel
uses a tensor as a loop bound (``range(0, tl.cdiv(K, BLOCK_K))``); numpy 2.4 made that an
error (``only 0-dimensional arrays can be converted to Python scalars``), numpy 2.0-2.3
warn. Hence ``numpy<2.4`` in ``pyproject.toml``; triton 3.7 and newer work with any numpy.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Any

_TRUE = ("1", "true", "yes", "on")


def _gpu_usable() -> bool:
    import torch

    if torch.cuda.is_available():
        return True
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available())


def choose() -> None:
    """Turn the interpreter on when nothing else can run kernels, if it is not too late.

    Respects an explicit ``TRITON_INTERPRET``; ``PK_INTERPRET=1`` forces the interpreter
    (for CPU tensors on a GPU machine). Once ``triton`` is imported the choice is made;
    :func:`active` then reports what Triton really does.
    """
    global TRITON_FIRST
    TRITON_FIRST = "triton" in sys.modules
    if "TRITON_INTERPRET" in os.environ:
        return
    if os.environ.get("PK_INTERPRET", "").strip().lower() in _TRUE:
        os.environ["TRITON_INTERPRET"] = "1"
        return
    if TRITON_FIRST:
        return
    if not _gpu_usable():
        os.environ["TRITON_INTERPRET"] = "1"


#: Whether ``triton`` was imported before ``portable_kernels`` (set by :func:`choose`): then
#: Triton's own library is decorated as compiled code, and no setting made afterwards can
#: turn the interpreter on in this process.
TRITON_FIRST = False


def active() -> bool:
    """Whether kernels run under the interpreter: Triton's knob is on *and* Triton's own
    library was decorated under it (else interpreted kernels fail calling ``tl.zeros``)."""
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return bool(triton.knobs.runtime.interpret) and isinstance(tl.zeros, InterpretedFunction)


def late_reason() -> str | None:
    """Why the interpreter is not usable although asked for, or None."""
    import triton

    if triton.knobs.runtime.interpret and not active():
        return (
            "TRITON_INTERPRET was set after triton was imported, so Triton's own library is "
            "compiled and interpreted kernels cannot call it; set TRITON_INTERPRET=1 (or "
            "PK_INTERPRET=1) before anything imports triton, or import portable_kernels first"
        )
    return None


#: Held by every launch under the interpreter: Triton's interpreter keeps the launch's grid
#: and program ids in process-global state, so two threads interpreting at once read each
#: other's (seen: ``ValueError('x >= grid_dim[0]')`` in 14-16 of 40 calls from 8 threads).
#: Reentrant: an op's launch runs inside another op's (a backward calling a forward).
_LOCK = threading.RLock()


class _SharedPatches:
    """Triton's interpreter re-patches ``triton.language`` on every call of a ``@triton.jit``
    helper inside a kernel, not only at the kernel's launch: ``_patch_lang`` walks the
    language modules with ``inspect.getmembers`` and rebinds their builtins, about a third
    of an interpreted launch's time in kernels built of small helpers (matmul's tiles,
    flash attention's steps). A helper whose language modules the running kernel already
    patched finds nothing left to patch (an already patched builtin is not a builtin any
    more), so this wrapper answers such calls with a scope that restores nothing. The
    kernel's own scope still restores everything it patched when the launch ends."""

    class _Nothing:
        @staticmethod
        def restore() -> None:
            pass

    def __init__(self, patch_lang: Any, language: tuple) -> None:
        self.patch_lang = patch_lang
        self.language = language  # triton.language and triton.language.core
        self.patched: set[int] | None = None  # ids of the modules patched by the running launch

    def __call__(self, fn: Any) -> Any:
        # The language modules the function sees, as _patch_lang finds them.
        tl, core = self.language
        modules = {id(v) for v in fn.__globals__.values() if v is tl or v is core}
        if self.patched is not None:  # a helper called by the running kernel
            if modules <= self.patched:
                return self._Nothing
            self.patched |= modules
            return self.patch_lang(fn)
        scope = self.patch_lang(fn)  # a launch: its scope is restored when it ends
        self.patched = modules
        restore = scope.restore

        def restore_all() -> None:
            self.patched = None
            restore()

        scope.restore = restore_all
        return scope


_patches_shared = False  # whether _share_patches ran


def _share_patches() -> None:
    """Install :class:`_SharedPatches` in Triton's interpreter, where its internals are the
    ones it was written against (triton 3.6 to 3.9); elsewhere leave it as it is."""
    global _patches_shared
    import triton.language as tl
    from triton.runtime import interpreter

    _patches_shared = True
    patch_lang = getattr(interpreter, "_patch_lang", None)
    if callable(patch_lang) and hasattr(interpreter, "_LangPatchScope") \
            and not isinstance(patch_lang, _SharedPatches):
        interpreter._patch_lang = _SharedPatches(patch_lang, (tl, tl.core))


class Serialized:
    """The context of one interpreted launch: the interpreter's lock, and numpy's floating
    point warnings off. The interpreter computes in numpy, which warns (``invalid value
    encountered in subtract``) where a kernel meets NaN or inf inputs by design (a softmax
    row of -inf); the results are what torch returns, so the warnings are noise to users."""

    __slots__ = ("_errstate",)

    def __enter__(self) -> None:
        import numpy as np

        _LOCK.acquire()
        try:
            if not _patches_shared:
                _share_patches()
            self._errstate = np.errstate(all="ignore")
            self._errstate.__enter__()
        except BaseException:
            _LOCK.release()
            raise

    def __exit__(self, *exc) -> None:
        try:
            self._errstate.__exit__(*exc)
        finally:
            _LOCK.release()
