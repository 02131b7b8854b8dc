"""ACME's tuning configs, as functions of the device returning ``list[triton.Config]``."""
from __future__ import annotations

import triton

from portable_kernels import DeviceInfo


def vector_add_wide(device: DeviceInfo) -> list[triton.Config]:
    """Wide blocks: fewer, larger programs for a memory-bound kernel.

    The vector_add launcher sizes its grid from the first config (it does not autotune), so
    one config per device is all it reads.
    """
    if "interpreter" in device.capabilities:
        # Triton's CPU interpreter pays per program, not per element: the wider the better.
        return [triton.Config({"BLOCK_SIZE": 16384}, num_warps=1)]
    # 16-byte accesses per thread with room to spare: BLOCK_SIZE >= 4 * warp_size * num_warps.
    return [triton.Config({"BLOCK_SIZE": 8192}, num_warps=8)]


def grid_stride(device: DeviceInfo) -> list[triton.Config]:
    """ACME's own kernel (``kernels.py``): one block per loop step of each program."""
    if "interpreter" in device.capabilities:
        return [triton.Config({"BLOCK_SIZE": 16384}, num_warps=1)]
    return [triton.Config({"BLOCK_SIZE": 4096}, num_warps=8)]
