"""A call's replay signature (``portable_kernels._replay``): the key a recipe is found by.

``signature(args, kwargs, current)`` answers ``(key, pointers)``, or None where the call
cannot replay (a tensor that needs a gradient under grad mode, an argument of another type
than a tensor, a scalar, a tuple of scalars or a non-empty list or tuple of tensors, a host
tensor beside device ones). The key holds the selection context
(``portable_kernels._context``); per tensor its dtype, shape, strides, device index and
address modulo 16 (and once, after the first tensor, whether it is a CUDA tensor or its
device's type); per list of tensors its type and length, then its tensors; per scalar its
type and value; the keyword names; which tensors share an address; the current device where
``current`` reads it. ``pointers``: the tensors' addresses, in order (a list's in place).

Two implementations build one key: :func:`python_signature` below, the reference, and
``_signature.c``, the same in C, built at first use with Triton's C build helper (the one
it builds its own launchers with, for every vendor). The key is most of the Python a
replayed call runs before its allocations and launches. Where the C module does not build
(no compiler) the Python one serves, and ``PK_C_SIGNATURE=0`` keeps it.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from . import _context

__all__ = ["SCALARS", "SEQUENCES", "TENSORS", "c_signature", "python_signature", "signature"]

log = logging.getLogger(__name__)

#: Argument classes a signature takes, exactly (a subclass may hash or compare otherwise).
SCALARS = frozenset({int, float, bool, str, type(None)})
TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
#: Containers a signature takes when they hold tensors only (non-empty).
SEQUENCES = frozenset({list, tuple})


def python_signature(args: tuple, kwargs: dict,
                     current: Callable[[], int] | None) -> tuple[tuple, list] | None:
    """The signature in Python (the reference ``_signature.c`` follows)."""
    grad = torch.is_grad_enabled()
    key = [_context.current.get()]
    pointers = []
    first = None  # the first tensor's device index, or device where it has none
    for a in (itertools.chain(args, kwargs.values()) if kwargs else args):
        kind = type(a)
        if kind in TENSORS:
            first = _add_tensor(a, grad, first, key, pointers)
            if first is _NONE:
                return None
        elif kind in SCALARS:
            key.append(kind)
            key.append(a)
        elif kind is tuple and all(type(v) in SCALARS for v in a):
            key.append(tuple(map(type, a)))  # (1, 0) == (1.0, 0) == (True, 0)
            key.append(a)
        elif kind in SEQUENCES and a and all(type(t) in TENSORS for t in a):
            # Tensors in a list (grouped_matmul's groups): the list's kind and length, then
            # each tensor as an argument of its own.
            key.append((kind, len(a)))
            for t in a:
                first = _add_tensor(t, grad, first, key, pointers)
                if first is _NONE:
                    return None
        else:
            return None
    if kwargs:
        key.append(tuple(kwargs))
    if len(pointers) > 1 and len(set(pointers)) < len(pointers):
        key.append(tuple([pointers.index(p) for p in pointers]))  # which share an address
    if current is not None:
        key.append(current())
    return tuple(key), pointers


_NONE = object()  # _add_tensor's answer where the call has no signature


def _add_tensor(a: torch.Tensor, grad: bool, first: Any, key: list, pointers: list) -> Any:
    """Append tensor ``a``'s entry to ``key`` and its address to ``pointers``; answers the
    first tensor's device index (or device where it has none), or :data:`_NONE`."""
    if grad and a.requires_grad:
        return _NONE
    p = a.data_ptr()
    # The device's index, not a.device: an int hashes and compares in the lookup for less
    # than a device object does.
    index = a.get_device()
    if index < 0:  # the host, meta or another device without an index
        index = a.device
    if first is None:
        first = index
        if type(index) is int:
            key.append(a.is_cuda or a.device.type)  # once; is_cuda is cheaper
    elif type(index) is not type(first) or (type(index) is not int
                                            and index.type != first.type):
        # A host tensor beside device ones: its values may steer the host code (a host
        # read the dispatch mode does not see).
        return _NONE
    key.append((a.dtype, a.shape, a.stride(), index, p & 15))
    pointers.append(p)
    return first


_lock = threading.Lock()
_c: Any = None
_c_module: Any = None  # the built module (tests re-init it with stand-in tensor classes)
_c_failed = False


def c_signature() -> Callable | None:
    """``_signature.c``'s ``signature`` (built once per process), or None where it does not
    build or ``PK_C_SIGNATURE=0``."""
    global _c, _c_module, _c_failed
    if _c is None and not _c_failed:
        with _lock:
            if _c is None and not _c_failed:
                if os.environ.get("PK_C_SIGNATURE", "1") == "0":
                    _c_failed = True
                    return None
                try:
                    from triton.runtime.build import compile_module_from_src

                    src = Path(__file__).with_name("_signature.c").read_text()
                    module = compile_module_from_src(src, "portable_kernels_signature")
                    module.init(tuple(TENSORS), _context.current, torch.is_grad_enabled)
                    _c, _c_module = module.signature, module
                except Exception as exc:  # no compiler, no headers: the Python one serves
                    _c_failed = True
                    log.warning("portable_kernels: the C signature did not build (%s); "
                                "replays key calls in Python", exc)
    return _c


def signature() -> Callable:
    """The signature function replays use: the C one where it builds, else the Python."""
    return c_signature() or python_signature
