"""Tuning configs for Iluvatar CoreX GPUs, as data looked up by kernel and variant.

A CoreX warp is 64 lanes and a workgroup holds at most 1024 threads, so ``num_warps``
never exceeds 16 (``_common.max_warps``).
"""
from __future__ import annotations

from typing import Callable

import triton

from portable_kernels import DeviceInfo
from portable_kernels_backends import _common

Configs = Callable[[DeviceInfo], "list[triton.Config]"]


def _gemm(device: DeviceInfo, bk: int) -> triton.Config:
    # CoreX: 64x64 output tiles with 4 warps of 64 lanes (256 threads) and num_stages 1,
    # i.e. no software pipelining of the K loop.
    return triton.Config({"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": 8},
                         num_warps=min(4, _common.max_warps(device)), num_stages=1)


def _matmul(device: DeviceInfo) -> list[triton.Config]:
    return [_gemm(device, 64), _gemm(device, 32)]

def flash_attn_configs(device: DeviceInfo) -> list[triton.Config]:
    """The seed's Iluvatar FlashAttention tiling: 64x64 tiles, 4 warps of 64 lanes, no
    software pipelining (num_stages 1). Rows wider than 256 bytes (fp16 D=256, fp32
    D>64) halve the key tile to keep K, V and the accumulator within registers and LDS.
    Also the configs of the iluvatar.* variants on devices whose backend has none."""
    warps = min(4, _common.max_warps(device))
    return [
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "ROW_BYTES_MAX": 256},
                      num_warps=warps, num_stages=1),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 32, "BWD_BLOCK_M": 32, "BWD_BLOCK_N": 32},
                      num_warps=warps, num_stages=1),
    ]


def _flash_attn_with_kvcache(device: DeviceInfo) -> list[triton.Config]:
    # flash_attn's CoreX tiling applied to decode: 64-key steps, 4 warps of 64 lanes, no
    # software pipelining. Not yet run on CoreX.
    return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_R": 16, "WRITE_BLOCK_T": 16},
                          num_warps=min(4, _common.max_warps(device)), num_stages=1)]


_TABLE: dict[tuple[str, str | None], Configs] = {
    **_common.MEMORY_BOUND,
    ("flash_attn", None): flash_attn_configs,
    ("matmul", None): _matmul,
    ("grouped_matmul", None): _matmul,
    ("flash_attn_with_kvcache", None): _flash_attn_with_kvcache,
}


def configs(kernel: str, variant: str, device: DeviceInfo) -> list[triton.Config] | None:
    """Configs for ``variant`` of ``kernel`` on ``device``, or None to use the variant's."""
    return _common.table_configs(_TABLE, kernel, variant, device)
