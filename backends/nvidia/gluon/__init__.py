"""The NVIDIA backend's kernels of its own: Hopper (sm_90) kernels written in Gluon, Triton's
lower-level language, for ``nvidia.hopper_gluon`` of ``matmul`` and ``flash_attn``.

Why they exist and why here: Triton 3.6 cannot get sm_90's overlap of copies, warpgroup
MMAs and the epilogue (or the softmax) from the portable kernels (its warp-specialized
loops specialize few shapes, and computed wrong attention outputs on the H200); Gluon
states those schedules by hand, for one architecture. Kernels for one vendor's
architecture live in that vendor's backend, so the families in ``portable_kernels/kernels/``
know nothing of these: each variant is registered here with its own launcher through the
``Variant`` API a third-party backend uses (``docs/plugin-authors.md``, "Shipping a kernel
of your own"), and reuses the family's host helpers (argument checks, the descriptor
predicate, flash_attn's backward preprocess and autograd).

- ``_common.py``: what the kernels share (copy-engine names across Triton releases, the
  releases checked, host descriptors without the constructor's checks);
- ``matmul_gluon.py``, ``flash_attn_gluon.py``: the kernels and their launch functions;
- ``matmul.py``, ``flash_attn.py``: each variant's predicate, launcher and registration.

Importing the kernel modules decorates the kernels, so :func:`register` imports them when
the backend's ``pk_register_variants`` runs, never at import time of the backend.
"""
from __future__ import annotations


def register(registry) -> None:
    """Add the Gluon variants of ``matmul`` and ``flash_attn`` to ``registry``."""
    from . import flash_attn, matmul

    registry.add_variant(matmul.variant())
    registry.add_variant(flash_attn.variant())
