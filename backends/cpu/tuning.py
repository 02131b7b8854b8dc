"""One config per kernel for Triton's interpreter.

The interpreter costs about 30 µs per program and 60 µs per ``tl`` operation whatever the
block size, so blocks are as large as the kernel allows: fewer programs and fewer loop
iterations. It cannot autotune, so each entry is a single config.
"""
from __future__ import annotations

import triton

from portable_kernels_backends import _common

# (kernel, variant) first, then (kernel, None) for every variant of the kernel.
_CONFIGS: dict[tuple[str, str | None], triton.Config] = {
    ("vector_add", None): triton.Config({"BLOCK_SIZE": 4096}, num_warps=1),
    ("softmax", None): triton.Config({"MAX_BLOCK_N": 1024}, num_warps=1),
}


def config(kernel: str, variant: str) -> triton.Config | None:
    """The interpreter config for ``variant`` of ``kernel``, or None."""
    return _common.lookup(_CONFIGS, kernel, variant)
