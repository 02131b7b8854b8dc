"""Choosing between compiled Triton and Triton's CPU interpreter, before Triton is imported.

Triton decides compile-or-interpret when a function is decorated with ``@triton.jit``, and
its own library (``tl.zeros``, ``tl.max``, ...) is decorated when ``triton`` is imported.
So on a machine with no GPU, ``TRITON_INTERPRET=1`` must be set before the first
``import triton`` anywhere in the process, which is why this runs first thing in
``portable_kernels/__init__.py`` (the only import-time query the library makes: whether
torch sees a GPU, and only when the user has not decided).
"""
from __future__ import annotations

import os
import sys

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
    if "TRITON_INTERPRET" in os.environ:
        return
    if os.environ.get("PK_INTERPRET", "").strip().lower() in _TRUE:
        os.environ["TRITON_INTERPRET"] = "1"
        return
    if "triton" in sys.modules:
        return
    if not _gpu_usable():
        os.environ["TRITON_INTERPRET"] = "1"


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
