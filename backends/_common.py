"""Helpers shared by the built-in backends: reading a ``torch.cuda`` device (NVIDIA CUDA,
AMD ROCm and Iluvatar CoreX all expose one) and looking up tuning tables."""
from __future__ import annotations

import dataclasses

import torch
import triton


@dataclasses.dataclass(frozen=True)
class CudaProps:
    name: str
    major: int
    minor: int
    num_sms: int
    shared_memory: int
    warp_size: int
    gcn_arch: str


def props(device: torch.device) -> CudaProps:
    """What ``torch.cuda.get_device_properties`` says of ``device`` (a cuda device)."""
    p = torch.cuda.get_device_properties(device)
    smem = getattr(p, "shared_memory_per_block_optin", 0) or getattr(p, "shared_memory_per_block", 0)
    return CudaProps(
        name=p.name,
        major=p.major,
        minor=p.minor,
        num_sms=p.multi_processor_count,
        shared_memory=int(smem),
        warp_size=int(getattr(p, "warp_size", 0) or 0),
        gcn_arch=getattr(p, "gcnArchName", "") or "",
    )


def triton_version() -> str:
    return triton.__version__


def lookup(table: dict, kernel: str, variant: str):
    """A tuning table entry: ``(kernel, variant)`` first, then ``(kernel, None)``."""
    found = table.get((kernel, variant))
    return found if found is not None else table.get((kernel, None))


def table_configs(table: dict, kernel: str, variant: str, device) -> "list[triton.Config] | None":
    """Call the table's config function for ``variant`` of ``kernel`` on ``device``, if any."""
    fn = lookup(table, kernel, variant)
    return None if fn is None else fn(device)


def max_warps(device) -> int:
    """The most warps a program may have: warps x lanes stays within 1024 threads (so 16
    on 64-lane devices)."""
    return max(1, 1024 // device.warp_size)
