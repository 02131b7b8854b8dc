"""Tuning configs for NVIDIA GPUs, as data looked up by kernel and variant.

Each entry is a function of the ``DeviceInfo`` returning ``list[triton.Config]``; more than
one config means Triton autotunes among them on first use.
"""
from __future__ import annotations

from typing import Callable

import triton

from portable_kernels import DeviceInfo
from portable_kernels_backends import _common

Configs = Callable[[DeviceInfo], "list[triton.Config]"]


def _vector_add(device: DeviceInfo) -> list[triton.Config]:
    # Memory-bound: 16-byte accesses per thread need BLOCK_SIZE >= 4 * 32 * num_warps.
    return [triton.Config({"BLOCK_SIZE": 2048}, num_warps=8)]


def _softmax(device: DeviceInfo) -> list[triton.Config]:
    # Rows up to 8192 fp32 values stay in registers (16 warps x 32 lanes x 16 values).
    return [triton.Config({"MAX_BLOCK_N": 8192}, num_warps=16)]


# (kernel, variant) first, then (kernel, None) for every variant of the kernel.
_TABLE: dict[tuple[str, str | None], Configs] = {
    ("vector_add", None): _vector_add,
    ("softmax", None): _softmax,
}


def configs(kernel: str, variant: str, device: DeviceInfo) -> list[triton.Config] | None:
    """Configs for ``variant`` of ``kernel`` on ``device``, or None to use the variant's."""
    return _common.table_configs(_TABLE, kernel, variant, device)
