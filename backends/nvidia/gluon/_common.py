"""What the Gluon kernels (``flash_attn_gluon.py``, ``matmul_gluon.py``) share: the names of
the copy-engine operations across Triton releases, the releases the kernels were checked on,
and the part of their predicates that is about where Gluon runs at all.

Gluon is Triton's lower-level language (explicit layouts, partitions, barriers and
asynchronous MMAs). It is experimental: its operations were renamed between releases, and
it does not run under Triton's interpreter.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Triton 3.7+ renamed the copy-engine load and store (3.9 removed the old load's name).
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

#: The Triton releases the Gluon kernels have run and been checked on. They also compile for
#: sm_90 under 3.9 (``ci/sm90_compile.py``, as CI installs it), but Gluon is experimental and
#: its lowering may change what the kernels rely on (one mbarrier arrival per consumer
#: partition, as 3.6 lowers it), so elsewhere the Gluon variants decline and the Triton
#: kernels serve until a GPU run checks them.
TRITON_OK = triton.__version__.startswith("3.6.")


class FixedTile(NamedTuple):
    """A Gluon kernel's one tile (they are not autotuned), kept in a launch plan's cache so
    that reports which read an autotuner's ``best_config`` (``portable-kernels tune``) name
    it, not the first config of the plan's table, which the kernel does not use."""

    best_config: str


def runs_here(device_type: str) -> str | None:
    """Why a Gluon kernel cannot run for tensors on ``device_type`` with this Triton, or
    None when it can."""
    if device_type != "cuda":
        return (f"tensors on {device_type}: Gluon kernels run only on CUDA devices "
                "(Triton's interpreter does not run them)")
    if not TRITON_OK:
        return (f"checked on Triton 3.6 only: Gluon is experimental, and triton "
                f"{triton.__version__} has not run this kernel on a GPU (TRITON_OK)")
    return None


def descriptor(t: torch.Tensor, shape: list[int], strides: list[int], block: list[int],
               layout: Any) -> TensorDescriptor:
    """Gluon's host ``TensorDescriptor`` of ``t`` (``shape``, ``strides`` in elements,
    ``block`` boxes, an ``NVMMASharedLayout``), built without its constructor's checks.

    The checks (16-byte aligned base and strides, unit last stride, positive sizes, block
    shape) cost about 1-2 µs of Python per descriptor, several per eager call, and the
    callers' predicates have already made them for every tensor that reaches a Gluon
    kernel (``_host.tma_layout``, ``flash_attn._descriptor_issue``), so the fields are
    set directly. The launchers' stand-in tests (``tests/test_flash_attn_gluon.py``,
    ``tests/test_matmul_gluon.py``) check that the checked constructor takes every
    descriptor they build. Zero padding, as the constructor's default."""
    desc = object.__new__(TensorDescriptor)
    desc.base = t
    desc.shape = shape
    desc.strides = strides
    desc.block_shape = block
    desc.layout = layout
    desc.padding = "zero"
    return desc
