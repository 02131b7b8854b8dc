"""The kernel families, one module each, written once in Triton.

Each module follows the same anatomy: a docstring (algorithm, constexpr switches), private
``@triton.jit`` helpers, the kernels, the host launcher (check, allocate, grid, launch), a
thin ``torch.autograd.Function`` where the kernel has a backward, a plain-torch reference,
and ``register(registry)`` declaring the family and its ``generic`` variant.
"""
from __future__ import annotations

from .. import plugins as _plugins

# Plugins' pk_runtime_setup (vendor environment read when kernels are decorated) should run
# before any module below defines a kernel. A plugin that imports kernel modules while it
# is being loaded runs inside the host's construction: building another host there would
# deadlock, so its kernels are simply decorated first.
if not _plugins.RUNTIME_READY and not _plugins.BUILDING:
    _plugins.host()
