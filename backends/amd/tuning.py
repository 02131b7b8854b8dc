"""Tuning configs for AMD GPUs, as data looked up by kernel and variant.

On CDNA a warp is 64 lanes and a workgroup holds at most 1024 threads, so ``num_warps``
never exceeds 16 (``_common.max_warps``).
"""
from __future__ import annotations

from typing import Callable

import triton

from portable_kernels import DeviceInfo
from portable_kernels_backends import _common

Configs = Callable[[DeviceInfo], "list[triton.Config]"]


def _vector_add(device: DeviceInfo) -> list[triton.Config]:
    return [triton.Config({"BLOCK_SIZE": 2048}, num_warps=min(8, _common.max_warps(device)))]


def _softmax(device: DeviceInfo) -> list[triton.Config]:
    return [triton.Config({"MAX_BLOCK_N": 8192}, num_warps=min(16, _common.max_warps(device)))]


_TABLE: dict[tuple[str, str | None], Configs] = {
    ("vector_add", None): _vector_add,
    ("softmax", None): _softmax,
}


def configs(kernel: str, variant: str, device: DeviceInfo) -> list[triton.Config] | None:
    """Configs for ``variant`` of ``kernel`` on ``device``, or None to use the variant's."""
    return _common.table_configs(_TABLE, kernel, variant, device)
