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


def _gemm(device: DeviceInfo, bm: int, bn: int, bk: int, warps: int, group: int = 8,
          waves_per_eu: int = 0) -> triton.Config:
    kwargs = {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": group}
    if device.has("wave64"):
        # CDNA compile options: 16x16 MFMA instructions, and a cap on waves per SIMD that
        # trades occupancy for registers per wave (0: the compiler's choice).
        kwargs.update(matrix_instr_nonkdim=16, waves_per_eu=waves_per_eu)
    # num_stages 2: the AMD stream pipeliner double-buffers through LDS (64 KB on CDNA).
    return triton.Config(kwargs, num_warps=min(warps, _common.max_warps(device)), num_stages=2)


def _matmul(device: DeviceInfo) -> list[triton.Config]:
    return [
        _gemm(device, 256, 256, 64, 8, group=4, waves_per_eu=2),
        _gemm(device, 256, 128, 64, 8, group=4, waves_per_eu=2),
        _gemm(device, 128, 128, 64, 4, waves_per_eu=2),
        _gemm(device, 128, 64, 64, 4),
        _gemm(device, 64, 64, 64, 4),
    ]


def _grouped_matmul(device: DeviceInfo) -> list[triton.Config]:
    return [
        _gemm(device, 256, 128, 64, 8, group=4, waves_per_eu=2),
        _gemm(device, 128, 128, 64, 4, waves_per_eu=2),
        _gemm(device, 64, 64, 64, 4),
    ]

def _flash_attn(device: DeviceInfo) -> list[triton.Config]:
    # ROCm's FlashAttention tuning: on CDNA 128x64 tiles of 4 wavefronts, waves_per_eu=2
    # (two workgroups per SIMD hide latency without software pipelining: num_stages 1, or
    # 2 where the stream pipeliner pays off, MI300/MI350) and 16x16 MFMA instructions.
    # Wider rows (fp16 D=256, fp32 D>64) use 64x64 tiles and one wave per EU: the
    # accumulator alone fills the VGPRs. RDNA (32-lane waves, no MFMA): small tiles.
    warps = min(4, _common.max_warps(device))
    if not device.has("wave64"):
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=warps, num_stages=1)]
    stages = 2 if device.arch in ("gfx942", "gfx950") else 1
    return [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BWD_BLOCK_M": 64, "BWD_BLOCK_N": 64,
                       "ROW_BYTES_MAX": 256, "waves_per_eu": 2, "matrix_instr_nonkdim": 16},
                      num_warps=warps, num_stages=stages),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BWD_BLOCK_M": 32, "BWD_BLOCK_N": 32,
                       "waves_per_eu": 1, "matrix_instr_nonkdim": 16},
                      num_warps=warps, num_stages=1),
    ]


_TABLE: dict[tuple[str, str | None], Configs] = {
    **_common.MEMORY_BOUND,
    ("flash_attn", None): _flash_attn,
    ("matmul", None): _matmul,
    ("grouped_matmul", None): _grouped_matmul,
}


def configs(kernel: str, variant: str, device: DeviceInfo) -> list[triton.Config] | None:
    """Configs for ``variant`` of ``kernel`` on ``device``, or None to use the variant's."""
    return _common.table_configs(_TABLE, kernel, variant, device)
