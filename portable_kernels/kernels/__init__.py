"""The kernel families, one module each, written once in Triton.

Each module follows the same anatomy: a docstring (algorithm, constexpr switches), private
``@triton.jit`` helpers, the kernels, the host launcher (check, allocate, grid, launch), a
thin ``torch.autograd.Function`` where the kernel has a backward, a plain-torch reference,
and ``register(registry)`` declaring the family and its ``generic`` variant.
"""
from __future__ import annotations

from .. import plugins as _plugins

# Triton decides compile-or-interpret when a function is decorated, so the backends'
# pk_runtime_setup must have run before any module below defines a kernel.
if not _plugins.RUNTIME_READY:
    _plugins.host()
