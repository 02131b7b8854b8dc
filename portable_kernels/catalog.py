"""The core's own plugin: declares every kernel family and registers its ``generic`` variant.

Kernel modules are imported inside the hook, not at the top of this file: registration runs
after ``pk_runtime_setup``, so the kernels are decorated only once the CPU backend has had
its chance to turn Triton's interpreter on.
"""
from __future__ import annotations

import importlib

from .hookspecs import hookimpl

#: Kernel families, one module each under ``portable_kernels/kernels/``. Each module has a
#: ``register(registry)`` function that declares the family and its ``generic`` variant.
FAMILIES = (
    "vector_add",
    "softmax",
    "asin",
    "dropout",
    "layer_norm",
    "rms_norm",
    "swiglu",
    "geglu",
    "flash_attn",
    "flash_attn_varlen",
    "matmul",
    "grouped_matmul",
    "rope",
    "add_rms_norm",
    "kv_cache_write",
    "flash_attn_with_kvcache",
    "cross_entropy",
    "fused_linear_cross_entropy",
)


@hookimpl(tryfirst=True)
def pk_register_variants(registry):
    for family in FAMILIES:
        importlib.import_module(f"portable_kernels.kernels.{family}").register(registry)
