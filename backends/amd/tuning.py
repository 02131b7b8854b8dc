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
    if not device.has("wave64"):
        return _rdna_gemms(device)
    # Registers decide (ci/compile_matrix.py, VGPRs a lane): 256x256 with waves_per_eu=2
    # fits gfx942 (244) but spilled 17 on gfx90a and 53 on gfx950, also with the
    # compiler's own cap, so only gfx942 has it. kpack=2 (two k-packs per MFMA operand
    # load, in ROCm's MI300 GEMM tables) made that tile spill 18-32 on gfx942: not used.
    big = [_gemm(device, 256, 256, 64, 8, group=4, waves_per_eu=2)] if device.arch == "gfx942" else []
    return big + [
        _gemm(device, 256, 128, 64, 8, group=4, waves_per_eu=2),
        _gemm(device, 128, 128, 64, 4, waves_per_eu=2),
        _gemm(device, 128, 64, 64, 4),
        _gemm(device, 64, 64, 64, 4),
    ]


def _rdna_gemms(device: DeviceInfo) -> list[triton.Config]:
    # RDNA3 (gfx1100): 32-lane waves, WMMA instead of MFMA, no matrix_instr_nonkdim or
    # waves_per_eu. CDNA's 256-wide tiles spilled 681-2079 registers there.
    return [
        _gemm(device, 128, 128, 32, 8),
        _gemm(device, 128, 64, 32, 4),
        _gemm(device, 64, 64, 32, 4),
    ]


def _grouped_matmul(device: DeviceInfo) -> list[triton.Config]:
    if not device.has("wave64"):
        return _rdna_gemms(device)
    # The grouped kernel holds a group table's pointers and sizes on top of a tile: at
    # waves_per_eu=2 (256 VGPRs) 256x128 spilled 12-59 registers and 128x128 with 4 warps
    # 21-189 on gfx942 (ci/compile_matrix.py); these fit with the compiler's choice.
    return [
        _gemm(device, 128, 128, 64, 8),
        _gemm(device, 128, 128, 32, 4),
        _gemm(device, 128, 64, 64, 4),
        _gemm(device, 64, 64, 64, 4),
    ]


def _flash_attn(device: DeviceInfo) -> list[triton.Config]:
    # By the bytes of one padded K/V row (ROW_BYTES_MAX: the launcher takes the first class
    # that fits). CDNA: ROCm's FlashAttention tuning, 128x64 tiles of 4 wavefronts and
    # 16x16 MFMA instructions, num_stages 2 where the stream pipeliner pays off (MI300,
    # MI350) and 1 elsewhere. Registers decide the rest (ci/compile_matrix.py, gfx942):
    # waves_per_eu=2 caps a lane at 256 VGPRs, which the D=64 kernels fit with 32x64
    # dk/dv blocks (64x64 spilled 44-55) but the D=128 ones do not (forward 18-26 spilled,
    # dk/dv 246-452): one wave per EU there, and for the widest rows.
    if not device.has("wave64"):
        return _rdna_flash_attn(device)
    stages = 2 if device.arch in ("gfx942", "gfx950") else 1

    def cfg(bm, bn, dkdv, dq, waves, stages, row_bytes=None):
        kwargs = {"BLOCK_M": bm, "BLOCK_N": bn, "BWD_BLOCK_M": dkdv[0], "BWD_BLOCK_N": dkdv[1],
                  "DQ_BLOCK_M": dq[0], "DQ_BLOCK_N": dq[1],
                  "waves_per_eu": waves, "matrix_instr_nonkdim": 16}
        if row_bytes is not None:
            kwargs["ROW_BYTES_MAX"] = row_bytes
        return triton.Config(kwargs, num_warps=4, num_stages=stages)

    return [
        cfg(128, 64, (32, 64), (64, 32), 2, stages, row_bytes=128),   # fp16 D<=64
        cfg(128, 64, (32, 64), (64, 32), 1, stages, row_bytes=256),   # fp16 D<=128, fp32 D<=64
        cfg(64, 64, (32, 32), (32, 32), 1, 1),                        # wider rows
    ]


def _rdna_flash_attn(device: DeviceInfo) -> list[triton.Config]:
    # RDNA3 (32-lane waves, WMMA): 8 warps keep the forward within 256 VGPRs a lane
    # (64x32 at D=64 and 32x32 at D=128 spill nothing; with 4 warps the D=128 tiles
    # spilled 7-111). The backward fits at D <= 64 with 16x16 blocks of 4 warps (dk/dv
    # 199 VGPRs, dq 236; 16x32 with 8 warps spilled 29-45 in dq); wider rows spill in
    # every tile tried (dk/dv 90-590 registers, dq 13-1100, from 16x16 to 64x64 blocks,
    # 1 to 8 warps): docs/portability.md lists it as a known limit.
    def cfg(bm, bn, bwd, row_bytes=None, bwd_warps=None):
        kwargs = {"BLOCK_M": bm, "BLOCK_N": bn, "BWD_BLOCK_M": bwd[0], "BWD_BLOCK_N": bwd[1]}
        if bwd_warps is not None:
            kwargs["BWD_NUM_WARPS"] = bwd_warps  # the dq kernel's too (DQ_NUM_WARPS unset)
        if row_bytes is not None:
            kwargs["ROW_BYTES_MAX"] = row_bytes
        return triton.Config(kwargs, num_warps=8, num_stages=1)

    return [cfg(64, 32, (16, 16), row_bytes=128, bwd_warps=4),
            cfg(32, 32, (16, 32), row_bytes=256), cfg(16, 32, (16, 16))]


def _flash_attn_with_kvcache(device: DeviceInfo) -> list[triton.Config]:
    # 4 waves of 64 lanes on CDNA (warps clamped to 1024 threads by _common.max_warps),
    # 16x16 MFMA instructions and the stream pipeliner's 2 stages where it pays off for
    # flash_attn (MI300, MI350); RDNA3 (32-lane waves, WMMA): no CDNA options. 32 keys a
    # step, as the H100 streams best: at 64, the launcher's fit (_fit_keys) would halve it
    # on gfx942's 64 KB of LDS anyway. Compiled only (ci/compile_matrix.py); not yet timed
    # on a GPU.
    kwargs = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_R": 16, "WRITE_BLOCK_T": 16}
    if device.has("wave64"):
        kwargs["matrix_instr_nonkdim"] = 16
    stages = 2 if device.arch in ("gfx942", "gfx950") else 1
    return [triton.Config(kwargs, num_warps=min(4, _common.max_warps(device)), num_stages=stages)]


_TABLE: dict[tuple[str, str | None], Configs] = {
    **_common.MEMORY_BOUND,
    ("flash_attn", None): _flash_attn,
    ("matmul", None): _matmul,
    ("grouped_matmul", None): _grouped_matmul,
    ("flash_attn_with_kvcache", None): _flash_attn_with_kvcache,
}


def configs(kernel: str, variant: str, device: DeviceInfo) -> list[triton.Config] | None:
    """Configs for ``variant`` of ``kernel`` on ``device``, or None to use the variant's."""
    return _common.table_configs(_TABLE, kernel, variant, device)
