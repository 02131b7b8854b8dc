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


#: Families that run another family's kernels on the same tiles: their tuning is that
#: family's unless a table names them.
SHARED_TUNING = {"flash_attn_varlen": "flash_attn"}


def lookup(table: dict, kernel: str, variant: str):
    """A tuning table entry: ``(kernel, variant)`` first, then ``(kernel, None)``; for a
    family of :data:`SHARED_TUNING` without entries of its own, its host family's."""
    if kernel in SHARED_TUNING and (kernel, variant) not in table and (kernel, None) not in table:
        kernel = SHARED_TUNING[kernel]
    found = table.get((kernel, variant))
    return found if found is not None else table.get((kernel, None))


def table_configs(table: dict, kernel: str, variant: str, device) -> "list[triton.Config] | None":
    """Call the table's config function for ``variant`` of ``kernel`` on ``device``, if any."""
    fn = lookup(table, kernel, variant)
    return None if fn is None else fn(device)


def max_warps(device) -> int:
    """The most warps a program may have (``DeviceInfo.max_warps``: warps x lanes stays
    within 1024 threads, so 16 on 64-lane devices)."""
    return device.max_warps


# --- configs shared by every GPU backend --------------------------------------------------
# The memory-bound families need the same shapes on every vendor's GPU: enough bytes in
# flight per thread, with num_warps clamped so that warps x lanes stay within 1024 threads.

def _warps(device, n: int) -> int:
    return min(n, max_warps(device))


def _vector_add(device) -> "list[triton.Config]":
    # 16-byte accesses per thread need BLOCK_SIZE >= 4 * lanes * num_warps.
    return [triton.Config({"BLOCK_SIZE": 2048}, num_warps=_warps(device, 8))]


def _softmax(device) -> "list[triton.Config]":
    # Rows up to 8192 fp32 values stay in registers (16 warps x 32 lanes x 16 values).
    return [triton.Config({"MAX_BLOCK_N": 8192}, num_warps=_warps(device, 16))]


def _dropout(device) -> "list[triton.Config]":
    # Ten Philox rounds make this integer-heavy for an elementwise kernel: 8 elements per
    # thread, not the 16 bytes per thread a pure copy wants.
    return [triton.Config({"BLOCK_SIZE": 1024}, num_warps=_warps(device, 4))]


def _asin(device) -> "list[triton.Config]":
    return [triton.Config({"BLOCK_SIZE": 1024}, num_warps=_warps(device, 4))]


def _layer_norm(device) -> "list[triton.Config]":
    # Rows up to 8192 wide in one chunk; shorter rows share a 4096-element tile. Such rows
    # take the backward's lock-free path (4 programs per SM, PROGRAMS_PER_SM's default);
    # for longer ones, 64 partial rows spread the dweight/dbias lock over the SMs.
    return [triton.Config({"MAX_BLOCK_N": 8192, "TILE": 4096, "GROUPS": 64}, num_warps=_warps(device, 8))]


def _rope(device) -> "list[triton.Config]":
    # Per pair two loads, two stores and a cos/sin gather (cached: shared by the heads of a
    # token): 16 pairs per thread at 4 warps.
    return [triton.Config({"TILE": 2048}, num_warps=_warps(device, 4))]
def _kv_cache_write(device) -> "list[triton.Config]":
    # A scatter copy of one head's D elements per token: 16 tokens x D=128 fp16 is 4 KB
    # of keys (and as much of values) per program, 32 bytes a thread at 4 warps of 32.
    return [triton.Config({"BLOCK_T": 16}, num_warps=_warps(device, 4))]


def _cross_entropy(device) -> "list[triton.Config]":
    return [triton.Config({"MAX_BLOCK_V": 4096, "TILE": 4096}, num_warps=_warps(device, 8))]


#: Tuning-table entries every GPU backend starts from (``{**MEMORY_BOUND, ...}``).
MEMORY_BOUND = {
    ("vector_add", None): _vector_add,
    ("softmax", None): _softmax,
    ("dropout", None): _dropout,
    ("asin", None): _asin,
    ("layer_norm", None): _layer_norm,
    ("rms_norm", None): _layer_norm,  # layer_norm's kernels with RMS on
    # Gated activations: two loads and a store per element, as vector_add.
    ("swiglu", None): _vector_add,
    ("geglu", None): _vector_add,
    ("rope", None): _rope,
    ("add_rms_norm", None): _layer_norm,  # layer_norm's kernels with RMS and ADD on
    ("kv_cache_write", None): _kv_cache_write,
    # Vocabulary chunks of 4096 fp32 values over 8 warps (16 a thread); one row a program
    # from there up. fused_linear_cross_entropy launches the same kernel on its chunks.
    ("cross_entropy", None): _cross_entropy,
    ("fused_linear_cross_entropy", None): _cross_entropy,
}
